"""Stochastic exponent reduction of Global-QSGD exponential levels (Global-QSGD paper, App. B).

Values. After the global normalization each worker holds values ``sign * 2^-e`` (``e >= 1``;
``e = 0`` is zero) whose magnitudes are at most ``2^-c``, ``c`` = :func:`exponent_offset`. A
value travels as the ``bits``-wide code ``sign << (bits - 1) | e``, packed with the layout of
:mod:`.packing`; zero is always code 0.

Combination. Two values combine into ``C_nat(x1 + x2)``: the sum rounded to one of its two
neighbouring powers of two with the probabilities that keep it unbiased (Algorithm 2). With
``leq`` selecting the larger magnitude, ``sign12`` = +1 / -1 / 0 for equal signs / opposite
signs / a zero operand, ``diff = |e1 - e2| - (1 - sign12) // 2`` and a uniform ``p`` in [0, 1),
the result has the larger operand's sign and the exponent ``emin - sign12 * [p < 2^-diff]``
(``emin``: the smaller nonzero exponent), or is zero when two equal magnitudes cancel. The
paper draws ``k = -floor(log2(p))`` capped at ``m = s + 1``; differences here can reach
``2^(bits-1) - 2`` (cancellations push exponents past the encoder's range), so
``[p < 2^-diff]`` is decided exactly on the binary digits of p:
its first 32 digits are ``hash32(i, k0, k1)`` for element index i, and digit words t = 1, 2, 3
(consulted only when all earlier digits are zero, probability 2^-32) are
``hash32(i, k0 ^ (t * 0x632BE5AB), k1 ^ (t * 0x85157AF5))`` (products modulo 2^32).

Schedules (n ranks, d elements, ``nb = ceil(d / PACK_BLOCK)`` packing blocks). Chunks are whole
packing blocks, so every exchanged byte range is :func:`packed_range` of its elements and the
combination kernel :func:`exp_combine` runs on packed bytes. Every combination in round ``t``
computed by rank ``g`` draws its p from ``derive_key(seed, t, g)`` (``seed`` is the exchange
seed, not a worker seed) at the global element index, so independent combinations get
independent bits, the result does not depend on how a range is cut into calls, and any rank
that recomputes a combination gets the same bits. ``combine(own, received)`` is symmetric in
its operands.

* ``"tree"``: with ``P = 2^floor(log2 n)``: round 0 (only when n > P) folds rank ``r >= P``
  into rank ``g = r - P`` over all blocks. Rounds ``t = 1 .. log2 P`` reduce-scatter by
  recursive halving among ranks ``g < P``: ``mask = P >> t``, partner ``g ^ mask``; the pair's
  current block range ``[b0, b1)`` (initially ``[0, nb)``) splits at
  ``mid = b0 + (b1 - b0 + 1) // 2``; rank g keeps ``[b0, mid)`` if ``g & mask == 0``, else
  ``[mid, b1)``, receives the partner's bytes of the kept range and combines them into its own.
  Rank g then owns its final range; ranks ``< P`` allgather the owned ranges by recursive
  doubling and send the whole result to rank ``g + P`` where it exists. Each element is rounded
  ``ceil(log2 n)`` times.
* ``"ring"``: the blocks split into n chunks by :func:`chunk_bounds`; in round
  ``t = 0 .. n - 2`` rank g receives chunk ``(g - t - 1) mod n`` from rank ``g - 1`` and combines
  it into its own (chunk c is accumulated in rank order c, c + 1, ...). Rank g owns chunk
  ``(g + 1) mod n`` and a ring allgather copies the owned chunks. Each element is rounded
  ``n - 1`` times.

Allgathers copy bytes, so every rank ends with the same final codes.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from .base import check_payload_size
from .packing import PACK_BLOCK, pack_block, packed_nbytes, unpack_block
from .rng import block_key, derive_key, hash32_lo, split_key


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

#: Multipliers of the key halves of p's digit words t = 1, 2, 3 (see module doc).
_EXT0, _EXT1 = 0x632BE5AB, 0x85157AF5


#: Stand-in exponent of a zero operand: larger than any real exponent, so a zero is never the
#: larger magnitude and its difference to a nonzero exponent exceeds 32 (no rounding).
_ZERO_KEY = 1 << 20


@intrinsic
def _combine_lanes(typingctx, a, b, h, smask):
    """Algorithm 2 on one pair of codes, as i32 LLVM IR (numba would widen it to 64-bit lanes).

    ``a``, ``b``: codes ``sign << (bits - 1) | e``; ``smask = 1 << (bits - 1)``; ``h``: the first
    32 binary digits of p. Returns the combined code. With zeros mapped to ``_ZERO_KEY``, ``lo``
    / ``hi`` are the exponents of the larger / smaller magnitude (the paper's ``leq`` select)
    and ``diff = hi - lo - [opposite signs]``. The rounding moves the exponent one step (down
    for equal signs, up for opposite) iff ``p < 2^-diff``: always when ``diff <= 0``, else iff
    ``h <= 0x7FFFFFFF >> (diff - 1)``, exact for ``diff <= 32``. For larger diff (or a zero
    operand) this reads as ``h == 0``; :func:`_combine_block` redoes those elements exactly.
    """
    sig = types.int32(types.int32, types.int32, types.uint32, types.int32)

    def codegen(context, builder, signature, args):
        a_, b_, h_, smask_ = args
        i32 = ir.IntType(32)

        def const(v):
            return ir.Constant(i32, v)

        emask = builder.sub(smask_, const(1))
        e1 = builder.and_(a_, emask)
        e2 = builder.and_(b_, emask)
        k1 = builder.select(builder.icmp_signed("==", e1, const(0)), const(_ZERO_KEY), e1)
        k2 = builder.select(builder.icmp_signed("==", e2, const(0)), const(_ZERO_KEY), e2)
        leq = builder.icmp_signed("<=", k1, k2)
        lo = builder.select(leq, k1, k2)
        hi = builder.select(leq, k2, k1)
        sign = builder.and_(builder.select(leq, a_, b_), smask_)
        opp = builder.icmp_signed("!=", builder.and_(builder.xor(a_, b_), smask_), const(0))
        opp_m = builder.sext(opp, i32)  # -1 for opposite signs
        gap = builder.sub(hi, lo)
        diff = builder.add(gap, opp_m)
        d1 = builder.sub(diff, const(1))
        d1 = builder.select(builder.icmp_unsigned("<", d1, const(31)), d1, const(31))
        thr = builder.lshr(const(0x7FFFFFFF), d1)
        up = builder.or_(builder.icmp_signed("<=", diff, const(0)),
                         builder.icmp_unsigned("<=", h_, thr))
        up_m = builder.sext(up, i32)
        # e = lo - up (equal signs: the sum doubles) or lo + up (opposite: it halves)
        e = builder.add(lo, builder.sub(builder.xor(up_m, opp_m), opp_m))
        zero = builder.or_(builder.icmp_signed("==", lo, const(_ZERO_KEY)),
                           builder.and_(opp, builder.icmp_signed("==", gap, const(0))))
        return builder.and_(builder.or_(e, sign), builder.not_(builder.sext(zero, i32)))

    return sig, codegen


@numba.njit(nogil=True)
def _up_exact(a, b, index, bits, k0, k1):
    """``[p < 2^-diff]`` for an element whose first 32 digits of p are zero: true up to
    diff 32, decided on digit words t = 1, 2, 3 (module doc) beyond; false for a zero operand."""
    emask = (1 << (bits - 1)) - 1
    e1, e2 = a & emask, b & emask
    if e1 == 0 or e2 == 0:
        return False
    left = abs(e1 - e2) - (1 if (a ^ b) >> (bits - 1) else 0) - 32
    t = 1
    while left > 0:
        kt0 = np.uint32((k0 ^ (t * _EXT0)) & 0xFFFFFFFF)
        kt1 = np.uint32((k1 ^ (t * _EXT1)) & 0xFFFFFFFF)
        g = hash32_lo(np.uint32(index & 0xFFFFFFFF), block_key(index, kt0), kt1)
        if left < 32:
            return (g >> (32 - left)) == 0
        if g != 0:
            return False
        left -= 32
        t += 1
    return True


@numba.njit(inline="always")
def _combine_run(xa, xb, acc, n, start, sh, bits, k0, k1):
    """``acc[j] |= combine(a_j, b_j) << sh`` for j < n, where a_j, b_j are the codes in bits
    ``[sh, sh + bits)`` of ``xa[j]``, ``xb[j]`` and belong to element ``start + j``. The range
    lies in one packing block (one high index word); ``acc`` is int32. Callers pass ``sh`` as a
    literal so that the shifts compile to constant 32-bit lane shifts."""
    smask = np.int32(1 << (bits - 1))
    cmask = np.int32((1 << bits) - 1)
    kb = block_key(start, k0)
    a8, b8, t = xa[:n], xb[:n], acc[:n]
    # a 32-bit counter instead of base + j keeps the index lanes 32 bits wide
    idx = np.uint32(start & 0xFFFFFFFF)
    rare = np.int32(0)
    for j in range(n):
        h = hash32_lo(idx, kb, k1)
        a = np.int32(np.int32(np.int32(a8[j]) >> sh) & cmask)
        b = np.int32(np.int32(np.int32(b8[j]) >> sh) & cmask)
        t[j] = np.int32(t[j] | np.int32(_combine_lanes(a, b, h, smask) << sh))
        rare = np.int32(rare | np.int32(h == np.uint32(0)))
        idx = np.uint32(idx + np.uint32(1))
    if rare:
        # p's first 32 digits are zero for some element (probability 2^-32 each): decide
        # exactly, then force the rounding through h (0: round, 0xFFFFFFFF: do not)
        base = np.uint32(start & 0xFFFFFFFF)
        for j in range(n):
            if hash32_lo(np.uint32(base + np.uint32(j)), kb, k1) == 0:
                a = np.int32(np.int32(np.int32(a8[j]) >> sh) & cmask)
                b = np.int32(np.int32(np.int32(b8[j]) >> sh) & cmask)
                up = _up_exact(a, b, start + j, bits, k0, k1)
                hx = np.uint32(0) if up else np.uint32(0xFFFFFFFF)
                code = _combine_lanes(a, b, hx, smask)
                t[j] = np.int32((t[j] & ~np.int32(cmask << sh)) | np.int32(code << sh))


@numba.njit(inline="always")
def _narrow(acc, out, n):
    """``out[:n] = acc[:n]`` as uint8; in its own loop so the combine loops stay free of byte
    shuffles, and last because ``out`` may alias an operand."""
    o, t = out[:n], acc[:n]
    for j in range(n):
        o[j] = np.uint8(t[j])


@numba.njit(cache=True, nogil=True)
def exp_combine(a_codes_packed, b_codes_packed, out_packed, n_elements, first_element_index,
                bits, k0, k1):
    """Combine two packed exponent-code ranges element by element (Algorithm 2).

    Args:
        a_codes_packed, b_codes_packed: uint8 packed codes (:mod:`.packing` layout) of elements
            ``first_element_index .. first_element_index + n_elements``, starting at that
            element's block (see :func:`packed_range`).
        out_packed: receives the combined codes, same layout; may be ``a_codes_packed`` or
            ``b_codes_packed`` (each block is read completely before it is written).
        n_elements: elements in the range; a multiple of ``PACK_BLOCK`` unless the range ends
            the vector.
        first_element_index: global index of the first element, a multiple of ``PACK_BLOCK``.
        bits: code width, 2..8.
        k0, k1: key halves of the combination, ``split_key(derive_key(seed, round, group))``.

    Returns:
        The number of bytes written to ``out_packed``.
    """
    if first_element_index % PACK_BLOCK != 0 or first_element_index < 0:
        raise ValueError("first_element_index must be a multiple of PACK_BLOCK")
    if n_elements < 0 or bits < 2 or bits > 8:
        raise ValueError("exp_combine: n_elements must be >= 0 and bits in 2..8")
    nbytes = packed_nbytes(n_elements, bits)
    if a_codes_packed.size < nbytes or b_codes_packed.size < nbytes or out_packed.size < nbytes:
        raise ValueError("packed buffers are shorter than packed_nbytes(n_elements, bits)")
    acc = np.empty(PACK_BLOCK, np.int32)
    if bits == 8 or bits == 4 or bits == 2:
        # one bit plane: byte j holds codes j, j + L, ... (packing.py), combined in place of
        # unpacked copies; padding codes past the block are 0 and combine to 0
        per = 8 // bits
        for b0 in range(0, n_elements, PACK_BLOCK):
            m = min(PACK_BLOCK, n_elements - b0)
            L = (m + per - 1) // per
            o = b0 // per
            xa, xb = a_codes_packed[o : o + L], b_codes_packed[o : o + L]
            start = first_element_index + b0
            acc[:L] = 0
            if bits == 8:
                _combine_run(xa, xb, acc, L, start, 0, 8, k0, k1)
            elif bits == 4:
                _combine_run(xa, xb, acc, L, start, 0, 4, k0, k1)
                _combine_run(xa, xb, acc, L, start + L, 4, 4, k0, k1)
            else:
                _combine_run(xa, xb, acc, L, start, 0, 2, k0, k1)
                _combine_run(xa, xb, acc, L, start + L, 2, 2, k0, k1)
                _combine_run(xa, xb, acc, L, start + 2 * L, 4, 2, k0, k1)
                _combine_run(xa, xb, acc, L, start + 3 * L, 6, 2, k0, k1)
            _narrow(acc, out_packed[o : o + L], L)
        return nbytes
    ca = np.empty(PACK_BLOCK + 8, np.uint8)
    cb = np.empty(PACK_BLOCK + 8, np.uint8)
    co = np.empty(PACK_BLOCK + 8, np.uint8)
    o = 0
    for b0 in range(0, n_elements, PACK_BLOCK):
        m = min(PACK_BLOCK, n_elements - b0)
        unpack_block(a_codes_packed, o, m, bits, ca)
        unpack_block(b_codes_packed, o, m, bits, cb)
        acc[:m] = 0
        _combine_run(ca, cb, acc, m, first_element_index + b0, 0, bits, k0, k1)
        _narrow(acc, co, m)
        o = pack_block(co, m, bits, out_packed, o)
    return o


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
    """The combinations of a reduce-scatter over n ranks (module doc) and who owns what after it.

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


def reduce_packed(buffers: Sequence[Any], size: int, bits: int, seed: int, reduction: str,
                  xp: Any = np, combine: Callable = exp_combine) -> Any:
    """Run the reduction of n ranks' packed codes in one process, combination by combination.

    Args:
        buffers: each rank's packed codes (uint8, ``packed_nbytes(size, bits)`` bytes), in rank
            order; not modified.
        size: elements per payload.
        bits: code width.
        seed: the exchange seed (keys: module doc).
        reduction: "tree" or "ring".
        xp: array module of the buffers (NumPy, or CuPy for device buffers).
        combine: the combination kernel, :func:`exp_combine` or its device twin.

    Returns:
        The reduced packed codes every rank holds after the allgather.
    """
    n = len(buffers)
    check_reduce_buffers(buffers, size, bits, reduction)
    work = [xp.array(b, dtype=xp.uint8, copy=True) for b in buffers]
    rounds, owners = schedule(n, -(-size // PACK_BLOCK), reduction)
    for step in rounds:
        for c in step:
            i0, i1, lo, hi = block_byte_range(c.b0, c.b1, size, bits)
            if i1 == i0:
                continue
            k0, k1 = round_key(seed, c.round, c.rank)
            own = work[c.rank][lo:hi]
            combine(own, work[c.partner][lo:hi], own, i1 - i0, i0, bits, k0, k1)
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

