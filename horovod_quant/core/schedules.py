"""How gather-exchange payloads are scheduled across n workers, and their exact references.

Two schedules exist for codecs whose payloads do not sum (``exchange == "gather"``):

* ``"allgather"``: every worker sends its whole payload to everyone; each rank decodes the n
  payloads in rank order and averages. Receive volume (n - 1) * P per rank.
* ``"sra"`` (scatter-reduce-allgather, the bidirectional compression of the natural-compression
  paper, Algorithm 1): the vector is cut into n chunks (:func:`chunk_bounds`); worker r encodes
  chunk c with seed ``derive_key(worker_seed(seed, r), c)`` and sends it to rank c (alltoall);
  rank c decodes the n payloads of its chunk in rank order, averages, re-encodes the mean with
  seed ``derive_key(seed, REENCODE_TAG, c)`` and the re-encoded chunks are allgathered. Receive
  volume about 2 (n - 1) / n * P, independent of n, at the price of a second quantization
  (variance omega_W / n + omega_M in the paper's notation, with omega_M = omega of the codec on
  a chunk).

``auto`` picks allgather for n <= ``SRA_MIN_WORLD`` - 1 and sra above.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .base import Codec, as_vector, worker_seed
from .rng import derive_key

REENCODE_TAG = 0x5EA
SRA_MIN_WORLD = 5
GATHER_SCHEDULES = ("auto", "allgather", "sra")


def resolve_gather(schedule: str, n: int, codec: Codec | None = None) -> str:
    """The concrete schedule for ``schedule`` ("auto", "allgather" or "sra") and n workers.

    Codecs normalized by a global norm (sparse Global-QSGD) always allgather: re-encoding a
    chunk mean would need a second global norm, which the sra schedule does not have.
    """
    if schedule not in GATHER_SCHEDULES:
        raise ValueError(f"gather={schedule!r} is not valid: choose one of {list(GATHER_SCHEDULES)}")
    if codec is not None and hasattr(codec, "norm_statistic"):
        return "allgather"
    if schedule == "auto":
        return "sra" if n >= SRA_MIN_WORLD else "allgather"
    return schedule


def chunk_bounds(size: int, n: int) -> list[tuple[int, int]]:
    """Split ``range(size)`` into n contiguous chunks whose lengths differ by at most one."""
    base, extra = divmod(size, n)
    bounds, lo = [], 0
    for c in range(n):
        hi = lo + base + (1 if c < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


def chunk_seed(seed: int, rank: int, chunk: int) -> int:
    """Seed worker ``rank`` encodes chunk ``chunk`` with in the sra schedule."""
    return derive_key(worker_seed(seed, rank), chunk)


def reencode_seed(seed: int, chunk: int) -> int:
    """Seed the owner of ``chunk`` re-encodes the chunk mean with in the sra schedule."""
    return derive_key(seed, REENCODE_TAG, chunk)


def sra_reference(codec: Codec, xs: Sequence[np.ndarray], seed: int) -> tuple[np.ndarray, int]:
    """Single-process result of the sra schedule; returns (mean, bytes one worker sends)."""
    n = len(xs)
    size = xs[0].size
    out = np.empty(size, np.float32)
    sent = np.zeros(n, np.int64)
    for c, (lo, hi) in enumerate(chunk_bounds(size, n)):
        parts = [codec.encode(x[lo:hi], seed=chunk_seed(seed, r, c)) for r, x in enumerate(xs)]
        sent += [p.nbytes for p in parts]
        mean = Codec.combine_gathered(codec, parts, seed)
        again = codec.encode(mean, seed=reencode_seed(seed, c))
        sent[c] += again.nbytes
        codec.decode(again, out[lo:hi])
    return out, int(sent.max())


def mean_estimate(codec: Codec, xs: Sequence, seed: int = 0, gather: str = "allgather"
                  ) -> tuple[np.ndarray, int]:
    """The n-worker mean that the distributed exchange computes, simulated in one process.

    Worker ``r`` encodes ``xs[r]`` with :func:`worker_seed` ``(seed, r)``; payloads combine as
    the codec's exchange does (sum, gather with the given schedule, or its custom reduction such
    as Global-QSGD's stochastic exponent reduce or NDQSG's side-information decoding). A real
    n-rank run with the same inputs, seed and schedule gives bit-identical numbers.

    Args:
        codec: a codec from :func:`get_codec`.
        xs: n 1-D arrays of equal length, one per worker.
        seed: the exchange seed.
        gather: schedule for gather codecs: "allgather", "sra" or "auto" (see module doc).

    Returns:
        ``(estimate, wire_bytes)``: the float32 mean estimate and the largest number of payload
        bytes one worker sends (a one-float norm allreduce is not counted).
    """
    vecs = [as_vector(x) for x in xs]
    if not vecs:
        raise ValueError("mean_estimate needs at least one worker's vector")
    if len({v.size for v in vecs}) != 1:
        raise ValueError(f"all workers' vectors must have one length, got {[v.size for v in vecs]}")
    if codec.exchange == "gather" and resolve_gather(gather, len(vecs), codec) == "sra":
        return sra_reference(codec, vecs, seed)
    return codec.reference_mean(vecs, seed)
