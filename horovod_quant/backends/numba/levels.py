"""Fused single-pass CPU kernels (numba) for the level quantizers.

One kernel serves QSGD, standard dithering, NUQSGD, natural dithering and natural compression:
they differ only in the level grid (uniform j/s, or binary-geometric 0, 2^(1-s), ..., 1/2, 1)
and in the scale (L2, L-infinity, general p-norm, or the smallest power of two >= max|x|).

Per packing block (``PACK_BLOCK`` elements, cache resident) the encoder computes the scale of
each bucket the first time the block touches it, rounds every element with its counter-based
uniform, and packs codes; the input is read from memory once. A code is
``sign << (bits - 1) | level_index``. The decoder unpacks a block and multiplies a signed level
table by the bucket scale (fused ``+=`` for gather exchanges).

8-bit codes are written straight into the payload (their packed layout is the codes). A bucket
whose scale is below 2^-100 is rounded on a copy scaled by 2^64 (see ``_TINY_SCALE``).

Mirrored in ``kernels/levels.cu``; a change to the arithmetic here must be made there too
(including the tiny-scale rule).
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from ..protocol import MODE_UNIFORM, NORM_L2, NORM_MAX, NORM_P, NORM_POW2, PACK_BLOCK
from .packing import pack_block, unpack_block
from .rng import block_key, hash32_at, u24_float

_LANES = 8

#: Buckets whose scale is below this are rounded on a copy multiplied by ``_TINY_BOOST``
#: (and the scale too): s / scale and 1 / scale overflow float32 for scales near the subnormal
#: range, which used to round every nonzero element to the top level (a bias). Scaling by a
#: power of two is exact here, so every other bucket rounds exactly as before.
_TINY_SCALE = np.float32(2.0 ** -100)
_TINY_BOOST = np.float32(2.0 ** 64)


@intrinsic
def _sumsq_lanes(typingctx, arr, lo, n8, lanes):
    """``lanes[j] += float64(x[lo + i])^2`` for i < n8 with i % 8 == j, each lane summed left
    to right: the order of :func:`_bucket_scale`, written as <8 x double> vector operations
    (numba would keep the lanes in memory and run them one by one). ``arr`` must be a
    C-contiguous float32 array, ``lanes`` a C-contiguous float64 array of 8."""
    if arr.layout != "C" or arr.dtype != types.float32 or lanes.layout != "C":
        return None
    sig = types.void(arr, types.intp, types.intp, lanes)

    def codegen(context, builder, signature, args):
        a, lo_, n8_, ln = args
        src = context.make_array(signature.args[0])(context, builder, value=a).data
        dst = context.make_array(signature.args[3])(context, builder, value=ln).data
        v8f, v8d = ir.VectorType(ir.FloatType(), 8), ir.VectorType(ir.DoubleType(), 8)
        dvec = builder.bitcast(dst, v8d.as_pointer())
        acc = cgutils.alloca_once(builder, v8d)
        builder.store(builder.load(dvec, align=8), acc)
        base = builder.gep(src, [lo_])
        zero, step = ir.Constant(lo_.type, 0), ir.Constant(lo_.type, _LANES)
        with cgutils.for_range_slice(builder, zero, n8_, step) as (i, _):
            ptr = builder.bitcast(builder.gep(base, [i]), v8f.as_pointer())
            v = builder.fpext(builder.load(ptr, align=4), v8d)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(v, v)), acc)
        builder.store(builder.load(acc), dvec, align=8)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(inline="always")
def _bucket_scale(x, lo, hi, norm_kind, p):
    """Scale of x[lo:hi]: its norm, NaN/Inf when the bucket holds a non-finite value.

    Sums run in 8 interleaved float64 lanes (element i feeds lane (i - lo) % 8), combined in
    lane order: a fixed order the GPU kernel reproduces, and 8 independent chains that SIMD.
    The max of finite values is taken on the integer bit patterns of |x| (same order as the
    floats, and an integer max vectorizes); a bucket with Inf/NaN takes the float path, which
    defines the NaN that is stored.
    """
    xs = x[lo:hi]
    n = xs.size
    if norm_kind == NORM_MAX or norm_kind == NORM_POW2:
        ib = xs.view(np.int32)
        mb = np.int32(0)
        for i in range(n):
            a = np.int32(ib[i] & np.int32(0x7FFFFFFF))
            mb = a if a > mb else mb
        if mb < np.int32(0x7F800000):
            m = np.int32(mb).view(np.float32)
            return _pow2_ceil(m) if norm_kind == NORM_POW2 else m
    n8 = n // _LANES * _LANES
    if norm_kind == NORM_L2 or norm_kind == NORM_P:
        lanes = np.zeros(_LANES, np.float64)
        if norm_kind == NORM_L2:
            _sumsq_lanes(x, lo, n8, lanes)
        else:
            for i in range(0, n8, _LANES):
                for j in range(_LANES):
                    lanes[j] += _abs_pow(np.float64(xs[i + j]), p)
        for i in range(n8, n):
            v = np.float64(xs[i])
            lanes[i - n8] += v * v if norm_kind == NORM_L2 else _abs_pow(v, p)
        acc = 0.0
        for j in range(_LANES):
            acc += lanes[j]
        if norm_kind == NORM_L2:
            return np.float32(np.sqrt(acc))
        return np.float32(acc if p == 1.0 else acc ** (1.0 / p))  # as the CUDA kernel does
    # max and pow2 with a non-finite value: max() skips NaN, so non-finite values are tracked
    # by x - x (NaN for them)
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
        m = _pow2_ceil(m)
    if m != m:  # one NaN pattern whatever the platform's inf - inf gives (x86: sign set)
        m = np.float32(np.nan)
    return m


@numba.njit(inline="always")
def _abs_pow(v, p):
    """|v| ** p in float64; p = 1 skips pow (pow(a, 1) == a exactly)."""
    return np.abs(v) if p == 1.0 else np.abs(v) ** p


@numba.njit(inline="always")
def _pow2_ceil(m):
    """Smallest power of two >= m for finite m >= 0 (2^-126 for subnormal m; inf above 2^127);
    0 stays 0."""
    if m > 0:
        b = np.uint32(np.float32(m).view(np.uint32))
        ex = b >> np.uint32(23)
        if ex == 0:
            ex = np.uint32(1)
        elif b & np.uint32(0x7FFFFF):
            ex += np.uint32(1)
        m = np.uint32(ex << np.uint32(23)).view(np.float32)
    return m


@numba.njit(inline="always")
def _round_uniform(xs, cs, base, sc, s, sign_bit, kb, k1):
    """Codes for xs (element indices base, base + 1, ...) on the grid {j/s}: level floor(t) or
    floor(t) + 1, t = |x| s / sc. Everything stays in 32-bit lanes (8 per AVX2 vector)."""
    fs = np.float32(s)
    mult = fs / sc
    for j in range(xs.size):
        v = xs[j]
        t = min(np.abs(v) * mult, fs)
        lvl = np.int32(t)
        frac = t - np.float32(lvl)
        u = u24_float(hash32_at(base, j, kb, k1))
        mag = np.int32(lvl + np.int32(u < frac))
        cs[j] = np.uint8(mag | (sign_bit if (v < 0) & (mag != 0) else np.int32(0)))


@numba.njit(inline="always")
def _round_geometric(xs, cs, base, sc, s, sign_bit, kb, k1):
    """Codes for xs on {0, 2^(1-s), ..., 1/2, 1}: code c >= 1 stands for 2^(c - s).

    Above the smallest level the rounding probability is the float's mantissa fraction,
    compared as an integer with 23 random bits (exact); below it, r * 2^(s-1) vs 24 bits.
    """
    inv = np.float32(1.0) / sc
    low_mult = np.float32(2.0) ** np.float32(s - 1)
    top_shift = np.int32(s - 127)
    for j in range(xs.size):
        v = xs[j]
        r = min(np.abs(v) * inv, np.float32(1.0))
        h = hash32_at(base, j, kb, k1)
        rb = np.int32(np.float32(r).view(np.uint32))
        # code of the lower power of two 2^e is e + s; 127 is the float32 exponent bias
        lower = np.int32(np.int32(rb >> 23) + top_shift)
        up_hi = np.int32(np.int32(h >> np.uint32(9)) < np.int32(rb & 0x7FFFFF))
        up_lo = np.int32(u24_float(h) < r * low_mult)
        mag = np.int32(lower + up_hi) if lower >= 1 else up_lo
        cs[j] = np.uint8(mag | (sign_bit if (v < 0) & (mag != 0) else np.int32(0)))


@numba.njit(cache=True, nogil=True)
def encode_levels(x, bucket, norm_kind, p, grid, s, bits, k0, k1, out):
    """Encode float32 ``x`` into ``out`` = [float32 scale per bucket][packed codes].

    Returns the number of bytes written. With ``bits == 8`` the codes go straight into
    ``out`` (the packed layout of 8-bit codes is the codes themselves).
    """
    n = x.size
    nb = (n + bucket - 1) // bucket
    scales = out[: 4 * nb].view(np.float32)
    codes = np.empty(PACK_BLOCK + 8, np.uint8)
    boosted = np.empty(0, np.float32)
    sign_bit = np.int32(1 << (bits - 1))
    o = 4 * nb
    next_bucket = 0
    for b0 in range(0, n, PACK_BLOCK):
        b1 = min(b0 + PACK_BLOCK, n)
        while next_bucket < nb and next_bucket * bucket < b1:
            lo = next_bucket * bucket
            scales[next_bucket] = _bucket_scale(x, lo, min(lo + bucket, n), norm_kind, p)
            next_bucket += 1
        kb = block_key(b0, k0)
        dst = out[o : o + (b1 - b0)] if bits == 8 else codes
        i = b0
        while i < b1:
            k = i // bucket
            hi = min((k + 1) * bucket, b1)
            sc = scales[k]
            cs = dst[i - b0 : hi - b0]
            if sc > 0 and np.isfinite(sc):
                xs = x[i:hi]
                if sc < _TINY_SCALE:
                    if boosted.size == 0:
                        boosted = np.empty(PACK_BLOCK, np.float32)
                    for j in range(hi - i):
                        boosted[j] = xs[j] * _TINY_BOOST
                    xs = boosted[: hi - i]
                    sc = sc * _TINY_BOOST
                base = np.uint32(i & 0xFFFFFFFF)
                if grid == MODE_UNIFORM:
                    _round_uniform(xs, cs, base, sc, s, sign_bit, kb, k1)
                else:
                    _round_geometric(xs, cs, base, sc, s, sign_bit, kb, k1)
            else:
                cs[:] = 0
            i = hi
        if bits == 8:
            o += b1 - b0
        else:
            o = pack_block(codes, b1 - b0, bits, out, o)
    return o


@numba.njit(cache=True, nogil=True)
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


@numba.njit(cache=True, nogil=True)
def combine_levels(datas, n, bucket, bits, table, inv_count, out):
    """The mean of several :func:`encode_levels` payloads (a tuple, rank order) in one pass.

    Per packing block, every payload in turn is unpacked and added into a block accumulator
    that starts at zero, and the block is scaled by ``inv_count`` into ``out``: the float32
    operations, and their order, of zeroing ``out``, :func:`decode_levels` with ``accumulate``
    per payload and a final scaling, with ``out`` written once instead of 2 + 2n passes over
    it (the accumulator stays in cache).
    """
    nb = (n + bucket - 1) // bucket
    codes = np.empty(PACK_BLOCK + 8, np.uint8)
    acc = np.empty(PACK_BLOCK, np.float32)
    offsets = np.full(len(datas), 4 * nb, np.int64)
    scales = np.empty((len(datas), nb), np.float32)
    for r in range(len(datas)):
        scales[r] = datas[r][: 4 * nb].view(np.float32)
    for b0 in range(0, n, PACK_BLOCK):
        b1 = min(b0 + PACK_BLOCK, n)
        acc[: b1 - b0] = 0
        for r in range(len(datas)):
            offsets[r] = unpack_block(datas[r], offsets[r], b1 - b0, bits, codes)
            i = b0
            while i < b1:
                k = i // bucket
                hi = min((k + 1) * bucket, b1)
                sc = scales[r, k]
                ab = acc[i - b0 : hi - b0]
                cb = codes[i - b0 : hi - b0]
                for j in range(ab.size):
                    ab[j] += table[cb[j]] * sc
                i = hi
        for j in range(b1 - b0):
            out[b0 + j] = acc[j] * inv_count
    return out
