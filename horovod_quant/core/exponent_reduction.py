"""Global-QSGD's stochastic exponent reduction (Global-QSGD paper, App. B): its rounds and a
run of them in one process.

Values are exponent codes ``sign << (bits - 1) | e`` of ``sign * 2^-e`` (zero is code 0),
packed in the protocol's layout. Two values combine into an unbiased power-of-two rounding of
their sum (``Backend.exp_combine``), with random bits keyed by the exchange seed, the round and
the combining rank (:func:`round_key`), so any rank that recomputes a combination gets the same
bits. :func:`schedule` lists the combinations of a "tree" (fold, then recursive halving) or
"ring" reduce-scatter over whole packing blocks; :func:`reduce_packed` runs them in one
process, :mod:`horovod_quant.exchange.mpi_exponent_allreduce` between ranks over MPI. The
combination rule and both schedules, bit for bit: docs/dev/formats.md ("The exponent reduction").
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from ..backends import PACK_BLOCK, backend_of, packed_nbytes
from .base import check_payload_size
from .rng import derive_key, split_key


def chunk_bounds(size: int, n: int) -> list[tuple[int, int]]:
    """Split ``range(size)`` into n contiguous chunks whose lengths differ by at most one (the
    ring reduction's chunks of blocks, the sra plan's chunks of elements)."""
    base, extra = divmod(size, n)
    bounds, lo = [], 0
    for c in range(n):
        hi = lo + base + (1 if c < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


REDUCTIONS = ("tree", "ring")


def packed_range(i0: int, i1: int, size: int, bits: int) -> tuple[int, int]:
    """Byte range ``[lo, hi)`` of the packed codes of elements ``[i0, i1)`` of a ``size``-element
    payload.

    Args:
        i0: first element, a multiple of ``PACK_BLOCK`` (or ``size`` for an empty range).
        i1: end element, a multiple of ``PACK_BLOCK`` or ``size``.
        size: elements in the whole payload.
        bits: code width, 1..8.

    Returns:
        ``(lo, hi)`` byte offsets into the packed payload.
    """
    def aligned(i: int) -> bool:
        return i % PACK_BLOCK == 0 or i == size

    if not (aligned(i0) and aligned(i1) and 0 <= i0 <= i1 <= size):
        raise ValueError(
            f"elements [{i0}, {i1}) of {size} do not split the packed bytes cleanly: both ends "
            f"must be multiples of PACK_BLOCK={PACK_BLOCK} (the end may also be {size})")
    lo = i0 // PACK_BLOCK * (PACK_BLOCK * bits // 8)
    return lo, lo + int(packed_nbytes(i1 - i0, bits))


def reduction_rounds(n: int, reduction: str) -> int:
    """Roundings each element undergoes: ``ceil(log2 n)`` for "tree", ``n - 1`` for "ring"."""
    return (n - 1).bit_length() if reduction == "tree" else n - 1


def exponent_offset(n: int, reduction: str) -> int:
    """The c of the scaling by 2^-c that keeps every partial sum of n values at most 1/2.

    A rounding never exceeds the next power of two above the exact sum. Tree: a group of
    ``2^t`` workers then sums to at most ``2^(t - c)`` (two groups at their bound add exactly),
    so ``c = ceil(log2(2n))`` as in the paper. Ring: a partial sum ``M >= 2^-c`` plus one more
    value (at most ``2^-c``) may round up to ``2M``, so after n - 1 rounds it can reach
    ``2^(n - 1 - c)``: ``c = n``. (The paper's division by 2n does not bound a sequential
    accumulation: four workers at the top level can round up to 1, which has no code.)
    """
    return n if reduction == "ring" else (2 * n - 1).bit_length()


class Combination(NamedTuple):
    """One combination of a schedule: rank ``rank`` combines the bytes of blocks ``[b0, b1)``
    received from ``partner`` into its own, in round ``round`` (key group = ``rank``)."""

    round: int
    rank: int
    partner: int
    b0: int
    b1: int


def schedule(n: int, n_blocks: int, reduction: str
             ) -> tuple[list[list[Combination]], list[tuple[int, int, int]]]:
    """The combinations of a reduce-scatter over n ranks (docs/dev/formats.md) and who owns what
    after it.

    Args:
        n: number of ranks.
        n_blocks: packing blocks of the payload.
        reduction: "tree" or "ring".

    Returns:
        ``(rounds, owners)``: ``rounds[k]`` lists the combinations of one round (they read and
        write disjoint data, so their order within a round does not matter); ``owners`` lists
        ``(rank, b0, b1)``, the fully reduced block range each owner holds before the allgather.
    """
    if reduction == "ring":
        chunks = chunk_bounds(n_blocks, n)
        rounds = [[Combination(t, g, (g - 1) % n, *chunks[(g - t - 1) % n]) for g in range(n)]
                  for t in range(n - 1)]
        return rounds, [(g, *chunks[(g + 1) % n]) for g in range(n)]
    top = 1 << (n.bit_length() - 1)
    rounds = []
    if n > top:
        rounds.append([Combination(0, r - top, r, 0, n_blocks) for r in range(top, n)])
    ranges = [(0, n_blocks)] * top
    t, mask = 1, top >> 1
    while mask:
        step = []
        for g in range(top):
            b0, b1 = ranges[g]
            mid = b0 + (b1 - b0 + 1) // 2
            ranges[g] = (b0, mid) if g & mask == 0 else (mid, b1)
            step.append(Combination(t, g, g ^ mask, *ranges[g]))
        rounds.append(step)
        t, mask = t + 1, mask >> 1
    return rounds, [(g, *ranges[g]) for g in range(top)]


def round_key(seed: int, round_index: int, group: int) -> tuple[np.uint32, np.uint32]:
    """Key halves of the combination computed by rank ``group`` in round ``round_index``."""
    return split_key(derive_key(seed, round_index, group))


def block_byte_range(b0: int, b1: int, size: int, bits: int) -> tuple[int, int, int, int]:
    """``(i0, i1, lo, hi)``: the elements ``[i0, i1)`` of packing blocks ``[b0, b1)`` of a
    ``size``-element payload and their packed byte range ``[lo, hi)``."""
    i0, i1 = min(b0 * PACK_BLOCK, size), min(b1 * PACK_BLOCK, size)
    return (i0, i1, *packed_range(i0, i1, size, bits))


def check_reduce_buffers(buffers: Sequence[Any], size: int, bits: int, reduction: str) -> None:
    """The arguments of :func:`reduce_packed`, checked before any buffer is read: at least one
    buffer, each exactly ``packed_nbytes(size, bits)`` bytes, ``size`` in [0, 2^40], ``bits``
    in 2..8, a known reduction. Raises ValueError saying which does not hold."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduce_packed: reduction={reduction!r} is not one of {REDUCTIONS}")
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 2 <= bits <= 8:
        raise ValueError(f"reduce_packed: bits={bits!r} must be an integer in 2..8")
    size = check_payload_size("reduce_packed", size)
    if len(buffers) == 0:
        raise ValueError("reduce_packed: no buffers to reduce")
    want = int(packed_nbytes(int(size), int(bits)))
    got = [int(b.nbytes) for b in buffers]
    if any(g != want for g in got):
        raise ValueError(f"reduce_packed: buffers of {got} bytes, {want} expected for "
                         f"size={size} (bits={bits}, packed exponent codes)")


def reduce_packed(buffers: Sequence[Any], size: int, bits: int, seed: int, reduction: str) -> Any:
    """Run the reduction of n ranks' packed codes in one process, combination by combination.

    Args:
        buffers: each rank's packed codes (uint8, ``packed_nbytes(size, bits)`` bytes), in rank
            order; not modified.
        size: elements per payload.
        bits: code width.
        seed: the exchange seed (keys: :func:`round_key`).
        reduction: "tree" or "ring".

    Returns:
        The reduced packed codes every rank holds after the allgather.
    """
    n = len(buffers)
    check_reduce_buffers(buffers, size, bits, reduction)
    be = backend_of(buffers[0])  # the combination kernel: Backend.exp_combine
    xp = be.xp
    work = [xp.array(be.array(b), dtype=xp.uint8, copy=True) for b in buffers]
    rounds, owners = schedule(n, -(-size // PACK_BLOCK), reduction)
    for step in rounds:
        for c in step:
            i0, i1, lo, hi = block_byte_range(c.b0, c.b1, size, bits)
            if i1 == i0:
                continue
            k0, k1 = round_key(seed, c.round, c.rank)
            own = work[c.rank][lo:hi]
            be.exp_combine(own, work[c.partner][lo:hi], own, i1 - i0, i0, bits, k0, k1)
    out = xp.empty(int(packed_nbytes(size, bits)), xp.uint8)
    for g, b0, b1 in owners:
        _, _, lo, hi = block_byte_range(b0, b1, size, bits)
        out[lo:hi] = work[g][lo:hi]
    return out


def partial_sum_sizes(n: int, reduction: str) -> list[int]:
    """Largest number of workers summed by one combination of the k-th rounding an element
    undergoes, k = 1 .. :func:`reduction_rounds` (used by the variance bound of
    :meth:`.global_qsgd.GlobalQSGD.theta`)."""
    if reduction == "ring":
        return list(range(2, n + 1))
    return [min(1 << t, n) for t in range(1, reduction_rounds(n, "tree") + 1)]

