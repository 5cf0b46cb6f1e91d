"""``hq.torch.DistributedOptimizer``: Horovod's signature, plus fusion, grouped norms, policy.

Its ideas, side by side: the buckets (:mod:`~horovod_quant.torch.buckets`), the exchange
schedule (:mod:`~horovod_quant.torch.schedule`), the fallback controller
(:mod:`horovod_quant.fallback`), under the gradient exchanger that runs them
(:mod:`~horovod_quant.torch.exchanger`); this module holds the torch optimizer around it: the
hooks, ``synchronize``, ``step`` and the checkpoints. A bucket of step ``t`` is exchanged with
seed ``opt.runtime.seed_of(t, names)`` (its parameters' names comma-joined, as every door keys
a payload): ``mean_estimate(codec, [that vector on each rank], that seed, gather="auto",
pipeline_elems=, topology=, fabric=)`` with ``opt``'s values reproduces it exactly.

As in Horovod, every parameter gets the averaged gradient on every rank, also where a rank did
not use it (zeros), and building the optimizer waits for no other rank: the ranks check that
they agree on the codecs, the policy, the bucket layout and the step at the first
``synchronize()``, before anything else waits for a peer. Unlike Horovod's, it follows
``requires_grad`` changed between steps. ``state_dict()`` adds its own state (step, codec
states, fallback decisions) to the wrapped optimizer's first parameter group, where Horovod's
``broadcast_optimizer_state`` carries it too. Exchange tags carry the step (ranks out of step
raise); after an error in a step it refuses to go on. docs/pytorch.md, section 1.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator

import horovod.torch as hvd
import torch

from ..core.base import Codec
from ..core.contract import HorovodWire
from ..core.registry import get_codec, horovod_equivalent
from ..doors import OPTIMIZER_DOOR, DoorEnvironment, DoorOptions, SettingsAttributes, door_options
from ..exchange.codec_states import CodecStates
from ..exchange.cost import Fabric
from ..exchange.runtime import ExchangeRuntime
from ..exchange.topology import Topology
from ..fallback import FallbackAttributes, FallbackController
from ..stats import StepStats
from .compression import QuantizedCompressor
from .exchanger import GradientExchanger
from .tensors import parameter_names

#: the key of the optimizer's own state in the first parameter group of its ``state_dict()``
#: (where Horovod's ``broadcast_optimizer_state`` carries it; a checkpoint of an older version
#: holds it beside torch's "state" and "param_groups", and still loads)
STATE_KEY = "horovod_quant"


def _resolve_codec(compression: Any) -> tuple[Codec, DoorOptions | None]:
    """(codec, the compressor's settings or None) from what a user may pass as
    ``compression``."""
    if isinstance(compression, QuantizedCompressor):
        return compression.codec, compression.options
    if isinstance(compression, Codec):
        return compression, None
    if isinstance(compression, str):
        return get_codec(compression), None
    if compression is None or compression is hvd.Compression.none:
        return horovod_equivalent(HorovodWire.KEEP), None
    if compression is hvd.Compression.fp16:
        return horovod_equivalent(HorovodWire.FLOAT16), None
    raise ValueError(f"compression={compression!r} is not understood: pass "
                     "hq.torch.Compression.<codec>(...), a codec, a codec name, or "
                     "hvd.Compression.none/fp16")


def _names_of(named_parameters: Any, params: list) -> dict[int, str]:
    """``{id(parameter): name}`` of the optimizer's parameters: from ``named_parameters``
    (every one must be there), else ``param.<i>``."""
    named = parameter_names(named_parameters)
    if named is None:
        return {id(p): f"param.{i}" for i, p in enumerate(params)}
    missing = [p for p in params if id(p) not in named]
    if missing:
        raise ValueError(f"{len(missing)} optimizer parameters are missing from "
                         "named_parameters")
    return {key: name for key, (name, _) in named.items()}


class _QuantDistributedOptimizer(torch.optim.Optimizer):
    """The optimizer :func:`DistributedOptimizer` returns (a subclass of the wrapped
    optimizer's class, built there, as Horovod builds its own): the hooks, ``synchronize``,
    ``step`` and the checkpoints around a :class:`~.exchanger.GradientExchanger`."""

    def __init__(self, params, named_parameters, codec: Codec, backward_passes_per_step: int,
                 op, gradient_predivide_factor: float, groups, sparse_as_dense: bool,
                 process_set, options: DoorOptions, environment: DoorEnvironment) -> None:
        super(self.__class__, self).__init__(params)
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("horovod_quant optimizers support op=hvd.Average or hvd.Sum; "
                             "Adasum combines models, not gradient means")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
        self.codec, self.options = codec, options
        self.op, self.gradient_predivide_factor = op, gradient_predivide_factor
        self.backward_passes_per_step = backward_passes_per_step
        self.sparse_as_dense, self.process_set = sparse_as_dense, process_set
        self._delay: dict[int, int] = {}
        self._grad_accs: list[Any] = []
        self._should_synchronize = True
        # synchronize() ran and no gradient reached the exchange since: step() must not
        # exchange the averaged gradients again (it warns once instead)
        self._synchronized = False
        self._warned_resync = False
        trainable = self._trainable()
        self._exchanger = GradientExchanger(
            trainable, _names_of(named_parameters, trainable), named_parameters is not None,
            codec, options, environment, op, gradient_predivide_factor, groups, sparse_as_dense,
            process_set, self._watch)
        if self._exchanger.size > 1:
            for p in trainable:
                self._watch(p)

    # -- the exchanger's records, as the optimizer's attributes ---------------------------------
    @property
    def runtime(self) -> ExchangeRuntime:
        """The exchanges, codec states, seeds and statistics (``opt.runtime.seed_of(t, names)``:
        the seed of a bucket of step ``t``)."""
        return self._exchanger.runtime

    @property
    def stats(self) -> StepStats:
        return self._exchanger.runtime.stats

    @property
    def last_stats(self) -> StepStats | None:
        return self._exchanger.last_stats

    @property
    def on_step(self) -> Callable[[StepStats], None] | None:
        return self.options.on_step

    @property
    def fabric(self) -> Fabric:
        """The links' speeds the plan choice weighs (GPU or CPU ranks' defaults, HQ_LINK_GBIT,
        HQ_INTRA_GBYTE, HQ_ROUND_US, or as measured): what mean_estimate needs to reproduce a
        bucket's plan."""
        return self._exchanger.runtime.fabric

    @property
    def codec_states(self) -> CodecStates:
        """The adaptive codecs' states (NDQSG's) the exchanges carry from step to step."""
        return self._exchanger.runtime.states

    @property
    def transport(self) -> str | None:
        """What carries the payloads: "gloo" (a group beside Horovod) or "horovod"; known from
        the first ``synchronize()`` on (None before)."""
        return self._exchanger.transport

    @property
    def topology(self) -> Topology | None:
        """Which ranks share hosts, where the transport runs hierarchical exchanges (else None;
        known from the first ``synchronize()`` on): what :func:`~horovod_quant.mean_estimate`
        needs to reproduce a bucket."""
        return self._exchanger.topology

    @property
    def _fallback(self) -> FallbackController:
        return self._exchanger.fallback

    @property
    def fallback_settled(self) -> bool:
        """Whether the fallback has decided for good (always with ``fallback="never"``): from
        the next step on the layout no longer changes for the fallback's sake."""
        return self._exchanger.fallback.settled(self._exchanger.step)

    # -- hooks --------------------------------------------------------------------------------
    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _watch(self, p: torch.nn.Parameter) -> None:
        """Hand ``p``'s gradient to the exchanger from the backward hook of its gradient
        accumulator, once every ``backward_passes_per_step`` passes (once per parameter)."""
        if id(p) in self._delay:
            return
        acc = p.expand_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(self._make_hook(p))
        self._grad_accs.append(acc)
        self._delay[id(p)] = self.backward_passes_per_step

    def _make_hook(self, p: torch.nn.Parameter) -> Callable[..., None]:
        def hook(*_):
            with self._exchanger.refusal.guard():
                if self._delay[id(p)] <= 0:
                    raise AssertionError("Gradients were computed more than "
                                         "backward_passes_per_step times before step(); raise "
                                         "backward_passes_per_step to accumulate gradients "
                                         "locally.")
                self._adopt_group_state()
                self._delay[id(p)] -= 1
                self._synchronized = False
                if self._delay[id(p)] == 0:
                    self._exchanger.gradient_ready(p)
        return hook

    def _rearm(self) -> None:
        """Every parameter's hook hands its gradient over after the next
        ``backward_passes_per_step`` passes."""
        for key in self._delay:
            self._delay[key] = self.backward_passes_per_step

    # -- synchronize / step -------------------------------------------------------------------
    def synchronize(self) -> None:
        """Average the gradients now (clipping before a ``step()`` in :meth:`skip_synchronize`);
        called again before new gradients, ``zero_grad`` or ``step``, it exchanges nothing.
        The first call also runs the ranks' configuration check and sets up the transport
        (:class:`~.exchanger.GradientExchanger`), on every rank at this same point."""
        if self._synchronized:
            return
        with self._exchanger.refusal.guard():
            self._adopt_group_state()
            self._exchanger.synchronize(self._trainable())
            self._rearm()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Use after an explicit ``synchronize()`` (e.g. for gradient clipping) around step()."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronize (unless :meth:`skip_synchronize`, or after ``synchronize()``: then a
        warning, once), then the wrapped optimizer's step."""
        self._exchanger.refusal.check()
        if self._should_synchronize:
            if not self._synchronized:
                self.synchronize()
            elif not self._warned_resync:  # Horovod warns here too
                self._warned_resync = True
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(): the gradients are averaged "
                              "already, so nothing is exchanged again; wrap step() in "
                              "`with optimizer.skip_synchronize():`", UserWarning, stacklevel=2)
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Accumulate ``passes`` backward passes before each exchange (as Horovod's)."""
        if passes < 1:
            raise ValueError(f"backward_passes_per_step={passes} must be >= 1")
        self.backward_passes_per_step = passes
        self._rearm()

    def zero_grad(self, *args, **kwargs):
        self._exchanger.refusal.check()
        if self._exchanger.in_flight:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize()")
        self._synchronized = False
        return super(self.__class__, self).zero_grad(*args, **kwargs)

    # -- checkpoints ----------------------------------------------------------------------------
    def own_state(self) -> dict[str, Any]:
        """This optimizer's own state, plain values (:meth:`.GradientExchanger.own_state`)."""
        self._adopt_group_state()
        return self._exchanger.own_state()

    def load_own_state(self, own: dict[str, Any]) -> None:
        """Continue from :meth:`own_state`'s state (this rank alone, nothing waits for the
        others; :meth:`.GradientExchanger.load_own_state`)."""
        self._exchanger.load_own_state(own)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()`` with :meth:`own_state` under
        :data:`STATE_KEY` in its first parameter group (where Horovod's
        ``broadcast_optimizer_state`` carries it to every rank)."""
        own = self.own_state()
        saved = super(self.__class__, self).state_dict()
        if saved["param_groups"]:
            saved["param_groups"][0][STATE_KEY] = own
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`: torch's part as torch does, and this optimizer's own
        state where there is one (a plain torch optimizer's state dict has none). Nothing here
        waits for the other ranks: load on every rank, or on one and broadcast (Horovod's
        ``broadcast_optimizer_state``, or :func:`~horovod_quant.torch.broadcast.
        broadcast_state`); ranks whose steps differ raise the same error at the first
        ``synchronize()`` (the check), or at their first exchange later on."""
        state_dict = dict(state_dict)
        own = state_dict.pop(STATE_KEY, None)  # where an older version kept it
        super(self.__class__, self).load_state_dict(state_dict)
        if own is not None:
            self.param_groups[0][STATE_KEY] = own
        self._adopt_group_state()

    def _adopt_group_state(self) -> None:
        """Load the state a load or Horovod's ``broadcast_optimizer_state`` left in the first
        parameter group (at the start of the next step at the latest)."""
        if self.param_groups and STATE_KEY in self.param_groups[0]:
            self.load_own_state(self.param_groups[0].pop(STATE_KEY))


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                         compression: Any = None, backward_passes_per_step: int = 1,
                         op: Any = hvd.Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = hvd.global_process_set, *,
                         options: DoorOptions | None = None, **settings: Any):
    """Wrap ``optimizer`` so gradients are averaged across ranks through a horovod_quant codec.

    Same arguments as ``horovod.torch.DistributedOptimizer`` (``num_groups``/``groups`` define
    the fusion buckets when given), plus the settings of
    :class:`~horovod_quant.doors.DoorOptions`, as ``options=`` or as keywords, not both:
    ``fusion_bytes``, ``policy``, ``seed``, ``gather``, ``pipeline_elems``, ``transport``,
    ``on_step``, ``fallback``. A keyword not given comes from the compressor
    (``compression=hq.torch.Compression.<codec>(...)``), else is DoorOptions' default.

    ``transport`` (:mod:`horovod_quant.torch.transport`): "auto" (groups beside Horovod for
    CPU gradients, and for CUDA gradients where ranks share hosts, buckets started in bucket
    order; else Horovod's collectives), "gloo" or "horovod"; the choice is logged once and kept
    in ``opt.transport``; ``opt.topology`` and ``opt.fabric`` choose the plans (docs/pytorch.md,
    "GPU hosts"). ``fallback``: "auto"
    lets Horovod's float32 allreduce carry the buckets whose codec does not pay
    (:class:`~horovod_quant.fallback.FallbackController`, docs/pytorch.md), "never" always
    runs the codec; a one-rank world never measures. ``on_step`` is called with each step's
    :class:`StepStats` (also at ``opt.last_stats``).

    Returns:
        An optimizer of a subclass of ``type(optimizer)``; its ``fallback_decisions`` lists
        the :class:`~horovod_quant.fallback.FallbackDecision` of every bucket once measured,
        ``fallback_step_check`` the :class:`~horovod_quant.fallback.StepCheck` once one ran,
        and ``fallback_settled`` whether the fallback has decided for good.

    Raises:
        ValueError: an argument is invalid (``fallback`` not "auto" or "never", ...), or
            settings are given both as keywords and in ``options=`` (set them in one place).
    """
    codec, inherited = _resolve_codec(compression)
    chosen = door_options(settings, options, inherited, OPTIMIZER_DOOR)
    environment = DoorEnvironment.read(OPTIMIZER_DOOR)  # the environment, once, here
    if num_groups and groups is None:
        groups = num_groups
    cls = type(optimizer.__class__.__name__, (optimizer.__class__, SettingsAttributes,
                                              FallbackAttributes),
               dict(_QuantDistributedOptimizer.__dict__))
    # Horovod's broadcast_optimizer_state initializes the state of a fresh optimizer with a
    # step; for optimizers of its own module it runs the wrapped optimizer's step, not the one
    # that exchanges gradients (which only the ranks without a loaded state would run)
    cls.__module__ = hvd.DistributedOptimizer.__module__
    opt = cls(optimizer.param_groups, named_parameters, codec, backward_passes_per_step, op,
              gradient_predivide_factor, groups, sparse_as_dense, process_set, chosen,
              environment)
    opt.load_state_dict(optimizer.state_dict())
    return opt
