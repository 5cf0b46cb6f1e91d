"""The gradient exchange under ``hq.torch.DistributedOptimizer``, without the torch optimizer.

:class:`GradientExchanger` holds the bucket layout (:mod:`~horovod_quant.torch.buckets`), the
optimizer's :class:`~horovod_quant.exchange.runtime.ExchangeRuntime`, the exchange schedule
(:mod:`~horovod_quant.torch.schedule`), Horovod's path for the gradients the layout leaves to
Horovod (:mod:`~horovod_quant.torch.horovod_path`) and the fallback controller
(:mod:`horovod_quant.fallback`). The optimizer hands it each gradient its hook finds ready
(:meth:`~GradientExchanger.gradient_ready`) and asks for the step's means
(:meth:`~GradientExchanger.synchronize`). Building it waits for no peer, as Horovod's own
optimizer: the cross-rank check, then the transport (groups beside Horovod, built collectively)
and the exchanges are set up at the first ``synchronize()``, a point every rank reaches in its
program's order (hooks may run in other orders on other ranks, and checks pair by the order they
start), so the first step's exchanges start there, once the check passed. Its state (step, codec
states, fallback decisions, links, sparse parameters) rides in the optimizer's checkpoints
(:meth:`~GradientExchanger.own_state`).
"""
from __future__ import annotations

from typing import Any, Callable

import horovod.torch as hvd
import torch

from ..core.base import Codec
from ..core.baselines import HOROVOD_SIXTEEN_BIT
from ..doors import DoorEnvironment, DoorOptions, Refusal, load_codec_states, mpi_exchange_config
from ..exchange.cost import Fabric
from ..exchange.runtime import ExchangeRuntime
from ..fallback import BaselineChoice, BucketTrial, FallbackController, measured_fabric
from ..policy import describe
from ..stats import StepStats
from .buckets import Bucket, BucketLayout
from .collectives import HorovodTorchCollectives
from .horovod_path import HorovodPath
from .schedule import ExchangeSchedule
from .tensors import BASELINE_DTYPES, on_gpu
from .transport import (
    horovod_end_of_job,
    horovod_topology,
    resolve_transport,
    transport_collectives,
    transport_of,
)
from .trials import bucket_trials, horovod_plan

Parameter = torch.nn.Parameter


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


class GradientExchanger:
    """Averages one optimizer's gradients across the ranks of a Horovod process set.

    Args:
        params: the parameters that take gradients.
        names: ``{id(parameter): name}`` (the buckets' keys); parameters unfrozen later are
            named here too.
        named_by_user: whether ``names`` came from ``named_parameters`` (a parameter unfrozen
            later must then be there).
        codec, options, environment: the default codec, the door's settings and the
            environment's (read at the door).
        op, gradient_predivide_factor, groups, sparse_as_dense, process_set: as Horovod's
            ``DistributedOptimizer`` takes them.
        watch: registers the backward hook of a parameter unfrozen since the last step.

    Attributes:
        step: the completed steps (the exchanges' seeds and tags carry it).
        size: the number of ranks.
        layout, runtime, fallback: the :class:`~.buckets.BucketLayout`, the exchanges (codec
            states, seeds, statistics, the links' speeds the plans weigh) and the
            :class:`~horovod_quant.fallback.FallbackController`.
        refusal: stops the exchanger at its first error inside a step.
        last_stats: the last step's :class:`StepStats`.
        comm, schedule, transport, topology: the collectives the exchanges run on, the
            :class:`~.schedule.ExchangeSchedule`, which transport they are ("gloo": groups
            beside Horovod, or "horovod") and which ranks share hosts where the exchanges are
            hierarchical; set at the first ``synchronize()`` (None before).
    """

    def __init__(self, params: list[Parameter], names: dict[int, str], named_by_user: bool,
                 codec: Codec, options: DoorOptions, environment: DoorEnvironment, op: Any,
                 gradient_predivide_factor: float, groups: Any, sparse_as_dense: bool,
                 process_set: Any, watch: Callable[[Parameter], None]) -> None:
        if (BASELINE_DTYPES.get(options.baseline) == torch.bfloat16
                and any(not on_gpu(p) for p in params)):
            raise ValueError(f"baseline={options.baseline!r}: Horovod's CPU allreduce takes no "
                             "bfloat16; choose another baseline (or 'auto') for CPU gradients")
        self.codec, self.options, self._environment = codec, options, environment
        self._op, self._factor = op, gradient_predivide_factor
        self._sparse_as_dense, self._process_set = sparse_as_dense, process_set
        self._named_by_user, self._watch = named_by_user, watch
        self.step = 0
        self.size = HorovodTorchCollectives(process_set).size  # (asks no peer)
        self.layout = BucketLayout(params, names, codec, options.policy, groups,
                                   options.fusion_bytes)
        self.fallback = FallbackController(options.fallback, options.baseline,
                                           HOROVOD_SIXTEEN_BIT)
        # where the codecs run: the first device whose gradients the CUDA kernels encode
        self._device = next((p.device for p in params if on_gpu(p)), torch.device("cpu"))
        self.runtime = ExchangeRuntime(options.seed, options.gather, options.pipeline_elems,
                                       environment.fabric(self._device.type == "cuda"),
                                       environment.config_timeout)
        self._transport = resolve_transport(environment.transport_for(options.transport))
        # an error inside a step stops the exchanger: the ranks may have stopped apart
        self.refusal = Refusal("optimizer", "a new hq.torch.DistributedOptimizer")
        self.last_stats: StepStats | None = None
        self.comm: Any = None
        self.transport: str | None = "horovod" if self.size == 1 else None  # (one rank: none built)
        self.topology: Any = None
        self.schedule: ExchangeSchedule | None = None  # and _horovod: at the first synchronize
        self._horovod: HorovodPath | None = None
        self._hooked: set[int] = set()  # handed over by their hooks this step
        self._started: set[int] = set()  # their exchange started (or joined their bucket's)
        self._densified: set[int] = set()  # sparse this step, exchanged dense (sparse_as_dense)

    @property
    def in_flight(self) -> bool:
        """Whether a gradient reached the exchange this step and the step has not ended."""
        return bool(self._hooked)

    # -- set-up -----------------------------------------------------------------------------
    def _config(self) -> dict:
        """What every rank must agree on: all that changes what goes on the wire (not
        ``backward_passes_per_step``: it changes when a rank starts its exchanges, not which)."""
        options, names = self.options, self.layout.names
        mpi = ({} if self._transport == "gloo" else mpi_exchange_config(
            options.policy.codecs(self.codec), self._environment.mpi_exchange))
        return {
            "door": "optimizer", **self.codec.config(), "seed": options.seed, "step": self.step,
            "transport": self._transport, **mpi, "pipeline_elems": options.pipeline_elems,
            "op": self._op, "gradient_predivide_factor": self._factor,
            "sparse_as_dense": self._sparse_as_dense, "gather": options.gather,
            "fabric": list(self.runtime.fabric), "policy": describe(options.policy),
            "fallback": [options.fallback, options.baseline, self.fallback.baseline,
                         sorted(names[k] for k in self.fallback.fallen_back)],
            **self.layout.describe()}

    def _set_up(self) -> None:
        """Once, at the first ``synchronize()``: the cross-rank check (a loaded or broadcast
        state is in by now, so ranks at other steps raise the same error naming them), then,
        only once the ranks agree, the transport, the exchanges (an MPI communicator's set-up
        pairs by call order) and the job's ledger entry. Collective: every rank calls it at the
        same point of its program, which the backward hooks are not."""
        if self.schedule is not None:
            return
        horovod = HorovodTorchCollectives(self._process_set)
        self.runtime.check(horovod, self._config())
        prefix = self.runtime.wait_check()
        self.comm = transport_collectives(self._process_set, self._transport, self._device,
                                          self._environment)
        self.transport = transport_of(self.comm)
        self.topology = getattr(self.comm.hierarchy, "topology", None)
        self.runtime.open(self.options.policy.codecs(self.codec), self.comm)
        self.schedule = ExchangeSchedule(self.comm, self.runtime, self.layout.names, prefix)
        self.schedule.use(self.layout.buckets)
        self._horovod = HorovodPath(self._op, self._factor, self._process_set, prefix)
        self.refusal.register(self.step, horovod_end_of_job(horovod))
        self.refusal.begin()

    # -- a gradient is ready ------------------------------------------------------------------
    def gradient_ready(self, p: Parameter) -> None:
        """``p``'s gradient is ready (its hook): its exchange starts, or joins its bucket's; in
        the first step it waits for ``synchronize()`` (nothing goes out before the check)."""
        self.refusal.begin()
        self.fallback.exchange_started()
        self._hooked.add(id(p))
        if self.schedule is not None:
            self._start(p)
            self.schedule.advance()

    def _start(self, p: Parameter) -> None:
        """``p``'s gradient to Horovod's allreduce, or one more of its bucket's."""
        self._started.add(id(p))
        if p.grad is not None and p.grad.is_sparse and self._sparse_as_dense:
            p.grad = p.grad.to_dense()
            self._densified.add(id(p))
        bucket = self.layout.bucket_of.get(id(p))
        if bucket is None or (p.grad is not None and p.grad.is_sparse):
            if bucket is not None:  # found sparse now: its bucket slot is zeros this step
                self.layout.sparse.add(id(p))
            self._horovod.start(p, self.layout.names[id(p)], self.layout.cast.get(id(p)),
                                self.runtime.stats)
            if bucket is None:
                return
        self.schedule.bucket_ready(bucket, self.step, self._flat)

    def _flat(self, bucket: Bucket) -> Any:
        return bucket.flat_input(lambda p: not self._horovod.carries(p))

    # -- the step -----------------------------------------------------------------------------
    def synchronize(self, trainable: list[Parameter]) -> None:
        """The step's exchange: every gradient averaged in place (``trainable``: the
        parameters that take gradients now), the layout formed again where it changed, the
        fallback's work, then the step ends."""
        self.refusal.begin()
        if self.size > 1:
            self._set_up()
            self.fallback.exchange_started()  # a step without gradients: it starts now
            unfrozen, frozen_bare = self._follow_requires_grad(trainable)
            self._start_the_rest(unfrozen)
            self._copy_means_back()
            self._horovod.finish()
            self._sparsify_again()
            for p in frozen_bare:  # its exchange gave it zeros; frozen, it keeps no gradient
                p.grad = None
            relayout = self._layout_changed(trainable, unfrozen)
            relayout |= self._fallback_step()  # (collective: runs every step)
            if relayout:
                self._relayout()
        self._finish_step()

    def _follow_requires_grad(self, trainable: list[Parameter]
                              ) -> tuple[list[Parameter], list[Parameter]]:
        """``requires_grad`` changed since the layout was formed (layers frozen or unfrozen):
        the unfrozen (watched from now on; this step Horovod's allreduce carries them), and
        the frozen that have no gradient (they get none); the layout takes the new set from
        the next step on."""
        unfrozen = self.layout.unfrozen(trainable, self._named_by_user)
        for p in unfrozen:
            self._watch(p)
        frozen_bare = [p for p in self.layout.params if not p.requires_grad and p.grad is None]
        return unfrozen, frozen_bare

    def _start_the_rest(self, unfrozen: list[Parameter]) -> None:
        """Start what no hook started: the first step's gradients, the unfrozen ones', and
        those of parameters this rank did not use (zeros)."""
        for p in [p for b in self.layout.buckets for p in b.params] + self.layout.raw + unfrozen:
            if id(p) not in self._started:
                self._start(p)

    def _copy_means_back(self) -> None:
        """Each bucket's mean handed to its parameters' gradients (:meth:`.Bucket.hand_over`),
        times the number of ranks for ``op=hvd.Sum``; a parameter this rank did not use gets
        one (Horovod's zeros)."""
        factor = float(self.size) if self._op == hvd.Sum else 1.0
        for bucket, mean in self.schedule.finish(self.step, self._flat):
            if factor != 1.0:
                mean.mul_(factor)
            offset = 0
            for p in bucket.params:
                n = p.numel()
                if not self._horovod.carries(p):
                    bucket.hand_over(p, mean[offset:offset + n])
                offset += n

    def _sparsify_again(self) -> None:
        """As Horovod: the gradients exchanged dense (``sparse_as_dense``) go back sparse."""
        for p in self.layout.params:
            if id(p) in self._densified:
                p.grad = p.grad.to_sparse()
        self._densified.clear()

    def _layout_changed(self, trainable: list[Parameter], unfrozen: list[Parameter]) -> bool:
        """Whether the layout must be formed again: parameters frozen or unfrozen (the layout
        takes ``trainable``), or a bucketed gradient found sparse."""
        changed = len(trainable) != len(self.layout.params) or bool(unfrozen)
        if changed:
            self.layout.params = trainable
        return changed or any(k in self.layout.bucket_of for k in self.layout.sparse)

    def _fallback_step(self) -> bool:
        """The fallback's work at the end of the step; whether it moved buckets."""
        return self.fallback.end_step(
            self.comm, f"{self.runtime.prefix}.fallback", self.step,
            [[id(p) for p in b.params] for b in self.layout.buckets], self._trials,
            horovod_plan(self.size), self._measured_links)

    def _trials(self) -> list[BucketTrial]:
        """The fallback's trial of every bucket (:func:`.trials.bucket_trials`)."""
        return bucket_trials(self.layout, self.schedule, self.step, self.runtime.prefix,
                             self._horovod, self.fallback.candidates, self.comm.hierarchy)

    def _measured_links(self, choice: BaselineChoice) -> str:
        """The links' rates fitted to the baseline trial (:func:`~horovod_quant.fallback.
        measured_fabric`); the exchanges choose their plans again for them. In words."""
        self.runtime.use_fabric(measured_fabric(choice, self.runtime.fabric,
                                                self.topology or horovod_topology(self.comm),
                                                [b.numel for b in self.layout.buckets],
                                                self._environment.fabric_set))
        return self.runtime.fabric.describe()

    def _relayout(self, check: bool = True) -> None:
        """Form the buckets again (sparse and fallen-back parameters leave theirs); the ranks
        check the new layout (``check``: not where one rank alone relays out, as in a load)."""
        self.layout.form(self.fallback.fallen_back, keep_buffers=self.fallback.checking,
                         fallback_dtype=BASELINE_DTYPES[self.fallback.baseline])
        if self.schedule is not None:  # (else it takes the layout when it is set up)
            self.schedule.use(self.layout.buckets)
        if check:
            self.runtime.check_again(self.comm, self._config())

    def _finish_step(self) -> None:
        """The step ends: its statistics (to ``on_step``), the step count (the job's ledger)."""
        if self.fallback.choice is not None:
            self.runtime.stats.baseline = f"{self.fallback.baseline} ({self.fallback.choice.plan})"
            self.runtime.stats.fallen_back = len(self.fallback.fallen_back)
        self._hooked.clear()
        self._started.clear()
        self.step += 1
        self.refusal.count(self.step)
        self.last_stats = self.runtime.stats.reset()
        if self.options.on_step is not None:
            self.options.on_step(self.last_stats)

    # -- its state in checkpoints ---------------------------------------------------------------
    def own_state(self) -> dict[str, Any]:
        """Its state, plain values: the step (the exchanges' seeds), the world size, the codec
        states, the fallback's decisions and the links it measured (the plans' fabric) and the
        parameters found sparse (names, as ``named_parameters`` gave them)."""
        names = self.layout.names
        return {"step": self.step, "world_size": self.size,
                "codec_states": self.runtime.states.state_dict(),
                "fallback": self.fallback.state_dict(names.__getitem__),
                "fabric": list(self.runtime.fabric),
                "sparse": sorted(names[k] for k in self.layout.sparse)}

    def load_own_state(self, own: dict[str, Any]) -> None:
        """Continue from :meth:`own_state`'s state (this rank alone, nothing waits for the
        others); one saved at another world size is adapted, with one warning.

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
        key_of = _key_by_name(self.layout.names)
        self.step = step
        self.refusal.count(step)
        load_codec_states(self.runtime.states, codec_states, own.get("world_size"), self.size,
                          "hq.torch.DistributedOptimizer")
        self.fallback.load_state_dict(fallback, key_of)
        if own.get("fabric") is not None:  # (a state saved before the links were measured: none)
            self.runtime.use_fabric(Fabric(*own["fabric"]))
        self.layout.sparse = {key_of(name) for name in sparse}
        self._relayout(check=False)
