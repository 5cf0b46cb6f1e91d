"""The fallback's trial of ``hq.torch.DistributedOptimizer``'s buckets: for each bucket, its
codec exchange and Horovod's allreduce of the same vector in each candidate baseline's dtype
(:class:`~horovod_quant.fallback.BucketTrial`), run into a scratch buffer so that no gradient
changes."""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable

import torch

from ..exchange.collectives import Collectives
from ..exchange.driver import Exchange
from ..exchange.topology import Hierarchy
from ..fallback import BucketTrial, ranks
from .buckets import Bucket, BucketLayout
from .collectives import synchronize
from .horovod_path import HorovodPath
from .schedule import ExchangeSchedule
from .tensors import BASELINE_DTYPES, as_tensor, blocking_on


def _bucket_trial(bucket: Bucket, out: Any, exchange: Exchange, seed: int, name: str,
                  allreduce: Callable[[torch.Tensor, str], Any], candidates: Iterable[str],
                  local: Collectives | None) -> BucketTrial:
    """The blocking runs that measure ``bucket``, each writing into ``out``: its codec exchange
    with ``seed`` (the estimate is discarded), Horovod's ``allreduce`` of the same vector in
    each candidate baseline's dtype (cast there and back, as ``Compression.fp16`` does), and
    with ``local`` (the host's ranks' collectives) the float32 allreduce inside the host."""
    first = bucket.params[0]

    def baseline_run(baseline: str) -> None:
        wire = as_tensor(out).to(BASELINE_DTYPES[baseline])
        synchronize(allreduce(wire, f"{name}.{baseline}"))
        as_tensor(out).copy_(wire)

    def run_local() -> None:
        local.allreduce_async(out, f"{name}.local").wait()

    return BucketTrial(
        bucket.index, repr(bucket.codec), bucket.numel * 4,
        blocking_on(first, lambda: exchange.start(bucket.mean, seed, name, out=out).wait()),
        {b: blocking_on(first, lambda b=b: baseline_run(b)) for b in candidates},
        None if local is None else run_local)


def horovod_plan(count: int) -> str:
    """How Horovod's allreduce runs over ``count`` ranks, in words (the fallback's log)."""
    hierarchical = os.environ.get("HOROVOD_HIERARCHICAL_ALLREDUCE", "0") not in ("", "0")
    return f"Horovod's {'hierarchical' if hierarchical else 'ring'} allreduce, {ranks(count)}"


def bucket_trials(layout: BucketLayout, schedule: ExchangeSchedule, step: int, prefix: str,
                  horovod: HorovodPath, candidates: Iterable[str],
                  hierarchy: Hierarchy | None) -> list[BucketTrial]:
    """Every bucket's trial at ``step``: its codec exchange with the step's seed, Horovod's
    allreduce (``horovod``'s op and factors) in each of ``candidates``, and with a
    ``hierarchy`` the float32 allreduce inside the host; one scratch buffer per device."""
    scratch = layout.scratch()
    return [_bucket_trial(b, scratch[b], schedule.exchange_of(b), schedule.seed_of(step, b),
                          f"{prefix}.fallback.b{b.index}", horovod.allreduce_async_,
                          tuple(candidates), None if hierarchy is None else hierarchy.local)
            for b in layout.buckets]
