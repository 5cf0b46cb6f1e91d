"""Exchanges over an in-process threaded world equal mean_estimate bit for bit."""
import numpy as np
import pytest

import horovod_quant as hq
from horovod_quant.exchange import Exchange, LocalCollectives
from horovod_quant.exchange.plans import pipeline_seed
from horovod_quant.exchange.wire import frame, unframe
from horovod_quant.core.registry import codec_class
from horovod_quant.core.payload import Payload

from threaded_comm import run_ranks

SIMPLE = ["none", "fp16", "bf16", "qsgd", "nuqsgd", "natural", "natural_dithering",
          "standard_dithering"]


def _inputs(n, size, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(size).astype(np.float32) * (r + 1) for r in range(n)]


def _distributed(codec, xs, seed, gather):
    def rank_fn(comm):
        ex = Exchange(codec, comm, gather=gather)
        return ex.start(xs[comm.rank], seed, "t0").wait()
    return run_ranks(len(xs), rank_fn)


def _codec(name, n):
    params = {"world_size": n} if codec_class(name).needs_world_size else {}
    return hq.get_codec(name, **params)


@pytest.mark.parametrize("name", [c for c in hq.available_codecs()])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("gather", ["allgather", "sra"])
def test_exchange_matches_reference(name, n, gather):
    codec = _codec(name, n)
    if codec.combine != "gather" and gather == "sra":
        pytest.skip("schedule applies to gather codecs only")
    xs = _inputs(n, 3001)
    results = _distributed(codec, xs, seed=11, gather=gather)
    ref, _ = hq.mean_estimate(_codec(name, n), xs, seed=11, gather=gather)
    for r in results:
        assert np.array_equal(r, ref, equal_nan=True)


def test_frames_round_trip():
    payloads = [Payload(np.arange(k, dtype=np.uint8), k) for k in (0, 1, 5, 300)]
    tags = [(k, 1000 + k) for k in range(len(payloads))]
    buf = np.concatenate([frame(p, t) for p, t in zip(payloads, tags)])
    parts, got_tags = unframe(buf)
    assert [p.tolist() for p in parts] == [p.data.tolist() for p in payloads]
    assert got_tags == tags


@pytest.mark.parametrize("cut", [1, 8, 23, 24, 30])
def test_truncated_frames_raise(cut):
    buf = frame(Payload(np.arange(40, dtype=np.uint8), 40), (40, 7))
    with pytest.raises(ValueError, match="damaged exchange"):
        unframe(buf[:cut])
    with pytest.raises(ValueError, match="damaged exchange"):
        unframe(np.concatenate([buf, buf[:cut]]))


@pytest.mark.parametrize("name", [c for c in hq.available_codecs()])
@pytest.mark.parametrize("n", [2, 5])
def test_pipelined_exchange_matches_pipelined_reference(name, n):
    """Pieces of 1000 elements (the last shorter; 1000 is no multiple of the packing block or
    bucket): the same bits as mean_estimate with the same pipeline_elems, on every rank."""
    xs = _inputs(n, 3001, seed=4)

    def rank_fn(comm):
        ex = Exchange(_codec(name, n), comm, gather="auto", pipeline_elems=1000)
        return ex.start(xs[comm.rank], 5, "piped").wait()

    results = run_ranks(n, rank_fn)
    ref, _ = hq.mean_estimate(_codec(name, n), xs, seed=5, gather="auto", pipeline_elems=1000)
    whole, _ = hq.mean_estimate(_codec(name, n), xs, seed=5, gather="auto")
    for r in results:
        assert np.array_equal(r, ref, equal_nan=True)
    if name not in ("none", "fp16", "bf16"):  # pieces draw their own randomness
        assert not np.array_equal(ref, whole)


def test_pipelined_global_norm_spans_all_pieces():
    """One global norm for the whole vector: a piece with small values keeps its resolution
    relative to the whole, not to itself (a per-piece norm would quantize it finer)."""
    n = 2
    xs = [np.concatenate([np.full(500, 100.0, np.float32), np.full(500, 0.5, np.float32)])
          for _ in range(n)]
    make = lambda: hq.get_codec("global_qsgd", world_size=n, bits=8, levels="linear")
    piped, _ = hq.mean_estimate(make(), xs, seed=1, pipeline_elems=500)
    codec = make()
    norm = codec.global_norm(xs)
    want = codec.combine_payloads([codec.encode_worker(x[500:], pipeline_seed(
        1, 1, 2), r, norm) for r, x in enumerate(xs)], pipeline_seed(1, 1, 2))
    assert np.array_equal(piped[500:], want)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True])
def test_pipeline_elems_validated(bad):
    with pytest.raises(ValueError, match="pipeline_elems"):
        Exchange(hq.get_codec("qsgd"), LocalCollectives(), pipeline_elems=bad)
    with pytest.raises(ValueError, match="pipeline_elems"):
        hq.mean_estimate(hq.get_codec("qsgd"), [np.ones(10, np.float32)], pipeline_elems=bad)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_nested_outage_share_exact_in_a_distributed_exchange(n):
    """Each P2 rank counts its own wrong coarse bins and one allreduce sums them: the share
    every rank reports equals the reference's, which knows every input."""
    rng = np.random.default_rng(9)
    base = rng.standard_normal(6000).astype(np.float32)
    # a loose side information and a small fixed k: some coarse bins are wrong
    xs = [base + 0.05 * rng.standard_normal(6000).astype(np.float32) for _ in range(n)]
    make = lambda: hq.get_codec("nested_dithered", world_size=n, bits=6, coarse_ratio=5)

    def rank_fn(comm):
        codec = make()
        Exchange(codec, comm).start(xs[comm.rank], 2, "nd").wait()
        return codec.last_stats

    ref = make()
    hq.mean_estimate(ref, xs, seed=2)
    want = ref.last_stats["outside_share"]
    assert 0 < want < 0.5
    for stats in run_ranks(n, rank_fn):
        assert stats["outside_share"] == want
        assert stats["p2_values"] == ref.last_stats["p2_values"]
