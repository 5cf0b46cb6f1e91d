"""Exchanges over an in-process threaded world equal mean_estimate bit for bit."""
import threading
import time

import numpy as np
import pytest

import horovod_quant as hq
from horovod_quant.core.contract import Combine
from horovod_quant.core.payload import Payload
from horovod_quant.core.registry import codec_class
from horovod_quant.exchange import CodecStates, Exchange, LocalCollectives
from horovod_quant.exchange.plans import pipeline_seed
from horovod_quant.exchange.wire import frame, norm_wire, unframe

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
    if codec.traits.combine is not Combine.GATHER and gather == "sra":
        pytest.skip("schedule applies to gather codecs only")
    xs = _inputs(n, 3001)
    results = _distributed(codec, xs, seed=11, gather=gather)
    ref, _ = hq.mean_estimate(_codec(name, n), xs, seed=11, gather=gather)
    for r in results:
        assert np.array_equal(r, ref, equal_nan=True)


def test_frames_round_trip():
    payloads = [Payload(np.arange(k, dtype=np.uint8), k) for k in (0, 1, 5, 300)]
    tags = [(k, 1000 + k, 7 * k) for k in range(len(payloads))]
    buf = np.concatenate([frame(p, t) for p, t in zip(payloads, tags)])
    parts, got_tags = unframe(buf)
    assert [p.tolist() for p in parts] == [p.data.tolist() for p in payloads]
    assert got_tags == tags


@pytest.mark.parametrize("cut", [1, 8, 31, 32, 38])
def test_truncated_frames_raise(cut):
    buf = frame(Payload(np.arange(40, dtype=np.uint8), 40), (40, 7, 3))
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
    def make():
        return hq.get_codec("global_qsgd", world_size=n, bits=8, levels="linear")
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
    def make():
        return hq.get_codec("nested_dithered", world_size=n, bits=6, coarse_ratio=5)

    def rank_fn(comm):
        codec = make()
        exchange = Exchange(codec, comm)
        exchange.start(xs[comm.rank], 2, "nd").wait()
        return exchange.states.of(codec).last_stats

    ref, states = make(), CodecStates()
    hq.mean_estimate(ref, xs, seed=2, states=states)
    want = states.of(ref).last_stats["outside_share"]
    assert 0 < want < 0.5
    for stats in run_ranks(n, rank_fn):
        assert stats["outside_share"] == want
        assert stats["p2_values"] == states.of(ref).last_stats["p2_values"]


def _global_qsgd(n):
    return hq.get_codec("global_qsgd", world_size=n, bits=4)


@pytest.mark.parametrize("pipeline_elems", [None, 700])
def test_global_norm_start_does_not_wait_for_peers(pipeline_elems):
    """Rank 0 starts a global-norm exchange before rank 1 has issued anything: start returns,
    advance() does not wait, and once rank 1 joins an advance() starts the pieces. Both ranks
    get mean_estimate's bits (pipelined: the same pieces, one norm over the whole vector)."""
    xs = _inputs(2, 3001, seed=6)
    rank0_started = threading.Event()

    def rank_fn(comm):
        ex = Exchange(_global_qsgd(2), comm, pipeline_elems=pipeline_elems)
        assert not ex.blocks_on_peers  # its norm is matched by name and waited for later
        if comm.rank == 1:
            assert rank0_started.wait(10)
            return ex.start(xs[1], 3, "g").wait()
        pending = ex.start(xs[0], 3, "g")
        pending.advance()
        assert not pending.issued  # the norm cannot have arrived: rank 1 has not started
        rank0_started.set()
        deadline = time.monotonic() + 10
        while not pending.issued and time.monotonic() < deadline:
            pending.advance()
            time.sleep(0.001)
        assert pending.issued  # the pieces started before wait()
        return pending.wait()

    results = run_ranks(2, rank_fn, asynchronous=True)
    ref, _ = hq.mean_estimate(_global_qsgd(2), xs, seed=3, pipeline_elems=pipeline_elems)
    for r in results:
        assert np.array_equal(r, ref, equal_nan=True)


@pytest.mark.parametrize("n", [2, 3])
def test_global_norm_exchanges_started_in_any_order(n):
    """Ranks start two global-norm exchanges in opposite orders (as ranks reaching buckets in
    different orders would) and advance them without blocking: nothing waits for a peer before
    wait(), and each result is mean_estimate of its own vectors with its own norm."""
    xa, xb = _inputs(n, 2500, seed=7), _inputs(n, 1200, seed=8)

    def rank_fn(comm):
        ex = Exchange(_global_qsgd(n), comm, pipeline_elems=1000)
        jobs = [("a", xa[comm.rank], 1), ("b", xb[comm.rank], 2)]
        if comm.rank % 2:
            jobs.reverse()
        pending = {name: ex.start(x, seed, name) for name, x, seed in jobs}
        for p in pending.values():
            p.advance()
        return {name: pending[name].wait() for name in ("a", "b")}

    results = run_ranks(n, rank_fn, asynchronous=True)
    ref_a, _ = hq.mean_estimate(_global_qsgd(n), xa, seed=1, pipeline_elems=1000)
    ref_b, _ = hq.mean_estimate(_global_qsgd(n), xb, seed=2, pipeline_elems=1000)
    for r in results:
        assert np.array_equal(r["a"], ref_a) and np.array_equal(r["b"], ref_b)


def test_advance_block_starts_the_pieces_and_counts_the_norm():
    """advance(block=True) waits for the norm and starts the pieces; the exchange's bytes
    include the norm's allgather, and an exchange given its norm starts issued."""
    n, x_size = 2, 2000
    xs = _inputs(n, x_size, seed=9)
    codec = _global_qsgd(n)
    norm = codec.global_norm(xs)

    def rank_fn(comm):
        ex = Exchange(_global_qsgd(n), comm, pipeline_elems=500)
        pending = ex.start(xs[comm.rank], 4, "v")
        pending.advance(block=True)
        assert pending.issued
        given = ex.start(xs[comm.rank], 4, "w", norm=norm)
        assert given.issued
        return pending.wait(), pending.stats.bytes_sent, given.wait(), given.stats.bytes_sent

    norm_bytes = norm_wire(codec, [xs[0]]).nbytes
    ref, _ = hq.mean_estimate(_global_qsgd(n), xs, seed=4, pipeline_elems=500)
    for mean, sent, mean_given, sent_given in run_ranks(n, rank_fn, asynchronous=True):
        assert np.array_equal(mean, ref) and np.array_equal(mean_given, ref)
        assert sent == sent_given + norm_bytes


def test_advance_is_a_no_op_for_exchanges_without_a_norm():
    def rank_fn(comm):
        pending = Exchange(hq.get_codec("qsgd"), comm).start(_inputs(2, 100)[comm.rank], 1, "q")
        assert pending.issued
        pending.advance()
        return pending.wait()

    a, b = run_ranks(2, rank_fn, asynchronous=True)
    assert np.array_equal(a, b)
