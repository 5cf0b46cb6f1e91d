"""The codec contract shared by every algorithm (see docs/dev/architecture.md)."""
from __future__ import annotations

import abc
import json
from typing import Any, ClassVar, NamedTuple, Sequence

import numpy as np

from ..backends import backend_of
from .contract import Combine, ExchangeTraits, traits_of
from .payload import Payload
from .rng import derive_key


def as_vector(x: Any) -> Any:
    """A flat float32 view of ``x`` on its backend (a copy only when the dtype or layout
    requires one): NumPy for host arrays, a flat float32 CuPy array for device arrays (CuPy,
    CUDA torch tensors).

    float16, bfloat16 (``ml_dtypes``/torch-converted) and float64 inputs are accepted; codecs
    compute in float32 and decode to float32, as the framework doors cast back to the tensor's
    dtype.
    """
    return backend_of(x).vector(x)


def array_module(x: Any) -> Any:
    """``cupy`` for device arrays, else ``numpy``: allocate like ``x`` without importing CuPy
    on machines that never see a device array."""
    return backend_of(x).xp


def worker_seed(seed: int, rank: int) -> int:
    """The seed worker ``rank`` encodes with when the exchange's seed is ``seed``.

    The framework doors derive ``seed`` itself from (user seed, step, tensor); every rank can
    compute every other rank's seed, which DQSG/NDQSG receivers need to regenerate dithers.
    """
    return derive_key(seed, 0x7A4B, rank)


def check_int(name: str, value: Any, low: int, high: int | None = None, hint: str = "") -> int:
    """Validate an integer parameter, raising ValueError that says what to change."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < low or (high is not None and value > high):
        rng = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name}={value} is out of range: use a value in {rng}. {hint}".strip())
    return value


def check_choice(name: str, value: Any, choices: Sequence[Any]) -> Any:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid: choose one of {list(choices)}")
    return value


# -- payload validation -----------------------------------------------------------------------
#: Largest element count a payload may declare: 2^40 (4 TiB of float32, beyond any tensor). A
#: larger (or negative) size is a damaged header; checked before anything is allocated.
MAX_PAYLOAD_SIZE = 1 << 40


class CodecState(abc.ABC):
    """What a codec whose encoding adapts between exchanges carries from one exchange to the
    next (NDQSG's measured side-information error). The exchange that runs the codec holds it
    (:meth:`Codec.new_state`), never the codec: codecs are values, so equal configurations may
    share one codec object. A checkpoint saves it with :meth:`state_dict`."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The state as plain Python values (floats, ints, strings, lists, dicts)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the state :meth:`state_dict` gave (of a codec with the same configuration).

        Raises:
            ValueError: ``state`` is not such a state.
        """


class WireLayout(NamedTuple):
    """What a valid payload of ``size`` elements looks like on the wire (:meth:`Codec.wire_layout`).

    Attributes:
        size: the element count the layout is for.
        nbytes: the payload's byte count; a lower bound when ``exact`` is False (variable-length
            formats: Elias streams, whose decoding kernel checks every read).
        exact: whether ``nbytes`` is the exact count.
        detail: the parameters ``nbytes`` follows from, for error messages.
        head: the value of the leading header field the length depends on (the nonzero count
            of a sparse Global-QSGD payload, the coarse ratio k of an NDQSG payload), else 0.
    """

    size: int
    nbytes: int
    exact: bool = True
    detail: str = ""
    head: int = 0


def check_payload_size(name: str, size: Any) -> int:
    """The element count a payload declares, as an int in [0, MAX_PAYLOAD_SIZE]; raises
    ValueError naming the codec otherwise."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise ValueError(f"{name}: payload size must be an integer, got {size!r}")
    size = int(size)
    if not 0 <= size <= MAX_PAYLOAD_SIZE:
        raise ValueError(f"{name}: payload size={size} is out of range [0, 2^40]: a damaged "
                         f"or wrong size")
    return size


def _nbytes(data: Any) -> int:
    nb = getattr(data, "nbytes", None)
    return int(nb) if nb is not None else int(np.asarray(data).nbytes)


def _numel(a: Any) -> int:
    """Elements of a NumPy/CuPy array or a torch tensor (whose ``size`` is a method)."""
    return int(a.numel()) if callable(getattr(a, "numel", None)) else int(np.size(a))


def _head_bytes(data: Any, count: int) -> np.ndarray:
    """The first ``count`` bytes of a payload's data as a host uint8 array (a device payload
    copies just these bytes)."""
    be = backend_of(data)
    return np.ascontiguousarray(be.to_host(be.array(data).view(np.uint8)[:count]))


class Codec(abc.ABC):
    """An unbiased (or baseline) gradient compressor on flat float32 arrays.

    Methods take NumPy arrays, CuPy arrays or CUDA torch tensors and run on their backend
    (``backend_of``, :mod:`horovod_quant.backends`): each is written once against the
    backend interface, and backends give the same bytes.

    Subclasses validate their parameters in ``__init__``, implement :meth:`encode` and
    :meth:`decode`, and call ``Codec.__init__`` last with their parameters. What they can do
    beyond that is a capability they inherit (:mod:`.contract`: ``SumDecodable``, ``Reduced``,
    ``GlobalNorm``, ``SideInformation``); their wire format they declare as class keywords
    (``class FP16(Codec, wire_dtype=np.float16, horovod_wire=HorovodWire.FLOAT16)``, the
    names of :data:`.contract.DECLARED`). Both make :attr:`traits`, what the other layers
    decide on.
    """

    name: ClassVar[str]
    #: what the exchange and the doors decide on about this codec (:class:`.contract.
    #: ExchangeTraits`): fixed by :func:`.contract.traits_of` when the class is created, from
    #: its capabilities and its class keywords (a bare codec: gathered uint8 payloads)
    traits: ClassVar[ExchangeTraits] = ExchangeTraits(Combine.GATHER, np.dtype(np.uint8))
    #: the constructor needs ``world_size`` (the framework doors fill it from the process set)
    needs_world_size: ClassVar[bool] = False
    #: the suffixes a codec spec may give after the name (``"<name>-<suffix>:<bits>"``,
    #: :meth:`~horovod_quant.doors.CodecRequest.from_spec`), each with the parameters it sets
    spec_suffixes: ClassVar[dict[str, dict[str, Any]]] = {}

    def __init__(self, **params: Any) -> None:
        self.params = dict(params)
        #: the ranks this codec combines (codecs that :attr:`needs_world_size`), else None
        self.world_size: int | None = params.get("world_size")

    def __init_subclass__(cls, **declared: Any) -> None:
        """Fix the class's :attr:`traits` from its capabilities and the traits it declares
        as class keywords (TypeError for an unknown one)."""
        super().__init_subclass__()
        cls.traits = traits_of(cls, cls.traits, **declared)

    # -- contract ---------------------------------------------------------------------------
    @abc.abstractmethod
    def encode(self, x: Any, seed: int = 0) -> Payload:
        """Encode a 1-D float array. ``seed`` makes every random draw reproducible."""

    @abc.abstractmethod
    def decode(self, payload: Payload, out: np.ndarray | None = None) -> np.ndarray:
        """Decode one worker's payload to float32 (into ``out`` when given)."""

    def decode_add(self, payload: Payload, out: np.ndarray) -> np.ndarray:
        """``out += decode(payload)``; codecs override with a fused kernel."""
        self.check_payload(payload, out)
        dst = backend_of(payload.data).array(out)  # a CUDA torch tensor: its CuPy view
        dst += self.decode(payload)
        return out

    def payload_from_wire(self, data: np.ndarray, size: int, **meta: Any) -> Payload:
        """Rebuild a payload from the bytes a collective delivered.

        ``meta`` carries what every rank knows without it being sent: the sender's seed
        (``seed=worker_seed(s, r)``, for codecs that regenerate a dither), the global norm, ...
        """
        raw = Payload(backend_of(data).array(data).view(np.uint8),
                      check_payload_size(self.name, size), dict(meta))
        self.check_payload(raw)  # before the view: a damaged length may not be whole words
        return Payload(raw.data.view(self.traits.wire_dtype), raw.size, raw.meta)

    # -- payload validation (every decode entry point, CPU and GPU, before any kernel) --------
    def wire_layout(self, size: int, head: np.ndarray | None = None) -> WireLayout | None:
        """The byte count of a valid payload of ``size`` elements (see :class:`WireLayout`).

        ``head`` holds the payload's first ``traits.head_nbytes`` bytes (host uint8) for formats
        whose length depends on a header field; raises ValueError on an invalid header. Every
        codec of this package defines it; None (the default, for codecs defined elsewhere)
        leaves the byte count unchecked.
        """
        return None

    def expected_nbytes(self, size: int) -> int:
        """The payload bytes of ``size`` elements: :meth:`wire_layout`'s where the layout does
        not depend on a header, else ``bits`` per element (what the exchange's cost model
        weighs, never a check)."""
        layout = None if self.traits.head_nbytes else self.wire_layout(size)
        if layout is not None:
            return layout.nbytes
        return -(-size * int(self.params.get("bits", 32)) // 8)

    def new_state(self) -> CodecState | None:
        """A fresh state for an exchange that runs this codec (see :class:`CodecState`), or
        None: the codec encodes every exchange alike (every codec but NDQSG)."""
        return None

    def for_world_size(self, world_size: int) -> "Codec":
        """This codec for an exchange between ``world_size`` ranks (the hosts of a
        hierarchical exchange): itself unless it :attr:`needs_world_size`, else one built with
        the same parameters for that size (built once: codecs never change)."""
        if not self.needs_world_size or self.params.get("world_size") == world_size:
            return self
        resized = self.__dict__.setdefault("_resized", {})
        if world_size not in resized:
            resized[world_size] = type(self)(**self.resize_params(world_size))
        return resized[world_size]

    def limit_note(self) -> str | None:
        """Where this codec is weaker at its world size than with fewer workers: why, and the
        alternatives (:mod:`.limits`); None where it is not (every codec whose payloads are
        not summed). The codec warns with it when built."""
        return None

    def resize_params(self, world_size: int) -> dict[str, Any]:
        """The constructor parameters of :meth:`for_world_size`'s codec."""
        return {**self.params, "world_size": world_size}

    def check_payload(self, payload: Payload, out: Any | None = None) -> WireLayout:
        """Validate a payload before any kernel reads it (and ``out`` before one writes it).

        Checks the declared size (an integer in [0, 2^40]), the header fields the length
        depends on, the byte count against :meth:`wire_layout` (exact for fixed-width formats,
        a lower bound for variable-length ones, whose kernels check every read), and that
        ``out`` has ``size`` elements. Host and device payloads alike (a device payload's
        header bytes are copied to the host). Raises ValueError naming the codec and the
        mismatch; returns the layout.
        """
        name = self.name
        size = check_payload_size(name, payload.size)
        nbytes = _nbytes(payload.data)
        head, head_nbytes = None, self.traits.head_nbytes
        if head_nbytes:
            if nbytes < head_nbytes:
                raise ValueError(f"{name}: payload has {nbytes} bytes, fewer than its "
                                 f"{head_nbytes}-byte header (size={size})")
            head = _head_bytes(payload.data, head_nbytes)
        lay = self.wire_layout(size, head)
        if lay is None:
            lay = WireLayout(size, nbytes, True, "unchecked")
        if (nbytes != lay.nbytes) if lay.exact else (nbytes < lay.nbytes):
            what = "" if lay.exact else "at least "
            raise ValueError(f"{name}: payload has {nbytes} bytes, {what}{lay.nbytes} expected "
                             f"for size={size} ({lay.detail})")
        if out is not None and _numel(out) != size:
            raise ValueError(f"{name}: out has {_numel(out)} elements, the payload decodes to "
                             f"size={size}")
        return lay

    def check_payloads(self, payloads: Sequence[Payload], out: Any | None = None
                       ) -> list[WireLayout]:
        """:meth:`check_payload` of every payload of an exchange; they must encode the same
        number of elements (``out``'s, when given). Returns their layouts."""
        if len(payloads) == 0:
            raise ValueError(f"{self.name}: no payloads to combine")
        lays = [self.check_payload(payloads[0], out)]
        lays += [self.check_payload(p) for p in payloads[1:]]
        if any(lay.size != lays[0].size for lay in lays):
            raise ValueError(f"{self.name}: payloads encode different lengths "
                             f"{[lay.size for lay in lays]}")
        return lays

    def config(self) -> dict[str, Any]:
        """Everything that must agree across ranks (checked once at the first step)."""
        return {"codec": self.name, **self.params}

    def config_key(self) -> str:
        """:meth:`config` as canonical JSON: equal for codecs built with the same parameters
        (a key for one exchange per codec)."""
        return json.dumps(self.config(), sort_keys=True)

    def encode_worker(self, x: Any, seed: int, rank: int, norm: float | None = None,
                      state: CodecState | None = None) -> Payload:
        """What worker ``rank`` sends in an exchange with seed ``seed``.

        ``norm`` is the global norm for codecs that normalize by one (Global-QSGD); ``state``
        the exchange's :meth:`new_state` for codecs that adapt (None: a fresh one); codecs whose
        encoding depends on the rank (NDQSG's two groups) override this.
        """
        return self.encode(x, seed=worker_seed(seed, rank))

    def combine_gathered(self, payloads: Sequence[Payload], seed: int,
                         out: np.ndarray | None = None) -> np.ndarray:
        """The mean estimate from every worker's payload, given in rank order (into ``out``
        when given: a reused buffer saves the page faults of a fresh one on every exchange).

        Gather exchanges decode and accumulate in rank order in float32, so every rank (and
        the reference) performs the same operations; custom exchanges override this with
        their reduction (a fallback when no custom collective is available).
        """
        size = self.check_payloads(payloads, out)[0].size
        be = backend_of(payloads[0].data)
        est = be.xp.empty(size, np.float32) if out is None else be.array(out)
        est.fill(0)
        for p in payloads:
            self.decode_add(p, est)
        be.scale(est, 1.0 / len(payloads), est)
        return est if out is None else out

    def combine_payloads(self, payloads: Sequence[Payload], seed: int) -> np.ndarray:
        """The mean estimate from every worker's payload (rank order) as the exchange combines
        them: the elementwise sum of the words then ``decode_sum`` for
        :class:`~.contract.SumDecodable` codecs, :meth:`combine_gathered` otherwise."""
        if self.traits.combine is Combine.SUM:
            self.check_payloads(payloads)

            def words(p: Payload) -> np.ndarray:
                return np.asarray(p.data).reshape(-1).view(self.traits.wire_dtype)

            total = words(payloads[0]).copy()
            for p in payloads[1:]:
                total += words(p)
            return self.decode_sum(Payload(total, payloads[0].size, dict(payloads[0].meta)),
                                   len(payloads))
        return self.combine_gathered(payloads, seed)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{type(self).__name__}({args})"
