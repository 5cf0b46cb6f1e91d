"""Numba kernels of Global-QSGD: global norm statistics, the linear (summable uint64 words),
exponential and sparse encoders and decoders, and the exponent combination of the stochastic
reduction (Algorithm 2). Formats and arithmetic: docs/dev/formats.md ("Global-QSGD", "The
exponent reduction"); mirrored in ``kernels/global_qsgd.cu``.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ..protocol import PACK_BLOCK, SPARSE_BAD_POSITIONS, SPARSE_OK, SPARSE_SHORT
from .levels import _sumsq_lanes
from .packing import pack_block, packed_nbytes, unpack_block
from .rng import block_key, hash32_lo, u24_float

WORD_BLOCK = 1024

_LANES = 8
#: Norms below this are handled on values and norm scaled by ``_TINY_BOOST``: s / norm and
#: 1 / norm overflow float32 near the subnormal range (0 * inf would round zeros to the top
#: level). Scaling by a power of two is exact, so other norms round exactly as without it.
_TINY_NORM = np.float32(2.0 ** -100)
_TINY_BOOST = np.float32(2.0 ** 64)



# -- norm ------------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _sum_squares(x):
    """sum x^2 in float64, in 8 interleaved lanes combined in lane order (fixed order); the
    lanes as vector operations (:func:`.levels._sumsq_lanes`, the bucket norms' loop)."""
    n = x.size
    n8 = n // _LANES * _LANES
    lanes = np.zeros(_LANES, np.float64)
    _sumsq_lanes(x, 0, n8, lanes)
    for i in range(n8, n):
        v = np.float64(x[i])
        lanes[i - n8] += v * v
    acc = 0.0
    for j in range(_LANES):
        acc += lanes[j]
    return acc


@numba.njit(cache=True, nogil=True)
def _max_abs(x):
    """max |x|, NaN if x holds a NaN or an infinity.

    One pass over the bit patterns with the sign cleared: for non-negative floats their order
    as uint32 is their order as floats, and infinities and NaNs sort above every finite value,
    so a single integer max (which vectorizes, unlike a NaN-aware float max) finds both.
    """
    u = x.view(np.uint32)
    top = np.uint32(0)
    for i in range(u.size):
        a = u[i] & np.uint32(0x7FFFFFFF)
        top = a if a > top else top
    if top >= np.uint32(0x7F800000):
        return np.float32(np.nan)
    return np.array([top], np.uint32).view(np.float32)[0]


# -- rounding --------------------------------------------------------------------------------
@numba.njit(inline="always")
def _boost(norm):
    """Factor applied to values and norm before dividing (``_TINY_BOOST`` for tiny norms)."""
    return _TINY_BOOST if norm < _TINY_NORM else np.float32(1.0)


@numba.njit(inline="always")
def _linear_level(v, boost, mult, fs, h):
    """Signed level in [-s, s] of v on the grid {j/s} (QSGD rounding, Definition 3.1 eq. (6)):
    floor(t) or floor(t) + 1 with t = |v| s / norm (``mult = s / (norm * boost)``), the upper
    one with probability frac(t). A NaN compares false and lands on s (only reachable when the
    norm does not cover x)."""
    t = (np.abs(v) * boost) * mult
    t = t if t < fs else fs
    lvl = np.int32(t)
    mag = np.int32(lvl + np.int32(u24_float(h) < t - np.float32(lvl)))
    return np.int32(-mag) if v < 0 else mag


@numba.njit(inline="always")
def _exp_code(v, boost, inv, low_mult, top, s_floor, e_low, smask, h):
    """Code ``sign | e`` of v on {0} U {2^-j, j < s} (Global-E_s), e = j + c, 0 for zero.

    With r = |v| / norm in [2^-(j+1), 2^-j) the upper level is taken with probability
    r / 2^-(j+1) - 1, the float's mantissa fraction, compared as an integer with 23 random bits
    (exact). Below the smallest level 2^(1-s) (code ``e_low = s - 1 + c``) it is taken with
    probability r * 2^(s-1) against 24 random bits. ``top = 127 + c``: e of the lower level is
    ``top - biased_exponent(r)``; ``s_floor = 128 - s``: the smallest biased exponent above
    the low range. ``inv = 1 / (norm * boost)``.
    """
    r = (np.abs(v) * boost) * inv
    r = r if r < np.float32(1.0) else np.float32(1.0)
    rb = np.int32(np.float32(r).view(np.int32))
    be = np.int32(rb >> 23)
    up = np.int32(np.int32(h >> np.uint32(9)) < np.int32(rb & 0x7FFFFF))
    e_hi = np.int32(np.int32(top - be) - up)
    e_lo = e_low if u24_float(h) < r * low_mult else np.int32(0)
    e = e_hi if be >= s_floor else e_lo
    return np.int32(e | smask) if (v < 0) & (e != 0) else e


# -- linear dense ----------------------------------------------------------------------------
@numba.njit(inline="always")
def _linear_fields(x, lo, hi, words, sh, boost, mult, fs, s, k0, k1):
    """OR the offset levels of x[lo:hi] into field ``sh`` of words[:hi - lo]. The range must
    not cross a multiple of 2^32 (one high index word)."""
    xs = x[lo:hi]
    ws = words[: hi - lo]
    kb = block_key(lo, k0)
    # a 32-bit counter instead of lo + j keeps the index lanes 32 bits wide
    idx = np.uint32(lo & 0xFFFFFFFF)
    ush = np.uint64(sh)
    for j in range(xs.size):
        q = _linear_level(xs[j], boost, mult, fs, hash32_lo(idx, kb, k1))
        ws[j] |= np.uint64(np.uint32(np.int32(q + s))) << ush
        idx = np.uint32(idx + np.uint32(1))


@numba.njit(cache=True, nogil=True)
def encode_linear(x, norm, s, bits, k0, k1, out):
    """Encode float32 x into the uint64 words ``out`` (layout: docs/dev/formats.md).

    Args:
        x: float32 vector.
        norm: global norm (float32); zero or non-finite gives all levels 0.
        s: number of levels; bits: field width; k0, k1: element key halves.
        out: uint64, ``ceil(x.size / (64 // bits))`` words.
    """
    n = x.size
    per = 64 // bits
    ok = norm > 0 and np.isfinite(norm)
    boost = _boost(norm)
    mult = np.float32(s) / (norm * boost) if ok else np.float32(0.0)
    fs = np.float32(s)
    for w0 in range(0, out.size, WORD_BLOCK):
        e0 = w0 * per
        m = min(WORD_BLOCK * per, n - e0)
        L = (m + per - 1) // per
        words = out[w0 : w0 + L]
        words[:] = 0
        for f in range(per):
            lo = e0 + f * L
            hi = min(lo + L, e0 + m)
            if hi <= lo:
                break
            # split at a multiple of 2^32 so each call has one high index word
            mid = min(hi, max(lo, ((lo >> 32) + 1) << 32))
            _linear_fields(x, lo, mid, words, f * bits, boost, mult, fs, s, k0, k1)
            if mid < hi:
                _linear_fields(x, mid, hi, words[mid - lo :], f * bits, boost, mult, fs, s,
                               k0, k1)


@numba.njit(cache=True, nogil=True)
def decode_linear(words, n, bits, offset, scale, out, accumulate):
    """``out[i] (+)= (field_i - offset) * scale`` for the n elements held in ``words``."""
    per = 64 // bits
    mask = np.uint64((1 << bits) - 1)
    off = np.int32(offset)
    for w0 in range(0, words.size, WORD_BLOCK):
        e0 = w0 * per
        m = min(WORD_BLOCK * per, n - e0)
        L = (m + per - 1) // per
        ws = words[w0 : w0 + L]
        for f in range(per):
            lo = e0 + f * L
            hi = min(lo + L, e0 + m)
            if hi <= lo:
                break
            ob = out[lo:hi]
            ush = np.uint64(f * bits)
            if accumulate:
                for j in range(ob.size):
                    ob[j] += np.float32(np.int32(np.int32((ws[j] >> ush) & mask) - off)) * scale
            else:
                for j in range(ob.size):
                    ob[j] = np.float32(np.int32(np.int32((ws[j] >> ush) & mask) - off)) * scale
    return out


# -- exponential dense / sparse codes ---------------------------------------------------------
@numba.njit(inline="always")
def _codes_block(x, b0, b1, grid_exp, norm, s, c, bits, k0, k1, codes):
    """Sign-magnitude codes of x[b0:b1] (one packing block) into ``codes[:b1 - b0]`` as int32:
    ``sign | e`` for exponential levels (offset c), ``sign | level`` for linear ones."""
    ok = norm > 0 and np.isfinite(norm)
    cs = codes[: b1 - b0]
    if not ok:
        cs[:] = 0
        return
    xs = x[b0:b1]
    kb = block_key(b0, k0)
    idx = np.uint32(b0 & 0xFFFFFFFF)
    smask = np.int32(1 << (bits - 1))
    boost = _boost(norm)
    if grid_exp:
        inv = np.float32(1.0) / (norm * boost)
        low_mult = np.float32(2.0) ** np.float32(s - 1)
        top = np.int32(127 + c)
        s_floor = np.int32(128 - s)
        e_low = np.int32(s - 1 + c)
        for j in range(xs.size):
            cs[j] = _exp_code(xs[j], boost, inv, low_mult, top, s_floor, e_low, smask,
                              hash32_lo(idx, kb, k1))
            idx = np.uint32(idx + np.uint32(1))
    else:
        mult = np.float32(s) / (norm * boost)
        fs = np.float32(s)
        for j in range(xs.size):
            q = _linear_level(xs[j], boost, mult, fs, hash32_lo(idx, kb, k1))
            cs[j] = np.int32(np.int32(-q) | smask) if q < 0 else q
            idx = np.uint32(idx + np.uint32(1))


@numba.njit(cache=True, nogil=True)
def encode_exp(x, norm, s, c, bits, k0, k1, out):
    """Packed exponent codes of float32 x into ``out`` (``packed_nbytes(x.size, bits)`` bytes)."""
    n = x.size
    codes = np.empty(PACK_BLOCK, np.int32)
    small = np.empty(PACK_BLOCK + 8, np.uint8)
    o = 0
    for b0 in range(0, n, PACK_BLOCK):
        b1 = min(b0 + PACK_BLOCK, n)
        _codes_block(x, b0, b1, True, norm, s, c, bits, k0, k1, codes)
        # narrowing in its own loop keeps the rounding loop free of byte shuffles
        for j in range(b1 - b0):
            small[j] = np.uint8(codes[j])
        o = pack_block(small, b1 - b0, bits, out, o)
    return o


@numba.njit(cache=True, nogil=True)
def decode_packed(data, n, bits, table, scale, out, accumulate):
    """``out[i] (+)= table[code_i] * scale`` for the n packed codes of ``data``."""
    codes = np.empty(PACK_BLOCK + 8, np.uint8)
    o = 0
    for b0 in range(0, n, PACK_BLOCK):
        b1 = min(b0 + PACK_BLOCK, n)
        o = unpack_block(data, o, b1 - b0, bits, codes)
        ob = out[b0:b1]
        cb = codes[: b1 - b0]
        if accumulate:
            for j in range(ob.size):
                ob[j] += table[cb[j]] * scale
        else:
            for j in range(ob.size):
                ob[j] = table[cb[j]] * scale
    return out


@numba.njit(cache=True, nogil=True)
def encode_sparse(x, grid_exp, norm, s, c, bits, k0, k1):
    """Sparse payload: ``[uint32 count][count uint32 positions][packed codes of the nonzeros]``.

    Returns the payload as a new uint8 array of exactly its size.
    """
    n = x.size
    codes = np.empty(PACK_BLOCK, np.int32)
    pos = np.empty(n, np.uint32)
    nz = np.empty(n + 8, np.uint8)
    cnt = 0
    for b0 in range(0, n, PACK_BLOCK):
        b1 = min(b0 + PACK_BLOCK, n)
        _codes_block(x, b0, b1, grid_exp, norm, s, c, bits, k0, k1, codes)
        for j in range(b1 - b0):
            if codes[j] != 0:
                pos[cnt] = np.uint32(b0 + j)
                nz[cnt] = np.uint8(codes[j])
                cnt += 1
    out = np.empty(4 + 4 * cnt + packed_nbytes(cnt, bits), np.uint8)
    out[:4].view(np.uint32)[0] = np.uint32(cnt)
    out[4 : 4 + 4 * cnt].view(np.uint32)[:] = pos[:cnt]
    scratch = np.empty(PACK_BLOCK + 8, np.uint8)
    o = 4 + 4 * cnt
    for b0 in range(0, cnt, PACK_BLOCK):
        m = min(PACK_BLOCK, cnt - b0)
        scratch[:m] = nz[b0 : b0 + m]
        o = pack_block(scratch, m, bits, out, o)
    return out




@numba.njit(inline="always")
def _order_violations(pos, lo, hi):
    """How many j in (lo, hi) have ``pos[j] <= pos[j - 1]``: a sum over unsigned indices (no
    negative-index wraparound), which vectorizes."""
    bad = np.uint32(0)
    for j in range(np.uint64(lo) + np.uint64(1), np.uint64(hi)):
        bad += np.uint32(pos[j] <= pos[j - np.uint64(1)])
    return bad


@numba.njit(cache=True, nogil=True)
def decode_sparse(data, n, bits, table, scale, out):
    """``out[pos] += table[code] * scale`` for every entry of a sparse payload of an n-element
    vector (``out`` holds n elements).

    The positions are checked first, without touching ``out``: they must increase strictly and
    stay below n (the encoder writes them in index order). One vectorized pass over them costs
    about a seventh of the decode of a payload whose every code is nonzero (a check fused into
    the scattering loop, or run per packing block, measured slower). Returns ``SPARSE_OK`` (0),
    ``SPARSE_SHORT`` when ``data`` is shorter than its count says (or the count exceeds n), or
    ``SPARSE_BAD_POSITIONS``; ``out`` is unchanged on an error.
    """
    if data.size < 4 or out.size < n:
        return SPARSE_SHORT
    cnt = np.int64(data[:4].view(np.uint32)[0])
    if cnt > n or 4 + 4 * cnt + packed_nbytes(cnt, bits) > data.size:
        return SPARSE_SHORT
    pos = data[4 : 4 + 4 * cnt].view(np.uint32)
    if cnt and (_order_violations(pos, 0, cnt) or np.int64(pos[cnt - 1]) >= n):
        return SPARSE_BAD_POSITIONS
    codes = np.empty(PACK_BLOCK + 8, np.uint8)
    o = 4 + 4 * cnt
    for b0 in range(0, cnt, PACK_BLOCK):
        m = min(PACK_BLOCK, cnt - b0)
        o = unpack_block(data, o, m, bits, codes)
        for j in range(m):
            out[pos[b0 + j]] += table[codes[j]] * scale
    return SPARSE_OK


#: Multipliers of the key halves of p's digit words t = 1, 2, 3 (docs/dev/formats.md, "The exponent
#: reduction").
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
    diff 32, decided on digit words t = 1, 2, 3 (docs/dev/formats.md) beyond; false for a zero
    operand."""
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
