"""Regression tests for decode() on damaged payloads (one per failure that was reported), the
messages, the metadata checks, and the GPU path's checks before any kernel launch.

Reported failures: a payload whose declared size exceeds its bytes crashed the interpreter
(qsgd, nuqsgd, natural / standard dithering, dithered, nested, Elias); 0xFF bytes in a sparse
Global-QSGD payload wrote out of bounds; a payload cut in half decoded to its declared size
without complaint; fp16/bf16 ignored the size. The crashing cases also run in a child
interpreter (:func:`test_known_crashes_in_a_child_process`), so that a regression fails that
test instead of killing pytest.
"""
from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import horovod_quant as hq
from horovod_quant.backends import use_backend
from horovod_quant.backends.cuda import CudaBackend
from horovod_quant.core import worker_seed
from horovod_quant.core.base import MAX_PAYLOAD_SIZE
from horovod_quant.core.contract import CombinedDecodable, SumDecodable
from horovod_quant.core.nested_dithered import HEADER
from horovod_quant.core.payload import Payload

RNG = np.random.default_rng(7)
X = RNG.standard_normal(100_000).astype(np.float32)

#: (name, params) of one configuration per codec family and format
CONFIGS = [
    ("none", {}), ("fp16", {}), ("bf16", {}),
    ("qsgd", {"bits": 4, "bucket_size": 512}), ("qsgd", {"bits": 2, "bucket_size": None}),
    ("qsgd", {"bits": 4, "bucket_size": 512, "elias": True}),
    ("qsgd", {"bits": 2, "bucket_size": None, "elias": True}),
    ("nuqsgd", {"bits": 4}), ("natural", {}), ("natural_dithering", {"bits": 3}),
    ("standard_dithering", {"bits": 5, "p": math.inf}),
    ("global_qsgd", {"world_size": 2, "levels": "linear", "bits": 8}),
    ("global_qsgd", {"world_size": 3, "levels": "exponential", "bits": 8}),
    ("global_qsgd", {"world_size": 4, "levels": "exponential", "mode": "sparse", "bits": 4}),
    ("global_qsgd", {"world_size": 2, "levels": "linear", "mode": "sparse", "bits": 8}),
    ("dithered", {"bits": 4}), ("nested_dithered", {"world_size": 2, "coarse_ratio": 5}),
]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in p.items())}" for n, p in CONFIGS]


def encoded(name, params, x=X, rank=0):
    codec = hq.get_codec(name, **params)
    if name == "global_qsgd":
        p = codec.encode_worker(x, 3, rank, codec.global_norm([x]))
    else:
        p = codec.encode_worker(x, 3, rank)
    return codec, p


_SAME = object()


def with_data(p, data, size=_SAME):
    return Payload(data, p.size if size is _SAME else size, dict(p.meta))


def decoders(codec, p):
    """Every single-payload decode entry point of the codec, as calls."""
    n = p.size
    raw = np.asarray(p.data).reshape(-1).view(np.uint8)
    calls = {
        "decode": lambda: codec.decode(p),
        "decode(out)": lambda: codec.decode(p, np.empty(X.size, np.float32)),
        "decode_add": lambda: codec.decode_add(p, np.zeros(X.size, np.float32)),
        # rebuilt from bytes, then decoded (an Elias stream is checked as it is decoded)
        "payload_from_wire": lambda: codec.decode(codec.payload_from_wire(raw, n, **p.meta)),
    }
    if isinstance(codec, CombinedDecodable):
        calls["decode_sum"] = lambda: codec.decode_sum(p, 1)
    if codec.name == "nested_dithered":
        calls["payload_from_wire"] = lambda: codec.payload_from_wire(raw, n, **p.meta)
        calls["decode_p2"] = lambda: codec.decode_p2(p, np.zeros(X.size, np.float32))
        calls.pop("decode")
        calls.pop("decode(out)")
        calls.pop("decode_add")
    return calls


# -- the reported failures -----------------------------------------------------------------------
@pytest.mark.parametrize("name, params", [
    ("qsgd", {}), ("nuqsgd", {}), ("natural", {}), ("natural_dithering", {}),
    ("standard_dithering", {}), ("dithered", {}),
    ("nested_dithered", {"world_size": 2, "coarse_ratio": 5}),
    ("qsgd", {"elias": True}), ("qsgd", {"elias": True, "bucket_size": None}),
])
@pytest.mark.parametrize("factor", [2, 100])
def test_declared_size_larger_than_bytes(name, params, factor):
    rank = 1 if name == "nested_dithered" else 0  # nested: a P2 payload (decode_p2)
    codec, p = encoded(name, params, rank=rank)
    big = with_data(p, p.data, factor * p.size)
    for label, call in decoders(codec, big).items():
        with pytest.raises(ValueError, match=f"^{codec.name}: ") as exc:
            call()
        assert str(factor * p.size) in str(exc.value), (label, str(exc.value))


def test_message_names_codec_sizes_and_parameters():
    codec, p = encoded("qsgd", {"bits": 4, "bucket_size": 512}, x=X[:8192])
    with pytest.raises(ValueError) as exc:
        codec.decode(with_data(p, p.data[:1234]))
    assert str(exc.value) == ("qsgd: payload has 1234 bytes, 4160 expected for size=8192 "
                              "(bits=4, bucket_size=512)")


@pytest.mark.parametrize("levels", ["linear", "exponential"])
@pytest.mark.parametrize("where", ["count", "positions", "codes", "everywhere"])
def test_sparse_global_qsgd_0xff(levels, where):
    codec, p = encoded("global_qsgd", {"world_size": 2, "levels": levels, "mode": "sparse",
                                       "bits": 8})
    cnt = int(p.data[:4].view(np.uint32)[0])
    assert cnt > 1000
    d = p.data.copy()
    span = {"count": slice(0, 4), "positions": slice(40, 48), "codes": slice(4 + 4 * cnt, None),
            "everywhere": slice(None)}[where]
    d[span] = 0xFF
    bad = with_data(p, d)
    if where == "codes":  # every code is valid: decodes (to any values)
        assert codec.decode(bad).shape == (p.size,)
        return
    for call in decoders(codec, bad).values():
        with pytest.raises(ValueError, match="^global_qsgd: "):
            call()
    with pytest.raises(ValueError, match="^global_qsgd: "):
        codec.combine_gathered([bad, p], 0)


@pytest.mark.parametrize("name, params", CONFIGS, ids=IDS)
@pytest.mark.parametrize("cut", ["half", "one byte", "extra byte", "empty"])
def test_cut_or_extended_payload(name, params, cut):
    codec, p = encoded(name, params)
    raw = np.asarray(p.data).reshape(-1).view(np.uint8)
    data = {"half": raw[: raw.size // 2], "one byte": raw[:-1], "empty": raw[:0],
            "extra byte": np.concatenate([raw, np.zeros(1, np.uint8)])}[cut]
    bad = with_data(p, data)
    for call in decoders(codec, bad).values():
        with pytest.raises(ValueError, match=f"^{codec.name}: "):
            call()


@pytest.mark.parametrize("name", ["fp16", "bf16", "none"])
@pytest.mark.parametrize("size", [0, 99_999, 100_001, 200_000])
def test_float_baselines_check_the_size(name, size):
    codec, p = encoded(name, {})
    for call in decoders(codec, with_data(p, p.data, size)).values():
        with pytest.raises(ValueError, match=f"^{name}: "):
            call()
    if isinstance(codec, SumDecodable):
        with pytest.raises(ValueError, match=f"^{name}: "):
            codec.decode_sum(with_data(p, p.data, size), 2)


def test_known_crashes_in_a_child_process():
    """The reported crashes, in a child interpreter: a crash fails this test, not pytest."""
    script = textwrap.dedent("""
        import numpy as np, horovod_quant as hq
        x = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
        def expect_error(codec, call):
            try:
                call()
            except ValueError as exc:
                assert str(exc).startswith(codec.name), exc
            else:
                raise SystemExit(f"{codec.name}: no error")
        for name, params in [("qsgd", {}), ("nuqsgd", {}), ("natural", {}),
                             ("natural_dithering", {}), ("standard_dithering", {}),
                             ("dithered", {}), ("qsgd", {"elias": True})]:
            c = hq.get_codec(name, **params)
            p = c.encode(x)
            for f in (2, 100, 10_000):
                expect_error(c, lambda: c.decode(hq.Payload(p.data, f * p.size, p.meta)))
        c = hq.get_codec("nested_dithered", world_size=2)
        ps = [c.encode_worker(x, 1, r) for r in range(2)]
        expect_error(c, lambda: c.decode(hq.Payload(ps[0].data, 100 * x.size, ps[0].meta)))
        expect_error(c, lambda: c.decode_p2(hq.Payload(ps[1].data, 100 * x.size, ps[1].meta),
                                            np.zeros(100 * x.size, np.float32)))
        c = hq.get_codec("global_qsgd", world_size=2, mode="sparse")
        p = c.encode(x)
        for lo, hi in [(0, 4), (10, 20), (4, 4 + 4 * 1000), (0, None)]:
            d = p.data.copy()
            d[lo:hi] = 0xFF
            expect_error(c, lambda: c.decode(hq.Payload(d, p.size, p.meta)))
        print("survived")
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600, check=False)
    assert res.returncode == 0 and "survived" in res.stdout, (res.returncode, res.stdout,
                                                              res.stderr[-2000:])


# -- metadata ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, params", CONFIGS, ids=IDS)
@pytest.mark.parametrize("size", [-1, -100_000, MAX_PAYLOAD_SIZE + 1, 2 ** 63, 1.5, "7", True,
                                  None])
def test_negative_absurd_or_non_integer_sizes(name, params, size):
    codec, p = encoded(name, params)
    bad = with_data(p, p.data, size)
    for call in decoders(codec, bad).values():
        with pytest.raises(ValueError, match=f"^{codec.name}: "):
            call()


@pytest.mark.parametrize("k", [-1, 1, 2, 4, 17, 2 ** 31 - 1, -(2 ** 31)])
def test_nested_header_k_out_of_range(k):
    codec = hq.get_codec("nested_dithered", world_size=2, bits=4)
    ps = [codec.encode_worker(X, 1, r) for r in range(2)]
    for victim in (0, 1):
        d = ps[victim].data.copy()
        d[:HEADER].view(np.int32)[0] = k
        bad = list(ps)
        bad[victim] = with_data(ps[victim], d)
        with pytest.raises(ValueError, match=f"^nested_dithered: payload header says k={k}"):
            codec.combine_gathered(bad, 1)
        for call in decoders(codec, bad[victim]).values():
            with pytest.raises(ValueError, match="^nested_dithered: "):
                call()


def test_nested_group_mismatch_and_side_information_sizes():
    codec = hq.get_codec("nested_dithered", world_size=2, bits=4, coarse_ratio=5)
    ps = [codec.encode_worker(X, 1, r) for r in range(2)]
    seeds = [worker_seed(1, r) for r in range(2)]
    with pytest.raises(ValueError, match="^nested_dithered: rank 0 is in P1"):
        codec.decode_side_info(ps[::-1], seeds)
    with pytest.raises(ValueError, match="^nested_dithered: rank 1 is in P2"):
        codec.decode_side_info([ps[0], ps[0]], seeds)
    with pytest.raises(ValueError, match="^nested_dithered: side information has 10"):
        codec.decode_p2(ps[1], np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="^nested_dithered: input of rank 1 has 5"):
        codec.decode_side_info(ps, seeds, inputs=[None, X[:5]])
    with pytest.raises(ValueError, match="^nested_dithered: got 1 inputs"):
        codec.decode_side_info(ps, seeds, inputs=[X])
    est = codec.decode_side_info(ps, seeds, inputs=[None, X])
    assert est.shape == X.shape and np.all(np.isfinite(est))


@pytest.mark.parametrize("name, params", CONFIGS, ids=IDS)
def test_out_of_the_wrong_size(name, params):
    codec, p = encoded(name, params)
    if name == "nested_dithered":
        return  # rank 0's payload (P1) covered by the decode checks below via dithered
    for n in (0, p.size - 1, p.size + 1):
        with pytest.raises(ValueError, match=f"^{codec.name}: out has {n} elements"):
            codec.decode(p, np.empty(n, np.float32))
        with pytest.raises(ValueError, match=f"^{codec.name}: out has {n} elements"):
            codec.decode_add(p, np.zeros(n, np.float32))


def test_payloads_of_different_lengths_do_not_combine():
    for name, params in CONFIGS:
        codec = hq.get_codec(name, **params)
        n = params.get("world_size", 2)
        xs = [X[:1000]] * (n - 1) + [X[:999]]
        if name == "global_qsgd":
            ps = [codec.encode_worker(x, 0, r, codec.global_norm(xs)) for r, x in enumerate(xs)]
        else:
            ps = [codec.encode_worker(x, 0, r) for r, x in enumerate(xs)]
        with pytest.raises(ValueError, match=f"^{codec.name}: payloads encode different"):
            codec.combine_gathered(ps, 0)
        with pytest.raises(ValueError, match=f"^{codec.name}: "):
            codec.combine_gathered([], 0)


@pytest.mark.parametrize("norm", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("mode, levels", [("dense", "linear"), ("dense", "exponential"),
                                          ("sparse", "linear"), ("sparse", "exponential")])
def test_non_finite_norms_decode_non_finite(norm, mode, levels):
    """A NaN/Inf norm is metadata decode must accept: the decoded values stay non-finite."""
    codec = hq.get_codec("global_qsgd", world_size=2, mode=mode, levels=levels, bits=8)
    p = codec.encode(X[:5000], norm=1.0)
    p.meta["norm"] = norm
    for label, call in decoders(codec, p).items():
        if label in ("decode(out)", "decode_add"):
            continue  # X.size elements: checked elsewhere
        out = call()
        if isinstance(out, Payload):
            out = codec.decode(out)
        assert out.shape == (5000,) and not np.any(np.isfinite(out)), label
    with pytest.raises(ValueError, match="^global_qsgd: payload.meta\\['norm'\\]='x'"):
        codec.decode(Payload(p.data, p.size, {"norm": "x"}))


# -- the device path: the same checks before any kernel launch ---------------------------------
class _NoKernels:
    """A kernel launcher for :class:`horovod_quant.backends.cuda.CudaBackend` on NumPy arrays
    whose every kernel fails the test: the checks must raise before a launch."""

    xp = np

    def to_host(self, a):
        return np.asarray(a)

    def __getattr__(self, name):
        def launch(*args, **kwargs):
            raise AssertionError(f"kernel {name} launched on a damaged payload")
        return launch


@pytest.mark.parametrize("name, params", [c for c in CONFIGS if "elias" not in c[1]],
                         ids=[i for c, i in zip(CONFIGS, IDS) if "elias" not in c[1]])
@pytest.mark.parametrize("damage", ["size x100", "half", "extra byte", "header"])
def test_device_ops_check_before_launching(name, params, damage):
    be = CudaBackend(_NoKernels())
    codec, p = encoded(name, params)
    raw = np.asarray(p.data).reshape(-1).view(np.uint8)
    if damage == "size x100":
        if params.get("mode") == "sparse":
            pytest.skip("positions below size: a well-formed payload of a longer vector")
        bad = with_data(p, p.data, 100 * p.size)
    elif damage == "half":
        bad = with_data(p, raw[: raw.size // 2])
    elif damage == "extra byte":
        bad = with_data(p, np.concatenate([raw, np.zeros(1, np.uint8)]))
    else:  # the first 8 bytes: a sparse count and first position, an NDQSG k, a scale
        if not codec.traits.head_nbytes:
            pytest.skip("a fixed-width payload without a header: any bytes decode")
        d = raw.copy()
        d[:8] = 0xFF
        bad = with_data(p, d)
    n = params.get("world_size", 2)
    calls = decoders(codec, bad)
    calls["combine_gathered"] = lambda: codec.combine_gathered([p] * (n - 1) + [bad], 0)
    if hasattr(codec, "reduce"):
        calls["decode_sum"] = lambda: codec.decode_sum(bad, n)
        calls["reduce"] = lambda: codec.reduce([p] * (n - 1) + [bad], 0)
    for call in calls.values():
        with use_backend(be), pytest.raises(ValueError, match=f"^{codec.name}: "):
            call()


def test_device_sparse_positions_checked_before_launching():
    be = CudaBackend(_NoKernels())
    codec, p = encoded("global_qsgd", {"world_size": 2, "mode": "sparse", "bits": 8})
    cnt = int(p.data[:4].view(np.uint32)[0])
    for j, value in [(0, p.size), (cnt - 1, p.size), (5, 0), (cnt // 2, 2 ** 32 - 1)]:
        d = p.data.copy()
        d[4: 4 + 4 * cnt].view(np.uint32)[j] = value
        with use_backend(be), pytest.raises(ValueError,
                                            match="^global_qsgd: damaged sparse payload"):
            codec.decode(with_data(p, d))
