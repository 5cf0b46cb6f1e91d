"""``hq.torch.DistributedOptimizer``: Horovod's signature, plus fusion, grouped norms, policy.

Its ideas, side by side: the buckets (:mod:`~horovod_quant.torch.buckets`), the exchange
schedule (:mod:`~horovod_quant.torch.schedule`) and the fallback controller
(:mod:`horovod_quant.fallback`); this module holds the hooks and the step. A bucket of step
``t`` is exchanged with seed ``opt.runtime.seed_of(t, names)`` (its parameters' names
comma-joined, as every door keys a payload): ``mean_estimate(codec, [that vector on each rank],
that seed, gather="auto", pipeline_elems=, topology=, fabric=)`` with ``opt``'s values
reproduces it exactly, global-norm codecs included (the norm is the bucket's).

As in Horovod, every parameter gets the averaged gradient on every rank, also where a rank did
not use it (its gradient counts as zeros). Unlike Horovod's, it follows ``requires_grad`` changed
between steps: an unfrozen parameter's first gradient takes Horovod's allreduce, then a bucket;
a frozen one keeps no gradient and leaves its bucket. The ranks check at construction that they
agree on the codecs, the policy and the bucket layout, before anything else waits for a peer. A
sparse gradient travels on Horovod's sparse path and leaves its bucket from the next step on.
``state_dict()`` adds its own state (step, codec states, fallback decisions) to the wrapped
optimizer's first parameter group, where Horovod's ``broadcast_optimizer_state`` carries it
too. Exchange tags carry the step (ranks out of step raise); after an error in a step it
refuses to go on. docs/pytorch.md, section 1, tells the whole story.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterable

import horovod.torch as hvd
import torch

from ..core.base import Codec
from ..core.baselines import HOROVOD_SIXTEEN_BIT
from ..core.registry import get_codec, horovod_equivalent
from ..doors import (
    OPTIMIZER_DOOR,
    DoorEnvironment,
    DoorOptions,
    Refusal,
    SettingsAttributes,
    door_options,
    load_codec_states,
    mpi_exchange_config,
)
from ..exchange.codec_states import CodecStates
from ..exchange.cost import Fabric
from ..exchange.runtime import ExchangeRuntime
from ..fallback import (
    BaselineChoice,
    BucketTrial,
    FallbackAttributes,
    FallbackController,
    measured_fabric,
)
from ..policy import describe
from ..stats import StepStats
from .buckets import Bucket, BucketLayout
from .collectives import HorovodTorchCollectives
from .compression import QuantizedCompressor
from .horovod_path import HorovodPath
from .schedule import ExchangeSchedule
from .tensors import BASELINE_DTYPES, on_gpu, parameter_names
from .transport import (
    horovod_end_of_job,
    horovod_topology,
    resolve_transport,
    transport_collectives,
    transport_of,
)
from .trials import bucket_trials, horovod_plan

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
        return horovod_equivalent("keep"), None
    if compression is hvd.Compression.fp16:
        return horovod_equivalent("float16"), None
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


def _key_by_name(names: dict[int, str]) -> Callable[[str], int]:
    """The inverse of ``names`` (``{id(parameter): name}``), raising ValueError for a name of
    another model."""
    by_name = {name: key for key, name in names.items()}

    def key_of(name: str) -> int:
        if name not in by_name:
            raise ValueError(f"the checkpoint names parameter {name!r}, which this optimizer "
                             "does not have: pass the same named_parameters as the saved job")
        return by_name[name]

    return key_of


class _OwnState:
    """The optimizer's own state in its checkpoints and broadcasts (a base class of the
    optimizer, before the wrapped optimizer's class, whose ``state_dict`` it extends)."""

    def own_state(self) -> dict[str, Any]:
        """This optimizer's own state, plain values: the step (the exchanges' seeds), the
        world size, the codec states, the fallback's decisions and the links it measured (the
        plans' fabric) and the parameters found sparse (names, as ``named_parameters`` gave
        them)."""
        self._adopt_group_state()
        names = self._layout.names
        return {"step": self._step, "world_size": self._comm.size,
                "codec_states": self.codec_states.state_dict(),
                "fallback": self._fallback.state_dict(names.__getitem__),
                "fabric": list(self.fabric),
                "sparse": sorted(names[k] for k in self._layout.sparse)}

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's ``state_dict()`` with :meth:`own_state` under
        :data:`STATE_KEY` in its first parameter group (where Horovod's
        ``broadcast_optimizer_state`` carries it to every rank)."""
        own = self.own_state()
        saved = super(_OwnState, self).state_dict()
        if saved["param_groups"]:
            saved["param_groups"][0][STATE_KEY] = own
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a :meth:`state_dict`: torch's part as torch does, and this optimizer's own
        state where there is one (a plain torch optimizer's state dict has none). Nothing here
        waits for the other ranks: load on every rank, or on one and broadcast (Horovod's
        ``broadcast_optimizer_state``, or :func:`~horovod_quant.torch.broadcast.
        broadcast_state`); ranks whose steps differ raise the same error at their first
        exchange."""
        state_dict = dict(state_dict)
        own = state_dict.pop(STATE_KEY, None)  # where an older version kept it
        super(_OwnState, self).load_state_dict(state_dict)
        if own is not None:
            self.param_groups[0][STATE_KEY] = own
        self._adopt_group_state()

    def load_own_state(self, own: dict[str, Any]) -> None:
        """Continue from :meth:`own_state`'s state (this rank alone, nothing waits for the
        others). A state saved at another world size is adapted: the codecs built for the
        number of workers start from their state re-keyed for this world, with one warning.

        Raises:
            ValueError: ``own`` is not such a state, or names parameters this optimizer does
                not have.
        """
        try:
            step = int(own["step"])
            codec_states, fallback, sparse = own["codec_states"], own["fallback"], own["sparse"]
        except (KeyError, TypeError, ValueError):
            raise ValueError("not a horovod_quant optimizer state: pass what state_dict() "
                             "or own_state() returned") from None
        key_of = _key_by_name(self._layout.names)
        self._step = step
        self._refusal.count(step)
        load_codec_states(self.codec_states, codec_states, own.get("world_size"),
                          self._comm.size, "hq.torch.DistributedOptimizer")
        self._fallback.load_state_dict(fallback, key_of)
        if own.get("fabric") is not None:  # (a state saved before the links were measured: none)
            self._use_fabric(Fabric(*own["fabric"]))
        self._layout.sparse = {key_of(name) for name in sparse}
        self._relayout(check=False)

    def _adopt_group_state(self) -> None:
        """Load the state a load or Horovod's ``broadcast_optimizer_state`` left in the first
        parameter group (at the start of the next step at the latest)."""
        if self.param_groups and STATE_KEY in self.param_groups[0]:
            self.load_own_state(self.param_groups[0].pop(STATE_KEY))


class _QuantDistributedOptimizer(torch.optim.Optimizer):
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
        # the environment's settings, read at the door (DistributedOptimizer)
        self._environment = environment
        self.op, self.gradient_predivide_factor = op, gradient_predivide_factor
        self.backward_passes_per_step = backward_passes_per_step
        self.sparse_as_dense, self.process_set = sparse_as_dense, process_set
        self.last_stats: StepStats | None = None
        self._step = 0
        self._fallback = FallbackController(options.fallback, options.baseline,
                                            HOROVOD_SIXTEEN_BIT)
        all_params = self._trainable()
        if (BASELINE_DTYPES.get(options.baseline) == torch.bfloat16
                and any(not on_gpu(p) for p in all_params)):
            raise ValueError(f"baseline={options.baseline!r}: Horovod's CPU allreduce takes no "
                             "bfloat16; choose another baseline (or 'auto') for CPU gradients")
        self._named_by_user = named_parameters is not None
        self._layout = BucketLayout(all_params, _names_of(named_parameters, all_params),
                                    codec, options.policy, groups, options.fusion_bytes)
        self._densified: set[int] = set()  # sparse this step, exchanged dense (sparse_as_dense)
        self._delay: dict[int, int] = {}
        self._hooked: set[int] = set()
        self._should_synchronize = True
        # synchronize() ran and no gradient reached the exchange since: step() must not
        # exchange the averaged gradients again (it warns once instead)
        self._synchronized = False
        self._warned_resync = False
        # an error inside a step stops the optimizer: the ranks may have stopped apart
        self._refusal = Refusal("optimizer", "a new hq.torch.DistributedOptimizer")
        # where the codecs run: the first device whose gradients the CUDA kernels encode
        device = next((p.device for p in all_params if on_gpu(p)), torch.device("cpu"))
        #: the links' speeds the plan choice weighs (GPU or CPU ranks' defaults, HQ_LINK_GBIT,
        #: HQ_INTRA_GBYTE, HQ_ROUND_US): what mean_estimate needs to reproduce a bucket's plan
        #: the optimizer's exchanges, codec states, checks, seeds, statistics and the links'
        #: speeds the plan choice weighs (``fabric``: GPU or CPU ranks' defaults,
        #: HQ_LINK_GBIT, HQ_INTRA_GBYTE, HQ_ROUND_US): what mean_estimate needs to reproduce a
        #: bucket's plan
        self.runtime = ExchangeRuntime(options.seed, options.gather, options.pipeline_elems,
                                       environment.fabric(device.type == "cuda"),
                                       environment.config_timeout)
        # the check comes before anything that can wait for a peer (the transport's and the
        # exchanges' set-up), over Horovod's collectives
        self._transport = resolve_transport(environment.transport_for(options.transport))
        self._comm = HorovodTorchCollectives(process_set)
        self.runtime.check(self._comm, self._layout_config())
        self._prefix = self.runtime.wait_check()
        self._comm = transport_collectives(process_set, self._transport, device,
                                           environment.mpi_exchange)
        #: what carries the payloads: "gloo" (a group beside Horovod) or "horovod"
        self.transport = transport_of(self._comm)
        #: which ranks share hosts, where the transport runs hierarchical exchanges (else None):
        #: what :func:`~horovod_quant.mean_estimate` needs to reproduce a bucket
        self.topology = getattr(self._comm.hierarchy, "topology", None)
        self.runtime.open(options.policy.codecs(codec), self._comm)
        self._schedule = ExchangeSchedule(self._comm, self.runtime, self._layout.names,
                                          self._prefix)
        self._schedule.use(self._layout.buckets)
        self._horovod = HorovodPath(op, gradient_predivide_factor, process_set, self._prefix)
        self._grad_accs: list[Any] = []
        if self._comm.size > 1:
            self._refusal.register(self._step, horovod_end_of_job(
                HorovodTorchCollectives(process_set)))
            for p in all_params:
                self._watch(p)

    # -- the optimizer's own settings and the fallback's records, as attributes -------------
    @property
    def on_step(self) -> Callable[[StepStats], None] | None:
        return self.options.on_step

    @property
    def fallback_settled(self) -> bool:
        """Whether the fallback has decided for good (always with ``fallback="never"``): from
        the next step on the layout no longer changes for the fallback's sake."""
        return self._fallback.settled(self._step)

    @property
    def stats(self) -> StepStats:
        return self.runtime.stats

    @property
    def fabric(self) -> Fabric:
        return self.runtime.fabric

    @property
    def codec_states(self) -> CodecStates:
        """The adaptive codecs' states (NDQSG's) the exchanges carry from step to step."""
        return self.runtime.states

    def _layout_config(self) -> dict:
        """What every rank must agree on, everything that changes what goes on the wire (the
        codecs, policy, seed, transport, pipeline, op and factors, sparse handling, fallback
        and the buckets). ``backward_passes_per_step`` is not checked: it changes when a rank
        starts its exchanges, not which."""
        options, names = self.options, self._layout.names
        mpi = ({} if self._transport == "gloo" else mpi_exchange_config(
            options.policy.codecs(self.codec), self._environment.mpi_exchange))
        return {
            "door": "optimizer", **self.codec.config(), "seed": options.seed, "step": self._step,
            "transport": self._transport, **mpi, "pipeline_elems": options.pipeline_elems,
            "op": self.op, "gradient_predivide_factor": self.gradient_predivide_factor,
            "sparse_as_dense": self.sparse_as_dense, "gather": options.gather,
            "fabric": list(self.fabric),
            "policy": describe(options.policy),
            "fallback": [options.fallback, options.baseline, self._fallback.baseline,
                         sorted(names[k] for k in self._fallback.fallen_back)],
            **self._layout.describe()}

    def _relayout(self, check: bool = True) -> None:
        """Form the buckets again (sparse and fallen-back parameters leave theirs); the ranks
        check the new layout (``check``: not where one rank alone relays out, as in a load)."""
        self._layout.form(self._fallback.fallen_back, keep_buffers=self._fallback.checking,
                          fallback_dtype=BASELINE_DTYPES[self._fallback.baseline])
        self._schedule.use(self._layout.buckets)
        if check:
            self.runtime.check_again(self._comm, self._layout_config())

    # -- hooks --------------------------------------------------------------------------------
    def _trainable(self) -> list[torch.nn.Parameter]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def _watch(self, p: torch.nn.Parameter) -> None:
        """Start ``p``'s exchange from the backward hook of its gradient accumulator."""
        acc = p.expand_as(p).grad_fn.next_functions[0][0]
        acc.register_hook(self._make_hook(p))
        self._grad_accs.append(acc)
        self._delay[id(p)] = self.backward_passes_per_step

    def _make_hook(self, p: torch.nn.Parameter):
        def hook(*_):
            with self._refusal.guard():
                key = id(p)
                if self._delay[key] <= 0:
                    raise AssertionError("Gradients were computed more than "
                                         "backward_passes_per_step times before step(); raise "
                                         "backward_passes_per_step to accumulate gradients "
                                         "locally.")
                self._adopt_group_state()
                self._refusal.begin()
                self._delay[key] -= 1
                self._synchronized = False
                if self._delay[key] == 0:
                    self._fallback.exchange_started()
                    self._hooked.add(key)
                    self._ready(p)
                    self._schedule.advance()
        return hook

    def _flat(self, bucket: Bucket) -> Any:
        return bucket.flat_input(lambda p: not self._horovod.carries(p))

    def _ready(self, p: torch.nn.Parameter) -> None:
        """``p``'s gradient is ready: to Horovod's allreduce, or one more of its bucket's."""
        if p.grad is not None and p.grad.is_sparse and self.sparse_as_dense:
            p.grad = p.grad.to_dense()
            self._densified.add(id(p))
        bucket = self._layout.bucket_of.get(id(p))
        if bucket is None or (p.grad is not None and p.grad.is_sparse):
            if bucket is not None:  # found sparse now: its bucket slot is zeros this step
                self._layout.sparse.add(id(p))
            self._horovod.start(p, self._layout.names[id(p)], self._layout.cast.get(id(p)),
                                self.stats)
            if bucket is None:
                return
        self._schedule.bucket_ready(bucket, self._step, self._flat)

    # -- synchronize / step -------------------------------------------------------------------
    def synchronize(self) -> None:
        """Average the gradients now (clipping before a ``step()`` in :meth:`skip_synchronize`);
        called again before new gradients, ``zero_grad`` or ``step``, it exchanges nothing."""
        if self._synchronized:
            return
        with self._refusal.guard():
            self._adopt_group_state()
            self._refusal.begin()
            self._synchronize()
        self._synchronized = True

    def _synchronize(self) -> None:
        if self._comm.size == 1:
            self._finish_step()
            return
        self._fallback.exchange_started()  # a step without gradients: its exchange starts now
        # requires_grad changed since the layout was formed (layers frozen or unfrozen): this
        # step the unfrozen go to Horovod's allreduce and the frozen keep no gradient; the
        # layout takes the new set from the next step on
        trainable = self._trainable()
        unfrozen = self._layout.unfrozen(trainable, self._named_by_user)
        frozen_bare = [p for p in self._layout.params if not p.requires_grad and p.grad is None]
        for p in unfrozen:
            if id(p) not in self._delay:  # from the next step on, from its hook
                self._watch(p)
        for p in [p for b in self._layout.buckets for p in b.params] + self._layout.raw + unfrozen:
            if id(p) not in self._hooked:  # no gradient this step (unused parameter)
                self._hooked.add(id(p))
                self._ready(p)
        factor = float(self._comm.size) if self.op == hvd.Sum else 1.0
        for bucket, mean in self._schedule.finish(self._step, self._flat, self.stats):
            if factor != 1.0:
                mean.mul_(factor)
            offset = 0
            for p in bucket.params:
                n = p.numel()
                if not self._horovod.carries(p):
                    if p.grad is None:  # unused here, used elsewhere: Horovod's zeros
                        p.grad = torch.zeros_like(p)
                    p.grad.copy_(mean[offset:offset + n].view_as(p.grad))
                offset += n
        self._horovod.finish()
        for p in self._layout.params:  # as Horovod: the optimizer gets the sparse form back
            if id(p) in self._densified:
                p.grad = p.grad.to_sparse()
        self._densified.clear()
        for p in frozen_bare:
            p.grad = None
        relayout = len(trainable) != len(self._layout.params) or bool(unfrozen)
        if relayout:
            self._layout.params = trainable
        relayout |= any(k in self._layout.bucket_of for k in self._layout.sparse)
        relayout |= self._fallback.end_step(
            self._comm, f"{self._prefix}.fallback", self._step,
            [[id(p) for p in b.params] for b in self._layout.buckets], self._trials,
            horovod_plan(self._comm.size), self._measured_links)
        if relayout:
            self._relayout()
        self._finish_step()

    def _trials(self) -> list[BucketTrial]:
        """The fallback's trial of every bucket (:func:`.trials.bucket_trials`)."""
        return bucket_trials(self._layout, self._schedule, self._step, self._prefix,
                             self._horovod, self._fallback.candidates, self._comm.hierarchy)

    def _measured_links(self, choice: BaselineChoice) -> str:
        """The links' rates fitted to the baseline trial (:func:`~horovod_quant.fallback.
        measured_fabric`); the exchanges choose their plans again for them. In words."""
        self._use_fabric(measured_fabric(choice, self.fabric,
                                         self.topology or horovod_topology(self._comm),
                                         [b.numel for b in self._layout.buckets],
                                         self._environment.fabric_set))
        return self.fabric.describe()

    def _use_fabric(self, fabric: Fabric) -> None:
        """Choose the plans again for ``fabric`` (measured, or a checkpoint's)."""
        self.runtime.use_fabric(fabric)

    def _finish_step(self) -> None:
        if self._fallback.choice is not None:
            self.stats.baseline = f"{self._fallback.baseline} ({self._fallback.choice.plan})"
            self.stats.fallen_back = len(self._fallback.fallen_back)
        self._hooked.clear()
        for key in self._delay:
            self._delay[key] = self.backward_passes_per_step
        self._step += 1
        self._refusal.count(self._step)
        self.last_stats = self.stats.reset()
        if self.on_step is not None:
            self.on_step(self.last_stats)

    @contextmanager
    def skip_synchronize(self):
        """Use after an explicit ``synchronize()`` (e.g. for gradient clipping) around step()."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        """Synchronize (unless :meth:`skip_synchronize`, or after ``synchronize()``: then a
        warning, once), then the wrapped optimizer's step."""
        self._refusal.check()
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
        for key in self._delay:
            self._delay[key] = passes

    def zero_grad(self, *args, **kwargs):
        self._refusal.check()
        if self._horovod.in_flight or self._schedule.in_flight:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize()")
        self._synchronized = False
        return super(self.__class__, self).zero_grad(*args, **kwargs)


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
    cls = type(optimizer.__class__.__name__, (_OwnState, optimizer.__class__, SettingsAttributes,
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
