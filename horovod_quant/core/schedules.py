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

Pipelining. :class:`horovod_quant.comm.Exchange` cuts a vector longer than ``pipeline_elems``
into pieces (:func:`pipeline_bounds`) and exchanges each as its own exchange with seed
:func:`pipeline_seed`, so that piece k + 1 is encoded while piece k is on the wire and piece k
is decoded while k + 1 is. A global-norm codec computes one norm over the whole vector and
every piece uses it; every piece is encoded before any is decoded (this fixes the state a
stateful codec, NDQSG, encodes with). ``mean_estimate(..., pipeline_elems=)`` reproduces
that exactly.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .base import Codec, as_vector, worker_seed
from .rng import derive_key

REENCODE_TAG = 0x5EA
PIPELINE_TAG = 0x919E
SRA_MIN_WORLD = 5
GATHER_SCHEDULES = ("auto", "allgather", "sra")
#: default piece length of a pipelined exchange (Exchange, the torch optimizer): 2^21 float32
#: = 8 MiB, a multiple of the packing block and of every power-of-two bucket size up to it (so
#: no bucket is cut in two). mean_estimate exchanges whole vectors unless given this value.
DEFAULT_PIPELINE_ELEMS = 1 << 21


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


def pipeline_bounds(size: int, pipeline_elems: int | None) -> list[tuple[int, int]]:
    """The pieces of a pipelined exchange: ``[(0, size)]`` when ``pipeline_elems`` is None or
    at least ``size``, else pieces of ``pipeline_elems`` elements (the last one shorter)."""
    if pipeline_elems is None or size <= pipeline_elems:
        return [(0, size)]
    return [(lo, min(lo + pipeline_elems, size)) for lo in range(0, size, pipeline_elems)]


def check_pipeline_elems(pipeline_elems: int | None) -> int | None:
    """Validate a ``pipeline_elems`` argument (None: no pipelining)."""
    if pipeline_elems is None:
        return None
    if isinstance(pipeline_elems, bool) or not isinstance(pipeline_elems, (int, np.integer)) \
            or pipeline_elems < 1:
        raise ValueError(f"pipeline_elems={pipeline_elems!r} must be a positive integer "
                         f"(elements per piece, e.g. {DEFAULT_PIPELINE_ELEMS}) or None")
    return int(pipeline_elems)


def pipeline_seed(seed: int, piece: int, pieces: int) -> int:
    """Seed of piece ``piece`` of ``pieces``: the exchange seed itself when there is one piece
    (an unpipelined exchange), else an independent key per piece."""
    return seed if pieces == 1 else derive_key(seed, PIPELINE_TAG, piece)


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


def _pipelined_reference(codec: Codec, vecs: list[np.ndarray], seed: int, gather: str,
                         bounds: list[tuple[int, int]]) -> tuple[np.ndarray, int]:
    n, pieces = len(vecs), len(bounds)
    out = np.empty(vecs[0].size, np.float32)
    wire = 0
    if codec.exchange == "gather" and resolve_gather(gather, n, codec) == "sra":
        for c, (lo, hi) in enumerate(bounds):
            out[lo:hi], w = sra_reference(codec, [v[lo:hi] for v in vecs],
                                          pipeline_seed(seed, c, pieces))
            wire += w
        return out, wire
    norm = codec.global_norm(vecs) if hasattr(codec, "norm_statistic") else None
    encoded = [[codec.encode_worker(v[lo:hi], pipeline_seed(seed, c, pieces), r, norm)
                for r, v in enumerate(vecs)] for c, (lo, hi) in enumerate(bounds)]
    for c, ((lo, hi), payloads) in enumerate(zip(bounds, encoded)):
        out[lo:hi] = codec.combine_payloads(payloads, pipeline_seed(seed, c, pieces))
        wire += max(p.nbytes for p in payloads)
    return out, wire


def mean_estimate(codec: Codec, xs: Sequence, seed: int = 0, gather: str = "allgather",
                  pipeline_elems: int | None = None) -> tuple[np.ndarray, int]:
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
        pipeline_elems: piece length of a pipelined exchange (module doc); None (default)
            exchanges the vectors whole. Pass the :class:`~horovod_quant.comm.Exchange`'s
            value (default :data:`DEFAULT_PIPELINE_ELEMS`) to reproduce it on longer vectors.

    Returns:
        ``(estimate, wire_bytes)``: the float32 mean estimate and the largest number of payload
        bytes one worker sends (per piece, summed over pieces; the norm statistics are not
        counted).
    """
    vecs = [as_vector(x) for x in xs]
    if not vecs:
        raise ValueError("mean_estimate needs at least one worker's vector")
    if len({v.size for v in vecs}) != 1:
        raise ValueError(f"all workers' vectors must have one length, got {[v.size for v in vecs]}")
    bounds = pipeline_bounds(vecs[0].size, check_pipeline_elems(pipeline_elems))
    if len(bounds) > 1:
        return _pipelined_reference(codec, vecs, seed, gather, bounds)
    if codec.exchange == "gather" and resolve_gather(gather, len(vecs), codec) == "sra":
        return sra_reference(codec, vecs, seed)
    return codec.reference_mean(vecs, seed)
