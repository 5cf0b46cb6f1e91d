"""What the four framework doors share: their settings (:class:`DoorOptions`, one default
each), the cross-rank configuration check and the ``Compression.<codec>(...)`` namespace.

The doors: Horovod PyTorch's ``compression=`` (:mod:`horovod_quant.torch.compression`),
``hq.torch.DistributedOptimizer`` (:mod:`horovod_quant.torch.optimizer`), the DDP hook
(:mod:`horovod_quant.torch.ddp`) and Horovod TensorFlow's ``compression=``
(:mod:`horovod_quant.tensorflow.compression`).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Iterable

from .exchange.collectives import Collectives, Handle
from .core import available_codecs, get_codec
from .core.registry import codec_class
from .core.base import Codec, check_int
from .core.contract import Combine
from .process_sets import mpi_exchange_enabled
from .exchange.plans import DEFAULT_PIPELINE_ELEMS, check_gather, check_pipeline_elems
from .env import env_seconds
from .fallback import check_fallback
from .policy import LayerPolicy, describe
from .stats import StepStats

log = logging.getLogger("horovod_quant")

#: default of ``HQ_CONFIG_TIMEOUT``: how long a rank waits for the others' configuration
CONFIG_TIMEOUT_S = 600.0

#: default of :attr:`DoorOptions.fusion_bytes`
DEFAULT_FUSION_BYTES = 32 << 20
#: what :attr:`DoorOptions.transport` takes besides None
TRANSPORTS = ("auto", "horovod", "gloo")
#: the settings of :class:`DoorOptions` that only ``hq.torch.DistributedOptimizer`` uses
OPTIMIZER_ONLY = ("fusion_bytes", "transport", "fallback", "on_step")


class _Unset:
    """The default of a door's ``pipeline_elems=`` argument, whose None means "whole
    vectors": the value then comes from the door's :class:`DoorOptions`."""

    def __repr__(self) -> str:
        return "DoorOptions.pipeline_elems"


UNSET: Any = _Unset()


@dataclasses.dataclass(frozen=True)
class DoorOptions:
    """The settings of the framework doors, with one default each, the same in every door: a
    tensor exchanged with the same codec and exchange seed gets the same bits through each of
    them (docs/pytorch.md, "Settings shared by every door").

    Every door takes ``options=DoorOptions(...)`` and each setting as a keyword argument of
    the same name; a keyword argument given as None (``pipeline_elems``: not given) takes the
    value from ``options``, else from the compressor a door was given, else the default here.

    Args:
        seed: base seed of every random draw (an integer).
        gather: schedule for gather codecs: "auto", "allgather" or "sra".
        policy: which tensors are compressed, and with which codec (None:
            :class:`~horovod_quant.policy.LayerPolicy`'s defaults).
        pipeline_elems: vectors longer than this are exchanged in pieces of this many elements
            (:class:`~horovod_quant.exchange.Exchange`); None sends every vector whole.
        fusion_bytes: float32 bytes per fused bucket (``hq.torch.DistributedOptimizer`` only).
        transport: what carries the payloads, "auto", "horovod" or "gloo"; None: the
            ``HQ_TRANSPORT`` environment variable, else "auto" (the optimizer only).
        fallback: "auto" (Horovod's float32 allreduce carries the buckets whose codec does not
            pay, :mod:`horovod_quant.fallback`) or "never" (the optimizer only).
        on_step: called with each step's :class:`~horovod_quant.stats.StepStats` (the
            optimizer only).

    The settings the optimizer alone uses are kept by a torch ``Compression`` (and used where
    it is passed to the optimizer); the TensorFlow door and the DDP hook raise ValueError when
    one of them is not at its default.
    """

    seed: int = 0
    gather: str = "auto"
    policy: LayerPolicy | None = None
    pipeline_elems: int | None = DEFAULT_PIPELINE_ELEMS
    fusion_bytes: int = DEFAULT_FUSION_BYTES
    transport: str | None = None
    fallback: str = "auto"
    on_step: Callable[[StepStats], None] | None = None

    def __post_init__(self) -> None:
        check_seed(self.seed)
        if self.policy is None:
            object.__setattr__(self, "policy", LayerPolicy())
        check_gather(self.gather)
        if not isinstance(self.policy, LayerPolicy):
            raise ValueError(f"policy={self.policy!r} is not a horovod_quant LayerPolicy")
        check_pipeline_elems(self.pipeline_elems)
        check_int("fusion_bytes", self.fusion_bytes, 1)
        if self.transport is not None and self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not valid: choose one of "
                             f"{list(TRANSPORTS)} ('auto': a gloo group beside Horovod for CPU "
                             "gradients) or None (the HQ_TRANSPORT environment variable)")
        check_fallback(self.fallback)
        if self.on_step is not None and not callable(self.on_step):
            raise ValueError(f"on_step={self.on_step!r} must be callable or None")

    def check_door(self, door: str) -> "DoorOptions":
        """``self``, for a door that does not use the optimizer-only settings; ValueError
        naming each one not at its default."""
        set_here = [f"{name}={getattr(self, name)!r}" for name in OPTIMIZER_ONLY
                    if getattr(self, name) != _DEFAULTS[name]]
        if set_here:
            raise ValueError(f"{', '.join(set_here)}: the {door} does not take these settings "
                             "(hq.torch.DistributedOptimizer alone does); leave them at their "
                             "defaults")
        return self


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(DoorOptions)}


def door_options(options: DoorOptions | None = None, inherited: DoorOptions | None = None,
                 **given: Any) -> DoorOptions:
    """A door's settings: ``given`` keyword arguments (None, and :data:`UNSET`, for "not
    given"; ``pipeline_elems=None`` is given), over ``options``, else over ``inherited`` (the
    settings of a compressor the door was handed), else over the defaults.

    Raises:
        ValueError: a setting is given both ways, or is invalid.
    """
    if options is not None and not isinstance(options, DoorOptions):
        raise ValueError(f"options={options!r} is not a horovod_quant DoorOptions")
    given = {k: v for k, v in given.items()
             if v is not UNSET and (v is not None or k == "pipeline_elems")}
    if options is not None:
        twice = sorted(k for k in given if getattr(options, k) != given[k])
        if twice:
            raise ValueError(f"{', '.join(twice)} given both as keyword arguments and in "
                             "options=: set each setting in one place")
    base = options if options is not None else inherited if inherited is not None else None
    return dataclasses.replace(base, **given) if base is not None else DoorOptions(**given)


class _CheckNumbers:
    """The n-th check of a process in a group of ranks pairs with the n-th check of every other
    rank of the group: checks are numbered when they start (not when a compressor is built),
    so a compressor built on one rank only, and never used, shifts nothing. The number also
    names the checked object's collectives."""

    def __init__(self) -> None:
        self._started: dict[tuple[str, int], int] = {}

    def started(self, comm: Collectives) -> int:
        """How many checks this rank started in ``comm``'s group."""
        return self._started.get((comm.group_id, comm.rank), 0)

    def take(self, comm: Collectives) -> int:
        n = self.started(comm)
        self._started[comm.group_id, comm.rank] = n + 1
        return n


CHECKS = _CheckNumbers()


def check_seed(seed: Any) -> int:
    """A seed as an int; ValueError for anything else (``7.9`` is not silently ``7``)."""
    return check_int("seed", seed, -(1 << 63), (1 << 64) - 1)


def wait_for_peers(handle: Handle, what: str, timeout: float | None = None) -> Any:
    """``handle.wait()``, giving up after ``timeout`` seconds (default ``HQ_CONFIG_TIMEOUT``).

    A collective that only some ranks call never completes; Horovod then waits forever. This
    logs a warning once a tenth of the time has passed and raises RuntimeError at the end, so
    the job fails with a message saying what it was waiting for.
    """
    timeout = env_seconds("HQ_CONFIG_TIMEOUT", CONFIG_TIMEOUT_S) if timeout is None else timeout
    start, pause, warned = time.monotonic(), 1e-4, False
    while not handle.done():
        waited = time.monotonic() - start
        if waited > timeout:
            raise RuntimeError(
                f"horovod_quant: waited {waited:.0f} s for {what}; some rank is not running the "
                "same horovod_quant compressor or optimizer at this point (a different "
                "compression= such as hvd.Compression.none, or a different number of "
                "horovod_quant compressors/optimizers). HQ_CONFIG_TIMEOUT sets how long to wait.")
        if not warned and waited > timeout / 10:
            log.warning("horovod_quant: still waiting for %s after %.0f s", what, waited)
            warned = True
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return handle.wait()


class ConfigCheck:
    """One cross-rank agreement check: every rank's ``config`` from one allgather of JSON.

    Started without blocking; :meth:`wait` raises the same ValueError on every rank when the
    configurations differ (every rank sees all of them), or RuntimeError when a rank never
    joins (:func:`wait_for_peers`).

    Args:
        comm: the collectives of the group.
        config: JSON-serializable description of everything that must agree.

    Attributes:
        prefix: ``hq.<group>.<n>`` for the n-th check in the group, the same on every rank;
            the prefix of the checked object's collective names.
    """

    def __init__(self, comm: Collectives, config: dict) -> None:
        self.prefix = f"hq.{comm.group_id}.{CHECKS.take(comm)}"
        self._handle = (comm.allgather_object_async(config, f"{self.prefix}.config")
                        if comm.size > 1 else None)
        self._done = comm.size == 1
        self._error: ValueError | None = None

    def wait(self) -> str:
        """Block until every rank's configuration is here; returns :attr:`prefix`. A mismatch
        raises again at every later call."""
        if not self._done:
            configs = wait_for_peers(self._handle, f"every rank's configuration "
                                                   f"(collective {self.prefix}.config)")
            self._done = True
            if any(c != configs[0] for c in configs):
                lines = "\n".join(f"  rank {r}: {c}" for r, c in enumerate(configs))
                self._error = ValueError(
                    "horovod_quant configuration differs between ranks; every rank must build "
                    f"the same codec, parameters, seed, policy and layout:\n{lines}")
        if self._error is not None:
            raise self._error
        return self.prefix


def check_same_config(comm: Collectives, config: dict) -> str:
    """:class:`ConfigCheck`, blocking; returns the check's prefix."""
    return ConfigCheck(comm, config).wait()


class CodecRequest:
    """A codec asked for by name (``Compression.<name>(**params)``), kept so that a door that
    knows its own group of ranks (the DDP door: a torch.distributed process group) can build
    it for that group's size.

    Args:
        name: the codec's registered name.
        params: the parameters the user gave (``world_size`` may be missing).
    """

    def __init__(self, name: str, params: dict) -> None:
        self.name = name
        self.params = dict(params)

    @property
    def needs_world_size(self) -> bool:
        """The codec needs ``world_size`` and the user gave none."""
        return codec_class(self.name).needs_world_size and "world_size" not in self.params

    def build(self, world_size: Callable[[], int],
              host_count: Callable[[], int | None] | None = None) -> Codec:
        """The codec; ``world_size()`` fills ``world_size`` when :attr:`needs_world_size`.

        Where the codec cannot combine that many payloads (linear Global-QSGD at 128 ranks)
        and ``host_count()`` names several hosts of several ranks each, it is built for the
        hosts instead, with a warning: the hierarchical exchange combines one payload per
        host, and a flat exchange refuses the codec (:func:`~.exchange.plans.plan_choice`).

        Raises:
            ValueError: invalid parameters, or a world too large for the codec and no hosts.
        """
        if not self.needs_world_size:
            return get_codec(self.name, **self.params)
        size = world_size()
        try:
            return get_codec(self.name, **self.params, world_size=size)
        except ValueError as exc:
            hosts = host_count() if host_count is not None else None
            if hosts is None or not 1 < hosts < size or size % hosts:
                raise
            codec = get_codec(self.name, **self.params, world_size=hosts)
            log.warning("horovod_quant: %s cannot combine %d ranks' payloads (%s); built for "
                        "the %d hosts instead: only a hierarchical exchange (one payload per "
                        "host) can run it", self.name, size, exc, hosts)
            return codec


class CompressorSettings:
    """The codec and settings a door holds (the Horovod doors' compressors, the DDP state).

    Args:
        codec: the codec (see :func:`horovod_quant.get_codec`), or a :class:`CodecRequest`
            and the function giving its world size, built when first used (a world-sized
            codec asked for before Horovod is initialized).
        options: the door's :class:`DoorOptions`.
        process_set: Horovod process set of the optimizer or tape, if not the global one.

    Attributes:
        options: the :class:`DoorOptions`; ``seed``, ``gather``, ``policy`` and
            ``pipeline_elems`` read them.
        stats: :class:`~horovod_quant.stats.StepStats` since the last ``stats.reset()``.
        codec_request: how ``Compression.<name>(...)`` asked for the codec, or None.
    """

    def __init__(self, codec: Codec | tuple[CodecRequest, Callable[[], int]],
                 options: DoorOptions, process_set: Any = None) -> None:
        self.codec_request: CodecRequest | None = None
        self._world_size: Callable[[], int] | None = None
        self._host_count: Callable[[], int] | None = None
        if isinstance(codec, tuple):  # (request, world size[, host count])
            self.codec_request, self._world_size, *hosts = codec
            self._host_count, codec = (hosts[0] if hosts else None), None
        self._codec = codec
        self.options = options
        self.process_set = process_set
        self.stats = StepStats()

    @property
    def codec(self) -> Codec:
        """The codec (a requested one is built at the first use)."""
        if self._codec is None:
            self._codec = self.codec_request.build(self._world_size, self._host_count)
        return self._codec

    @property
    def seed(self) -> int:
        return self.options.seed

    @property
    def gather(self) -> str:
        return self.options.gather

    @property
    def policy(self) -> LayerPolicy:
        return self.options.policy

    @property
    def pipeline_elems(self) -> int | None:
        return self.options.pipeline_elems

    def shared_config(self) -> dict:
        """What must agree across ranks (see :class:`ConfigCheck`)."""
        return {"door": "compressor", **self.codec.config(), "seed": self.seed,
                "gather": self.gather, "pipeline_elems": self.pipeline_elems,
                "policy": describe(self.policy)}


def mpi_exchange_config(codecs: Iterable[Codec]) -> dict:
    """``HQ_MPI_EXCHANGE`` for the configuration check of an exchange over Horovod's
    collectives, where it changes the wire: a codec with a custom combine runs the MPI
    reduction when it is on, else the allgather plan (and the MPI set-up is collective)."""
    if any(c.traits.combine is Combine.CUSTOM for c in codecs):
        return {"mpi_exchange": mpi_exchange_enabled()}
    return {}


def _initialized(size: Callable[[], int]) -> bool:
    """Whether a Horovod process set's ``size`` answers (Horovod is initialized)."""
    try:
        size()
    except ValueError:
        return False
    return True


class CompressionNamespace:
    """``Compression.<codec>(**params)`` for every registered codec, like Horovod's
    ``hvd.Compression`` (whose members are used without a call).

    Args:
        compressor_cls: the door's compressor class, built as
            ``compressor_cls(codec, process_set=, options=)``.
        global_process_set: the framework's ``hvd.global_process_set`` (fills ``world_size``).
        framework: named in the generated docstrings.
    """

    def __init__(self, compressor_cls: type, global_process_set: Any, framework: str,
                 host_count: Callable[[], int] | None = None) -> None:
        self._cls = compressor_cls
        self._global = global_process_set
        self._framework = framework
        self._host_count = host_count

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in available_codecs():
            raise AttributeError(f"no codec {name!r}; valid: {', '.join(available_codecs())}")

        def make(seed: int | None = None, gather: str | None = None, policy: Any = None,
                 pipeline_elems: int | None = UNSET, process_set: Any = None,
                 options: DoorOptions | None = None, **params: Any) -> Any:
            settings = door_options(options, seed=seed, gather=gather, policy=policy,
                                    pipeline_elems=pipeline_elems)
            request = CodecRequest(name, params)
            size = (process_set if process_set is not None else self._global).size
            # the hosts of the global set: where its world is too large for the codec, the
            # hierarchical exchange may still combine one payload per host
            hosts = self._host_count if process_set is None else None
            try:
                codec = request.build(size, hosts)
            except ValueError:
                if not request.needs_world_size or _initialized(size):
                    raise
                codec = (request, size, hosts)  # Horovod not initialized: built at first use
            compressor = self._cls(codec, process_set=process_set, options=settings)
            compressor.codec_request = request
            return compressor

        make.__name__ = name
        make.__doc__ = (f"A Horovod {self._framework} Compressor running the ``{name}`` codec.\n\n"
                        f"Args: seed, gather, policy, pipeline_elems, options (DoorOptions), "
                        f"process_set and the codec's own parameters (docs/codecs.md).")
        return make

    def __dir__(self) -> list[str]:
        return available_codecs()
