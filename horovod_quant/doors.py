"""What the framework doors share: their settings (:class:`DoorOptions`, one default each, and
:class:`DoorEnvironment`, the environment variables read once, at the door), the cross-rank
configuration check and the ``Compression.<codec>(...)`` namespace.

The doors: Horovod PyTorch's ``compression=`` (:mod:`horovod_quant.torch.compression`),
``hq.torch.DistributedOptimizer`` (:mod:`horovod_quant.torch.optimizer`), the DDP hook
(:mod:`horovod_quant.torch.ddp`), the FSDP hook (:mod:`horovod_quant.torch.fsdp`: the DDP
hook's settings), the outer all-reduce (:mod:`horovod_quant.torch.outer`) and Horovod
TensorFlow's ``compression=`` (:mod:`horovod_quant.tensorflow.compression`). Below the doors
nothing reads the environment: the doors hand the fabric and the MPI choice down as values.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from math import inf
from typing import Any, Callable, Iterable, Iterator

from .core import available_codecs, get_codec
from .core.base import Codec, check_int
from .core.contract import Combine
from .core.registry import codec_class
from .env import env_choice, env_flag, env_positive, env_seconds
from .exchange.check import CONFIG_TIMEOUT_S
from .exchange.codec_states import CodecStates
from .exchange.cost import Fabric
from .exchange.job_end import LEDGER, DoorSteps, StoreRendezvous
from .exchange.plans import DEFAULT_PIPELINE_ELEMS, check_gather, check_pipeline_elems
from .exchange.runtime import ExchangeRuntime
from .fallback import check_baseline, check_fallback
from .policy import LayerPolicy, describe
from .stats import StepStats

log = logging.getLogger("horovod_quant")

#: default of :attr:`DoorOptions.fusion_bytes`
DEFAULT_FUSION_BYTES = 32 << 20
#: what :attr:`DoorOptions.transport` takes besides None
TRANSPORTS = ("auto", "horovod", "gloo")


@dataclasses.dataclass(frozen=True)
class ExchangeSettings:
    """The settings of a door's exchanges, the same in every door: a tensor exchanged with the
    same codec and exchange seed gets the same bits through each of them (docs/pytorch.md,
    "Settings shared by every door").

    Args:
        seed: base seed of every random draw (an integer).
        gather: schedule for gather codecs: "auto", "allgather" or "sra".
        policy: which tensors are compressed, and with which codec (None:
            :class:`~horovod_quant.policy.LayerPolicy`'s defaults).
        pipeline_elems: vectors longer than this are exchanged in pieces of this many elements
            (:class:`~horovod_quant.exchange.Exchange`); None sends every vector whole.
    """

    seed: int = 0
    gather: str = "auto"
    policy: LayerPolicy | None = None
    pipeline_elems: int | None = DEFAULT_PIPELINE_ELEMS

    def __post_init__(self) -> None:
        check_seed(self.seed)
        if self.policy is None:
            object.__setattr__(self, "policy", LayerPolicy())
        check_gather(self.gather)
        if not isinstance(self.policy, LayerPolicy):
            raise ValueError(f"policy={self.policy!r} is not a horovod_quant LayerPolicy")
        check_pipeline_elems(self.pipeline_elems)


#: the names of :class:`ExchangeSettings`: what every door takes
SHARED_NAMES = tuple(f.name for f in dataclasses.fields(ExchangeSettings))


@dataclasses.dataclass(frozen=True)
class FallbackSettings:
    """The settings of the fallback (:mod:`horovod_quant.fallback`), which
    ``hq.torch.DistributedOptimizer`` and the DDP and FSDP hooks take.

    Args:
        fallback: "auto" (the baseline's allreduce carries the buckets whose codec does not
            pay) or "never".
        baseline: the uncompressed allreduce a codec must beat: "fp32", "fp16", "bf16", or
            "auto" (the faster of float32 and the door's 16-bit allreduce in the trial).
    """

    fallback: str = "auto"
    baseline: str = "auto"

    def __post_init__(self) -> None:
        check_fallback(self.fallback)
        check_baseline(self.baseline)


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """The settings ``hq.torch.DistributedOptimizer`` alone uses.

    Args:
        fusion_bytes: float32 bytes per fused bucket.
        transport: what carries the payloads, "auto", "horovod" or "gloo"; None: the
            ``HQ_TRANSPORT`` environment variable (:class:`DoorEnvironment`), else "auto".
        on_step: called with each step's :class:`~horovod_quant.stats.StepStats`.
    """

    fusion_bytes: int = DEFAULT_FUSION_BYTES
    transport: str | None = None
    on_step: Callable[[StepStats], None] | None = None

    def __post_init__(self) -> None:
        check_int("fusion_bytes", self.fusion_bytes, 1)
        if self.transport is not None and self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not valid: choose one of "
                             f"{list(TRANSPORTS)} ('auto': a gloo group beside Horovod for CPU "
                             "gradients) or None (the HQ_TRANSPORT environment variable)")
        if self.on_step is not None and not callable(self.on_step):
            raise ValueError(f"on_step={self.on_step!r} must be callable or None")


@dataclasses.dataclass(frozen=True)
class DoorOptions(OptimizerSettings, FallbackSettings, ExchangeSettings):
    """Every setting of the framework doors in one value, one default each: the
    :class:`ExchangeSettings` every door takes, the :class:`FallbackSettings` of the
    optimizer and the DDP and FSDP hooks, and the :class:`OptimizerSettings` of
    ``hq.torch.DistributedOptimizer``.

    Every door takes its settings one way: ``options=DoorOptions(...)``, or each setting as a
    keyword argument of the same name (over the settings of a compressor the door was given,
    else the defaults), not both (:func:`door_options`). A door raises ValueError for a
    setting it does not take (:data:`DOOR_TAKES`) that is given as a keyword or is not at its
    default, naming the doors that take it: a Horovod compressor keeps no setting for the
    optimizer it is passed to.
    """

    def __post_init__(self) -> None:
        ExchangeSettings.__post_init__(self)
        FallbackSettings.__post_init__(self)
        OptimizerSettings.__post_init__(self)

    def check_door(self, door: str, takes: tuple[str, ...] | None = None) -> "DoorOptions":
        """``self``, for ``door``, which takes only the settings ``takes`` (None: its
        :data:`DOOR_TAKES`); ValueError naming each other one not at its default, and the
        doors that take it."""
        takes = DOOR_TAKES[door] if takes is None else takes
        defaults = DoorOptions()
        refused = {name: getattr(self, name) for name in DOOR_SETTINGS
                   if name not in takes and getattr(self, name) != getattr(defaults, name)}
        if refused:
            raise refusal(door, refused)
        return self


#: the settings every door takes, the fallback's (the optimizer, the DDP and FSDP hooks) and
#: those only ``hq.torch.DistributedOptimizer`` uses
SHARED = SHARED_NAMES
FALLBACK = tuple(f.name for f in dataclasses.fields(FallbackSettings))
OPTIMIZER_ONLY = tuple(f.name for f in dataclasses.fields(OptimizerSettings))
DOOR_SETTINGS = SHARED + FALLBACK + OPTIMIZER_ONLY

#: the doors, as their messages name them
OPTIMIZER_DOOR = "hq.torch.DistributedOptimizer"
TORCH_COMPRESSOR_DOOR = "PyTorch compressor"
TF_DOOR = "TensorFlow door"
DDP_DOOR, FSDP_DOOR, OUTER_DOOR = "DDP hook", "FSDP hook", "outer all-reduce"
#: the settings each door takes: the outer all-reduce those of the exchange but the policy
#: (one tensor, all of it compressed); the Horovod compressors keep none for the optimizer
DOOR_TAKES: dict[str, tuple[str, ...]] = {
    OPTIMIZER_DOOR: DOOR_SETTINGS,
    DDP_DOOR: SHARED + FALLBACK,
    FSDP_DOOR: SHARED + FALLBACK,
    TORCH_COMPRESSOR_DOOR: SHARED,
    TF_DOOR: SHARED,
    OUTER_DOOR: ("seed", "gather", "pipeline_elems"),
}


def _in_words(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def refusal(door: str, refused: dict[str, Any]) -> ValueError:
    """The error of ``door`` for the ``refused`` settings (name -> value), naming for each
    the doors that take it (:data:`DOOR_TAKES`)."""
    takers: dict[tuple[str, ...], list[str]] = {}
    for name in refused:
        doors = tuple(d if d.startswith("hq.") else f"the {d}" for d, takes in DOOR_TAKES.items()
                      if name in takes and d != door)
        takers.setdefault(doors, []).append(name)
    where = "; ".join(f"{', '.join(names)}: {_in_words(list(doors))}"
                      for doors, names in takers.items())
    these, them = ("this setting", "it") if len(refused) == 1 else ("these settings", "them")
    return ValueError(f"{', '.join(f'{k}={v!r}' for k, v in refused.items())}: the "
                      f"{door} does not take {these} ({where}); pass {them} to a door that "
                      f"takes {them}, not to this one")


def door_options(given: dict[str, Any], options: DoorOptions | None = None,
                 inherited: DoorOptions | None = None, door: str | None = None,
                 takes: tuple[str, ...] | None = None) -> DoorOptions:
    """A door's settings from one place: ``options``, or the ``given`` keyword arguments over
    ``inherited`` (the settings of a compressor the door was handed), else the defaults;
    wherever they came from, checked for ``door`` (:meth:`DoorOptions.check_door`).

    Args:
        given: the settings given as keyword arguments (None is a value: ``pipeline_elems=None``
            sends whole vectors).
        options: the door's ``options=``.
        inherited: the settings of a compressor the door was handed.
        door: the door, by its name in :data:`DOOR_TAKES` (None: a door taking
            :data:`SHARED`).
        takes: the settings this door takes (None: the door's :data:`DOOR_TAKES`).

    Raises:
        ValueError: settings given both ways, a keyword that is no door's setting, a setting
            this door does not take (given as a keyword, or not at its default), or an invalid
            setting.
    """
    if takes is None:
        takes = SHARED if door is None else DOOR_TAKES[door]
    name = "door" if door is None else door
    if options is not None and not isinstance(options, DoorOptions):
        raise ValueError(f"options={options!r} is not a horovod_quant DoorOptions")
    unknown = sorted(set(given) - set(DOOR_SETTINGS))
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a setting of this door; it takes "
                         f"{', '.join(takes)} (or options=DoorOptions(...))")
    elsewhere = {k: v for k, v in given.items() if k not in takes}
    if elsewhere:
        raise refusal(name, elsewhere)
    if options is not None and given:
        names = ", ".join(sorted(given))
        raise ValueError(f"{names} given as keyword arguments and options= given too: set "
                         f"{names} inside options=DoorOptions(...), or drop options= and pass "
                         "every setting as a keyword")
    chosen = options if options is not None else dataclasses.replace(inherited or DoorOptions(),
                                                                       **given)
    return chosen.check_door(name, takes)


#: the environment variables of the doors' settings, read by :meth:`DoorEnvironment.read`
LINK_ENV, INTRA_ENV, ROUND_ENV = "HQ_LINK_GBIT", "HQ_INTRA_GBYTE", "HQ_ROUND_US"
MPI_EXCHANGE_ENV, TRANSPORT_ENV = "HQ_MPI_EXCHANGE", "HQ_TRANSPORT"
CUDA_AWARE_MPI_ENV, DEVICE_COLLECTIVES_ENV = "HQ_CUDA_AWARE_MPI", "HQ_DEVICE_COLLECTIVES"
CONFIG_TIMEOUT_ENV = "HQ_CONFIG_TIMEOUT"
#: the :class:`~.exchange.cost.Fabric` field each fabric variable sets, and its unit
FABRIC_ENV = {"link_gbit": (LINK_ENV, "Gbit/s"), "intra_gbyte": (INTRA_ENV, "GB/s"),
              "round_us": (ROUND_ENV, "microseconds")}
#: which parts of :class:`DoorEnvironment` each door reads; it ignores the other variables,
#: which a job sets on all its ranks and may mean for another door of the same job
DOOR_READS: dict[str, tuple[str, ...]] = {
    OPTIMIZER_DOOR: ("fabric", "mpi_exchange", "transport", "device_buffers"),
    DDP_DOOR: ("fabric",),
    FSDP_DOOR: ("fabric",),
    OUTER_DOOR: ("fabric",),
    TORCH_COMPRESSOR_DOOR: ("fabric", "mpi_exchange", "device_buffers"),
    TF_DOOR: ("fabric", "mpi_exchange"),
}


def config_timeout() -> float:
    """``HQ_CONFIG_TIMEOUT``, read now: seconds a rank waits for the others at a check."""
    return env_seconds(CONFIG_TIMEOUT_ENV, CONFIG_TIMEOUT_S)


@dataclasses.dataclass(frozen=True)
class DoorEnvironment:
    """The environment variables of the doors' settings, read once, where a door resolves its
    settings (:meth:`read`), and handed down as values: below the doors (the exchange, the
    fallback controller, the transport's choice, the collectives) nothing reads them.

    Args:
        link_gbit, intra_gbyte, round_us: ``HQ_LINK_GBIT``, ``HQ_INTRA_GBYTE``,
            ``HQ_ROUND_US``: the :class:`~.exchange.cost.Fabric` fields they set over the
            ranks' defaults, which a measurement keeps (None: unset).
        mpi_exchange: ``HQ_MPI_EXCHANGE`` (default on): whether Horovod's collectives run a
            custom reduction over MPI (Global-QSGD's exponent allreduce), which changes what
            goes on the wire.
        transport: ``HQ_TRANSPORT`` (default "auto"): the optimizer's transport where its
            ``transport=`` is None.
        cuda_aware_mpi, device_collectives: ``HQ_CUDA_AWARE_MPI``, ``HQ_DEVICE_COLLECTIVES``
            (None: unset, detected): whether MPI, and Horovod's collectives, take CUDA buffers
            (:mod:`horovod_quant.gpu.device_collectives`); read by the PyTorch Horovod doors.
        config_timeout: ``HQ_CONFIG_TIMEOUT`` (seconds, default 600, read by every door): how
            long a rank waits for the others at the configuration check
            (:func:`~.exchange.check.wait_for_peers`).
    """

    link_gbit: float | None = None
    intra_gbyte: float | None = None
    round_us: float | None = None
    mpi_exchange: bool = True
    transport: str = "auto"
    cuda_aware_mpi: bool | None = None
    device_collectives: bool | None = None
    config_timeout: float = CONFIG_TIMEOUT_S

    def __post_init__(self) -> None:
        for field in FABRIC_ENV:
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < inf):
                raise ValueError(f"{field}={value!r} must be a positive number")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r} is not valid: choose one of "
                             f"{list(TRANSPORTS)}")

    @classmethod
    def read(cls, door: str) -> "DoorEnvironment":
        """The variables ``door`` uses (:data:`DOOR_READS`), read now; the others keep
        their defaults.

        Raises:
            ValueError: a variable the door reads holds an invalid value (named).
        """
        reads = DOOR_READS[door]
        values: dict[str, Any] = {"config_timeout": config_timeout()}
        if "fabric" in reads:
            values.update({field: env_positive(name, None, unit)
                           for field, (name, unit) in FABRIC_ENV.items()})
        if "mpi_exchange" in reads:
            values["mpi_exchange"] = env_flag(MPI_EXCHANGE_ENV, default=True)
        if "transport" in reads:
            values["transport"] = env_choice(TRANSPORT_ENV, TRANSPORTS, "auto")
        if "device_buffers" in reads:
            values["cuda_aware_mpi"] = env_flag(CUDA_AWARE_MPI_ENV)
            values["device_collectives"] = env_flag(DEVICE_COLLECTIVES_ENV)
        return cls(**values)

    @property
    def fabric_set(self) -> dict[str, float]:
        """The fabric's fields the environment sets: ``{field: value}``."""
        return {field: getattr(self, field) for field in FABRIC_ENV
                if getattr(self, field) is not None}

    def fabric(self, on_gpu: bool) -> Fabric:
        """The fabric of CPU or GPU ranks (:meth:`~.exchange.cost.Fabric.for_ranks`), with
        the fields the environment sets."""
        return Fabric.for_ranks(on_gpu, self.fabric_set)

    def transport_for(self, transport: str | None) -> str:
        """The transport of a ``transport=`` setting: itself, else ``HQ_TRANSPORT``'s."""
        return self.transport if transport is None else transport


class SettingsAttributes:
    """The exchange settings of a door's :attr:`options` as its attributes (``door.seed``,
    ...), written once for every door."""

    options: ExchangeSettings

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


def check_seed(seed: Any) -> int:
    """A seed as an int; ValueError for anything else (``7.9`` is not silently ``7``)."""
    return check_int("seed", seed, -(1 << 63), (1 << 64) - 1)



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

    @classmethod
    def from_spec(cls, spec: str) -> "CodecRequest":
        """A codec asked for as ``"name"``, ``"name:bits"`` or ``"name-suffix:bits"`` (the
        examples' ``--codec``, the predictor's specs): a suffix sets the parameters the codec
        declares for it (:attr:`.core.base.Codec.spec_suffixes`: ``global_qsgd-lin:8``).

        Raises:
            ValueError: an unknown codec or suffix, or a part after ``:`` that is not an
                integer.
        """
        name, colon, bits = spec.strip().partition(":")
        suffix = ""
        if name not in available_codecs() and "-" in name:
            name, _, suffix = name.rpartition("-")
        suffixes = codec_class(name).spec_suffixes  # an unknown name: the valid ones listed
        if suffix and suffix not in suffixes:
            known = [f"{n}-{s}" for n in available_codecs() for s in codec_class(n).spec_suffixes]
            raise ValueError(f"codec {spec!r}: {name} takes no suffix -{suffix}; the codecs "
                             f"with suffixes: {', '.join(known)}")
        params: dict[str, Any] = {}
        if colon:
            try:
                params["bits"] = int(bits)
            except ValueError:
                raise ValueError(f"codec {spec!r}: bits {bits!r} is not an integer: write a "
                                 f"codec name, or name:bits with an integer number of bits "
                                 f"({name}:8)") from None
        return cls(name, {**params, **suffixes.get(suffix, {})})

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


@dataclasses.dataclass(frozen=True)
class RequestedCodec:
    """A codec asked for by name through ``Compression.<name>(...)``, with the group it is
    built for.

    Attributes:
        request: the name and the parameters the user gave.
        world_size: the group's size (Horovod's ``process_set.size``).
        host_count: the group's hosts, where a world too large for the codec may still
            combine one payload per host (see :meth:`CodecRequest.build`), or None.
    """

    request: CodecRequest
    world_size: Callable[[], int]
    host_count: Callable[[], int | None] | None = None

    def build(self) -> Codec:
        return self.request.build(self.world_size, self.host_count)

    def build_if_ready(self) -> Codec | None:
        """The codec, or None while it needs a world size that Horovod cannot give yet (not
        initialized): it is then built at its first use."""
        try:
            return self.build()
        except ValueError:
            if not self.request.needs_world_size or _initialized(self.world_size):
                raise
            return None


class CompressorSettings(SettingsAttributes):
    """The codec and settings a door holds (the Horovod doors' compressors, the DDP state).

    Args:
        codec: the codec (see :func:`horovod_quant.get_codec`), or a :class:`RequestedCodec`,
            built now, or at its first use when it needs a world size before Horovod is
            initialized.
        options: the door's :class:`DoorOptions`.
        door: the door (:data:`DOOR_READS`: which environment variables it reads).
        process_set: Horovod process set of the optimizer or tape, if not the global one.

    Attributes:
        options: the :class:`DoorOptions`; ``seed``, ``gather``, ``policy`` and
            ``pipeline_elems`` read them.
        stats: :class:`~horovod_quant.stats.StepStats` since the last ``stats.reset()``.
        codec_request: how ``Compression.<name>(...)`` asked for the codec, or None.
    """

    def __init__(self, codec: Codec | RequestedCodec, options: DoorOptions, door: str,
                 process_set: Any = None) -> None:
        self._requested = codec if isinstance(codec, RequestedCodec) else None
        self.codec_request = None if self._requested is None else self._requested.request
        self._codec = codec if self._requested is None else self._requested.build_if_ready()
        self.options = options
        self.process_set = process_set
        #: the door's environment variables, read now (:class:`DoorEnvironment`)
        self.environment = DoorEnvironment.read(door)
        #: the door's exchanges, codec states, check, seeds and statistics
        self.runtime = ExchangeRuntime(options.seed, options.gather, options.pipeline_elems,
                                       timeout=self.environment.config_timeout)

    @property
    def stats(self) -> StepStats:
        return self.runtime.stats

    @property
    def codec_states(self) -> CodecStates:
        """The adaptive codecs' states (NDQSG's) the door's exchanges carry."""
        return self.runtime.states

    @property
    def codec(self) -> Codec:
        """The codec (a requested one is built at the first use)."""
        if self._codec is None:
            self._codec = self._requested.build()
        return self._codec

    def shared_config(self) -> dict:
        """What must agree across ranks (see :class:`ConfigCheck`)."""
        return {"door": "compressor", **self.codec.config(), "seed": self.seed,
                "gather": self.gather, "pipeline_elems": self.pipeline_elems,
                "policy": describe(self.policy)}


class Refusal:
    """A door that stops at its first error: once a part of a step raised, the ranks'
    exchanges may have stopped at different points, and going on would leave them different,
    so every later part raises, naming the first error and what to build instead. It holds the
    door's entry in the job's ledger (:mod:`~horovod_quant.exchange.job_end`): an error that
    says a peer ended its job becomes the ranks' agreed :class:`~.exchange.wire.OutOfStep`.

    Args:
        door: the door, for the message.
        fresh: what to build to go on.
    """

    def __init__(self, door: str, fresh: str) -> None:
        self._door, self._fresh = door, fresh
        self.failed: str | None = None  # the first error, one line
        self._steps: DoorSteps | None = None

    def register(self, steps: int, rendezvous: StoreRendezvous | None) -> None:
        """Enter the door in the job's ledger (once, before its first exchange; None: no
        store to agree in, the door is not entered)."""
        if self._steps is None:
            self._steps = LEDGER.register(self._door, steps, rendezvous)

    def begin(self) -> None:
        """A step begins (for the agreement at the job's end)."""
        if self._steps is not None:
            self._steps.begin()

    def count(self, steps: int) -> None:
        """A step ended: the door's completed steps (for the agreement at the job's end)."""
        if self._steps is not None:
            self._steps.end(steps)

    def check(self) -> None:
        """Raise RuntimeError once an error stopped the door."""
        if self.failed is not None:
            raise RuntimeError(
                f"horovod_quant: this {self._door} stopped at an error ({self.failed}); its "
                "exchanges may have stopped at different points on different ranks, so it "
                f"does not go on: build {self._fresh}, and load a checkpoint on every rank "
                "(or on one and broadcast it)")

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Run a part of a step: :meth:`check` first; an error inside stops the door."""
        self.check()
        try:
            yield
        except BaseException as exc:
            agreed = LEDGER.explain() if self._steps is not None else None
            self.failed = f"{type(agreed or exc).__name__}: {agreed or exc}".split("\n")[0]
            if self._steps is not None:
                self._steps.failed = True
            if agreed is not None:
                raise agreed from exc
            raise


def load_codec_states(states: CodecStates, saved: dict, saved_world: int | None, world: int,
                      door: str) -> None:
    """Load a checkpoint's codec states into a door's ``states``. Saved at another world size
    (``saved_world``; None: not recorded), the states of the codecs built for the number of
    workers are carried to the same codecs built for ``world`` (each re-measures at its next
    exchange), with one warning naming both sizes."""
    if saved_world is None or int(saved_world) == world:
        states.load_state_dict(saved)
        return
    rekeyed = states.load_state_dict(saved, (int(saved_world), world))
    warnings.warn(f"horovod_quant: the {door} state was saved at world size {saved_world} and "
                  f"is loaded at world size {world}: the step carries over"
                  + (f", and the adaptive states of the codecs built for {saved_world} workers "
                     f"({len(rekeyed)}) now serve the same codecs built for {world}"
                     if rekeyed else ""), UserWarning, stacklevel=3)


def mpi_exchange_config(codecs: Iterable[Codec], mpi_exchange: bool) -> dict:
    """``HQ_MPI_EXCHANGE`` (the door's :attr:`DoorEnvironment.mpi_exchange`) for the
    configuration check of an exchange over Horovod's collectives, where it changes the wire:
    a codec with a custom combine runs the MPI reduction when it is on, else the allgather
    plan (and the MPI set-up is collective)."""
    if any(c.traits.combine is Combine.CUSTOM for c in codecs):
        return {"mpi_exchange": mpi_exchange}
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

        def make(process_set: Any = None, options: DoorOptions | None = None,
                 **params: Any) -> Any:
            settings = {k: params.pop(k) for k in DOOR_SETTINGS if k in params}
            size = (process_set if process_set is not None else self._global).size
            # the hosts of the global set: where its world is too large for the codec, the
            # hierarchical exchange may still combine one payload per host
            hosts = self._host_count if process_set is None else None
            return self._cls(RequestedCodec(CodecRequest(name, params), size, hosts),
                             process_set=process_set, options=options, **settings)

        make.__name__ = name
        make.__doc__ = (f"A Horovod {self._framework} Compressor running the ``{name}`` codec.\n\n"
                        f"Args: process_set, options (DoorOptions) or the settings as keywords "
                        f"(seed, gather, policy, pipeline_elems, and the torch door keeps the "
                        f"optimizer's), and the codec's own parameters (docs/codecs.md).")
        return make

    def __dir__(self) -> list[str]:
        return available_codecs()
