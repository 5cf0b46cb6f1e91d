"""What a codec needs from an exchange: its :class:`ExchangeTraits` and its capabilities.

Every codec class carries one frozen :class:`ExchangeTraits` (``codec.traits``), fixed by
:func:`traits_of` when the class is created, and every decision about a codec outside the codec
modules reads it, never the codec's type. What a codec can do beyond encode and decode is a
capability it inherits, the interface of the methods it then has: :class:`SumDecodable`
(payload words add under a plain allreduce), :class:`Reduced` (its own reduction, run by a
custom collective), :class:`GlobalNorm` (encoding needs the norm of every rank's vector) and
:class:`SideInformation` (decoding needs the other ranks' payloads and an outage count). Its
wire format is declared once, as class keywords (:data:`DECLARED`). A codec has the methods of
the capabilities it has and no others (docs/dev/architecture.md).
"""
from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

import numpy as np

from .payload import Payload


class Combine(str, enum.Enum):
    """How the payloads of n workers combine (derived from a codec's capabilities)."""

    #: elementwise sum of the words under a plain allreduce (:class:`SumDecodable`)
    SUM = "sum"
    #: each payload decoded and the results averaged in rank order
    GATHER = "gather"
    #: the codec's own reduction (:class:`Reduced`) or side information (:class:`SideInformation`)
    CUSTOM = "custom"


class HorovodWire(enum.Enum):
    """Horovod's own allreduce carries a codec's tensors in the framework doors, instead of an
    exchange of payloads (and Horovod fuses them)."""

    #: the tensor as it is (``hvd.Compression.none``)
    KEEP = "keep"
    #: cast to float16 and back (``hvd.Compression.fp16``)
    FLOAT16 = "float16"

    @property
    def cast(self) -> str | None:
        """The name of the dtype the tensor travels in, None when it travels as it is."""
        return None if self is HorovodWire.KEEP else self.value


@dataclass(frozen=True)
class ExchangeTraits:
    """What the other layers decide on about a codec, fixed when its class is created.

    Attributes:
        combine: how n payloads combine (:class:`Combine`).
        wire_dtype: dtype of ``Payload.data``, what a collective moves (declared).
        head_nbytes: leading payload bytes the payload's length depends on (a sparse count,
            an NDQSG header), 0 for fixed-length formats (declared).
        collective: the name in ``horovod_quant.exchange.CUSTOM_COLLECTIVES`` of the
            collective that runs a :class:`Reduced` codec's reduction, else None (declared).
        needs_norm: encoding needs the global norm first (:class:`GlobalNorm`).
        side_information: decoding needs every rank's payload and an outage count
            (:class:`SideInformation`).
        horovod_wire: how Horovod's own allreduce carries the codec's tensors
            (:class:`HorovodWire`), None when the codec's exchange does (declared).
    """

    combine: Combine
    wire_dtype: np.dtype
    head_nbytes: int = 0
    collective: str | None = None
    needs_norm: bool = False
    side_information: bool = False
    horovod_wire: HorovodWire | None = None


#: the traits a codec class declares, as class keywords (``class C(Codec, wire_dtype=...)``);
#: a class that declares none of them keeps its base's
DECLARED = ("wire_dtype", "head_nbytes", "collective", "horovod_wire")


class SideInfoOutcome(NamedTuple):
    """One rank's result of :meth:`SideInformation.combine_side_info`.

    Attributes:
        mean: the float32 mean estimate, the same on every rank.
        own_outages: values of this rank's own payload whose side-information decode failed.
        record: the exchange's statistics, completed by
            :meth:`SideInformation.finish_side_info`.
    """

    mean: Any
    own_outages: int
    record: Any


class CombinedDecodable(abc.ABC):
    """A codec whose n payloads combine into one payload that decodes to the mean."""

    @abc.abstractmethod
    def decode_sum(self, payload: Payload, n: int, out: Any | None = None) -> Any:
        """The float32 mean estimate from the combined payload of ``n`` workers (into ``out``
        when given)."""


class SumDecodable(CombinedDecodable):
    """Payload words of n workers add up elementwise under a plain allreduce (as
    ``traits.wire_dtype``); :meth:`decode_sum` turns the sum into the mean estimate
    (``traits.combine`` is :attr:`Combine.SUM`)."""


class Reduced(CombinedDecodable):
    """Payloads combine by the codec's own reduction (Global-QSGD's exponent reduction,
    Global-QSGD paper Algorithm 1), which the custom collective the class declares
    (``traits.collective``) runs between ranks; without it the allgather plan runs
    :meth:`reduce` on every rank."""

    @abc.abstractmethod
    def reduce(self, payloads: Sequence[Payload], seed: int) -> Payload:
        """The combined payload of n workers (rank order), reduced with exchange seed
        ``seed``; :meth:`decode_sum` decodes it."""


class GlobalNorm(abc.ABC):
    """Encoding needs the global norm of every rank's vector (Global-QSGD, Definition 3.1):
    each rank gives :meth:`norm_statistic` (of several vectors: :meth:`combine_statistics`),
    and :meth:`norm_from_statistics` gives the norm. Never the sra plan (a chunk mean would need
    a second norm)."""

    @abc.abstractmethod
    def norm_statistic(self, x: Any) -> float:
        """This rank's part of the global norm of ``x`` (float64; non-finite when x is)."""

    @abc.abstractmethod
    def combine_statistics(self, stats: Sequence[float]) -> float:
        """The statistic of several vectors from theirs, combined in the order given (float64;
        NaN when any is NaN, 0.0 for none)."""

    @abc.abstractmethod
    def norm_from_statistics(self, stats: Sequence[float]) -> np.float32:
        """The global norm from every rank's statistic, in rank order (the same float32 on
        every rank)."""


class SideInformation(abc.ABC):
    """Decoding needs side information from the other ranks' payloads (NDQSG, Algorithm 2):
    a gathered exchange combines with :meth:`combine_side_info`, sums the ranks'
    ``own_outages`` with one integer allreduce and hands the total to
    :meth:`finish_side_info`."""

    @abc.abstractmethod
    def combine_side_info(self, payloads: Sequence[Payload], seed: int, rank: int, x: Any,
                          out: Any | None = None, state: Any = None) -> SideInfoOutcome:
        """The mean estimate of a gathered exchange, decoded with side information.

        Args:
            payloads: every rank's payload, in rank order (``meta["seed"]`` set).
            seed: the exchange seed.
            rank: this rank.
            x: this rank's input vector: the outcome counts the side-information failures of
                this rank's own values (no rank knows the others').
            out: destination of the estimate, or None for a new array.
            state: the exchange's ``new_state()``, moved on by this exchange (None: a fresh
                one, dropped after).

        Every rank computes the same mean and moves its state the same way; the count is this
        rank's own.
        """

    @abc.abstractmethod
    def finish_side_info(self, outcome: SideInfoOutcome, total_outages: int) -> None:
        """Complete an exchange's statistics with the sum over ranks of ``outcome.own_outages``
        (what one integer allreduce gives every rank)."""


def traits_of(cls: type, base: ExchangeTraits, **declared: Any) -> ExchangeTraits:
    """The traits of codec class ``cls`` (``Codec.__init_subclass__``): what it declares
    (``declared``: its class keywords, :data:`DECLARED`; the others as ``base``, its base
    class's traits) and what its capabilities decide.

    Raises:
        TypeError: an unknown keyword, or a collective declared by a class that is not
            :class:`Reduced` (or a :class:`Reduced` class that names none).
    """
    unknown = sorted(set(declared) - set(DECLARED))
    if unknown:
        raise TypeError(f"{cls.__name__}: unknown codec class keywords {unknown}; a codec "
                        f"class declares {list(DECLARED)}")
    wire = {name: declared.get(name, getattr(base, name)) for name in DECLARED}
    reduced = issubclass(cls, Reduced)
    if reduced != (wire["collective"] is not None):
        raise TypeError(f"{cls.__name__}: a Reduced codec class, and only one, declares the "
                        f"collective that runs its reduction (collective=...)")
    if wire["horovod_wire"] is not None and not isinstance(wire["horovod_wire"], HorovodWire):
        raise TypeError(f"{cls.__name__}: horovod_wire={wire['horovod_wire']!r} is not a "
                        f"HorovodWire")
    side = issubclass(cls, SideInformation)
    combine = (Combine.SUM if issubclass(cls, SumDecodable)
               else Combine.CUSTOM if reduced or side else Combine.GATHER)
    return ExchangeTraits(combine, np.dtype(wire["wire_dtype"]), int(wire["head_nbytes"]),
                          wire["collective"], issubclass(cls, GlobalNorm), side,
                          wire["horovod_wire"])
