"""Baselines none / fp16 / bf16: exact casts, error bounds, summing exchange."""
from __future__ import annotations

import numpy as np
import pytest

import horovod_quant as hq
from horovod_quant.core.baselines import bf16_bits_to_float32, float32_to_bf16_bits

BASELINES = ["none", "fp16", "bf16"]
# relative error bound of round-to-nearest: half an ulp of the significand
REL = {"none": 0.0, "fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


def _x(n=5000, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * np.exp(rng.uniform(-5, 5, n))).astype(np.float32)


@pytest.mark.parametrize("name", BASELINES)
def test_contract(name):
    codec = hq.get_codec(name)
    # fp16/float32 payloads add up under allreduce; bf16 bit patterns travel by gather
    assert codec.traits.combine == ("gather" if name == "bf16" else "sum")
    x = _x()
    pl = codec.encode(x, seed=3)
    assert pl.size == x.size
    assert pl.nbytes == x.size * {"none": 4, "fp16": 2, "bf16": 2}[name]
    assert pl.data.dtype == codec.traits.wire_dtype and pl.data.ndim == 1
    d = codec.decode(pl)
    assert d.dtype == np.float32
    out = np.empty_like(d)
    assert codec.decode(pl, out) is out
    np.testing.assert_array_equal(out, d)
    acc = np.ones_like(d)
    codec.decode_add(pl, acc)
    np.testing.assert_array_equal(acc, 1 + d)
    # deterministic: the seed plays no role
    assert codec.encode(x, seed=99).data.tobytes() == pl.data.tobytes()
    # what a collective delivers (raw bytes) rebuilds the same payload
    again = codec.payload_from_wire(pl.data.view(np.uint8), pl.size)
    np.testing.assert_array_equal(codec.decode(again), d)


@pytest.mark.parametrize("name", BASELINES)
def test_error_bound_and_bias(name):
    """Deterministic rounding: per element |Q(x) - x| <= 2^-p |x| (so "unbiased" up to half an
    ulp and normalized variance <= 2^-2p), and the signed errors of random data cancel."""
    codec = hq.get_codec(name)
    x = _x(20000, 1)
    if name == "fp16":  # the bound holds in half precision's normal range
        x = x[(np.abs(x) >= 2.0 ** -14) & (np.abs(x) <= 65504)]
    d = codec.decode(codec.encode(x)).astype(np.float64)
    x64 = x.astype(np.float64)
    assert np.all(np.abs(d - x64) <= REL[name] * np.abs(x64))
    nvar = float(np.sum((d - x64) ** 2) / np.sum(x64 ** 2))
    assert nvar <= REL[name] ** 2
    rel = (d - x64) / x64
    # round-to-nearest errors are symmetric: their mean is far below the bound
    assert abs(float(rel.mean())) <= 0.05 * REL[name] + 1e-12


def test_none_is_exact():
    codec = hq.get_codec("none")
    x = _x()
    x[5] = np.nan
    x[6] = -np.inf
    d = codec.decode(codec.encode(x))
    np.testing.assert_array_equal(d, x)
    pl = codec.encode(x)
    x[0] = 123.0
    assert pl.data[0] != 123.0  # the payload is a copy, not a view of the input


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_fp16_is_ieee_half():
    codec = hq.get_codec("fp16")
    x = np.array([0.0, -0.0, 1.0, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 1e-9, np.nan, np.inf,
                  1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11], np.float32)
    d = codec.decode(codec.encode(x))
    np.testing.assert_array_equal(d, x.astype(np.float16).astype(np.float32))
    assert d[4] == np.inf and d[5] == np.inf and d[6] == -np.inf  # overflow
    assert d[11] == 1.0 and d[12] == np.float32(1 + 2.0 ** -9)   # ties to even


def test_bf16_rounding():
    x = np.array([1.0, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, 1 + 2.0 ** -8 + 2.0 ** -20, -2.5,
                  3.4028235e38, 1e-40, 0.0, -0.0, np.inf, -np.inf], np.float32)
    d = bf16_bits_to_float32(float32_to_bf16_bits(x))
    sub = np.uint32(0x00010000).view(np.float32)  # 1e-40 = 0x000116C2 rounds down
    expect = np.array([1.0, 1.0, 1 + 2.0 ** -6, 1 + 2.0 ** -7, -2.5, np.inf,
                       sub, 0.0, -0.0, np.inf, -np.inf], np.float32)
    np.testing.assert_array_equal(d, expect)
    assert np.signbit(d[8])
    # NaNs stay NaN, including one whose payload lives only in the low 16 bits
    nans = np.array([0x7FC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF], np.uint32).view(np.float32)
    assert np.isnan(bf16_bits_to_float32(float32_to_bf16_bits(nans))).all()


def test_bf16_matches_ml_dtypes():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = _x(100000, 2)
    x[:5] = [np.inf, -np.inf, 0.0, -0.0, 3.4e38]
    ours = float32_to_bf16_bits(x)
    theirs = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("name", BASELINES)
def test_mean_estimate(name):
    """none/fp16 sum in the wire dtype (what an allreduce does); bf16 widens every gathered
    payload to float32 and sums in rank order."""
    codec = hq.get_codec(name)
    xs = [_x(3000, r) for r in range(4)]
    est, wire = hq.mean_estimate(codec, xs, seed=0)
    assert est.dtype == np.float32 and wire == codec.encode(xs[0]).nbytes
    if name == "bf16":
        total = np.zeros(3000, np.float32)
        for x in xs:
            total += bf16_bits_to_float32(float32_to_bf16_bits(x))
        expect = total * np.float32(1 / 4)
    else:
        dt = np.float32 if name == "none" else np.float16
        total = xs[0].astype(dt)
        for x in xs[1:]:
            total = total + x.astype(dt)
        expect = total.astype(np.float32) * np.float32(1 / 4)
    np.testing.assert_array_equal(est, expect)
    true = np.mean(np.stack(xs).astype(np.float64), axis=0)
    tol = {"none": 1e-6, "fp16": 4 * 2.0 ** -11, "bf16": 4 * 2.0 ** -8}[name]
    assert np.all(np.abs(est - true) <= tol * np.max(np.abs(np.stack(xs)), axis=0) + 1e-30)
