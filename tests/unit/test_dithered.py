"""dithered (DQSG) and nested_dithered (NDQSG) against the nested-dithered-quantization paper.

The NumPy reference below is written from the paper (eq. (2), (6)-(7)) and the wire format in
docs/dev/formats.md ("Dithered codes"), not from the kernels. Statistical checks use
fixed seeds and tolerances derived from the exact distribution of the error (uniform on
[-Delta/2, Delta/2] per element, independent across elements), at 5 sigma; each kind of check
also runs a negative control that must fail it.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

import horovod_quant as hq
from horovod_quant.backends.numba.packing import packed_nbytes, unpack
from horovod_quant.backends.numba.rng import uniforms
from horovod_quant.core.dithered import fine_levels
from horovod_quant.core.nested_dithered import HEADER, coarse_bits, outage_bound, theorem6_ratio
from horovod_quant.core.rng import derive_key
from horovod_quant.exchange.codec_states import CodecStates

Z = 5.0
BUCKET = 512
SIZES = [0, 1, 7, 8, 9, BUCKET - 1, BUCKET + 1, 8192 + 513]


def grad(n, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * np.exp(rng.standard_normal(n // 97 + 1).repeat(97)[:n])
    return (x * scale).astype(np.float32)


def correlated(n_workers, d, noise, seed=0):
    """Workers' gradients g + noise * N(0, 1): side information is good when noise is small."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(d).astype(np.float32)
    return [(g + noise * rng.standard_normal(d)).astype(np.float32) for _ in range(n_workers)]


# --------------------------------------------------------------------------------------------
# reference from the paper
# --------------------------------------------------------------------------------------------
def ref_kappa(x, bucket):
    b = bucket or max(x.size, 1)
    out = []
    for lo in range(0, x.size, b):
        xb = x[lo:lo + b]
        out.append(np.max(np.abs(xb)) if np.all(np.isfinite(xb)) else np.nan)
    return np.array(out, np.float32), b


def ref_dqsg(x, bits, bucket, seed, alpha=1.0):
    """(kappa per bucket, fine indices q, decode) of eq. (2) with u = (1/2 - rho) Delta:
    q = ceil((x / kappa) alpha M - rho), x_hat = (kappa / M) ((q - 1/2) + rho), float32."""
    M = fine_levels(bits)
    kap, b = ref_kappa(x, bucket)
    ke = np.repeat(kap, b)[:x.size]
    ok = np.isfinite(ke) & (ke > 0)
    rho = uniforms(x.size, derive_key(seed))
    with np.errstate(invalid="ignore", divide="ignore"):
        t = (x / np.where(ok, ke, 1)).astype(np.float32) * np.float32(alpha * M)
    lvl = np.floor(t)
    q = np.where(ok, lvl.astype(np.int64) + (rho < (t - lvl)), 0)
    with np.errstate(invalid="ignore"):
        dec = ((q.astype(np.float32) - np.float32(0.5)) + rho) * (ke / np.float32(M))
    return kap, q, dec.astype(np.float32)


# ============================================================================================
# DQSG
# ============================================================================================
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("bucket", [BUCKET, None, 7])
def test_dithered_codes_and_decode_match_reference(bits, bucket):
    codec = hq.get_codec("dithered", bits=bits, bucket_size=bucket)
    M = fine_levels(bits)
    for n in SIZES:
        x = grad(n, n)
        p = codec.encode(x, seed=n + 17)
        kap, q, dec = ref_dqsg(x, bits, bucket, n + 17)
        nb = kap.size
        assert p.nbytes == 4 * nb + packed_nbytes(n, bits)
        np.testing.assert_array_equal(p.data[:4 * nb].view(np.float32), kap)
        codes = unpack(p.data[4 * nb:], n, bits)
        assert codes.max(initial=0) <= 2 * M
        np.testing.assert_array_equal(codes.astype(np.int64) - M, q)
        np.testing.assert_array_equal(codec.decode(p), dec)
        acc = np.ones(n, np.float32)
        np.testing.assert_array_equal(codec.decode_add(p, acc), np.float32(1) + dec)


@pytest.mark.parametrize("bits", range(2, 9))
def test_dithered_error_within_half_step(bits):
    codec = hq.get_codec("dithered", bits=bits)
    for n in SIZES:
        x = grad(n, 3)
        kap, b = ref_kappa(x, BUCKET)
        ke = np.repeat(kap.astype(np.float64), b)[:n]
        err = np.abs(codec.decode(codec.encode(x, seed=5)).astype(np.float64) - x)
        assert np.all(err <= ke / (2 * codec.M) * (1 + 1e-5) + 1e-30)


def _fractional_positions(M, per=300):
    """Buckets of 512 holding 1.0 (so kappa = 1) and values at fraction phi of a fine bin."""
    phis = [0.0, 0.1, 0.25, 0.5, 0.75, 0.97]
    rng = np.random.default_rng(7)
    x, group = [], []
    for g, phi in enumerate(phis):
        j = rng.integers(-M, M, per)
        x.append(((j + phi) / M).astype(np.float32))
        group.append(np.full(per, g))
    x, group = np.concatenate(x), np.concatenate(group)
    x = np.concatenate([[1.0], x]).astype(np.float32)  # kappa = 1 in the first bucket ...
    group = np.concatenate([[-1], group])
    for lo in range(BUCKET, x.size, BUCKET):          # ... and in every later one
        x[lo] = 1.0
        group[lo] = -1
    return x, group, len(phis)


def _ks_uniform(e):
    """sqrt(N) * Kolmogorov-Smirnov distance of samples e from U[-1/2, 1/2]."""
    s = np.sort(e) + 0.5
    n = s.size
    i = np.arange(1, n + 1)
    return math.sqrt(n) * max(np.max(i / n - s), np.max(s - (i - 1) / n))


def _theorem1_violations(codec, M, trials=200):
    """Per group of equal fractional position: KS distance, z of the mean and z of the mean
    square of e = (x_hat - x) / (kappa Delta) against U[-1/2, 1/2] (mean 0, E e^2 = 1/12,
    Var e^2 = 1/180). Returns the largest |statistic| / threshold over groups (> 1 = fail)."""
    x, group, ng = _fractional_positions(M)
    errs = np.stack([(codec.decode(codec.encode(x, seed=s)).astype(np.float64) - x) * M
                     for s in range(trials)])
    worst = 0.0
    for g in range(ng):
        e = errs[:, group == g].ravel()
        z_mean = abs(e.mean()) / math.sqrt(1 / 12 / e.size)
        z_var = abs((e * e).mean() - 1 / 12) / math.sqrt(1 / 180 / e.size)
        # P(sqrt(N) D > 2.6) < 1e-5 for the Kolmogorov distribution
        worst = max(worst, z_mean / Z, z_var / Z, _ks_uniform(e) / 2.6)
    return worst


def test_dithered_error_uniform_and_independent_of_x():
    """Theorem 1: the scaled error is U[-Delta/2, Delta/2] whatever x's position in its bin."""
    codec = hq.get_codec("dithered", bits=4)
    assert _theorem1_violations(codec, codec.M) <= 1.0
    # negative control: QSGD with the same grid is half-dithered (Lemma 2); its error depends
    # on x (zero at phi = 0, variance phi (1 - phi) Delta^2) and must fail
    qsgd = hq.get_codec("qsgd", bits=4, norm="max")
    assert _theorem1_violations(qsgd, 7) > 3.0


def _mean_error_moments(xs, bits, bucket):
    """Per element: variance and fourth moment of the mean estimate's error
    S = (1/n) sum_r kappa_r Delta U_r, U_r ~ U[-1/2, 1/2] independent (Theorem 1)."""
    n = len(xs)
    M = fine_levels(bits)
    v2 = []
    for x in xs:
        kap, b = ref_kappa(x, bucket)
        v2.append((np.repeat(kap.astype(np.float64), b)[:x.size] / M) ** 2 / (12 * n ** 2))
    v2 = np.array(v2)  # Var of each worker's term
    var = v2.sum(axis=0)
    # E S^4 = sum_r E t_r^4 + 6 sum_{r<s} E t_r^2 E t_s^2, E t^4 = 9/5 (E t^2)^2 for uniform t
    m4 = 1.8 * (v2 ** 2).sum(axis=0) + 3 * (var ** 2 - (v2 ** 2).sum(axis=0))
    return var, m4


def _unbiased_z(ests, truth, var):
    """z of the projection on the truth and of the chi-square sum of per-element z^2."""
    T = ests.shape[0]
    dev = ests.mean(axis=0) - truth
    z_proj = np.sum(truth * dev) / math.sqrt(np.sum(truth ** 2 * var) / T)
    chi = np.sum(dev ** 2 / (var / T))
    z_chi = (chi - dev.size) / math.sqrt(2 * dev.size)
    return z_proj, z_chi


def _variance_z(ests, truth, var, m4):
    T = ests.shape[0]
    sq = np.sum((ests - truth) ** 2, axis=1)
    return (sq.mean() - var.sum()) / math.sqrt(np.sum(m4 - var ** 2) / T)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_dithered_mean_estimate_unbiased_with_lemma3_variance(n):
    xs = [grad(1500, 10 + r, scale=r + 1) for r in range(n)]
    codec = hq.get_codec("dithered", bits=3, bucket_size=BUCKET)
    truth = np.mean(np.array(xs, np.float64), axis=0)
    T = 300
    ests = np.stack([hq.mean_estimate(codec, xs, seed=s)[0].astype(np.float64) for s in range(T)])
    var, m4 = _mean_error_moments(xs, 3, BUCKET)
    z_proj, z_chi = _unbiased_z(ests, truth, var)
    assert abs(z_proj) < Z and abs(z_chi) < Z
    assert abs(_variance_z(ests, truth, var, m4)) < Z
    # negative controls: a 1% scaled estimate is biased; QSGD's (data-dependent) variance is not
    # Lemma 3's
    assert abs(_unbiased_z(ests * 1.01, truth, var)[0]) > Z
    q = hq.get_codec("qsgd", bits=3, norm="max")
    q_ests = np.stack([hq.mean_estimate(q, xs, seed=s)[0].astype(np.float64) for s in range(T)])
    assert abs(_variance_z(q_ests, truth, var, m4)) > Z


def test_dithered_zero_and_nonfinite_buckets():
    codec = hq.get_codec("dithered", bits=4, bucket_size=8)
    x = grad(40, 1)
    x[8:16] = 0.0
    x[17] = np.nan
    x[26] = np.inf
    x[35] = -np.inf
    d = codec.decode(codec.encode(x, seed=2))
    assert np.all(d[8:16] == 0)
    assert not np.any(np.isfinite(d[16:24]))
    assert not np.any(np.isfinite(d[24:40]))
    assert np.all(np.isfinite(d[:8]))
    assert np.all(codec.decode(codec.encode(np.zeros(9, np.float32), seed=1)) == 0)


def test_dithered_needs_the_senders_seed():
    codec = hq.get_codec("dithered", bits=4)
    x = grad(3000, 2)
    p = codec.encode(x, seed=worker_seed_of(9, 1))
    wire = codec.payload_from_wire(p.data.copy(), p.size, seed=worker_seed_of(9, 1))
    np.testing.assert_array_equal(codec.decode(wire), codec.decode(p))
    with pytest.raises(ValueError, match="seed"):
        codec.decode(hq.Payload(p.data, p.size))
    # another seed regenerates other dithers: the error is no longer within Delta/2
    wrong = codec.payload_from_wire(p.data, p.size, seed=worker_seed_of(9, 2))
    kap, b = ref_kappa(x, BUCKET)
    ke = np.repeat(kap, b)[:x.size]
    assert np.mean(np.abs(codec.decode(wrong) - x) > ke / (2 * codec.M)) > 0.2
    assert not np.array_equal(codec.encode(x, seed=1).data, codec.encode(x, seed=2).data)


def worker_seed_of(seed, rank):
    return hq.worker_seed(seed, rank)


@pytest.mark.parametrize("params, match", [
    ({"bits": 1}, "bits=1"), ({"bits": 9}, "bits=9"), ({"bits": 2.5}, "bits"),
    ({"bits": True}, "bits"), ({"bucket_size": 0}, "bucket_size=0"),
])
def test_dithered_invalid_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        hq.get_codec("dithered", **params)


# ============================================================================================
# NDQSG
# ============================================================================================
def nested(n, **kw):
    return hq.get_codec("nested_dithered", world_size=n, **kw)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("bits, k", [(4, 5), (4, 3), (8, 31)])
def test_nested_equals_dqsg_inside_coarse_bin_with_fewer_bits(n, bits, k):
    """alpha = 1 and |alpha z + e| < Delta2/2: eq. (7) recovers the fine index, so the estimate
    is DQSG's with the same Delta1 and dithers, bit for bit, while P2 sends ceil(log2 k) bits."""
    d = 5000
    xs = correlated(n, d, noise=0.004, seed=n)
    codec = nested(n, bits=bits, coarse_ratio=k)
    dq = hq.get_codec("dithered", bits=bits)
    states = CodecStates()
    for seed in (1, 2):
        est, _ = hq.mean_estimate(codec, xs, seed=seed, states=states)
        ref, _ = hq.mean_estimate(dq, xs, seed=seed)
        np.testing.assert_array_equal(est, ref)
        stats = states.of(codec).last_stats
        assert stats["outside_share"] == 0.0
        assert stats["k"] == k and stats["bits_p2"] == coarse_bits(k)
    p2 = codec.encode_worker(xs[-1], 1, n - 1)
    nb = -(-d // BUCKET)
    assert p2.nbytes == HEADER + 4 * nb + packed_nbytes(d, coarse_bits(k))
    assert p2.nbytes < dq.encode(xs[-1]).nbytes
    assert codec.encode_worker(xs[0], 1, 0).nbytes == HEADER + dq.encode(xs[0]).nbytes
    # negative control: side information that is too poor breaks the equality
    far = correlated(n, d, noise=0.5, seed=n)
    assert not np.array_equal(hq.mean_estimate(codec, far, seed=1, states=states)[0],
                              hq.mean_estimate(dq, far, seed=1)[0])
    assert states.of(codec).last_stats["outside_share"] > 0.02


def test_nested_groups():
    assert [nested(n).n1 for n in (1, 2, 3, 4, 5)] == [1, 1, 2, 2, 3]
    assert nested(4, p1_fraction=0.25).n1 == 1 and nested(4, p1_fraction=1.0).n1 == 4
    c = nested(4)
    assert [c.in_p1(r) for r in range(4)] == [True, True, False, False]
    # everyone in P1: plain DQSG
    xs = correlated(3, 700, 0.1)
    est, _ = hq.mean_estimate(nested(3, p1_fraction=1.0), xs, seed=4)
    np.testing.assert_array_equal(est, hq.mean_estimate(hq.get_codec("dithered"), xs, seed=4)[0])


def _p1_side_info(codec, xs, seed):
    """The P1 mean every receiver computes (decode in rank order, float32 sum, / n1)."""
    acc = np.zeros(xs[0].size, np.float32)
    for r in range(codec.n1):
        codec.decode_add(codec.encode_worker(xs[r], seed, r), acc)
    return acc * np.float32(1.0 / codec.n1)


def eq8(k, alpha, sigma2, M):
    """Theorem 6, eq. (8), written from the paper: Chebyshev on alpha z + u with
    u ~ U[-Delta1/2, Delta1/2], P(|alpha z + u| > Delta2/2) <= (alpha^2 sigma_z^2 +
    Delta1^2/12) / (Delta2/2)^2, Delta1 = 1/M and Delta2 = k Delta1 (bucket-scale units)."""
    d1 = 1.0 / M
    return (alpha ** 2 * sigma2 + d1 * d1 / 12) / (k * d1 / 2) ** 2


def test_nested_outage_share_matches_theorem6():
    """With y fixed, a P2 value is decoded wrongly iff |alpha M z + e| > k/2 in fine steps,
    e ~ U[-1/2, 1/2] (Theorem 6): P(outage) = clip(|alpha M z| + 1/2 - k/2, 0, 1) exactly,
    0 when |z| < (Delta2 - Delta1) / (2 alpha); the reported share must match the sum of
    these probabilities and stay below eq. (8)'s bound. Values stay within [-1/2, 1/2] of the
    bucket scale: near +-1 a wrong coarse bin would leave [-M, M] and the decoder's clamp
    (module doc) corrects it, which only lowers the outage."""
    d, k, bits, alpha = 20000, 5, 8, 0.9
    M = fine_levels(bits)
    codec = nested(2, bits=bits, coarse_ratio=k, alpha=alpha, bucket_size=None)
    rng = np.random.default_rng(3)
    x0 = rng.uniform(-0.45, 0.45, d).astype(np.float32)
    x0[0] = 1.0
    seed = 8
    y = _p1_side_info(codec, [x0], seed)
    # P2 input: y plus a shift of 0..4 fine steps, so z spans inside, across and past the edge
    shift = rng.uniform(0, 4.0, d) * rng.choice([-1, 1], d) / (alpha * M)
    x1 = (y + shift).astype(np.float32)
    x1[0] = 1.0
    kap = float(np.max(np.abs(x1)))
    Zs = alpha * M * (y.astype(np.float64) - x1) / kap
    p = np.clip(np.abs(Zs) + 0.5 - k / 2, 0, 1)
    shares, state = [], codec.new_state()
    for t in range(40):
        payloads = [codec.encode_worker(x0, seed, 0), codec.encode(x1, seed=1000 + t, rank=1)]
        codec.decode_side_info(payloads, [hq.worker_seed(seed, 0), 1000 + t], inputs=[x0, x1],
                               state=state)
        shares.append(state.last_stats["outside_share"])
    # below the edge the decode is eq. (7) with the right coarse bin: alpha times the DQSG
    # decode of alpha x plus (1 - alpha^2) y, never wrong
    inside = np.abs(Zs) < (k - 1) / 2 - 1e-3
    x_hat = codec.decode_p2(codec.encode(x1, seed=1000, rank=1), y)
    expect = alpha * ref_dqsg(x1, bits, None, 1000, alpha=alpha)[2] + (1 - alpha ** 2) * y
    np.testing.assert_allclose(x_hat[inside], expect[inside], rtol=0, atol=1e-6)
    count = 40 * d
    mean_share = float(np.mean(shares))
    expect = p.mean()
    sd = math.sqrt(np.sum(p * (1 - p)) * 40) / count
    assert abs(mean_share - expect) < Z * sd, (mean_share, expect, sd)
    assert 0.05 < expect < 0.5  # the test exercises real outages
    sigma2 = float(np.mean(((y.astype(np.float64) - x1) / kap) ** 2))
    assert mean_share <= eq8(k, alpha, sigma2, M), (mean_share, eq8(k, alpha, sigma2, M))


def test_nested_shrinkage_bias_and_variance_eq9():
    """alpha < 1 and a correct coarse bin: x_hat = x + (1 - alpha^2) z - alpha kappa e
    (Appendix E), so E x_hat = alpha^2 x + (1 - alpha^2) y and
    E (x_hat - x)^2 = alpha^2 kappa^2 Delta1^2 / 12 + (1 - alpha^2)^2 (y - x)^2 (eq. (9))."""
    d, bits, alpha, k = 3000, 4, 0.8, 9
    M = fine_levels(bits)
    codec = nested(2, bits=bits, coarse_ratio=k, alpha=alpha, bucket_size=None)
    xs = correlated(2, d, noise=0.02, seed=5)
    y = _p1_side_info(codec, xs, 3).astype(np.float64)
    x = xs[1].astype(np.float64)
    kap = float(np.max(np.abs(xs[1])))
    T = 400
    dec = np.stack([codec.decode_p2(codec.encode(xs[1], seed=s, rank=1), y.astype(np.float32))
                    for s in range(T)]).astype(np.float64)
    mean = alpha ** 2 * x + (1 - alpha ** 2) * y
    var_e = (alpha * kap / M) ** 2 / 12  # the dither term alone is random here
    z = (dec.mean(axis=0) - mean) / math.sqrt(var_e / T)
    assert abs(z.sum() / math.sqrt(d)) < Z and abs((np.sum(z * z) - d) / math.sqrt(2 * d)) < Z
    mse = np.mean(np.sum((dec - x) ** 2, axis=1))
    exact = d * var_e + np.sum(((1 - alpha ** 2) * (y - x)) ** 2)
    # per element (x_hat - x) = b + s U with b the bias, s^2 = 12 var_e: Var = 4 b^2 s^2 / 12
    # + s^4 / 180
    b = (1 - alpha ** 2) * (y - x)
    sd = math.sqrt(np.sum(4 * b ** 2 * var_e + 144 * var_e ** 2 / 180) / T)
    assert abs(mse - exact) < Z * sd
    # negative control: the decodes are biased towards y, so the unbiased hypothesis fails
    z_x = (dec.mean(axis=0) - x) / math.sqrt(var_e / T)
    assert (np.sum(z_x * z_x) - d) / math.sqrt(2 * d) > Z


@pytest.mark.parametrize("n", [2, 3, 4])
def test_nested_mean_estimate_unbiased(n):
    """alpha = 1: unbiased with DQSG's variance whenever decoding is correct (Theorem 6)."""
    xs = correlated(n, 1500, noise=0.01, seed=20 + n)
    codec = nested(n, bits=3, coarse_ratio=3)
    truth = np.mean(np.array(xs, np.float64), axis=0)
    T = 300
    ests, states = [], CodecStates()
    for s in range(T):
        ests.append(hq.mean_estimate(codec, xs, seed=s, states=states)[0].astype(np.float64))
        assert states.of(codec).last_stats["outside_share"] == 0.0
    ests = np.stack(ests)
    var, m4 = _mean_error_moments(xs, 3, BUCKET)
    z_proj, z_chi = _unbiased_z(ests, truth, var)
    assert abs(z_proj) < Z and abs(z_chi) < Z
    assert abs(_variance_z(ests, truth, var, m4)) < Z


@pytest.mark.parametrize("alpha", [1.0, 0.8])
def test_nested_adaptive_ratio_and_state_agree_with_distributed_decode(alpha):
    """Default k: 2M+1 before any measurement (DQSG bytes, no outage), then Theorem 6 with the
    measured sigma_z^2; every rank's combine_gathered follows the same sequence."""
    n, d, bits = 4, 6000, 6
    M = fine_levels(bits)
    xs = correlated(n, d, noise=0.003, seed=1)
    codec = nested(n, bits=bits, alpha=alpha)
    sim_states, view = CodecStates(), codec.new_state()
    assert codec.coarse_ratio_of(None) == codec.coarse_ratio_of(view) == 2 * M + 1
    ks = []
    for seed in range(4):
        est, _ = hq.mean_estimate(codec, xs, seed=seed, states=sim_states)
        sim = sim_states.of(codec)
        payloads = [codec.encode_worker(x, seed, r, state=view) for r, x in enumerate(xs)]
        np.testing.assert_array_equal(codec.decode_side_info(
            payloads, [hq.worker_seed(seed, r) for r in range(n)], state=view), est)
        assert view.sigma2 == sim.sigma2 and view.next_k == sim.next_k
        st = sim.last_stats
        ks.append(st["k"])
        assert st["next_k"] == theorem6_ratio(bits, alpha, st["sigma2"], 0.01)
        assert st["outside_share"] <= 0.01
        assert view.last_stats["outside_share"] is None
    assert ks[0] == 2 * M + 1 and ks[1] < ks[0] and coarse_bits(ks[1]) < bits
    # sigma2 estimates E z^2 with z = (y - x) / kappa of the P2 ranks (in scaled units), from
    # ((alpha z + e)^2 - Delta1^2 / 12) / alpha^2, e ~ U[-Delta1/2, Delta1/2]
    y = _p1_side_info(codec, xs, 3).astype(np.float64)
    z2, terms = [], []
    for r in range(codec.n1, n):
        kap, b = ref_kappa(xs[r], BUCKET)
        zr = (y - xs[r]) / np.repeat(kap.astype(np.float64), b)[:d]
        z2.append(zr ** 2)
        terms.append(((alpha * zr + rng_uniform(d, r) / M) ** 2 - 1 / (12 * M * M)) / alpha ** 2)
    z2 = np.concatenate(z2)
    sd = np.std(np.concatenate(terms)) / math.sqrt(z2.size)
    assert abs(sim.sigma2 - z2.mean()) < Z * sd
    # negative control: the residuals' raw mean square is off by Delta1^2 / 12 (and alpha)
    raw = (sim.sigma2 * alpha ** 2 + 1 / (12 * M * M))
    assert abs(raw - z2.mean()) > Z * sd


def rng_uniform(d, seed):
    return np.random.default_rng(seed).uniform(-0.5, 0.5, d)


def test_side_information_interface_keeps_each_exchange_to_itself():
    """``combine_side_info`` returns this rank's own outage count and the exchange's record;
    ``finish_side_info`` completes that record, not whichever exchange was decoded last; the
    state (sigma2, next k) moves once per combine, as ``decode_side_info`` moves it."""
    n, bits, d = 4, 4, 3000  # P2: ranks 2, 3; each knows only its own input
    a, b = correlated(n, d, noise=0.3, seed=3), correlated(n, d, noise=0.001, seed=4)
    codec = nested(n, bits=bits, coarse_ratio=3)
    ref_states, state = CodecStates(), codec.new_state()
    ref_a, _ = hq.mean_estimate(codec, a, seed=5, states=ref_states)
    share_a = ref_states.of(codec).last_stats["outside_share"]
    outcomes = {}
    for name, xs, seed in (("a", a, 5), ("b", b, 6)):
        payloads = [codec.payload_from_wire(codec.encode_worker(x, seed, r).data, d,
                                            seed=hq.worker_seed(seed, r))
                    for r, x in enumerate(xs)]
        outcomes[name] = [codec.combine_side_info(payloads, seed, r, xs[r], state=state)
                          for r in range(n)]
    np.testing.assert_array_equal(outcomes["a"][0].mean, ref_a)
    assert outcomes["a"][0].own_outages == 0  # rank 0 is in P1: no values of its own to miss
    wrong = sum(o.own_outages for o in outcomes["a"])
    assert wrong > 0 and state.last_stats is outcomes["b"][-1].record
    codec.finish_side_info(outcomes["a"][-1], wrong)
    assert outcomes["a"][-1].record["outside_share"] == share_a
    assert state.last_stats["outside_share"] is None  # b is not finished
    assert not hasattr(hq.get_codec("dithered"), "combine_side_info")


def test_nested_payload_carries_its_ratio():
    """A receiver whose running estimate differs (exchanges in flight) still decodes."""
    xs = correlated(2, 2000, noise=0.002)
    sender, receiver = nested(2, coarse_ratio=5), nested(2)
    payloads = [sender.encode_worker(x, 3, r) for r, x in enumerate(xs)]
    assert sender.payload_k(payloads[1]) == 5 and receiver.coarse_ratio_of(None) == 15
    np.testing.assert_array_equal(receiver.combine_gathered(payloads, 3),
                                  sender.combine_gathered(payloads, 3))
    with pytest.raises(ValueError, match="side information"):
        receiver.decode(payloads[1])
    with pytest.raises(ValueError, match="P2"):
        receiver.combine_gathered(payloads[::-1], 3)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_nested_sizes_zeros_and_nonfinite(n):
    codec = nested(n)
    for d in SIZES:
        xs = correlated(n, d, noise=0.01, seed=d)
        est, wire = hq.mean_estimate(codec, xs, seed=d)
        assert est.shape == (d,) and est.dtype == np.float32 and np.all(np.isfinite(est))
        assert wire >= HEADER
    xs = correlated(n, 3 * BUCKET, noise=0.01)
    for x in xs:
        x[BUCKET:2 * BUCKET] = 0.0
    est, _ = hq.mean_estimate(codec, xs, seed=1)
    assert np.all(est[BUCKET:2 * BUCKET] == 0)
    for bad_rank in (0, n - 1):  # P1 and P2
        bad = [x.copy() for x in xs]
        bad[bad_rank][5] = np.nan
        bad[bad_rank][2 * BUCKET + 3] = np.inf
        est, _ = hq.mean_estimate(codec, bad, seed=2)
        assert not np.any(np.isfinite(est[:BUCKET]))
        assert not np.isfinite(est[5]) and not np.isfinite(est[2 * BUCKET + 3])
        assert np.all(np.isfinite(est[BUCKET:2 * BUCKET]))


@pytest.mark.parametrize("params, match", [
    ({}, "world_size"), ({"world_size": 0}, "world_size=0"),
    ({"world_size": 2, "bits": 1}, "bits=1"),
    ({"world_size": 2, "p1_fraction": 0}, "p1_fraction"),
    ({"world_size": 2, "p1_fraction": 1.5}, "p1_fraction"),
    ({"world_size": 2, "alpha": 0.0}, "alpha"), ({"world_size": 2, "alpha": 1.2}, "alpha"),
    ({"world_size": 2, "alpha": "x"}, "alpha"),
    ({"world_size": 2, "coarse_ratio": 4}, "odd"),
    ({"world_size": 2, "coarse_ratio": 1}, "coarse_ratio=1"),
    ({"world_size": 2, "bits": 4, "coarse_ratio": 17}, "2\\^bits - 1 = 15"),
    ({"world_size": 2, "outage": 0}, "outage"), ({"world_size": 2, "outage": 1}, "outage"),
    ({"world_size": 2, "bucket_size": 0}, "bucket_size=0"),
])
def test_nested_invalid_parameters(params, match):
    with pytest.raises(ValueError, match=match):
        hq.get_codec("nested_dithered", **params)


def test_nested_wrong_world():
    codec = nested(3)
    xs = correlated(2, 100, 0.1)
    with pytest.raises(ValueError, match="world_size=3"):
        hq.mean_estimate(codec, xs, seed=0)
    payloads = [codec.encode_worker(x, 0, r) for r, x in enumerate(xs)]
    with pytest.raises(ValueError, match="world_size=3"):
        codec.decode_side_info(payloads, [0, 1])


def test_theorem6_ratio():
    M = fine_levels(4)
    assert theorem6_ratio(4, 1.0, math.inf, 0.01) == 2 * M + 1
    # sigma = 0: Delta1^2 / (3 Delta2^2) = 1 / (3 k^2) <= 0.01 first at k = 7
    assert theorem6_ratio(4, 1.0, 0.0, 0.01) == 7
    for s2 in (1e-4, 1e-3, 3e-3):
        k = theorem6_ratio(4, 1.0, s2, 0.01)
        assert k % 2 == 1 and eq8(k, 1.0, s2, M) <= 0.01 or k == 2 * M + 1
        assert k == 3 or eq8(k - 2, 1.0, s2, M) > 0.01
    # the codec's bound (behind its choice of k and last_stats' outside_bound) is eq. (8)
    for k, alpha, s2, bits in [(3, 1.0, 1e-3, 4), (5, 0.9, 2e-4, 8), (11, 0.5, 0.0, 6)]:
        m = fine_levels(bits)
        assert outage_bound(k, alpha, s2, m) == pytest.approx(eq8(k, alpha, s2, m), rel=1e-12)


def test_equal_nested_codecs_share_one_object_safely():
    """Codecs are values: exchanges of one NDQSG codec object each carry their own adaptive
    state (CodecStates), so each gives what it gives with a codec object of its own; a state
    saved and loaded (as JSON, a checkpoint) continues where it was."""
    n, bits = 4, 6
    close, loose = correlated(n, 3000, noise=0.003, seed=5), correlated(n, 3000, noise=0.3, seed=6)
    shared = nested(n, bits=bits)
    mine = {"close": nested(n, bits=bits), "loose": nested(n, bits=bits)}
    shared_states = {"close": CodecStates(), "loose": CodecStates()}
    own_states = {"close": CodecStates(), "loose": CodecStates()}
    for seed in range(3):
        for which, xs in (("close", close), ("loose", loose)):
            got, _ = hq.mean_estimate(shared, xs, seed=seed, states=shared_states[which])
            want, _ = hq.mean_estimate(mine[which], xs, seed=seed, states=own_states[which])
            np.testing.assert_array_equal(got, want)
    k = {w: shared_states[w].of(shared).next_k for w in shared_states}
    assert k["close"] < k["loose"]
    resumed = CodecStates()
    resumed.load_state_dict(json.loads(json.dumps(shared_states["close"].state_dict())))
    assert resumed.of(shared).next_k == k["close"]
    np.testing.assert_array_equal(
        hq.mean_estimate(shared, close, seed=9, states=resumed)[0],
        hq.mean_estimate(shared, close, seed=9, states=shared_states["close"])[0])
    with pytest.raises(ValueError, match="not an NDQSG exchange state"):
        shared.new_state().load_state_dict({"k": 3})
