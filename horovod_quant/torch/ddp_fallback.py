"""The DDP hook's fallback (:mod:`horovod_quant.fallback` for
:class:`~horovod_quant.torch.ddp.QuantizationState`): the user's best uncompressed allreduce,
float32 or DDP's bfloat16 hook ("auto": the faster in the trial), carries the buckets whose
codec does not pay.

At the end of step :data:`~horovod_quant.fallback.FALLBACK_STEP`, on the state's worker after
the step's last bucket (every collective from one thread, in one order on every rank), the
baseline trial times each bucket's candidate baselines (and the float32 allreduce among the
host's ranks, where the group has host groups); the state fits the links' rates to them and
chooses its plans again; the bucket trial then times each bucket's exchanges against the
baseline. A bucket that falls back is averaged as DDP's own hooks average it: the whole bucket
cast to the baseline's dtype, divided by the group's size, allreduced, cast back (a NaN or inf
stays one). Buckets are named by their parameters' names where the state has them, else by
their index: the names outlive a checkpoint.
"""
from __future__ import annotations

from typing import Any, Callable, Collection, Mapping

import torch
import torch.distributed as dist

from ..core.baselines import DDP_SIXTEEN_BIT
from ..doors import DoorOptions
from ..exchange import job_end
from ..exchange.collectives import Collectives
from ..exchange.cost import Fabric
from ..exchange.topology import Topology
from ..fallback import BaselineChoice, BucketTrial, FallbackController, measured_fabric, ranks
from ..stats import StepStats
from .distributed import HANDED, WorkHandle
from .tensors import BASELINE_DTYPES, blocking_on, flat_array

#: starts a bucket's collectives and returns the function that finishes them (its mean in
#: place) and returns the future's value
Start = Callable[[], Callable[[], torch.Tensor]]


class HookFallback:
    """The fallback of one :class:`~horovod_quant.torch.ddp.QuantizationState`.

    The state calls :meth:`bucket_arrived` for each bucket the hook gets, :meth:`start` for
    each dense bucket (a start on the baseline, or None: the state's exchanges), and wraps the
    step's last bucket with :meth:`then_end_step`.

    Args:
        options: the state's settings (``fallback``, ``baseline``).
        comm: the state's collectives (of its own process group).
        stats: the state's stats (the fallen-back buckets and the baseline count there).
        codecs: the state's codecs (a part's ``codec_index`` indexes them).
        exchanges: the start of bucket ``index``'s exchanges of ``step`` (its ``parts``) on a
            copy of its buffer, counted nowhere: ``exchanges(index, parts, copy, step)``.
        links: the state's fabric and the topology its rates are fitted over.
        use_fabric: gives the state (and its exchanges) the fitted fabric.
        fixed: the fabric's fields the door's environment sets, which a fit keeps.

    Attributes:
        controller: the :class:`~horovod_quant.fallback.FallbackController`; its keys are the
            buckets' names (:meth:`key_of`).
        fabric: the links' rates fitted to the baseline trial, else None.
    """

    def __init__(self, options: DoorOptions, comm: Collectives, stats: StepStats,
                 codecs: list, exchanges: Callable[[int, Any, torch.Tensor, int], Start],
                 links: Callable[[], tuple[Fabric, Topology]],
                 use_fabric: Callable[[Fabric], None], fixed: Collection[str] = ()) -> None:
        # the 16-bit allreduce a DDP user runs: DDP's bf16_compress_hook (gloo sums bfloat16)
        self.controller = FallbackController(options.fallback, options.baseline,
                                             DDP_SIXTEEN_BIT)
        self.fabric: Fabric | None = None
        self._comm, self._stats, self._codecs = comm, stats, codecs
        self._exchanges, self._links, self._use_fabric = exchanges, links, use_fabric
        self._fixed = fixed  # the fabric's fields the door's environment sets: kept as set
        # the group's own torch.distributed group, unwrapped where device arrays are staged
        self._group = getattr(comm, "inner", comm).group
        #: this step's buckets with a codec so far: (index, key, buffer, parts)
        self._buckets: list[tuple[int, str, torch.Tensor, Any]] = []
        self._in_step = False

    @staticmethod
    def key_of(bucket: dist.GradBucket, names: Mapping[int, tuple[str, Any]] | None) -> str:
        """How the fallback names ``bucket``: its parameters' names (``names``: id -> (name,
        parameter)), else its index."""
        if names is None:
            return str(bucket.index())
        return ",".join(names[id(p)][0] for p in bucket.parameters())

    def bucket_arrived(self, last: bool) -> None:
        """A bucket reached the hook (``last``: the step's last): the step's first starts the
        step check's clock."""
        if not self._in_step:
            self.controller.exchange_started()
        self._in_step = not last

    def state_dict(self) -> dict[str, Any]:
        """The controller's decisions and the fitted fabric, as plain values."""
        return {"controller": self.controller.state_dict(str),
                "fabric": None if self.fabric is None else list(self.fabric)}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        """Take up :meth:`state_dict`'s state."""
        self.controller.load_state_dict(saved["controller"], str)
        self.fabric = None if saved["fabric"] is None else Fabric(*saved["fabric"])

    def start(self, bucket: dist.GradBucket, buffer: torch.Tensor, parts: Any,
              names: Mapping[int, tuple[str, Any]] | None) -> Start | None:
        """The start of ``bucket``'s mean on the baseline where it fell back, else None; a
        bucket with a codec among its ``parts`` (the state's, of its flat ``buffer``; each
        part's ``codec_index`` None where it is exact) is recorded for the trial."""
        if all(part.codec_index is None for part in parts):  # exact already: nothing to judge
            return None
        key = self.key_of(bucket, names)
        self._buckets.append((bucket.index(), key, buffer, parts))
        if key not in self.controller.fallen_back:
            return None
        stats = self._stats
        baseline = self.controller.baseline
        start = self.start_baseline(baseline, buffer)

        def counted() -> Callable[[], torch.Tensor]:
            stats.add_raw(buffer.numel() * BASELINE_DTYPES[baseline].itemsize,
                          buffer.numel() * 4)
            stats.fallen_back += 1
            return start()

        return counted

    def start_baseline(self, baseline: str, buffer: torch.Tensor) -> Start:
        """The start of ``buffer``'s mean as DDP's own hooks take it (``allreduce_hook``,
        ``fp16_compress_hook``, ``bf16_compress_hook``): the whole bucket cast to
        ``baseline``'s dtype (in place where it has it), divided by the group's size,
        allreduced; the finish casts it back into ``buffer``."""
        def start() -> Callable[[], torch.Tensor]:
            flat = buffer.detach().reshape(-1)
            wire = flat.to(BASELINE_DTYPES[baseline]).div_(self._comm.size)
            work = HANDED.add(dist.all_reduce(wire, group=self._group, async_op=True), wire)

            def finish() -> torch.Tensor:
                nonlocal work
                job_end.wait(WorkHandle(work, lambda: None))  # a peer's end of job stops it
                # torch holds the wire while the work lives (HANDED waits for that at exit),
                # and the worker keeps its last job (this closure) until the next
                work = None
                if wire is not flat:
                    flat.copy_(wire)
                return buffer

            return finish

        return start

    def plan(self) -> str:
        """How the baselines' allreduce runs, in words (the log's and the stats')."""
        backend = dist.get_backend(self._group)
        return f"torch.distributed {backend} allreduce, {ranks(self._comm.size)}"

    def then_end_step(self, start: Start, step: int, prefix: str) -> Start:
        """``start`` (the step's last bucket's) whose finish then ends ``step`` for the
        controller (collective where it measures or decides; names under ``prefix``), on the
        worker before the bucket's future completes: the next step's buckets see the
        decisions, and DDP leaves the buckets' means (the trial's vectors) alone meanwhile."""
        def started() -> Callable[[], torch.Tensor]:
            finish = start()

            def finished() -> torch.Tensor:
                value = finish()
                self._end_step(step, prefix)
                return value

            return finished

        return started

    def _end_step(self, step: int, prefix: str) -> None:
        buckets, self._buckets = self._buckets, []
        self.controller.end_step(
            self._comm, f"{prefix}.fallback", step, [[key] for _, key, _, _ in buckets],
            lambda: self._trials(prefix, step, buckets), self.plan(),
            lambda choice: self._measured_links(choice, [b.numel() for _, _, b, _ in buckets]))
        if self.controller.choice is not None:
            self._stats.baseline = f"{self.controller.baseline} ({self.controller.choice.plan})"

    def _measured_links(self, choice: BaselineChoice, numels: list[int]) -> str:
        """The links' rates fitted to the baseline trial's timings (buckets of ``numels``
        elements), the environment's overrides kept, handed to the state; in words."""
        fabric, topology = self._links()
        self.fabric = measured_fabric(choice, fabric, topology, numels, self._fixed)
        self._use_fabric(self.fabric)
        return self.fabric.describe()

    def _trials(self, prefix: str, step: int,
                buckets: list[tuple[int, str, torch.Tensor, Any]]) -> list[BucketTrial]:
        """The trial of each of ``buckets`` (this step's, their means in place): blocking runs
        of its exchanges, of each candidate baseline's allreduce and, where the group has
        host groups, of the float32 allreduce among this host's ranks, each on a copy of the
        bucket (the gradients stay as they are)."""
        hierarchy = self._comm.hierarchy
        trials = []
        for index, _, buffer, parts in buckets:
            scratch = buffer.detach().reshape(-1).clone()
            name = f"{prefix}.fallback.b{index}"

            def blocking(start: Start, on: torch.Tensor = scratch) -> Callable[[], None]:
                return blocking_on(on, lambda: start()())

            def run_local(on: torch.Tensor = scratch, name: str = name) -> None:
                hierarchy.local.allreduce_async(flat_array(on), f"{name}.local").wait()

            baselines = {b: blocking(self.start_baseline(b, scratch))
                         for b in self.controller.candidates}
            codecs = ", ".join(repr(self._codecs[part.codec_index]) for part in parts
                               if part.codec_index is not None)
            trials.append(BucketTrial(index, codecs, buffer.numel() * 4,
                                      blocking(self._exchanges(index, parts, scratch, step)),
                                      baselines, None if hierarchy is None else run_local))
        return trials
