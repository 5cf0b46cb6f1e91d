"""The element hash of the counter-based random numbers (:mod:`horovod_quant.core.rng` derives
the keys): ``hash32(index, k0, k1)`` for an element, ``u24_float`` a uniform in [0, 1) on a 24-bit
grid. Written in CUDA in ``kernels/hq_common.cuh`` too; both must change together.

The element hash is a keyed variant of Wellons' ``lowbias32`` mixer (two rounds, 32-bit
multiplies only, so it vectorizes with AVX2 ``vpmulld`` and maps to one IMAD on a GPU).
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic


def _emit_hash(builder, lo, k0, k1):
    """IR of ``mix(mix(lo * 0x9E3779B9 + k0) ^ k1)`` on i32 values (``mix`` = lowbias32)."""
    i32 = ir.IntType(32)

    def const(v):
        return ir.Constant(i32, v)

    def mix(x):
        x = builder.xor(x, builder.lshr(x, const(16)))
        x = builder.mul(x, const(0x21F0AAAD))
        x = builder.xor(x, builder.lshr(x, const(15)))
        x = builder.mul(x, const(0xD35A2D97))
        return builder.xor(x, builder.lshr(x, const(15)))

    x = mix(builder.add(builder.mul(lo, const(0x9E3779B9)), k0))
    return mix(builder.xor(x, k1))


@intrinsic
def _hash32_ir(typingctx, lo, k0, k1):
    """LLVM IR of the element hash on i32 lanes. Written as an intrinsic because numba widens
    uint32 arithmetic to 64 bits, which halves the SIMD width of the rounding loops."""
    sig = types.uint32(types.uint32, types.uint32, types.uint32)

    def codegen(context, builder, signature, args):
        return _emit_hash(builder, *args)

    return sig, codegen


@intrinsic
def hash32_at(typingctx, base, j, kb, k1):
    """:func:`hash32_lo` of the low index word ``base + j`` (mod 2**32), ``j`` an int64 loop
    counter. The add is done in i32 on the truncated counter, so a vectorized loop keeps one
    i32 induction vector instead of two i64 ones (same value as ``hash32_lo(base + j, ...)``)."""
    sig = types.uint32(types.uint32, types.int64, types.uint32, types.uint32)

    def codegen(context, builder, signature, args):
        base_, j_, kb_, k1_ = args
        lo = builder.add(base_, builder.trunc(j_, ir.IntType(32)))
        return _emit_hash(builder, lo, kb_, k1_)

    return sig, codegen


@intrinsic
def u24_float(typingctx, h):
    """``(h >> 8) * 2**-24`` as float32 via i32 ops (exact uniform on a 24-bit grid)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        v = builder.sitofp(builder.lshr(args[0], ir.Constant(i32, 8)), ir.FloatType())
        return builder.fmul(v, ir.Constant(ir.FloatType(), 1.0 / 16777216.0))

    return sig, codegen


@numba.njit(inline="always")
def block_key(start, k0):
    """First key half for indices sharing ``start >> 32`` (fold the high word once per block)."""
    return np.uint32(k0 ^ np.uint32((np.uint64(start) >> np.uint64(32)) * np.uint64(0x85EBCA6B)
                                    & np.uint64(0xFFFFFFFF)))


@numba.njit(inline="always")
def hash32(index, k0, k1):
    """32 random bits for element ``index`` under key halves ``(k0, k1)``.

    ``hash32(i, k0, k1) == mix(mix(lo(i) * 0x9E3779B9 + (k0 ^ hi(i) * 0x85EBCA6B)) ^ k1)`` with
    ``mix`` the lowbias32 round; inner loops hoist the high-word fold with :func:`block_key`
    and call :func:`hash32_lo`.
    """
    return _hash32_ir(np.uint32(np.uint64(index) & np.uint64(0xFFFFFFFF)), block_key(index, k0), k1)


@numba.njit(inline="always")
def hash32_lo(lo, kb, k1):
    """:func:`hash32` for an index whose high word is already folded into ``kb``."""
    return _hash32_ir(np.uint32(lo), kb, k1)


@numba.njit(cache=True, nogil=True)
def uniform24(n, k0, k1, start=0):
    """``n`` uniforms in [0, 1) with 24-bit resolution (exact float32), for tests and NumPy
    codecs. Kernels call :func:`hash32` inline instead of materializing this array."""
    out = np.empty(n, np.float32)
    for i in range(n):
        out[i] = u24_float(hash32(np.uint64(start + i), k0, k1))
    return out


def uniforms(n: int, key: int, start: int = 0) -> np.ndarray:
    """Uniform [0, 1) float32 draws for element indices ``start .. start+n-1`` under ``key``."""
    k0, k1 = np.uint32(key & 0xFFFFFFFF), np.uint32(key >> 32)  # rng.split_key
    return uniform24(int(n), k0, k1, int(start))
