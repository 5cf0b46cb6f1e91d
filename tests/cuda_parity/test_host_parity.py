"""CPU/GPU parity without a GPU: the kernels' code compiled for the host against numba.

``conftest.py`` builds ``host_parity.cu`` with nvcc: the __host__ __device__ functions and
block programs of ``kernels/*.cuh`` (the exact code the CUDA kernels run), replayed thread by
thread and block by block on the CPU. ``CudaBackend(HostBackend)`` (the ``host_cuda`` fixture)
drives them through the same Python launch logic as the GPU (``horovod_quant.backends.cuda``),
and :func:`on` runs a codec method on it. Every comparison is bit for bit:
payload bytes, and float32 results compared as uint32 patterns.

What this cannot see (covered by tests/gpu on a GPU): the CUDA launch itself (grid/block
shapes, shared-memory declarations), device-only intrinsics, and the NVRTC compile (checked
below for .ftz / fma when libnvrtc is present).
"""
from __future__ import annotations

import ctypes
import glob
import math
import os
import re
import subprocess
import sys

import numba
import numpy as np
import pytest

import horovod_quant as hq
from horovod_quant.backends import (
    MODE_DITHER,
    MODE_EXP,
    MODE_GEOMETRIC,
    MODE_NESTED,
    MODE_UNIFORM,
    NORM_L2,
    NORM_MAX,
    NORM_P,
    NORM_POW2,
    SCALED_MODES,
    numba_backend,
    use_backend,
)
from horovod_quant.backends.cuda.specs import (
    CODE_BITS,
    FAST_BITS,
    MODE_NAMES,
    block_encode_kernel,
    decode_kernel,
    exp_combine_kernel,
    kernel_names,
    tile_encode_kernel,
    tile_encode_specs,
)
from horovod_quant.backends.numba import global_qsgd as NG
from horovod_quant.backends.numba import packing
from horovod_quant.backends.numba import rng as NR
from horovod_quant.core import exponent_reduction
from horovod_quant.core import rng as R
from horovod_quant.core.base import as_vector, worker_seed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PB = packing.PACK_BLOCK
SIZES = [0, 1, 7, 8, 9, 8191, 8192, 8193, 2 * PB + 17]
INF = float("inf")


# -- numba references ------------------------------------------------------------------------
@numba.njit(cache=True)
def _nb_hash(idx, k0, k1):
    out = np.empty(idx.size, np.uint32)
    for i in range(idx.size):
        out[i] = NR.hash32(idx[i], k0, k1)
    return out


@numba.njit(cache=True)
def _nb_hash_lo(lo, kb, k1):
    out = np.empty(lo.size, np.uint32)
    for i in range(lo.size):
        out[i] = NR.hash32_lo(lo[i], kb, k1)
    return out


@numba.njit(cache=True)
def _nb_block_key(starts, k0):
    out = np.empty(starts.size, np.uint32)
    for i in range(starts.size):
        out[i] = NR.block_key(starts[i], k0)
    return out


@numba.njit(cache=True)
def _nb_u24(h):
    out = np.empty(h.size, np.float32)
    for i in range(h.size):
        out[i] = NR.u24_float(h[i])
    return out


@numba.njit(cache=True)
def _nb_combine(a, b, h, smask):
    out = np.empty(a.size, np.int32)
    for i in range(a.size):
        out[i] = NG._combine_lanes(a[i], b[i], h[i], smask)
    return out


def _mix32(x: int) -> int:
    """lowbias32 in Python (rng.py)."""
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0xD35A2D97) & 0xFFFFFFFF
    return x ^ (x >> 15)


def _k1_for_zero_hash(index: int, k0: int) -> int:
    """The k1 that makes hash32(index, k0, k1) == 0 (mix is a bijection with mix(0) = 0)."""
    kb = k0 ^ (((index >> 32) * 0x85EBCA6B) & 0xFFFFFFFF)
    return _mix32(((index & 0xFFFFFFFF) * 0x9E3779B9 + kb) & 0xFFFFFFFF)


def on(backend, method, *args, **kwargs):
    """``method(*args, **kwargs)`` (a codec method) with its NumPy arrays on ``backend``: the
    way these tests choose the host-replayed CUDA backend."""
    with use_backend(backend):
        return method(*args, **kwargs)


def same(a, b) -> bool:
    """Bit-identical arrays (float32 compared as bit patterns)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == np.float32:
        return bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))
    if a.dtype == np.float64:
        return bool(np.array_equal(a.view(np.uint64), b.view(np.uint64)))
    return bool(np.array_equal(a, b))


def same_nan(a, b) -> bool:
    """Bit-identical except that any NaN matches any NaN (NaN payload bits are platform's)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    na, nb = np.isnan(a), np.isnan(b)
    return bool(np.array_equal(na, nb)) and same(np.where(na, 0, a), np.where(nb, 0, b))


def first_diff(a, b) -> str:
    a, b = np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)
    if a.size != b.size:
        return f"sizes {a.size} != {b.size}"
    d = np.flatnonzero(a.view(np.uint8) != b.view(np.uint8)) if a.dtype == b.dtype else []
    return f"first differing bytes at {d[:8]}"


# -- data ------------------------------------------------------------------------------------
def gen(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    if kind == "normal" or n == 0:
        return x
    if kind == "special":
        # zero runs, tiny buckets (scale < 2^-100: the boosted path), subnormals, huge values,
        # exact powers of two, negative zeros, one dominant element
        segs = np.array_split(np.arange(n), 8)
        x[segs[0]] = 0.0
        x[segs[1]] *= np.float32(1e-33)
        x[segs[2]] = (rng.standard_normal(segs[2].size) * 1e-41).astype(np.float32)
        x[segs[3]] *= np.float32(1e30)
        x[segs[4]] = np.ldexp(1.0, rng.integers(-30, 3, segs[4].size)).astype(np.float32) * \
            rng.choice([-1, 1], segs[4].size).astype(np.float32)
        x[segs[5]] = -0.0
        if segs[6].size:
            x[segs[6][0]] = np.float32(1e4)
        return x
    if kind == "nonfinite":
        pos = rng.choice(n, size=max(1, n // 997), replace=False)
        x[pos[::2]] = np.nan
        x[pos[1::2]] = np.inf
        if n > 3:
            x[3] = -np.inf
        return x
    raise ValueError(kind)


# -- primitives ------------------------------------------------------------------------------
def test_splitmix_and_derive_key(hostlib):
    rng = np.random.default_rng(0)
    seeds = [0, 1, 7, 2 ** 63, 2 ** 64 - 1] + [int(v) for v in rng.integers(0, 2 ** 63, 50)]
    for s in seeds:
        assert hostlib.hqh_splitmix64(s) == R.splitmix64(s)
    for fields in [(), (1,), (3, -1), (0x7A4B, 5), (-(2 ** 40), 2 ** 63 + 5, 9)]:
        for s in seeds[:10]:
            f = np.array([v & (2 ** 64 - 1) for v in fields] or [0], np.uint64)
            assert hostlib.hqh_derive_key(s, f.ctypes.data, len(fields)) == R.derive_key(s, *fields)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2 ** 64 - 1])
def test_hash32_u24_block_key(hostlib, seed):
    k0, k1 = R.split_key(R.derive_key(seed))
    rng = np.random.default_rng(seed % 1000)
    idx = np.concatenate([
        np.arange(0, 20000, dtype=np.uint64),
        np.arange(2 ** 32 - 5000, 2 ** 32 + 5000, dtype=np.uint64),  # high-word change
        np.arange(3 * 2 ** 32 - 10, 3 * 2 ** 32 + 10, dtype=np.uint64),
        rng.integers(0, 2 ** 63, 20000, dtype=np.uint64),
        np.array([2 ** 64 - 1, 2 ** 63, 2 ** 40], np.uint64),
    ])
    out = np.empty(idx.size, np.uint32)
    hostlib.hqh_hash32(idx.ctypes.data, idx.size, int(k0), int(k1), out.ctypes.data)
    assert same(out, _nb_hash(idx, k0, k1))

    lo = rng.integers(0, 2 ** 32, 5000, dtype=np.uint64).astype(np.uint32)
    kb = np.uint32(rng.integers(0, 2 ** 32))
    hostlib.hqh_hash32_lo(lo.ctypes.data, lo.size, int(kb), int(k1), out.ctypes.data)
    assert same(out[: lo.size], _nb_hash_lo(lo, kb, k1))

    starts = idx[::7].copy()
    bk = np.empty(starts.size, np.uint32)
    hostlib.hqh_block_key(starts.ctypes.data, starts.size, int(k0), bk.ctypes.data)
    assert same(bk, _nb_block_key(starts, k0))

    h = np.concatenate([out, np.array([0, 1, 255, 256, 2 ** 31, 2 ** 32 - 1], np.uint32)])
    u = np.empty(h.size, np.float32)
    hostlib.hqh_u24(h.ctypes.data, h.size, u.ctypes.data)
    assert same(u, _nb_u24(h))
    # and the uniforms the CPU codecs use
    first = np.arange(1000, dtype=np.uint64)  # kept alive: ctypes holds only the address
    hostlib.hqh_hash32(first.ctypes.data, 1000, int(k0), int(k1), out.ctypes.data)
    hostlib.hqh_u24(out.ctypes.data, 1000, u.ctypes.data)
    assert same(u[:1000], NR.uniforms(1000, R.derive_key(seed)))


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_unpack(hostlib, host_cuda, host_cuda_small, bits):
    rng = np.random.default_rng(bits)
    for n in SIZES + [PB - 1, 3 * PB + 1, 5]:
        assert hostlib.hqh_packed_nbytes(n, bits) == packing.packed_nbytes(n, bits)
        codes = rng.integers(0, 1 << bits, n).astype(np.uint8)
        ref = packing.pack(codes, bits)
        for ops in (host_cuda, host_cuda_small):
            out = np.full(ref.size, 0xAB, np.uint8)
            if n:
                ops.kernels.pack(codes, n, bits, out)
            assert same(out, ref), (bits, n, first_diff(out, ref))
        back = np.empty(n, np.uint8)
        host_cuda.kernels.unpack(ref, n, bits, back)
        assert same(back, packing.unpack(ref, n, bits)) and same(back, codes)


# -- level quantizers ------------------------------------------------------------------------
LEVEL_SPECS = [
    ("qsgd", {"norm": "l2"}), ("qsgd", {"norm": "max"}), ("qsgd", {"levels": 3}),
    ("standard_dithering", {"p": 1.0}), ("standard_dithering", {"p": 3.0}),
    ("standard_dithering", {"p": INF}), ("nuqsgd", {}), ("natural_dithering", {}),
    ("natural_dithering", {"p": 1.0}), ("natural", {}),
]
BUCKETS = [1, 3, 8, 100, 512, PB, PB + 1, 20000, None]


def _level_codec(name, kw, bits, bucket):
    try:
        return hq.get_codec(name, bits=bits, bucket_size=bucket, **kw)
    except ValueError:
        return None


def _sizes_for(bucket):
    extra = [] if bucket is None else [bucket - 1, bucket, bucket + 1]
    return sorted(set(SIZES + [s for s in extra if 0 <= s <= 3 * PB]))


def _check_levels(ops, codec, x, seed, nonfinite=False):
    ref = codec.encode(x, seed=seed)
    got = on(ops, codec.encode, x, seed=seed)
    n = x.size
    nb = -(-n // codec._bucket(n)) if n else 0
    where = f"{codec!r} n={n}"
    if nonfinite:
        assert same_nan(got.data[: 4 * nb].view(np.float32),
                        ref.data[: 4 * nb].view(np.float32)), where
        assert same(got.data[4 * nb:], ref.data[4 * nb:]), where
    else:
        assert same(got.data, ref.data), f"{where}: {first_diff(got.data, ref.data)}"
    cmp = same_nan if nonfinite else same
    assert cmp(on(ops, codec.decode, got), codec.decode(ref)), where
    base = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    a, b = base.copy(), base.copy()
    assert cmp(on(ops, codec.decode_add, got, a), codec.decode_add(ref, b)), where


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("spec", LEVEL_SPECS,
                         ids=lambda s: f"{s[0]}-{'-'.join(map(str, s[1].values()))}")
def test_levels_encode_decode(host_cuda, spec, bits):
    name, kw = spec
    ran = 0
    for bucket in BUCKETS:
        codec = _level_codec(name, kw, bits, bucket)
        if codec is None:
            continue
        for n in _sizes_for(bucket):
            _check_levels(host_cuda, codec, gen("normal", n, n + bits), seed=n * 31 + bits)
            ran += 1
    if ran == 0:
        pytest.skip(f"{name} has no {bits}-bit configuration")


@pytest.mark.parametrize("kind", ["special", "nonfinite"])
@pytest.mark.parametrize("spec", LEVEL_SPECS,
                         ids=lambda s: f"{s[0]}-{'-'.join(map(str, s[1].values()))}")
def test_levels_special_values(host_cuda, spec, kind):
    name, kw = spec
    for bits in (3, 4, 8):
        for bucket in (16, 100, 512, None):
            codec = _level_codec(name, kw, bits, bucket)
            if codec is None:
                continue
            for n in (9, 1000, PB + 3, 3 * PB):
                _check_levels(host_cuda, codec, gen(kind, n, bits * n), seed=bits,
                              nonfinite=kind == "nonfinite")


@pytest.mark.parametrize("spec", [("qsgd", {}), ("natural", {}), ("nuqsgd", {}),
                                  ("standard_dithering", {"p": 3.0})], ids=lambda s: s[0])
def test_levels_block_size_independent(host_cuda_small, spec):
    """The same bytes with 64-thread blocks: no result depends on the thread layout."""
    name, kw = spec
    for bits in (3, 4, 8):
        for bucket in (3, 100, 512, PB + 1, None):
            codec = _level_codec(name, kw, bits, bucket)
            for n in (0, 9, PB + 1, 2 * PB + 17):
                _check_levels(host_cuda_small, codec, gen("special", n, n), seed=7)


@pytest.mark.parametrize("npay", [1, 2, 5])
@pytest.mark.parametrize("spec", [("qsgd", {}), ("natural", {}), ("natural_dithering", {})],
                         ids=lambda s: s[0])
def test_levels_combine_gathered(host_cuda, spec, npay):
    name, kw = spec
    for bits in (2, 4, 8):
        codec = _level_codec(name, kw, bits, 512)
        if codec is None:
            continue
        for n in (1, 9, PB + 1):
            pays = [codec.encode(gen("normal", n, r), worker_seed(3, r)) for r in range(npay)]
            assert same(on(host_cuda, codec.combine_gathered, pays, 3),
                        codec.combine_gathered(pays, 3))


def test_float64_and_float16_inputs(host_cuda):
    rng = np.random.default_rng(5)
    x64 = np.concatenate([rng.standard_normal(1000), [1e-40, -3e-45, 1e-46, 1e39, 2.5e-39]])
    assert same(host_cuda.vector(x64), as_vector(x64))
    x16 = rng.standard_normal(1000).astype(np.float16)
    assert same(host_cuda.vector(x16), as_vector(x16))
    for norm in ("l2", "max"):  # 1e39 is Inf in float32: max-norm's NaN scale, one pattern
        codec = hq.get_codec("qsgd", bits=4, norm=norm)
        assert same(on(host_cuda, codec.encode, x64, 1).data, codec.encode(x64, 1).data)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_baselines(host_cuda):
    x = gen("special", 3000, 1)
    x[5] = np.nan
    for name in ("none", "fp16", "bf16"):  # (fp16 overflows for the 1e30 values: inf, as on CPU)
        codec = hq.get_codec(name)
        ref, got = codec.encode(x), on(host_cuda, codec.encode, x)
        assert same_nan(got.data.view(np.uint8), ref.data.view(np.uint8)) or \
            same(got.data, ref.data), name
        assert same_nan(on(host_cuda, codec.decode, got), codec.decode(ref)), name


# -- Global-QSGD -----------------------------------------------------------------------------
GQ_CONFIGS = [("linear", "dense", "tree"), ("exponential", "dense", "tree"),
              ("exponential", "dense", "ring"), ("linear", "sparse", "tree"),
              ("exponential", "sparse", "tree")]


@pytest.mark.parametrize("norm", ["max", "l2"])
@pytest.mark.parametrize("cfg", GQ_CONFIGS, ids=lambda c: "-".join(c))
def test_global_qsgd(host_cuda, cfg, norm):
    levels, mode, reduction = cfg
    ran = 0
    for world in (1, 2, 3, 4, 5):
        for bits in (2, 3, 4, 5, 8, 12, 16):
            try:
                codec = hq.get_codec("global_qsgd", world_size=world, bits=bits, levels=levels,
                                     norm=norm, mode=mode, reduction=reduction)
            except ValueError:
                continue
            for n in (0, 1, 9, PB + 1, 3 * PB + 5, 40000):
                xs = [gen("special" if (n + world) % 3 == 0 else "normal", n, 10 * world + r)
                      for r in range(world)]
                stats = [on(host_cuda, codec.norm_statistic, x) for x in xs]
                assert stats == [codec.norm_statistic(x) for x in xs]
                g = codec.global_norm(xs)
                ref = [codec.encode_worker(x, 11, r, g) for r, x in enumerate(xs)]
                got = [on(host_cuda, codec.encode, x, worker_seed(11, r), norm=g)
                       for r, x in enumerate(xs)]
                where = f"{codec!r} n={n}"
                for a, b in zip(got, ref):
                    assert same(a.data, b.data), f"{where}: {first_diff(a.data, b.data)}"
                assert same(on(host_cuda, codec.decode, got[0]), codec.decode(ref[0])), where
                acc = gen("normal", n, 99)
                assert same(on(host_cuda, codec.decode_add, got[-1], acc.copy()),
                            codec.decode_add(ref[-1], acc.copy())), where
                assert same(on(host_cuda, codec.combine_gathered, got, 11),
                            codec.combine_gathered(ref, 11)), where
                # own-norm encode (norm=None) and a zero / non-finite norm
                assert same(on(host_cuda, codec.encode, xs[0], 5).data, codec.encode(xs[0], 5).data)
                tiny = xs[0] * np.float32(1e-34)  # norm below 2^-100: the boosted path
                assert same(on(host_cuda, codec.encode, tiny, 5).data, codec.encode(tiny, 5).data)
                for bad in (0.0, np.inf, np.nan, 1e-38):
                    assert same(on(host_cuda, codec.encode, xs[0], 5, norm=bad).data,
                                codec.encode(xs[0], 5, norm=bad).data), (where, bad)
                ran += 1
    assert ran


def test_norm_statistics_nonfinite(host_cuda):
    for norm in ("max", "l2"):
        codec = hq.get_codec("global_qsgd", world_size=2, norm=norm)
        for kind in ("special", "nonfinite"):
            x = gen(kind, 5000, 3)
            a, b = on(host_cuda, codec.norm_statistic, x), codec.norm_statistic(x)
            assert (math.isnan(a) and math.isnan(b)) or a == b, (norm, kind, a, b)


# -- exponent combination --------------------------------------------------------------------
def _random_exp_codes(rng, n, bits, top=None):
    top = (1 << (bits - 1)) - 1 if top is None else top
    e = rng.integers(0, top + 1, n)
    e[rng.random(n) < 0.2] = 0
    sign = rng.integers(0, 2, n) << (bits - 1)
    return np.where(e > 0, e | sign, 0).astype(np.uint8)


@pytest.mark.parametrize("bits", range(2, 9))
def test_exp_combine(host_cuda, host_cuda_small, bits):
    rng = np.random.default_rng(bits)
    for size, i0 in ((1, 0), (9, 0), (PB, 0), (PB + 5, 0), (3 * PB + 17, PB), (2 * PB, 2 * PB)):
        a = packing.pack(_random_exp_codes(rng, size, bits), bits)
        b = packing.pack(_random_exp_codes(rng, size, bits), bits)
        lo, hi = exponent_reduction.packed_range(i0, size, size, bits)
        k0, k1 = (int(v) for v in R.split_key(R.derive_key(size, bits)))
        ref = a.copy()
        NG.exp_combine(ref[lo:hi], b[lo:hi], ref[lo:hi], size - i0, i0, bits, k0, k1)
        for ops in (host_cuda, host_cuda_small):
            got = a.copy()  # combined in place (out aliases a)
            ops.kernels.launched.clear()
            ops.exp_combine(got[lo:hi], b[lo:hi], got[lo:hi], size - i0, i0, bits, k0, k1)
            assert same(got, ref), (bits, size, i0, first_diff(got, ref))
            words = bits in FAST_BITS and size - i0 >= PB  # the word program on full blocks
            assert (exp_combine_kernel(True, bits) in ops.kernels.launched) == words


@pytest.mark.parametrize("bits", range(2, 9))
def test_combine_codes_exhaustive(hostlib, bits):
    """Algorithm 2 on every pair of codes for a spread of random digit words h."""
    smask = 1 << (bits - 1)
    codes = np.arange(1 << bits, dtype=np.int32)
    a, b = (v.reshape(-1).astype(np.int32) for v in np.meshgrid(codes, codes))
    for h in (0, 1, 2, 0x7FFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF, 0x12345678):
        hv = np.full(a.size, h, np.uint32)
        ref = _nb_combine(a, b, hv, np.int32(smask))
        got = np.array([hostlib.hqh_combine_codes(int(x), int(y), h, smask)
                        for x, y in zip(a, b)], np.int32)
        assert same(got, ref), (bits, h)


@pytest.mark.parametrize("bits", [2, 4, 6, 8])
def test_exp_combine_rare_exact_path(host_cuda, bits):
    """Elements whose first 32 random digits are zero take the exact path (digit words
    t = 1, 2, 3): force h == 0 at chosen elements through the key and compare."""
    rng = np.random.default_rng(100 + bits)
    top = (1 << (bits - 1)) - 1
    size = 2 * PB + 40
    for target in (5, PB + 3, 2 * PB + 39):
        for _ in range(6):
            k0 = int(rng.integers(0, 2 ** 32))
            k1 = _k1_for_zero_hash(target, k0)
            assert _nb_hash(np.array([target], np.uint64), np.uint32(k0), np.uint32(k1))[0] == 0
            ca = _random_exp_codes(rng, size, bits)
            cb = _random_exp_codes(rng, size, bits)
            # a large exponent gap (diff > 32 when bits allow) and the other cases at target
            e1 = int(rng.integers(1, top + 1))
            e2 = int(rng.integers(1, top + 1)) if rng.random() < 0.5 else top
            ca[target] = e1 | (int(rng.integers(0, 2)) << (bits - 1))
            cb[target] = (1 if top > 1 else e2) if rng.random() < 0.3 else e2
            a, b = packing.pack(ca, bits), packing.pack(cb, bits)
            ref = a.copy()
            NG.exp_combine(ref, b, ref, size, 0, bits, k0, k1)
            got = a.copy()
            host_cuda.exp_combine(got, b, got, size, 0, bits, k0, k1)
            assert same(got, ref), (bits, target, ca[target], cb[target])


def test_reduce_packed_matches(host_cuda):
    rng = np.random.default_rng(9)
    for reduction in ("tree", "ring"):
        for n in (2, 3, 5, 8):
            for size in (1, PB + 3, 5 * PB + 9):
                bufs = [packing.pack(_random_exp_codes(rng, size, 8, top=20), 8) for _ in range(n)]
                ref = exponent_reduction.reduce_packed(bufs, size, 8, 77, reduction)
                got = on(host_cuda, exponent_reduction.reduce_packed, bufs, size, 8, 77, reduction)
                assert same(got, ref), (reduction, n, size)


# -- DQSG / NDQSG ----------------------------------------------------------------------------
@pytest.mark.parametrize("bits", range(2, 9))
def test_dithered(host_cuda, bits):
    for bucket in (1, 100, 512, PB + 1, None):
        codec = hq.get_codec("dithered", bits=bits, bucket_size=bucket)
        for n in _sizes_for(bucket)[::2] + [2 * PB + 17]:
            for kind in ("normal", "special"):
                x = gen(kind, n, n + bits)
                ref, got = codec.encode(x, 3), on(host_cuda, codec.encode, x, 3)
                assert same(got.data, ref.data), (bits, bucket, n, kind)
                assert same(on(host_cuda, codec.decode, got), codec.decode(ref))
                acc = gen("normal", n, 1)
                assert same(on(host_cuda, codec.decode_add, got, acc.copy()),
                            codec.decode_add(ref, acc.copy()))
        pays = [codec.encode(gen("normal", 1000, r), worker_seed(4, r)) for r in range(3)]
        assert same(on(host_cuda, codec.combine_gathered, pays, 4), codec.combine_gathered(pays, 4))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_nested_dithered(host_cuda, world, bits):
    rng = np.random.default_rng(world * 10 + bits)
    for alpha in (1.0, 0.7):
        for k in (None, 3, 5):
            kw = dict(world_size=world, bits=bits, alpha=alpha, coarse_ratio=k, bucket_size=512)
            try:
                c_cpu = hq.get_codec("nested_dithered", **kw)
                c_gpu = hq.get_codec("nested_dithered", **kw)
            except ValueError:
                continue
            for n in (1, 9, 600, PB + 1, 2 * PB + 17):
                s_cpu, s_gpu = c_cpu.new_state(), c_gpu.new_state()  # the exchange's state
                base = rng.standard_normal(n).astype(np.float32)
                xs = [base + np.float32(0.05) * rng.standard_normal(n).astype(np.float32)
                      for _ in range(world)]
                if n > 600:
                    xs[-1][:512] = 0.0  # a zero bucket in a P2 payload
                    xs[-1][700] = np.nan  # a non-finite one
                for rnd in range(2):  # the second exchange uses the adapted k
                    seed = 9 + rnd
                    ref = [c_cpu.encode_worker(x, seed, r, state=s_cpu)
                           for r, x in enumerate(xs)]
                    got = [on(host_cuda, c_gpu.encode, x, worker_seed(seed, r), rank=r,
                              state=s_gpu) for r, x in enumerate(xs)]
                    for a, b in zip(got, ref):
                        nb = -(-n // 512)
                        assert same_nan(a.data[4: 4 + 4 * nb].view(np.float32),
                                        b.data[4: 4 + 4 * nb].view(np.float32))
                        assert (same(a.data[:4], b.data[:4])
                                and same(a.data[4 + 4 * nb:], b.data[4 + 4 * nb:]))
                    seeds = [worker_seed(seed, r) for r in range(world)]
                    e_ref = c_cpu.decode_side_info(ref, seeds, inputs=xs, state=s_cpu)
                    e_got = on(host_cuda, c_gpu.decode_side_info, got, seeds, inputs=xs,
                               state=s_gpu)
                    assert same_nan(e_got, e_ref), (world, bits, alpha, k, n, rnd)
                    assert s_gpu.sigma2 == s_cpu.sigma2 or (math.isinf(s_gpu.sigma2)
                                                            and math.isinf(s_cpu.sigma2))
                    assert s_gpu.last_stats == s_cpu.last_stats
                    if n <= 600:
                        assert same(on(host_cuda, c_gpu.decode, got[0]), c_cpu.decode(ref[0]))


# -- every specialisation, at the backend entry points -----------------------------------------
# The warp-tile encode and the word decode take full packing blocks of 4- and 8-bit codes; the
# generic programs the rest. Each test names the entry point it must have replayed
# (HostBackend.launched), so every compiled specialisation is compared with numba bit for bit.
SPEC_SIZES = [0, 1, 7, 8191, 8192, 8193, 2 * PB + 17, 5 * PB]
DATA_KINDS = ("normal", "special", "nonfinite")


def _encode_params(mode: int, kind: int, bits: int) -> dict:
    """``Backend.encode`` keywords of a codec of ``mode`` with ``bits``-bit codes (NESTED: the
    P2 code width, k = 2^bits - 1 of 127 fine levels; alpha 0.7)."""
    if mode == MODE_UNIFORM:
        return {"norm_kind": kind, "p": 3.0, "s": hq.get_codec("qsgd", bits=bits).s}
    if mode == MODE_GEOMETRIC:
        return {"norm_kind": kind, "p": 3.0,
                "s": hq.get_codec("natural_dithering", bits=bits).s}
    if mode == MODE_EXP:
        codec = hq.get_codec("global_qsgd", world_size=1, bits=bits, levels="exponential")
        return {"s": codec.s, "c": codec.c}
    if mode == MODE_DITHER:
        M = (1 << (bits - 1)) - 1
        return {"M": M, "am": float(M)}
    return {"M": 127, "k": (1 << bits) - 1, "am": float(np.float32(0.7 * 127))}


def _payload_size(mode: int, n: int, bucket: int, bits: int, offset: int) -> int:
    nb = -(-n // bucket) if n else 0
    return offset + (4 * nb if mode in SCALED_MODES else 0) + packing.packed_nbytes(n, bits)


def _check_encode(ops, mode, bits, x, bucket, seed, offset=0, **kw):
    """Encode x on both backends into buffers prefilled alike; compare every byte (scales:
    any NaN matches any NaN). Returns the numba payload."""
    n = x.size
    keys = R.split_key(R.derive_key(seed))
    size = _payload_size(mode, n, bucket, bits, offset)
    ref = np.full(size, 0xCD, np.uint8)
    got = ref.copy()
    numba_backend().encode(x, ref, offset, bucket, mode, bits, keys, **kw)
    ops.encode(x, got, offset, bucket, mode, bits, keys, **kw)
    nb = 4 * -(-n // bucket) if n and mode in SCALED_MODES else 0
    where = f"mode={MODE_NAMES[mode]} bits={bits} n={n} bucket={bucket} {kw}"
    sc = slice(offset, offset + nb)
    assert same_nan(got[sc].view(np.float32), ref[sc].view(np.float32)), where
    assert same(got[: offset], ref[: offset]) and same(got[offset + nb:], ref[offset + nb:]), \
        f"{where}: {first_diff(got, ref)}"
    return ref


@pytest.mark.parametrize("spec", tile_encode_specs(),
                         ids=lambda s: tile_encode_kernel(*s).replace("hq_encode_tile_", ""))
def test_tile_encode_specialisation(host_cuda, spec):
    """Every warp-tile encode: buckets 4 .. 512, sizes around and across packing blocks,
    special and non-finite values, against numba; the tile ran on the full blocks."""
    mode, kind, bits = spec
    name = tile_encode_kernel(mode, kind, bits)
    kw = _encode_params(mode, kind, bits)
    launched = host_cuda.kernels.launched
    for bucket in ([PB] if mode == MODE_EXP else [4, 8, 32, 128, 256, 512]):
        edges = [3 * PB + bucket - 1, 3 * PB + bucket, 3 * PB + bucket + 1]
        for n in SPEC_SIZES + edges:
            for i, data in enumerate(DATA_KINDS):
                x = gen(data, n, n + bits + i)
                if mode == MODE_EXP:
                    amax = float(np.max(np.abs(x))) if n else 0.0
                    kw["gnorm"] = float(np.float32(2 * amax)) if math.isfinite(amax) else amax
                launched.clear()
                _check_encode(host_cuda, mode, bits, x, bucket, seed=n + i,
                              offset=4 if mode == MODE_NESTED else 0, **kw)
                assert (name in launched) == (n >= PB), (name, n, launched)
    if mode == MODE_EXP:  # zero, non-finite and tiny (boosted) global norms
        x = gen("normal", 3 * PB + 5, 1)
        for gnorm in (0.0, math.inf, math.nan, 1e-38, 5e-31):
            _check_encode(host_cuda, mode, bits, x, PB, seed=2, **{**kw, "gnorm": gnorm})


@pytest.mark.parametrize("bits", CODE_BITS)
@pytest.mark.parametrize("mode", list(MODE_NAMES), ids=lambda m: MODE_NAMES[m])
def test_block_encode_specialisation(host_cuda, host_cuda_small, mode, bits):
    """Every generic encode: buckets that are not powers of two, straddle packing blocks or
    hold the whole vector; every scale kind; bits 4 / 8 where the tile cannot run (tails,
    odd buckets, misaligned input); 256- and 64-thread blocks."""
    name = block_encode_kernel(mode, bits)
    kinds = [NORM_MAX] if mode in (MODE_EXP, MODE_DITHER, MODE_NESTED) else \
        [NORM_L2, NORM_MAX, NORM_P, NORM_POW2]
    buckets = [1, 3, 100, 512, PB, PB + 1, 20000]
    for kind in kinds:
        kw = _encode_params(mode, kind, bits)
        for ops in (host_cuda, host_cuda_small):
            for bucket in buckets:
                for n in (9, PB + 3, 3 * PB + 5):
                    x = gen("special" if n % 2 else "normal", n, n + bucket)
                    if mode == MODE_EXP:
                        kw["gnorm"] = float(np.float32(1.5 * np.max(np.abs(x))))
                    ops.kernels.launched.clear()
                    _check_encode(ops, mode, bits, x, bucket, seed=bucket,
                                  offset=4 if mode == MODE_NESTED else 0, **kw)
                    assert name in ops.kernels.launched, (name, n, bucket)
            # a whole vector as one bucket (bucket_size=None)
            x = gen("normal", 2 * PB + 17, bits)
            _check_encode(ops, mode, bits, x, x.size, seed=3, **kw)
    # misaligned input: x not 16-byte aligned takes the generic program on every block
    base = gen("normal", 2 * PB + 1, bits)
    x = base[1:]
    kw = _encode_params(mode, NORM_MAX, bits)
    if mode == MODE_EXP:
        kw["gnorm"] = 7.0
    host_cuda.kernels.launched.clear()
    _check_encode(host_cuda, mode, bits, x, 512, seed=9, **kw)
    assert host_cuda.kernels.launched == [name]


def _level_payloads(bits, n, bucket, count, seed=0, kind="normal"):
    """``count`` numba payloads of qsgd-like uniform codes (max norm), and the codec table."""
    codec = hq.get_codec("qsgd", bits=bits)
    pays = []
    for r in range(count):
        x = gen(kind, n, seed + 31 * r)
        pay = np.empty(_payload_size(MODE_UNIFORM, n, bucket, bits, 0), np.uint8)
        numba_backend().encode(x, pay, 0, bucket, MODE_UNIFORM, bits,
                               R.split_key(R.derive_key(seed + r)), norm_kind=NORM_MAX,
                               s=codec.s)
        pays.append(pay)
    return pays, codec.table


def _dither_payloads(bits, n, bucket, count, seed=0):
    M = (1 << (bits - 1)) - 1
    keys = [R.split_key(R.derive_key(seed + r, 5)) for r in range(count)]
    pays = []
    for r in range(count):
        x = gen("special" if r % 2 else "normal", n, seed + 17 * r)
        pay = np.empty(_payload_size(MODE_DITHER, n, bucket, bits, 0), np.uint8)
        numba_backend().encode(x, pay, 0, bucket, MODE_DITHER, bits, keys[r], M=M, am=float(M))
        pays.append(pay)
    return pays, keys, M


def _misaligned(a: np.ndarray, shift: int) -> np.ndarray:
    """A copy of the uint8 array ``a`` that starts ``shift`` bytes past an aligned address
    (payloads inside gathered buffers can start anywhere)."""
    buf = np.zeros(a.size + 64, np.uint8)
    start = (-buf.ctypes.data) % 16 + shift
    out = buf[start: start + a.size]
    out[:] = a
    return out


def _program(bits, n, bucket_ok):
    """The decode entry points expected for n elements: words on full blocks, groups on the
    rest."""
    words = bits in FAST_BITS and bucket_ok and n >= PB
    return words, (not words) or n % PB != 0


@pytest.mark.parametrize("bits", CODE_BITS)
def test_level_decode_specialisation(host_cuda, bits):
    """Every level decode (word program at 4 / 8 bits, group program at all widths): decode,
    decode_add, the gather mean of 1 .. 17 payloads (several launches of 8), the global-scale
    decode; payloads at every byte alignment, output misaligned; against numba."""
    nb_ = numba_backend()
    launched = host_cuda.kernels.launched
    for bucket in (4, 512, 3, 100, PB + 1):
        pow2 = bucket & (bucket - 1) == 0
        for n in (1, 7, PB, PB + 1, 2 * PB + 17, 4 * PB):
            pays, table = _level_payloads(bits, n, bucket, 17, seed=n + bucket,
                                          kind="special" if n % 2 else "normal")
            words, groups = _program(bits, n, pow2)
            base = gen("normal", n, 5)
            for shift in (0, 1, 2, 3):
                data = _misaligned(pays[0], shift)
                for accumulate in (False, True):
                    ref, got = base.copy(), base.copy()
                    nb_.decode_levels(pays[0], n, bucket, bits, table, ref, accumulate)
                    launched.clear()
                    host_cuda.decode_levels(data, n, bucket, bits, table, got, accumulate)
                    assert same(got, ref), (bits, n, bucket, shift, accumulate)
                    assert (decode_kernel("levels", True, bits) in launched) == words
                    assert (decode_kernel("levels", False, bits) in launched) == groups
            for count in (1, 2, 8, 9, 17):
                datas = [_misaligned(p, r % 4) for r, p in enumerate(pays[:count])]
                ref = np.full(n, np.nan, np.float32)
                nb_.combine_levels(pays[:count], n, bucket, bits, table, 1.0 / count, ref)
                buf = np.full(n + 1, np.nan, np.float32)
                for got in (buf[:n], buf[1:]):  # output 16-byte aligned or not
                    launched.clear()
                    host_cuda.combine_levels(datas, n, bucket, bits, table, 1.0 / count, got)
                    assert same(got, ref), (bits, n, bucket, count)
                    assert len(launched) == -(-count // 8) * (words + groups), launched
    # one global scale (Global-QSGD exponent codes): any n takes the word program
    codec = hq.get_codec("global_qsgd", world_size=1, bits=bits, levels="exponential")
    for n in (5, PB, 3 * PB + 9):
        x = gen("special", n, n)
        pay = np.empty(packing.packed_nbytes(n, bits), np.uint8)
        numba_backend().encode(x, pay, 0, max(n, 1), MODE_EXP, bits, (3, 4), s=codec.s,
                               c=codec.c, gnorm=float(np.max(np.abs(x))))
        for accumulate in (False, True):
            ref, got = gen("normal", n, 1), gen("normal", n, 1)
            nb_.decode_codes(pay, n, bits, codec.table, np.float32(0.37), ref, accumulate)
            host_cuda.decode_codes(_misaligned(pay, n % 4), n, bits, codec.table,
                                   np.float32(0.37), got, accumulate)
            assert same(got, ref), (bits, n, accumulate)


@pytest.mark.parametrize("bits", CODE_BITS)
def test_dither_decode_specialisation(host_cuda, bits):
    """Every DQSG decode (word and group programs): 1 .. 17 payloads with their own keys,
    assign / accumulate, a final multiply, misaligned payloads; against numba."""
    nb_ = numba_backend()
    launched = host_cuda.kernels.launched
    for bucket in (4, 512, 100):
        for n in (7, PB, 2 * PB + 17):
            pays, keys, M = _dither_payloads(bits, n, bucket, 17, seed=bucket + n)
            words, groups = _program(bits, n, bucket & (bucket - 1) == 0)
            for count in (1, 3, 9, 17):
                for accumulate, post in ((False, None), (True, None), (False, 0.25)):
                    ref, got = gen("normal", n, 2), gen("normal", n, 2)
                    nb_.decode_dither(pays[:count], keys[:count], 0, n, bucket, bits, M, ref,
                                      accumulate, post)
                    launched.clear()
                    host_cuda.decode_dither([_misaligned(p, 3 * r % 4) for r, p in
                                             enumerate(pays[:count])], keys[:count], 0, n,
                                            bucket, bits, M, got, accumulate, post)
                    assert same(got, ref), (bits, n, bucket, count, accumulate, post)
                    assert (decode_kernel("dither", True, bits) in launched) == words
                    assert (decode_kernel("dither", False, bits) in launched) == groups


def test_tile_reductions_replay_warp_collectives(host_cuda):
    """A bucket's maximum sits in each lane, row and part of a tile in turn: the warp
    butterflies (replayed lane group by lane group on the host) must find it wherever it is."""
    for bits in FAST_BITS:
        s = hq.get_codec("qsgd", bits=bits).s
        for bucket in (4, 16, 128, 256, 512):
            for pos in range(0, 2 * PB, 97):
                x = gen("normal", 2 * PB, pos) * np.float32(1e-3)
                x[pos] = np.float32(-3.0)
                _check_encode(host_cuda, MODE_UNIFORM, bits, x, bucket, seed=pos,
                              norm_kind=NORM_MAX, s=s)


def test_kernel_launches_script_cases(host_cuda):
    """benchmarks/kernel_launches.py (compute-sanitizer's and ncu's launch list) covers every
    entry point, and each of its cases runs on valid inputs and launches the specialised
    program it names (replayed here on the host)."""
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import kernel_launches as KL
    finally:
        sys.path.pop(0)
    cases = KL.cases()
    declared = {k for c in cases for k in c.kernels}
    assert declared == {k for ks in kernel_names().values() for k in ks}
    specialised = re.compile(r"^hq_(encode_tile|encode_block|decode_words|decode_groups|exp_comb)")
    for c in cases:
        host_cuda.kernels.launched.clear()
        c.run(host_cuda, np, 3 * PB + 5)
        assert set(host_cuda.kernels.launched) == {k for k in c.kernels if specialised.match(k)}, c
    assert [c.kernels for c in KL.select(cases, "decode", "words_levels_8b")] == \
        [("hq_decode_words_levels_8b",)] * 2


# -- sources ---------------------------------------------------------------------------------
def test_entry_points_and_ptx_from_nvcc(nvcc, tmp_path):
    """Each kernel file compiles to exactly the entry points the launcher knows
    (specs.kernel_names), and with the loader's options its PTX has no flush-to-zero and no
    contracted f32 multiply-add (nvcc's front end: NVRTC's is checked below where present)."""
    from horovod_quant.backends.cuda.source import KERNEL_FILES, load_source

    names = kernel_names()
    assert sorted(names) == sorted(KERNEL_FILES)
    for f in KERNEL_FILES:
        src = tmp_path / f
        src.write_text(load_source(f))
        ptx = tmp_path / (f + ".ptx")
        subprocess.run([nvcc, "-ptx", "-arch=compute_90", "-std=c++17", "-fmad=false",
                        "-ftz=false", "-prec-div=true", "-prec-sqrt=true", str(src), "-o",
                        str(ptx)], check=True, capture_output=True, timeout=600)
        text = ptx.read_text()
        entries = re.findall(r"^\.visible \.entry (\w+)\(", text, re.M)
        assert sorted(entries) == sorted(names[f]), (f, set(entries) ^ set(names[f]))
        instr = re.findall(r"^\s*([a-z]+(?:\.[a-z0-9]+)+)\s", text, re.M)
        f32 = [i for i in instr if "f32" in i]
        assert not [i for i in f32 if "ftz" in i], f
        assert not [i for i in f32 if i.startswith(("fma", "div.full")) or "approx" in i], f
        assert ".local" not in text, f"{f}: local memory (a runtime-indexed array?)"


def _find_nvrtc():
    pats = [os.environ.get("HQ_NVRTC_LIB", "")]
    for base in sys.path:
        pats += [os.path.join(base, "nvidia", "cu1*", "lib", "libnvrtc.so*"),
                 os.path.join(base, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")]
    pats += ["/usr/local/cuda/lib64/libnvrtc.so*", "/usr/local/cuda-*/lib64/libnvrtc.so*"]
    for pat in pats:
        for path in sorted(glob.glob(pat)) if pat else []:
            if "builtins" in path or "alt" in path:
                continue
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def test_sources_inline_and_nvrtc_ptx_is_exact():
    """The source CuPy loads (headers inlined) compiles with NVRTC under the loader's options,
    and its PTX has no flush-to-zero and no contracted f32 multiply-add."""
    from horovod_quant.backends.cuda.source import (
        KERNEL_FILES,
        kernel_dir,
        load_source,
        nvrtc_options,
    )

    assert (kernel_dir() / "hq_common.cuh").is_file()
    srcs = {f: load_source(f) for f in KERNEL_FILES}
    for f, src in srcs.items():
        assert not re.search(r'#\s*include\s+"hq_', src), f
        assert "extern \"C\" __global__" in src
    lib = _find_nvrtc()
    if lib is None:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc to run this check)")
    for f, src in srcs.items():
        for arch in ("compute_80", "compute_90"):
            prog = ctypes.c_void_p()
            assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), f.encode(), 0, None,
                                          None) == 0
            opts = [o.encode() for o in nvrtc_options(arch)]
            rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            n = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            log = ctypes.create_string_buffer(n.value)
            lib.nvrtcGetProgramLog(prog, log)
            assert rc == 0, f"{f} {arch}: {log.value.decode()}"
            lib.nvrtcGetPTXSize(prog, ctypes.byref(n))
            ptx = ctypes.create_string_buffer(n.value)
            lib.nvrtcGetPTX(prog, ptx)
            lib.nvrtcDestroyProgram(ctypes.byref(prog))
            instr = re.findall(r"^\s*([a-z]+(?:\.[a-z0-9]+)+)\s", ptx.value.decode(), re.M)
            f32 = [i for i in instr if "f32" in i]
            assert not [i for i in f32 if "ftz" in i], (f, arch, sorted(set(f32)))
            assert not [i for i in f32 if i.startswith(("fma", "div.full")) or "approx" in i], \
                (f, arch, sorted(set(f32)))


# -- backend choice ------------------------------------------------------------------------
class FakeDeviceArray:
    """Stands in for a CuPy array (the hook only looks at the type's module)."""

    __module__ = "cupy.fake"

    def __init__(self, a):
        self.a = np.asarray(a)

    def __array__(self, dtype=None, copy=None):
        return self.a if dtype is None else self.a.astype(dtype)


def test_device_arrays_pick_the_cuda_backend(host_cuda, monkeypatch):
    """codec.encode / decode / combine_gathered with a device array run on the CUDA backend
    (``backend_of``; here its host launcher) and give the CPU's bytes; NumPy arguments never
    ask for it; a kernel the backend lacks is an error, not a copy to the host."""
    import horovod_quant.backends as B
    import horovod_quant.backends.cuda as BC

    calls = []

    def cuda_backend():
        calls.append(1)
        return host_cuda

    monkeypatch.setattr(BC, "cuda_backend", cuda_backend)
    monkeypatch.setattr(BC, "as_cupy",
                        lambda o: np.asarray(o) if isinstance(o, FakeDeviceArray) else o)
    x = gen("normal", PB + 9, 0)
    for codec in (hq.get_codec("qsgd", bits=4, norm="l2"), hq.get_codec("natural"),
                  hq.get_codec("dithered", bits=3),
                  hq.get_codec("global_qsgd", world_size=2, bits=8)):
        ref = codec.encode(x, seed=3)
        calls.clear()
        got = codec.encode(FakeDeviceArray(x), seed=3)
        assert calls, f"{codec.name}: encode of a device array did not ask for the CUDA backend"
        assert same(got.data, ref.data), codec.name
        dev = hq.Payload(FakeDeviceArray(got.data), got.size, dict(got.meta))
        calls.clear()
        got_mean = codec.decode(dev)
        assert calls, f"{codec.name}: decode of a device payload did not ask for the CUDA backend"
        assert same(got_mean, codec.decode(ref)), codec.name
    codec = hq.get_codec("qsgd", bits=4, norm="l2")
    ref = [codec.encode(gen("normal", 100, r), worker_seed(1, r)) for r in range(3)]
    dev = [hq.Payload(FakeDeviceArray(p.data), p.size, dict(p.meta)) for p in ref]
    calls.clear()
    assert same(codec.combine_gathered(dev, 1), codec.combine_gathered(ref, 1))
    assert calls
    # numpy arguments never reach the CUDA backend
    calls.clear()
    codec.decode(codec.encode(x, 1))
    assert calls == []
    with pytest.raises(B.MissingKernel, match="no CUDA kernel for Elias coding"):
        hq.get_codec("qsgd", bits=3, elias=True).encode(FakeDeviceArray(x), 1)


def test_cupy_loader_compiles_and_caches(monkeypatch, tmp_path):
    """The GPU loader's NVRTC step (CuPy's bindings; no GPU needed): an architecture NVRTC
    rejects falls through to the next target, binaries land in the cache and are reused."""
    pytest.importorskip("cupy")
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception as exc:  # CuPy without its NVRTC library
        pytest.skip(f"NVRTC not loadable through CuPy: {exc!r}")
    from horovod_quant.backends.cuda import kernels as _cupy
    from horovod_quant.backends.cuda.source import KERNEL_FILES

    monkeypatch.setenv("HQ_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(_cupy, "_targets",
                        lambda: [("sm_1", "cubin"), ("sm_90", "cubin"), ("compute_80", "ptx")])
    paths = [_cupy.module_path(f) for f in KERNEL_FILES]
    for p in paths:
        assert p.parent == tmp_path and p.suffix == ".cubin" and "_sm_90_" in p.name
        assert p.read_bytes()[:4] == b"\x7fELF"
    stamps = [p.stat().st_mtime_ns for p in paths]
    assert [_cupy.module_path(f) for f in KERNEL_FILES] == paths
    assert [p.stat().st_mtime_ns for p in paths] == stamps


# -- reduce.cu: the host mean of the hierarchical exchange -----------------------------------
@pytest.mark.parametrize("nparts,divisor", [(0, 3), (1, 1), (2, 2), (3, 3), (2, 3), (8, 8)])
@pytest.mark.parametrize("kind", ["special", "nonfinite"])
def test_mean_in_order(host_cuda, nparts, divisor, kind):
    """``Backend.mean_in_order`` on the host-replayed kernel and on numba equals NumPy's ``+=``
    in part order then ``/=``, bit for bit: subnormal sums and quotients stay subnormal (CuPy's
    own elementwise kernels would flush them), signed zeros and non-finite values kept."""
    from horovod_quant.backends import numba_backend

    cmp = same_nan if kind == "nonfinite" else same
    for n in SIZES:
        parts = [gen(kind, n, 31 * nparts + r) for r in range(nparts)]
        want = parts[0].copy() if parts else np.zeros(n, np.float32)
        for part in parts[1:]:
            want += part
        with np.errstate(over="ignore", invalid="ignore"):
            want /= np.float32(divisor)
        for backend in (host_cuda, numba_backend()):
            out = np.full(n, np.nan, np.float32)
            with np.errstate(over="ignore", invalid="ignore"):
                got = backend.mean_in_order(parts, divisor, out)
            assert got is out and cmp(out, want), (backend.name, n, first_diff(out, want))
    if kind == "special" and nparts == 2:  # the case flush-to-zero would change
        tiny = [np.full(4, 3e-45, np.float32), np.full(4, 1e-45, np.float32)]
        out = np.empty(4, np.float32)
        assert (host_cuda.mean_in_order(tiny, 2, out) > 0).all()


@pytest.mark.parametrize("name", ["qsgd", "natural", "none"])
def test_hierarchical_exchange_on_the_cuda_backend(host_cuda, name):
    """The whole hierarchical plan (host means, the exchange between hosts, the allgather in
    the host) through the CUDA backend's launch logic gives the numba backend's bits, on
    vectors with subnormals, zeros and huge values."""
    from horovod_quant.exchange.topology import Topology

    codec, topology = hq.get_codec(name), Topology.grid(2, 3)
    xs = [gen("special", 2 * PB + 17, r) for r in range(topology.size)]
    ref, _ = hq.mean_estimate(codec, xs, 5, gather="hierarchical", topology=topology)
    got, _ = on(host_cuda, hq.mean_estimate, codec, xs, 5, gather="hierarchical",
                topology=topology)
    assert same(got, ref), first_diff(got, ref)
