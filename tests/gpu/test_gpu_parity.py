"""CPU/GPU parity and the statistical checks on a real GPU (CuPy).

Skipped without CuPy or a CUDA device; with ``HQ_TEST_GPU=1`` a missing GPU is a failure
instead (GPU CI). Every codec goes through the public dispatch point: ``codec.encode(x)`` with
a CuPy array (or a CUDA torch tensor) must give the same payload bytes as with the NumPy array,
and decoding the same float32 bit patterns.

    HQ_TEST_GPU=1 python -m pytest -q tests/gpu
"""
from __future__ import annotations

import math
import os

import numpy as np
import pytest

import horovod_quant as hq
from horovod_quant.backends import (
    MODE_DITHER,
    MODE_EXP,
    MODE_NESTED,
    MODE_UNIFORM,
    NORM_MAX,
    NORM_P,
    SCALED_MODES,
    numba_backend,
)
from horovod_quant.backends.cuda.specs import CODE_BITS, FAST_BITS, MODE_NAMES, tile_encode_specs
from horovod_quant.backends.numba import global_qsgd as NG
from horovod_quant.backends.numba import packing
from horovod_quant.core import exponent_reduction
from horovod_quant.core import rng as R
from horovod_quant.core.base import worker_seed

PB = packing.PACK_BLOCK
SIZES = [0, 1, 7, 8, 9, 8191, 8192, 8193, 2 * PB + 17]
INF = float("inf")


def _gpu_or_skip():
    reason = None
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            reason = "no CUDA device visible to CuPy"
    except Exception as exc:  # ImportError, CUDARuntimeError without a driver
        reason = f"CuPy unavailable: {exc!r}"
    if reason is None:
        return cupy
    if os.environ.get("HQ_TEST_GPU") == "1":
        pytest.fail(f"HQ_TEST_GPU=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def cp():
    cupy = _gpu_or_skip()
    import horovod_quant.gpu as G

    G.compile_kernels()
    return cupy


def host(a):
    import cupy

    return cupy.asnumpy(a) if isinstance(a, cupy.ndarray) else np.asarray(a)


def same(a, b) -> bool:
    a, b = host(a), host(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype == np.float32:
        return bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))
    return bool(np.array_equal(a, b))


def same_nan(a, b) -> bool:
    a, b = host(a).astype(np.float32), host(b).astype(np.float32)
    na, nb = np.isnan(a), np.isnan(b)
    return bool(np.array_equal(na, nb)) and same(np.where(na, 0, a), np.where(nb, 0, b))


def gen(kind, n, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    if kind == "normal" or n == 0:
        return x
    segs = np.array_split(np.arange(n), 8)
    if kind == "special":
        x[segs[0]] = 0.0
        x[segs[1]] *= np.float32(1e-33)
        x[segs[2]] = (rng.standard_normal(segs[2].size) * 1e-41).astype(np.float32)
        x[segs[3]] *= np.float32(1e30)
        x[segs[5]] = -0.0
        return x
    if kind == "nonfinite":
        pos = rng.choice(n, size=max(1, n // 997), replace=False)
        x[pos[::2]] = np.nan
        x[pos[1::2]] = np.inf
        return x
    raise ValueError(kind)


# -- basics ----------------------------------------------------------------------------------
def test_kernels_compile_and_pack(cp):
    import horovod_quant.gpu as G
    from horovod_quant.backends.cuda import cuda_backend

    assert G.available()
    be = cuda_backend().kernels
    rng = np.random.default_rng(0)
    for bits in range(1, 9):
        for n in SIZES:
            codes = rng.integers(0, 1 << bits, n).astype(np.uint8)
            ref = packing.pack(codes, bits)
            out = cp.full(ref.size, 0xAB, cp.uint8)
            if n:
                be.pack(cp.asarray(codes), n, bits, out)
            assert same(out, ref), (bits, n)
            back = cp.empty(n, cp.uint8)
            if n:
                be.unpack(cp.asarray(ref), n, bits, back)
            assert same(back, codes), (bits, n)


# -- level quantizers ------------------------------------------------------------------------
LEVEL_SPECS = [
    ("qsgd", {"norm": "l2"}), ("qsgd", {"norm": "max"}), ("standard_dithering", {"p": 1.0}),
    ("standard_dithering", {"p": INF}), ("nuqsgd", {}), ("natural_dithering", {}),
    ("natural", {}),
]
# p-norms other than 1, 2, inf use pow(), which is not correctly rounded on either side: bytes
# agree except for scales within an ulp of a float32 rounding boundary (docs/dev/gpu.md)
BUCKETS = [1, 3, 100, 512, PB, PB + 1, None]


def _codec(name, kw, bits, bucket):
    try:
        return hq.get_codec(name, bits=bits, bucket_size=bucket, **kw)
    except ValueError:
        return None


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("spec", LEVEL_SPECS,
                         ids=lambda s: f"{s[0]}-{'-'.join(map(str, s[1].values()))}")
def test_levels_payload_and_decode(cp, spec, bits):
    name, kw = spec
    for bucket in BUCKETS:
        codec = _codec(name, kw, bits, bucket)
        if codec is None:
            continue
        edges = [] if bucket is None else [bucket - 1, bucket + 1]
        for n in sorted(set(SIZES + [e for e in edges if 0 <= e <= 3 * PB])):
            for kind in ("normal", "special"):
                x = gen(kind, n, n + bits)
                ref = codec.encode(x, seed=7)
                got = codec.encode(cp.asarray(x), seed=7)
                assert isinstance(got.data, cp.ndarray)
                assert same(got.data, ref.data), (codec, n, kind)
                assert same(codec.decode(got), codec.decode(ref)), (codec, n, kind)
                out = cp.asarray(gen("normal", n, 1))
                want = codec.decode_add(ref, gen("normal", n, 1))
                assert same(codec.decode_add(got, out), want), (codec, n, kind)


def test_levels_nonfinite(cp):
    for name, kw in LEVEL_SPECS:
        codec = _codec(name, kw, 4, 512)
        x = gen("nonfinite", 3 * PB + 5, 3)
        ref, got = codec.encode(x, 1), codec.encode(cp.asarray(x), 1)
        nb = -(-x.size // 512)
        assert same_nan(host(got.data)[: 4 * nb].view(np.float32),
                        ref.data[: 4 * nb].view(np.float32))
        assert same(host(got.data)[4 * nb:], ref.data[4 * nb:])
        assert same_nan(codec.decode(got), codec.decode(ref))


@pytest.mark.parametrize("npay", [1, 3, 8])
def test_gather_combine_one_pass(cp, npay):
    for name, kw in LEVEL_SPECS[:4]:
        codec = _codec(name, kw, 4, 512)
        xs = [gen("normal", PB + 33, r) for r in range(npay)]
        ref = [codec.encode(x, worker_seed(5, r)) for r, x in enumerate(xs)]
        got = [codec.encode(cp.asarray(x), worker_seed(5, r)) for r, x in enumerate(xs)]
        assert same(codec.combine_gathered(got, 5), codec.combine_gathered(ref, 5))


def test_float64_float16_and_torch_inputs(cp):
    codec = hq.get_codec("qsgd", bits=4, norm="l2")
    x64 = np.concatenate([np.random.default_rng(1).standard_normal(5000), [1e-40, -2e-45]])
    assert same(codec.encode(cp.asarray(x64), 3).data, codec.encode(x64, 3).data)
    x16 = np.random.default_rng(2).standard_normal(5000).astype(np.float16)
    assert same(codec.encode(cp.asarray(x16), 3).data, codec.encode(x16, 3).data)
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    x = gen("normal", 3 * PB + 1, 4)
    t = torch.from_numpy(x).cuda()
    import horovod_quant.gpu as G

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), G.device_scope(t):  # kernels on torch's current stream
        p = codec.encode(t, seed=3)
        out = torch.empty_like(t)
        res = codec.decode(p, out)
    stream.synchronize()
    assert res is out
    assert same(p.data, codec.encode(x, 3).data)
    assert same(out.cpu().numpy(), codec.decode(codec.encode(x, 3)))


def test_elias_on_device_arrays_is_an_error(cp):
    """No CUDA kernel for Elias coding: an error that says what to do, nothing copied to the
    host behind the caller's back."""
    from horovod_quant.backends import MissingKernel

    codec = hq.get_codec("qsgd", bits=3, bucket_size=None, norm="l2", elias=True)
    x = gen("normal", 5000, 2)
    with pytest.raises(MissingKernel, match="no CUDA kernel for Elias coding"):
        codec.encode(cp.asarray(x), 4)
    with pytest.raises(MissingKernel, match="no CUDA kernel for Elias coding"):
        ref = codec.encode(x, 4)
        codec.decode(hq.Payload(cp.asarray(ref.data), ref.size))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_baselines(cp):
    x = gen("special", 5000, 1)
    x[7] = np.nan
    for name in ("none", "fp16", "bf16"):
        codec = hq.get_codec(name)
        ref, got = codec.encode(x), codec.encode(cp.asarray(x))
        assert same_nan(got.data, ref.data)  # NaN's bits are the platform's (docs/dev/gpu.md)
        assert same_nan(codec.decode(got), codec.decode(ref))


# -- Global-QSGD -----------------------------------------------------------------------------
@pytest.mark.parametrize("norm", ["max", "l2"])
@pytest.mark.parametrize("cfg", [("linear", "dense", "tree"), ("exponential", "dense", "tree"),
                                 ("exponential", "dense", "ring"), ("linear", "sparse", "tree"),
                                 ("exponential", "sparse", "tree")], ids=lambda c: "-".join(c))
def test_global_qsgd(cp, cfg, norm):
    levels, mode, reduction = cfg
    for world in (1, 2, 3, 4):
        for bits in (2, 4, 8, 12, 16):
            try:
                codec = hq.get_codec("global_qsgd", world_size=world, bits=bits, levels=levels,
                                     norm=norm, mode=mode, reduction=reduction)
            except ValueError:
                continue
            for n in (0, 1, 9, PB + 1, 3 * PB + 5):
                xs = [gen("normal", n, 10 * world + r) for r in range(world)]
                dx = [cp.asarray(x) for x in xs]
                assert ([codec.norm_statistic(d) for d in dx]
                        == [codec.norm_statistic(x) for x in xs])
                g = codec.global_norm(xs)
                ref = [codec.encode_worker(x, 11, r, g) for r, x in enumerate(xs)]
                got = [codec.encode_worker(d, 11, r, g) for r, d in enumerate(dx)]
                for a, b in zip(got, ref):
                    assert same(a.data, b.data), (codec, n)
                assert same(codec.decode(got[0]), codec.decode(ref[0]))
                assert same(codec.combine_gathered(got, 11), codec.combine_gathered(ref, 11))
                tiny = xs[0] * np.float32(1e-34)
                assert same(codec.encode(cp.asarray(tiny), 5).data, codec.encode(tiny, 5).data)


@pytest.mark.parametrize("bits", range(2, 9))
def test_exp_combine(cp, bits):
    import horovod_quant.gpu as G

    rng = np.random.default_rng(bits)
    top = (1 << (bits - 1)) - 1
    for size, i0 in ((1, 0), (PB + 5, 0), (3 * PB + 17, PB)):
        def codes(size=size):
            e = rng.integers(0, top + 1, size)
            s = rng.integers(0, 2, size) << (bits - 1)
            return np.where(e > 0, e | s, 0).astype(np.uint8)

        a, b = packing.pack(codes(), bits), packing.pack(codes(), bits)
        lo, hi = exponent_reduction.packed_range(i0, size, size, bits)
        k0, k1 = (int(v) for v in R.split_key(R.derive_key(size, bits)))
        ref = a.copy()
        NG.exp_combine(ref[lo:hi], b[lo:hi], ref[lo:hi], size - i0, i0, bits, k0, k1)
        da, db = cp.asarray(a), cp.asarray(b)
        G.exp_combine(da[lo:hi], db[lo:hi], da[lo:hi], size - i0, i0, bits, k0, k1)
        assert same(da, ref), (bits, size)


# -- DQSG / NDQSG ----------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_dithered(cp, bits):
    for bucket in (100, 512, None):
        codec = hq.get_codec("dithered", bits=bits, bucket_size=bucket)
        for n in SIZES:
            x = gen("special", n, n)
            ref, got = codec.encode(x, 3), codec.encode(cp.asarray(x), 3)
            assert same(got.data, ref.data)
            assert same(codec.decode(got), codec.decode(ref))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_nested_dithered(cp, world):
    rng = np.random.default_rng(world)
    for k in (None, 5):
        kw = dict(world_size=world, bits=4, coarse_ratio=k, bucket_size=512)
        c_cpu, c_gpu = hq.get_codec("nested_dithered", **kw), hq.get_codec("nested_dithered", **kw)
        base = rng.standard_normal(2 * PB + 17).astype(np.float32)
        xs = [base + np.float32(0.05) * rng.standard_normal(base.size).astype(np.float32)
              for _ in range(world)]
        s_cpu, s_gpu = c_cpu.new_state(), c_gpu.new_state()  # the exchange's state
        for rnd in range(2):  # the second exchange uses the adapted k
            ref = [c_cpu.encode_worker(x, rnd, r, state=s_cpu) for r, x in enumerate(xs)]
            got = [c_gpu.encode_worker(cp.asarray(x), rnd, r, state=s_gpu)
                   for r, x in enumerate(xs)]
            for a, b in zip(got, ref):
                assert same(a.data, b.data)
            seeds = [worker_seed(rnd, r) for r in range(world)]
            assert same(c_gpu.decode_side_info(got, seeds, state=s_gpu),
                        c_cpu.decode_side_info(ref, seeds, state=s_cpu))
            assert s_gpu.last_stats == s_cpu.last_stats


# -- every specialisation, at the backend entry points -----------------------------------------
# The same checks as tests/cuda_parity (which replays these programs on the CPU), here with
# the real launch: grid shapes, warp shuffles, 16-byte loads, alignment branches.
def _cuda():
    from horovod_quant.backends.cuda import cuda_backend

    return cuda_backend()


def _encode_params(mode, kind, bits):
    # p-norms: p = 1 (exact on both sides; other p call pow, see LEVEL_SPECS)
    if mode == MODE_UNIFORM:
        return {"norm_kind": kind, "p": 1.0, "s": hq.get_codec("qsgd", bits=bits).s}
    if mode == MODE_EXP:
        codec = hq.get_codec("global_qsgd", world_size=1, bits=bits, levels="exponential")
        return {"s": codec.s, "c": codec.c}
    if mode == MODE_DITHER:
        M = (1 << (bits - 1)) - 1
        return {"M": M, "am": float(M)}
    if mode == MODE_NESTED:
        return {"M": 127, "k": (1 << bits) - 1, "am": float(np.float32(0.7 * 127))}
    return {"norm_kind": kind, "p": 1.0, "s": hq.get_codec("natural_dithering", bits=bits).s}


def _check_encode(cp, mode, bits, x, bucket, seed, offset=0, dx=None, **kw):
    """Backend.encode on the GPU (of dx, default a copy of x) and with numba: same bytes."""
    n = x.size
    keys = R.split_key(R.derive_key(seed))
    nb = 4 * -(-n // bucket) if n and mode in SCALED_MODES else 0
    size = offset + nb + packing.packed_nbytes(n, bits)
    ref = np.full(size, 0xCD, np.uint8)
    numba_backend().encode(x, ref, offset, bucket, mode, bits, keys, **kw)
    got = cp.full(size, 0xCD, cp.uint8)
    _cuda().encode(cp.asarray(x) if dx is None else dx, got, offset, bucket, mode, bits, keys,
                   **kw)
    got = host(got)
    where = (MODE_NAMES[mode], bits, n, bucket)
    sc = slice(offset, offset + nb)
    assert same_nan(got[sc].view(np.float32), ref[sc].view(np.float32)), where
    assert same(got[:offset], ref[:offset]) and same(got[offset + nb:], ref[offset + nb:]), where
    return ref


@pytest.mark.parametrize("spec", tile_encode_specs(),
                         ids=lambda s: f"{MODE_NAMES[s[0]]}-{s[1]}-{s[2]}")
def test_tile_encode_specialisation(cp, spec):
    mode, kind, bits = spec
    kw = _encode_params(mode, kind, bits)
    for bucket in ([PB] if mode == MODE_EXP else [4, 32, 256, 512]):
        for n in (PB, 3 * PB + bucket + 1, 5 * PB):
            for data in ("normal", "special", "nonfinite"):
                x = gen(data, n, n + bucket)
                if mode == MODE_EXP:
                    kw["gnorm"] = 7.0
                _check_encode(cp, mode, bits, x, bucket, seed=n,
                              offset=4 if mode == MODE_NESTED else 0, **kw)


@pytest.mark.parametrize("bits", CODE_BITS)
@pytest.mark.parametrize("mode", list(MODE_NAMES), ids=lambda m: MODE_NAMES[m])
def test_block_encode_specialisation(cp, mode, bits):
    kind = NORM_MAX if mode in (MODE_EXP, MODE_DITHER, MODE_NESTED) else NORM_P
    kw = _encode_params(mode, kind, bits)
    if mode == MODE_EXP:
        kw["gnorm"] = 7.0
    for bucket in (3, 100, PB + 1):
        for n in (9, 2 * PB + 17):
            _check_encode(cp, mode, bits, gen("special", n, n), bucket, seed=bucket,
                          offset=4 if mode == MODE_NESTED else 0, **kw)
    # misaligned input (not 16-byte aligned): the generic program
    x = gen("normal", 2 * PB + 1, bits)
    _check_encode(cp, mode, bits, x[1:], 512, seed=4, dx=cp.asarray(x)[1:], **kw)


def _misaligned(cp, a, shift):
    """A device copy of the uint8 array a starting `shift` bytes past a 16-byte boundary."""
    buf = cp.zeros(a.size + 64, cp.uint8)
    start = (-buf.data.ptr) % 16 + shift
    out = buf[start: start + a.size]
    out[...] = cp.asarray(a)
    return out


@pytest.mark.parametrize("bits", CODE_BITS)
def test_level_decode_specialisation(cp, bits):
    """Word (4 / 8 bits) and group decodes: payloads at every byte alignment, 1 .. 17
    payloads summed (several launches of 8 pointers), output misaligned."""
    codec = hq.get_codec("qsgd", bits=bits)
    be, nb_ = _cuda(), numba_backend()
    for bucket in (4, 512, 100):
        for n in (7, PB, 2 * PB + 17, 4 * PB):
            pays = []
            for r in range(17):
                pay = np.empty(4 * -(-n // bucket) + packing.packed_nbytes(n, bits), np.uint8)
                nb_.encode(gen("special" if r % 2 else "normal", n, r), pay, 0, bucket,
                           MODE_UNIFORM, bits, (r, 7), norm_kind=NORM_MAX, s=codec.s)
                pays.append(pay)
            base = gen("normal", n, 5)
            for shift in range(4):
                for accumulate in (False, True):
                    ref = base.copy()
                    nb_.decode_levels(pays[0], n, bucket, bits, codec.table, ref, accumulate)
                    got = cp.asarray(base)
                    be.decode_levels(_misaligned(cp, pays[0], shift), n, bucket, bits,
                                     be.constant(codec.table), got, accumulate)
                    assert same(got, ref), (bits, n, bucket, shift, accumulate)
            for count in (1, 8, 9, 17):
                ref = np.empty(n, np.float32)
                nb_.combine_levels(pays[:count], n, bucket, bits, codec.table, 1.0 / count, ref)
                buf = cp.full(n + 1, np.nan, cp.float32)
                for got in (buf[:n], buf[1:]):
                    be.combine_levels([_misaligned(cp, p, r % 4) for r, p in
                                       enumerate(pays[:count])], n, bucket, bits,
                                      be.constant(codec.table), 1.0 / count, got)
                    assert same(got, ref), (bits, n, bucket, count)


@pytest.mark.parametrize("bits", CODE_BITS)
def test_dither_decode_specialisation(cp, bits):
    be, nb_ = _cuda(), numba_backend()
    M = (1 << (bits - 1)) - 1
    for bucket in (4, 512, 100):
        for n in (7, 2 * PB + 17):
            keys = [R.split_key(R.derive_key(r, 5)) for r in range(17)]
            pays = []
            for r in range(17):
                pay = np.empty(4 * -(-n // bucket) + packing.packed_nbytes(n, bits), np.uint8)
                nb_.encode(gen("special", n, r), pay, 0, bucket, MODE_DITHER, bits, keys[r], M=M,
                           am=float(M))
                pays.append(pay)
            for count in (1, 9, 17):
                for accumulate, post in ((False, None), (True, 0.25)):
                    ref, got = gen("normal", n, 2), cp.asarray(gen("normal", n, 2))
                    nb_.decode_dither(pays[:count], keys[:count], 0, n, bucket, bits, M, ref,
                                      accumulate, post)
                    be.decode_dither([_misaligned(cp, p, r % 4) for r, p in
                                      enumerate(pays[:count])], keys[:count], 0, n, bucket,
                                     bits, M, got, accumulate, post)
                    assert same(got, ref), (bits, n, bucket, count, accumulate)


@pytest.mark.parametrize("bits", FAST_BITS)
def test_gather_many_payloads_and_views(cp, bits):
    """combine_gathered of 17 peers whose payloads are views at odd offsets of one gathered
    buffer (as an allgather delivers them)."""
    codec = hq.get_codec("qsgd", bits=bits)
    n = 3 * PB + 5
    ref = [codec.encode(gen("normal", n, r), worker_seed(2, r)) for r in range(17)]
    size = ref[0].data.size
    gathered = cp.zeros(17 * size + 17, cp.uint8)
    views = []
    for r, p in enumerate(ref):
        v = gathered[r * (size + 1) + 1: r * (size + 1) + 1 + size]
        v[...] = cp.asarray(p.data)
        views.append(hq.Payload(v, p.size, dict(p.meta)))
    assert same(codec.combine_gathered(views, 2), codec.combine_gathered(ref, 2))


# -- statistics on the GPU -------------------------------------------------------------------
def _two_point_moments(codec, x, scales):
    """Per-element variance and 4th central moment of an unbiased two-level rounding."""
    half = 1 << (codec.bits - 1)
    lv = np.sort(np.abs(codec.table[: half]).astype(np.float64))
    bucket = codec._bucket(x.size)
    sc = np.repeat(scales.astype(np.float64), bucket)[: x.size]
    r = np.abs(x.astype(np.float64)) / np.where(sc > 0, sc, 1)
    j = np.clip(np.searchsorted(lv, r, side="right") - 1, 0, lv.size - 2)
    lo, hi = lv[j], lv[j + 1]
    p = np.where(hi > lo, (r - lo) / (hi - lo), 0)
    var = (r - lo) * (hi - r) * sc ** 2
    m4 = ((1 - p) * (r - lo) ** 4 + p * (hi - r) ** 4) * sc ** 4
    return var, m4


@pytest.mark.parametrize("spec", [("qsgd", {}), ("nuqsgd", {}), ("natural", {}),
                                  ("natural_dithering", {})], ids=lambda s: s[0])
def test_unbiased_and_variance_on_gpu(cp, spec):
    """T independent GPU encodings: the mean error and the mean squared error agree with the
    exact two-point moments within 5 standard errors (a wrong kernel fails this)."""
    name, kw = spec
    codec = _codec(name, kw, 4, 512)
    x = gen("normal", 4096, 0)
    dx = cp.asarray(x)
    T = 400
    nb = -(-x.size // 512)
    sum_e = np.zeros(x.size)
    sse = np.zeros(T)
    for t in range(T):
        p = codec.encode(dx, seed=1000 + t)
        e = host(codec.decode(p)).astype(np.float64) - x
        sum_e += e
        sse[t] = np.sum(e * e)
    scales = host(p.data)[: 4 * nb].view(np.float32)
    var, m4 = _two_point_moments(codec, x, scales)
    z_mean = sum_e.sum() / math.sqrt(T * var.sum())
    assert abs(z_mean) < 5, z_mean
    sd_sse = math.sqrt(np.sum(m4 - var ** 2) / T)
    z_var = (sse.mean() - var.sum()) / sd_sse
    assert abs(z_var) < 5, (z_var, sse.mean(), var.sum())


def test_dithered_error_uniform_on_gpu(cp):
    """DQSG: the error / kappa is uniform on [-Delta/2, Delta/2] whatever x (Theorem 1)."""
    codec = hq.get_codec("dithered", bits=3, bucket_size=None)
    x = gen("normal", 1 << 16, 1)
    p = codec.encode(cp.asarray(x), seed=2)
    kappa = float(np.abs(x).max())
    u = (host(codec.decode(p)).astype(np.float64) - x) / (kappa * codec.delta)
    assert np.all(np.abs(u) <= 0.5 + 1e-5)
    assert abs(u.mean()) < 5 * math.sqrt(1 / 12 / u.size)
    assert abs(u.var() - 1 / 12) < 5 * math.sqrt(1 / 180 / u.size)
