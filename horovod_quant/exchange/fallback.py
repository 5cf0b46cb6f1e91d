"""Falling back to the framework's float32 allreduce where a codec does not pay (issue 16).

On a fast link a codec's own cost (encode, decode, its extra collectives) can exceed the wire
time it saves: on an emulated 10 Gbit/s link Horovod's float32 allreduce moved 256 MB in
387 ms and every codec but one was slower, while at 1 Gbit/s the codecs were 2-5x faster. So a
door measures, once, each fused bucket's codec exchange and the float32 allreduce of the same
vector, and from then on lets the allreduce carry the buckets whose codec was slower.

This module is the framework-free part a door reuses: the argument's check, the timing of one
bucket (:func:`measure_bucket`), the agreement of the ranks on the numbers
(:func:`measure_and_decide`), the rule (:func:`decide`) and the record of a decision with its
log line (:class:`FallbackDecision`). The door supplies the two blocking trial runs and moves
the fallen-back buckets' tensors onto its allreduce path.

Tests force an outcome without real timing by replacing :func:`measure_bucket` (looked up at
call time) with a function returning chosen seconds; nothing else is meant to be replaced.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..core.base import check_choice
from .collectives import Collectives

#: values of a door's ``fallback`` argument: "auto" measures and decides, "never" always
#: keeps the codec
FALLBACK_MODES = ("auto", "never")

#: the step (counted from 0) at whose end the buckets are measured: step 0 compiles kernels,
#: allocates buffers and fills Horovod's response cache, which would count against whichever
#: trial ran first
FALLBACK_STEP = 1

#: blocking runs per trial, the shortest counts: the first run of the first trial also
#: measures how late the slowest rank arrived; later runs start together, as the previous
#: collective released every rank at about the same time
FALLBACK_TRIALS = 2

#: a bucket falls back when its codec exchange took longer than this times the float32
#: allreduce; 1.0: any measured loss, and a tie keeps the codec the user asked for
FALLBACK_MARGIN = 1.0


def check_fallback(mode: Any) -> str:
    """``mode`` if it is one of :data:`FALLBACK_MODES`, else ValueError naming them."""
    return check_choice("fallback", mode, FALLBACK_MODES)


@dataclass(frozen=True)
class BucketTrial:
    """What a door hands :func:`measure_and_decide` about one bucket.

    Attributes:
        bucket: the bucket's index.
        codec: how the log names the bucket's codec.
        nbytes: the bucket's float32 size in bytes.
        run_codec: runs the bucket's codec exchange once, blocking until its mean is ready.
        run_fp32: runs the float32 allreduce of the same vector once, blocking.
    """

    bucket: int
    codec: str
    nbytes: int
    run_codec: Callable[[], Any]
    run_fp32: Callable[[], Any]


@dataclass(frozen=True)
class FallbackDecision:
    """One bucket's measurement and what was decided from it (the same on every rank).

    Attributes:
        bucket: the bucket's index when it was measured.
        codec: the bucket's codec, as the log names it.
        nbytes: the bucket's float32 size in bytes.
        codec_s: seconds of the codec exchange (slowest rank's best run).
        fp32_s: seconds of the float32 allreduce (slowest rank's best run).
        step: the step it was measured at.
        fallback: True when the float32 allreduce carries the bucket's tensors from the next
            step on.
    """

    bucket: int
    codec: str
    nbytes: int
    codec_s: float
    fp32_s: float
    step: int
    fallback: bool

    def message(self) -> str:
        """The log line of a fallback (or of a kept codec)."""
        head = (f"horovod_quant: bucket {self.bucket} ({self.codec}, {self.nbytes / 1e6:.1f} MB): "
                f"codec exchange {self.codec_s * 1e3:.1f} ms")
        if self.fallback:
            return (f"{head} > float32 allreduce {self.fp32_s * 1e3:.1f} ms (measured at step "
                    f"{self.step}); the float32 allreduce carries it from now on")
        return (f"{head} <= float32 allreduce {self.fp32_s * 1e3:.1f} ms (measured at step "
                f"{self.step}); the codec keeps it")


def measure_bucket(trial: BucketTrial, trials: int = FALLBACK_TRIALS) -> tuple[float, float]:
    """This rank's (codec seconds, float32 seconds) of one bucket: the shortest of ``trials``
    blocking runs of each, the codec's first. Every rank must call it for the same buckets in
    the same order (the runs are collectives)."""
    return _shortest(trial.run_codec, trials), _shortest(trial.run_fp32, trials)


def _shortest(run: Callable[[], Any], trials: int) -> float:
    best = float("inf")
    for _ in range(trials):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def decide(trials: Sequence[BucketTrial], seconds: np.ndarray, step: int,
           margin: float = FALLBACK_MARGIN) -> list[FallbackDecision]:
    """The rule: a bucket falls back when its codec exchange took longer than ``margin`` times
    its float32 allreduce.

    Args:
        trials: the measured buckets.
        seconds: one row (codec seconds, float32 seconds) per bucket, agreed by every rank.
        step: the step they were measured at.
        margin: see :data:`FALLBACK_MARGIN`.

    Returns:
        One decision per bucket, in order.
    """
    return [FallbackDecision(t.bucket, t.codec, t.nbytes, float(codec_s), float(fp32_s), step,
                             bool(codec_s > margin * fp32_s))
            for t, (codec_s, fp32_s) in zip(trials, seconds)]


def measure_and_decide(comm: Collectives, trials: Sequence[BucketTrial], step: int,
                       name: str) -> list[FallbackDecision]:
    """Measure every bucket on this rank, agree on the numbers, decide. Collective: every rank
    calls it at the same point with the same buckets.

    Each rank's timings differ (its own encode and decode, when it entered a collective), so
    the ranks first take the elementwise maximum of them over ranks (one allreduce): every rank
    then decides from the same numbers, hence identically, which keeps the weights identical.
    The maximum is what a step waits for: the slowest rank.

    Args:
        comm: the collectives of the ranks.
        trials: the buckets, in the same order on every rank.
        step: the step being measured (for the records).
        name: collective name of the agreement.

    Returns:
        One decision per bucket, the same on every rank.
    """
    if not trials:
        return []
    local = np.array([measure_bucket(t) for t in trials], dtype=np.float64).reshape(-1, 2)
    agreed = comm.allreduce_async(local, name, "max").wait()
    return decide(trials, np.asarray(agreed).reshape(-1, 2), step)
