"""Property tests: decoding damaged payloads never crashes the process.

For every registered codec (several bit widths and bucket sizes, world sizes 2..4, every
Global-QSGD mode) random vectors (sizes 0, 1, odd, across packing blocks; zeros, NaN/Inf,
tiny and huge scales) are encoded, one rank's payload is damaged (truncated, extended, its
declared size changed, bytes overwritten with random values or runs of 0xFF), and every decode
entry point is fed with it. The property: each call either raises ValueError whose message
names the codec, or returns exactly ``size`` float32 values (any values: a corrupted byte of a
fixed-width payload is still a well-formed payload). Undamaged payloads must decode, and a
non-finite input element must stay non-finite after decoding.

A crash here would take pytest down with it; the known crashes are also run in a child process
by ``test_damaged_regressions.py``. Hypothesis draws new examples on every run (no example
database is written); a failure prints the example and a ``@reproduce_failure`` blob.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import horovod_quant as hq  # noqa: E402
from horovod_quant.backends.numba.elias import elias_decode_ints, elias_encode_ints  # noqa: E402
from horovod_quant.backends.numba.global_qsgd import exp_combine  # noqa: E402
from horovod_quant.backends.numba.packing import PACK_BLOCK, packed_nbytes  # noqa: E402
from horovod_quant.core import worker_seed  # noqa: E402
from horovod_quant.core.base import MAX_PAYLOAD_SIZE  # noqa: E402
from horovod_quant.core.contract import CombinedDecodable  # noqa: E402
from horovod_quant.core.exponent_reduction import reduce_packed  # noqa: E402
from horovod_quant.core.payload import Payload  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# -- codec configurations ----------------------------------------------------------------------
BUCKETS = st.sampled_from([None, 1, 7, 64, 512])
WORLD = st.integers(2, 4)


def _gq_params() -> st.SearchStrategy:
    linear_dense = st.fixed_dictionaries({
        "world_size": WORLD, "levels": st.just("linear"), "mode": st.just("dense"),
        "bits": st.sampled_from([5, 8, 16]), "norm": st.sampled_from(["max", "l2"])})
    exp_dense = st.fixed_dictionaries({
        "world_size": WORLD, "levels": st.just("exponential"), "mode": st.just("dense"),
        "bits": st.sampled_from([5, 8]), "norm": st.sampled_from(["max", "l2"]),
        "reduction": st.sampled_from(["tree", "ring"])})
    sparse = st.fixed_dictionaries({
        "world_size": WORLD, "levels": st.sampled_from(["linear", "exponential"]),
        "mode": st.just("sparse"), "bits": st.integers(2, 8),
        "norm": st.sampled_from(["max", "l2"])})
    return st.one_of(linear_dense, exp_dense, sparse)


CODEC_PARAMS = {
    "none": st.just({}),
    "fp16": st.just({}),
    "bf16": st.just({}),
    "qsgd": st.fixed_dictionaries({
        "bits": st.sampled_from([2, 3, 4, 8]), "bucket_size": BUCKETS,
        "norm": st.sampled_from(["l2", "max"]), "elias": st.booleans()}),
    "nuqsgd": st.fixed_dictionaries({"bits": st.sampled_from([3, 4, 8]), "bucket_size": BUCKETS}),
    "natural": st.fixed_dictionaries({"bits": st.sampled_from([2, 5, 8]), "bucket_size": BUCKETS}),
    "natural_dithering": st.fixed_dictionaries({
        "bits": st.sampled_from([2, 4, 8]), "bucket_size": BUCKETS,
        "p": st.sampled_from([1.0, 2.0, math.inf])}),
    "standard_dithering": st.fixed_dictionaries({
        "bits": st.sampled_from([2, 4, 7]), "bucket_size": BUCKETS,
        "p": st.sampled_from([1.5, 2.0, math.inf])}),
    "global_qsgd": _gq_params(),
    "dithered": st.fixed_dictionaries({"bits": st.sampled_from([2, 4, 8]), "bucket_size": BUCKETS}),
    "nested_dithered": st.fixed_dictionaries({
        "world_size": WORLD, "bits": st.sampled_from([3, 4, 8]),
        "coarse_ratio": st.sampled_from([None, 3, 5]),
        "p1_fraction": st.sampled_from([0.25, 0.5, 1.0]), "bucket_size": BUCKETS}),
}


def test_every_registered_codec_is_covered():
    assert sorted(CODEC_PARAMS) == sorted(hq.available_codecs())
    for name in hq.available_codecs():  # each defines its wire layout (the length checks)
        cls = type(hq.get_codec(name, **({"world_size": 2} if name in (
            "global_qsgd", "nested_dithered") else {})))
        assert any("wire_layout" in vars(k) for k in cls.__mro__
                   if issubclass(k, hq.Codec) and k is not hq.Codec), name


# -- inputs and damage -------------------------------------------------------------------------
SIZES = st.one_of(st.integers(0, 40), st.integers(41, 3000),
                  st.sampled_from([PACK_BLOCK - 1, PACK_BLOCK, PACK_BLOCK + 3, 2 * PACK_BLOCK + 5]))


@st.composite
def vectors(draw, count: int) -> list[np.ndarray]:
    """``count`` float32 vectors of one random size: normal values at a random scale (tiny,
    subnormal, huge), a share of zeros, and in one of them a few NaN/Inf."""
    size = draw(SIZES)
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    scale = draw(st.sampled_from([1.0, 1e-3, 1e-30, 1e-42, 1e30]))
    zeros = draw(st.sampled_from([0.0, 0.3, 1.0]))
    bad = draw(st.sampled_from([0, 0, 1, 3]))
    bad_rank = draw(st.integers(0, count - 1))
    xs = []
    for r in range(count):
        x = (rng.standard_normal(size) * scale).astype(np.float32)
        x[rng.random(size) < zeros] = 0
        if r == bad_rank and size and bad:
            x[rng.integers(0, size, bad)] = rng.choice([np.nan, np.inf, -np.inf], bad)
        xs.append(x)
    return xs


SIZE_CHANGES = {
    "double": lambda n: 2 * n + 1, "half": lambda n: n // 2, "zero": lambda n: 0,
    "negative": lambda n: -1 - n, "huge": lambda n: MAX_PAYLOAD_SIZE + 1 + n,
    "int64": lambda n: 2 ** 63 - 1,
}
DAMAGE = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True)),
    st.tuples(st.just("extend"), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("size"), st.integers(-5, 5).filter(bool)),
    st.tuples(st.just("size"), st.sampled_from(sorted(SIZE_CHANGES))),
    st.tuples(st.just("corrupt"), st.lists(st.tuples(st.floats(0, 1, exclude_max=True),
                                                     st.integers(0, 255)), min_size=1, max_size=8)),
    st.tuples(st.just("0xff"), st.floats(0, 1, exclude_max=True), st.integers(1, 64)),
)


def damage(payload: Payload, ops: list) -> Payload:
    """The payload after ``ops`` (data copied; the payload's dtype kept where the byte count
    still divides into its words, else raw bytes)."""
    data = np.asarray(payload.data).reshape(-1).view(np.uint8).copy()
    size = payload.size
    for op in ops:
        kind = op[0]
        if kind == "truncate":
            data = data[: int(op[1] * data.size)]
        elif kind == "extend":
            data = np.concatenate([data, np.frombuffer(op[1], np.uint8)])
        elif kind == "size":
            size = size + op[1] if isinstance(op[1], int) else SIZE_CHANGES[op[1]](size)
        elif kind == "corrupt":
            for where, value in op[1]:
                if data.size:
                    data[int(where * data.size)] = value
        else:
            start = int(op[1] * data.size)
            data[start: start + op[2]] = 0xFF
    item = payload.data.dtype.itemsize
    if data.size % item == 0:
        data = data.view(payload.data.dtype)
    return Payload(data, size, dict(payload.meta))


# -- the property ------------------------------------------------------------------------------
def outcome(codec, label: str, call, size):
    """Run one entry point: a ValueError naming the codec, or ``size`` float32 values."""
    try:
        result = call()
    except ValueError as exc:
        assert codec.name in str(exc), f"{label}: {exc}"
        return None
    if isinstance(result, Payload):  # reduce: a combined payload, decoded by the caller
        return result
    assert isinstance(result, np.ndarray), f"{label}: returned {type(result)}"
    assert result.dtype == np.float32 and result.shape == (size,), \
        f"{label}: {result.dtype} {result.shape}, size={size}"
    return result


def entry_points(codec, payloads, victim, pd, seed, xs):
    """(label, call) of every decode entry point of ``codec`` with payload ``victim`` replaced
    by the damaged ``pd``."""
    n0 = payloads[victim].size
    bad = list(payloads)
    bad[victim] = pd
    raw = np.asarray(pd.data).reshape(-1).view(np.uint8).copy()
    calls = [
        ("decode", lambda: codec.decode(pd)),
        ("decode(out)", lambda: codec.decode(pd, out=np.empty(n0, np.float32))),
        ("decode_add", lambda: codec.decode_add(pd, np.zeros(n0, np.float32))),
        ("payload_from_wire", lambda: codec.decode(
            codec.payload_from_wire(raw, pd.size, **pd.meta))),
        ("combine_gathered", lambda: codec.combine_gathered(bad, seed)),
        ("combine_payloads", lambda: codec.combine_payloads(bad, seed)),
    ]
    n = len(payloads)
    if isinstance(codec, CombinedDecodable):
        calls.append(("decode_sum", lambda: codec.decode_sum(pd, n)))
    if hasattr(codec, "reduce"):
        calls.append(("reduce", lambda: codec.decode_sum(codec.reduce(bad, seed), n)))
    if codec.name == "nested_dithered":
        seeds = [worker_seed(seed, r) for r in range(n)]
        calls.append(("decode_side_info", lambda: codec.decode_side_info(bad, seeds)))
        calls.append(("decode_side_info(inputs)",
                      lambda: codec.decode_side_info(bad, seeds, inputs=xs)))
        calls.append(("decode_p2", lambda: codec.decode_p2(pd, np.zeros(n0, np.float32))))
    return calls


def run_property(name: str, params: dict, xs: list[np.ndarray], seed: int, victim: int,
                 ops: list) -> None:
    codec = hq.get_codec(name, **params)
    if name == "global_qsgd":
        norm = codec.global_norm(xs)
        payloads = [codec.encode_worker(x, seed, r, norm) for r, x in enumerate(xs)]
    else:
        payloads = [codec.encode_worker(x, seed, r) for r, x in enumerate(xs)]
    victim %= len(payloads)
    pd = damage(payloads[victim], ops)
    for label, call in entry_points(codec, payloads, victim, pd, seed, xs):
        result = outcome(codec, label, call, pd.size)
        if isinstance(result, Payload):
            continue
        if not ops and not (name == "nested_dithered" and label in ("decode", "decode(out)",
                                                                    "decode_add", "decode_p2",
                                                                    "payload_from_wire")):
            # undamaged: must decode, and non-finite inputs stay non-finite
            assert result is not None, label
            if label in SINGLE:
                bad_in = ~np.isfinite(xs[victim])
            else:  # a combination of every rank's payload
                bad_in = np.logical_or.reduce([~np.isfinite(x) for x in xs])
            lost = bad_in & np.isfinite(result)
            assert not lost.any(), f"{label}: non-finite inputs decoded finite at " \
                                   f"{np.flatnonzero(lost)[:5]}"


#: entry points that decode the victim's payload alone
SINGLE = ("decode", "decode(out)", "decode_add", "payload_from_wire", "decode_sum")


def _world(params: dict) -> int | None:
    return params.get("world_size")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # fp16 overflow, inf - inf, ...
@pytest.mark.parametrize("name", sorted(CODEC_PARAMS))
def test_damaged_payloads_raise_or_decode(name):
    @SETTINGS
    @given(data=st.data(), params=CODEC_PARAMS[name], seed=st.integers(0, 2 ** 31),
           ops=st.lists(DAMAGE, min_size=0, max_size=2))
    def prop(data, params, seed, ops):
        count = _world(params) or data.draw(st.integers(1, 3), label="workers")
        xs = data.draw(vectors(count), label="xs")
        victim = data.draw(st.integers(0, count - 1), label="victim")
        run_property(name, params, xs, seed, victim, ops)

    prop()


# -- the Elias decoders and the exponent reduction, directly -------------------------------------
@SETTINGS
@given(values=st.lists(st.integers(1, 2 ** 50), min_size=0, max_size=40),
       ops=st.lists(DAMAGE.filter(lambda op: op[0] != "size"), min_size=0, max_size=2),
       extra=st.integers(-3, 3))
def test_elias_integer_decoder_on_damaged_streams(values, ops, extra):
    data = elias_encode_ints(np.array(values, np.int64))
    damaged = damage(Payload(data, len(values)), ops).data.view(np.uint8)
    count = max(0, len(values) + extra)
    try:
        out = elias_decode_ints(damaged, count)
    except ValueError as exc:
        assert "Elias" in str(exc)
        return
    assert out.shape == (count,) and out.dtype == np.int64
    if not ops and extra <= 0:
        np.testing.assert_array_equal(out, values[:count])


@SETTINGS
@given(data=st.data(), bits=st.integers(2, 8), n=st.integers(1, 4),
       reduction=st.sampled_from(["tree", "ring"]),
       ops=st.lists(DAMAGE, min_size=1, max_size=2))
def test_reduce_packed_on_damaged_buffers(data, bits, n, reduction, ops):
    size = data.draw(SIZES, label="size")
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="rng"))
    nbytes = int(packed_nbytes(size, bits))
    # random packed codes: any byte pattern is a valid set of codes (exponents beyond the
    # encoder's range combine without error)
    bufs = [rng.integers(0, 256, nbytes).astype(np.uint8) for _ in range(n)]
    victim = data.draw(st.integers(0, n - 1), label="victim")
    pd = damage(Payload(bufs[victim], size), ops)
    bufs[victim] = pd.data.view(np.uint8)
    try:
        out = reduce_packed(bufs, pd.size, bits, 5, reduction)
    except ValueError as exc:
        assert "reduce_packed" in str(exc)
        return
    assert out.dtype == np.uint8 and out.size == packed_nbytes(pd.size, bits)


@pytest.mark.parametrize("args, match", [
    ((100, 0, 9), "bits in 2..8"), ((100, 0, 1), "bits in 2..8"),
    ((-1, 0, 8), "n_elements"), ((100, 5, 8), "multiple of PACK_BLOCK"),
    ((100, -PACK_BLOCK, 8), "multiple of PACK_BLOCK"),
    ((PACK_BLOCK * 4, 0, 8), "shorter than packed_nbytes"),
])
def test_exp_combine_rejects_bad_arguments(args, match):
    n, first, bits = args
    a = np.zeros(200, np.uint8)
    with pytest.raises(ValueError, match=match):
        exp_combine(a, a.copy(), a.copy(), n, first, bits, np.uint32(1), np.uint32(2))


# -- damage aimed at the data-dependent fields ---------------------------------------------------
@SETTINGS
@given(data=st.data(), world=WORLD, levels=st.sampled_from(["linear", "exponential"]),
       bits=st.integers(2, 8), seed=st.integers(0, 2 ** 31),
       how=st.sampled_from(["random", "0xffffffff", "size", "size-1", "previous", "zero"]))
def test_sparse_positions_damaged(data, world, levels, bits, seed, how):
    """A sparse Global-QSGD position overwritten: the decoders raise unless the positions
    still increase strictly below size (then any values are fine)."""
    codec = hq.get_codec("global_qsgd", world_size=world, levels=levels, mode="sparse", bits=bits)
    xs = data.draw(vectors(world), label="xs")
    norm = codec.global_norm(xs)
    payloads = [codec.encode_worker(x, seed, r, norm) for r, x in enumerate(xs)]
    victim = data.draw(st.integers(0, world - 1), label="victim")
    p = payloads[victim]
    raw = p.data.copy()
    cnt = int(raw[:4].view(np.uint32)[0])
    if cnt == 0:
        return
    j = data.draw(st.integers(0, cnt - 1), label="entry")
    pos = raw[4: 4 + 4 * cnt].view(np.uint32)
    pos[j] = {"random": data.draw(st.integers(0, 2 ** 32 - 1), label="value"),
              "0xffffffff": 2 ** 32 - 1, "size": p.size, "size-1": p.size - 1,
              "previous": pos[j - 1] if j else pos[min(j + 1, cnt - 1)], "zero": 0}[how]
    valid = bool(np.all(pos < p.size) and np.all(np.diff(pos.astype(np.int64)) > 0))
    pd = Payload(raw, p.size, dict(p.meta))
    bad = list(payloads)
    bad[victim] = pd
    finite = math.isfinite(norm)
    for label, call in [("decode", lambda: codec.decode(pd)),
                        ("decode_add", lambda: codec.decode_add(pd, np.zeros(p.size, np.float32))),
                        ("combine_gathered", lambda: codec.combine_gathered(bad, seed))]:
        result = outcome(codec, label, call, p.size)
        if finite:  # a non-finite norm decodes to NaN without reading a position
            assert (result is not None) == valid, (label, how, valid)


@SETTINGS
@given(data=st.data(), bits=st.sampled_from([2, 3, 4, 8]), bucket=BUCKETS,
       seed=st.integers(0, 2 ** 31),
       hits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
                     min_size=1, max_size=6))
def test_elias_stream_bits_flipped(data, bits, bucket, seed, hits):
    """Bits of an Elias stream flipped (gaps, signs, levels, the terminator): ValueError or
    exactly size values, through every decode entry point."""
    codec = hq.get_codec("qsgd", bits=bits, bucket_size=bucket, elias=True)
    (x,) = data.draw(vectors(1), label="x")
    p = codec.encode(x, seed=seed)
    raw = p.data.copy()
    head = 4 * -(-x.size // (bucket or max(x.size, 1)))
    stream = raw[head:]
    for where, bit in hits:
        stream[int(where * stream.size)] ^= np.uint8(1 << bit)
    pd = Payload(raw, p.size, dict(p.meta))
    for label, call in [("decode", lambda: codec.decode(pd)),
                        ("decode_add", lambda: codec.decode_add(pd, np.zeros(p.size, np.float32))),
                        ("combine_gathered", lambda: codec.combine_gathered([pd, p], seed))]:
        outcome(codec, label, call, p.size)
