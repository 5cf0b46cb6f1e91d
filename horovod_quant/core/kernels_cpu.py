"""Fused single-pass CPU kernels (numba) for the level quantizers.

One kernel serves QSGD, standard dithering, NUQSGD, natural dithering and natural compression:
they differ only in the level grid (uniform j/s, or binary-geometric 0, 2^(1-s), ..., 1/2, 1)
and in the scale (L2, L-infinity, general p-norm, or the smallest power of two >= max|x|).

Per packing block (``PACK_BLOCK`` elements, cache resident) the encoder computes the scale of
each bucket the first time the block touches it, rounds every element with its counter-based
uniform, and packs codes; the input is read from memory once. A code is
``sign << (bits - 1) | level_index``. The decoder unpacks a block and multiplies a signed level
table by the bucket scale (fused ``+=`` for gather exchanges).

Mirrored in ``kernels/levels.cu``; a change to the arithmetic here must be made there too.
"""
from __future__ import annotations

import numba
import numpy as np

from .packing import PACK_BLOCK, pack_block, packed_nbytes, unpack_block
from .rng import block_key, hash32_lo, u24_float

NORM_L2, NORM_MAX, NORM_P, NORM_POW2 = 0, 1, 2, 3
GRID_UNIFORM, GRID_GEOMETRIC = 0, 1



_LANES = 8


@numba.njit(inline="always")
def _bucket_scale(x, lo, hi, norm_kind, p):
    """Scale of x[lo:hi]: its norm, NaN/Inf when the bucket holds a non-finite value.

    Sums run in 8 interleaved float64 lanes (element i feeds lane (i - lo) % 8), combined in
    lane order: a fixed order the GPU kernel reproduces, and 8 independent chains that SIMD.
    """
    xs = x[lo:hi]
    n = xs.size
    n8 = n // _LANES * _LANES
    if norm_kind == NORM_L2 or norm_kind == NORM_P:
        lanes = np.zeros(_LANES, np.float64)
        for i in range(0, n8, _LANES):
            for j in range(_LANES):
                v = np.float64(xs[i + j])
                lanes[j] += v * v if norm_kind == NORM_L2 else np.abs(v) ** p
        for i in range(n8, n):
            v = np.float64(xs[i])
            lanes[i - n8] += v * v if norm_kind == NORM_L2 else np.abs(v) ** p
        acc = 0.0
        for j in range(_LANES):
            acc += lanes[j]
        return np.float32(np.sqrt(acc)) if norm_kind == NORM_L2 else np.float32(acc ** (1.0 / p))
    # max and pow2: max() skips NaN, so non-finite values are tracked by x - x (NaN for them)
    mx = np.zeros(_LANES, np.float32)
    bad = np.zeros(_LANES, np.float32)
    for i in range(0, n8, _LANES):
        for j in range(_LANES):
            a = np.abs(xs[i + j])
            mx[j] = a if a > mx[j] else mx[j]
            bad[j] += xs[i + j] - xs[i + j]
    for i in range(n8, n):
        a = np.abs(xs[i])
        mx[i - n8] = a if a > mx[i - n8] else mx[i - n8]
        bad[i - n8] += xs[i] - xs[i]
    m = np.float32(0.0)
    for j in range(_LANES):
        m = mx[j] if mx[j] > m else m
        m += bad[j]
    if norm_kind == NORM_POW2 and m > 0 and np.isfinite(m):
        # smallest power of two >= m (2^-126 for subnormal m; inf above 2^127)
        b = np.uint32(np.float32(m).view(np.uint32))
        ex = b >> np.uint32(23)
        if ex == 0:
            ex = np.uint32(1)
        elif b & np.uint32(0x7FFFFF):
            ex += np.uint32(1)
        m = np.uint32(ex << np.uint32(23)).view(np.float32)
    return m


@numba.njit(inline="always")
def _round_uniform(x, lo, hi, sc, s, sign_shift, kb, k1, codes, c0):
    """Codes for x[lo:hi] on the grid {j/s}: level floor(t) or floor(t)+1, t = |x| s / sc."""
    mult = np.float32(s) / sc
    fs = np.float32(s)
    xs = x[lo:hi]
    cs = codes[lo - c0 : hi - c0]
    base = np.uint32(lo & 0xFFFFFFFF)
    for j in range(xs.size):
        v = xs[j]
        t = min(np.abs(v) * mult, fs)
        lvl = np.int32(t)
        frac = t - np.float32(lvl)
        u = u24_float(hash32_lo(base + np.uint32(j), kb, k1))
        mag = np.int32(lvl + np.int32(u < frac))
        neg = np.int32(np.int32(v < 0) & np.int32(mag != 0))
        cs[j] = np.uint8(mag | np.int32(neg << sign_shift))


@numba.njit(inline="always")
def _round_geometric(x, lo, hi, sc, s, sign_shift, kb, k1, codes, c0):
    """Codes for x[lo:hi] on {0, 2^(1-s), ..., 1/2, 1}: code c >= 1 stands for 2^(c - s).

    Above the smallest level the rounding probability is the float's mantissa fraction,
    compared as an integer with 23 random bits (exact); below it, r * 2^(s-1) vs 24 bits.
    """
    inv = np.float32(1.0) / sc
    low_mult = np.float32(2.0) ** np.float32(s - 1)
    top_shift = np.int32(s - 127)
    xs = x[lo:hi]
    cs = codes[lo - c0 : hi - c0]
    base = np.uint32(lo & 0xFFFFFFFF)
    for j in range(xs.size):
        v = xs[j]
        r = min(np.abs(v) * inv, np.float32(1.0))
        h = hash32_lo(base + np.uint32(j), kb, k1)
        rb = np.int32(np.float32(r).view(np.uint32))
        # code of the lower power of two 2^e is e + s; 127 is the float32 exponent bias
        lower = np.int32(np.int32(rb >> 23) + top_shift)
        up_hi = np.int32(np.int32(h >> np.uint32(9)) < np.int32(rb & 0x7FFFFF))
        up_lo = np.int32(u24_float(h) < r * low_mult)
        mag = np.int32(lower + up_hi) if lower >= 1 else up_lo
        neg = np.int32(np.int32(v < 0) & np.int32(mag != 0))
        cs[j] = np.uint8(mag | np.int32(neg << sign_shift))


@numba.njit(cache=True)
def encode_levels(x, bucket, norm_kind, p, grid, s, bits, k0, k1, out):
    """Encode float32 ``x`` into ``out`` = [float32 scale per bucket][packed codes].

    Returns the number of bytes written.
    """
    n = x.size
    nb = (n + bucket - 1) // bucket
    scales = out[: 4 * nb].view(np.float32)
    codes = np.empty(PACK_BLOCK + 8, np.uint8)
    sign_shift = bits - 1
    o = 4 * nb
    next_bucket = 0
    for b0 in range(0, n, PACK_BLOCK):
        b1 = min(b0 + PACK_BLOCK, n)
        while next_bucket < nb and next_bucket * bucket < b1:
            lo = next_bucket * bucket
            scales[next_bucket] = _bucket_scale(x, lo, min(lo + bucket, n), norm_kind, p)
            next_bucket += 1
        kb = block_key(b0, k0)
        i = b0
        while i < b1:
            k = i // bucket
            hi = min((k + 1) * bucket, b1)
            sc = scales[k]
            if sc > 0 and np.isfinite(sc):
                if grid == GRID_UNIFORM:
                    _round_uniform(x, i, hi, sc, s, sign_shift, kb, k1, codes, b0)
                else:
                    _round_geometric(x, i, hi, sc, s, sign_shift, kb, k1, codes, b0)
            else:
                codes[i - b0 : hi - b0] = 0
            i = hi
        o = pack_block(codes, b1 - b0, bits, out, o)
    return o


@numba.njit(cache=True)
def decode_levels(data, n, bucket, bits, table, out, accumulate):
    """Decode ``data`` (layout of :func:`encode_levels`) into ``out`` (``+=`` if accumulate).

    ``table[code]`` is the signed level of a code; the value is ``table[code] * scale``.
    """
    nb = (n + bucket - 1) // bucket
    scales = data[: 4 * nb].view(np.float32)
    codes = np.empty(PACK_BLOCK + 8, np.uint8)
    o = 4 * nb
    for b0 in range(0, n, PACK_BLOCK):
        b1 = min(b0 + PACK_BLOCK, n)
        o = unpack_block(data, o, b1 - b0, bits, codes)
        i = b0
        while i < b1:
            k = i // bucket
            hi = min((k + 1) * bucket, b1)
            sc = scales[k]
            ob = out[i:hi]
            cb = codes[i - b0 : hi - b0]
            if accumulate:
                for j in range(ob.size):
                    ob[j] += table[cb[j]] * sc
            else:
                for j in range(ob.size):
                    ob[j] = table[cb[j]] * sc
            i = hi
    return out


@numba.njit(cache=True)
def levels_nbytes(n, bucket, bits):
    """Payload bytes of :func:`encode_levels` for n elements."""
    return 4 * ((n + bucket - 1) // bucket) + packed_nbytes(n, bits)
