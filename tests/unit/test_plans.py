"""The exchange plans and their runners: the lockstep reference (mean_estimate), the Exchange
driver over threaded ranks, and the signatures the TensorFlow runner lays out its graph by."""
import numpy as np
import pytest

import horovod_quant as hq
from horovod_quant.core.base import worker_seed
from horovod_quant.core.contract import GlobalNorm
from horovod_quant.exchange import CUSTOM_COLLECTIVES, Done, Exchange, LocalCollectives, plans
from horovod_quant.exchange.reference import Lockstep
from horovod_quant.exchange.wire import NO_TAG, frame, unframe

from threaded_comm import run_ranks


def _codec(name, n, **params):
    if hq.core.registry.codec_class(name).needs_world_size:
        params["world_size"] = n
    return hq.get_codec(name, **params)


def _inputs(n, size, seed=0):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal(size).astype(np.float32)
    return [base + 0.1 * rng.standard_normal(size).astype(np.float32) for _ in range(n)]


def _pieces(codec, xs, seed, kind, norm=None):
    n = len(xs)
    return [plans.PLANS[kind](plans.Piece(codec, x, seed, r, n, norm, NO_TAG,
                                          np.empty(x.size, np.float32)))
            for r, x in enumerate(xs)]


def test_lockstep_sum_plan_is_the_rank_order_sum():
    """'none' sends float32 words: the reference sums them in rank order, then divides."""
    xs = _inputs(3, 1000)
    results = Lockstep(_pieces(hq.get_codec("none"), xs, 0, "sum")).finish()
    want = ((xs[0] + xs[1]) + xs[2]) * np.float32(1 / 3)
    for got in results:
        np.testing.assert_allclose(got, want, rtol=1e-6)
        assert np.array_equal(got, results[0])


def test_lockstep_allgather_plan_decodes_every_payload_in_rank_order():
    codec = hq.get_codec("qsgd", bits=4)
    xs, seed = _inputs(3, 2000), 7
    results = Lockstep(_pieces(codec, xs, seed, "allgather")).finish()
    want = codec.combine_gathered([codec.encode_worker(x, seed, r) for r, x in enumerate(xs)],
                                  seed)
    for got in results:
        assert np.array_equal(got, want)


def test_lockstep_counts_payload_bytes_per_rank():
    codec = hq.get_codec("qsgd", bits=4)
    xs = _inputs(2, 3000)
    run = Lockstep(_pieces(codec, xs, 1, "sra"))
    run.finish()
    chunk = [codec.encode(x[:1500]).nbytes for x in xs]
    # each rank sends its two chunks and re-encodes the one it owns
    assert run.payload_bytes == [2 * chunk[0] + chunk[0]] * 2


@pytest.mark.parametrize("kind", ["allgather", "sra"])
def test_a_witness_gets_every_rank_s_bits_and_the_others_stop_before_their_last_decode(kind):
    codec = hq.get_codec("qsgd", bits=4)
    xs = _inputs(4, 3000)
    every = Lockstep(_pieces(codec, xs, 3, kind))
    every.finish()
    witnessed = Lockstep(_pieces(codec, xs, 3, kind), witness=2)
    got = witnessed.finish()
    assert np.array_equal(got[2], every.results[2])
    assert got[:2] == [None, None] and got[3] is None  # their last decodes never ran
    assert witnessed.payload_bytes == every.payload_bytes


def test_mean_estimate_runs_every_rank_to_its_end_where_a_codec_state_advances():
    """NDQSG's ranks each finish their side-information decode: every rank's state moves (a
    witness alone would leave ranks 1-3 at their fresh state, and their next encode apart
    from a real run's)."""
    from horovod_quant.exchange.codec_states import CodecStates

    codec = _codec("nested_dithered", 4)
    states = [CodecStates() for _ in range(4)]
    fresh = CodecStates().of(codec).state_dict()
    hq.mean_estimate(codec, _inputs(4, 5000), seed=1, states=states)
    moved = [s.of(codec).state_dict() for s in states]
    assert all(m != fresh for m in moved) and all(m == moved[0] for m in moved)


def test_lockstep_refuses_diverging_plans():
    def plan(request):
        yield request

    with pytest.raises(RuntimeError, match="diverged"):
        Lockstep([plan(plans.Allgather(np.zeros(1))), plan(plans.Allreduce(np.zeros(1)))]).finish()

    def short():
        return np.zeros(1)
        yield  # a generator that ends at once

    with pytest.raises(RuntimeError, match="diverged"):
        Lockstep([short(), plan(plans.Allgather(np.zeros(1)))]).finish()


def test_lockstep_has_no_custom_collective():
    codec = _codec("global_qsgd", 2)
    xs = _inputs(2, 100)
    norm = codec.global_norm(xs)
    with pytest.raises(RuntimeError, match="allgather plan in place of its custom"):
        Lockstep(_pieces(codec, xs, 0, "custom", norm)).finish()


def _checked(plan, expected, label="t"):
    """``plan`` with every request checked against ``expected`` (a signature)."""
    value, i = None, 0
    while True:
        try:
            request = plan.send(value)
        except StopIteration as stop:
            assert i == len(expected), f"{label}: ended after {i} of {len(expected)} requests"
            return stop.value
        plans.check_request(request, expected[i] if i < len(expected) else None, label)
        i += 1
        value = yield request


@pytest.mark.parametrize("name", hq.available_codecs())
@pytest.mark.parametrize("gather", ["allgather", "sra"])
def test_plans_yield_their_signature(name, gather):
    """The TensorFlow runner builds its graph from plans.signature: every plan keeps to it."""
    n = 3
    codec = _codec(name, n)
    xs = _inputs(n, 1500)
    kind = plans.runnable(plans.plan_kind(codec, n, 1500, gather), custom=False)
    norm = None
    if codec.traits.needs_norm:  # as the runners decide
        norm = Lockstep([_checked(plans.norm_plan(codec, [x]), plans.signature("norm", codec))
                         for x in xs]).finish()[0]
    checked = [_checked(p, plans.signature(kind, codec)) for p in _pieces(codec, xs, 3, kind, norm)]
    got = Lockstep(checked).finish()[0]
    want, _ = hq.mean_estimate(_codec(name, n), xs, seed=3, gather=gather)
    assert np.array_equal(got, want, equal_nan=True)


def test_check_request_names_the_mismatch():
    with pytest.raises(RuntimeError, match="reached Allgather of uint8 where its signature "
                                           "says Allreduce of int64"):
        plans.check_request(plans.Allgather(np.zeros(3, np.uint8)),
                            (plans.Allreduce, np.dtype(np.int64)), "x")
    with pytest.raises(RuntimeError, match="says NoneType"):
        plans.check_request(plans.Allgather(np.zeros(3, np.uint8)), None, "x")
    with pytest.raises(RuntimeError, match="reached its end where its signature says Allgather"):
        plans.check_request(None, (plans.Allgather, np.dtype(np.uint8)), "x")


@pytest.mark.parametrize("name", hq.available_codecs())
@pytest.mark.parametrize("n,gather", [(2, "allgather"), (3, "sra"), (5, "auto")])
def test_exchange_driver_over_threads_matches_reference(name, n, gather):
    """The same plans run by Exchange on n threaded ranks (pieces of 700 elements in flight
    together, a global norm first where the codec needs one) give mean_estimate's bits."""
    xs = _inputs(n, 2500, seed=n)

    def rank_fn(comm):
        codec = _codec(name, n)
        ex = Exchange(codec, comm, gather=gather, pipeline_elems=700)
        pending = ex.start(xs[comm.rank], 11, "t")
        return pending.wait(), pending.stats, ex.kind_for(2500)

    results = run_ranks(n, rank_fn)
    want, _ = hq.mean_estimate(_codec(name, n), xs, seed=11, gather=gather, pipeline_elems=700)
    kind = plans.plan_kind(_codec(name, n), n, 2500, gather)
    for got, stats, got_kind in results:
        assert np.array_equal(got, want, equal_nan=True)
        assert stats.bytes_sent > 0 and got_kind == plans.runnable(kind, custom=False)
        assert sum(stats.plans.values()) == 4 and stats.bytes_local == 0


class _GatherThenReduce:
    """A stand-in custom collective: allgather the payloads, reduce with the codec (what the
    MPI exponent allreduce computes, without MPI)."""

    def __init__(self, codec, comm):
        self.codec, self.comm, self.calls = codec, comm, 0

    def __call__(self, payload, seed, name):
        self.calls += 1
        gathered = self.comm.allgather_async(frame(payload), name).wait()
        parts, _ = unframe(gathered)
        payloads = [self.codec.payload_from_wire(p, payload.size, **{**payload.meta,
                                                                     "seed": worker_seed(seed, r)})
                    for r, p in enumerate(parts)]
        return Done(self.codec.combine_gathered(payloads, seed))


def test_exchange_driver_runs_the_custom_plan(monkeypatch):
    n = 3
    xs = _inputs(n, 2500, seed=2)
    made = []

    def factory(codec, comm):
        made.append(_GatherThenReduce(codec, comm))
        return made[-1]

    monkeypatch.setitem(CUSTOM_COLLECTIVES, "exponent_allreduce", factory)

    def rank_fn(comm):
        ex = Exchange(_codec("global_qsgd", n), comm, pipeline_elems=1000)
        assert ex.kind_for(2500) == "custom" and ex.blocks_on_peers
        return ex.start(xs[comm.rank], 4, "c").wait()

    results = run_ranks(n, rank_fn)
    want, _ = hq.mean_estimate(_codec("global_qsgd", n), xs, seed=4, pipeline_elems=1000)
    assert [m.calls for m in made] == [3] * n  # three pieces on every rank
    for got in results:
        assert np.array_equal(got, want)


def test_one_rank_exchange_is_the_one_rank_reference():
    x = _inputs(1, 3000)[0]
    for name in hq.available_codecs():
        got = Exchange(_codec(name, 1), LocalCollectives(), pipeline_elems=1000).start(
            x, 2, "one").wait()
        want, _ = hq.mean_estimate(_codec(name, 1), [x], seed=2, pipeline_elems=1000)
        assert np.array_equal(got, want, equal_nan=True), name


def test_plan_kind_follows_declared_capabilities():
    big = 1 << 20
    assert plans.plan_kind(hq.get_codec("none"), 4, big) == "sum"
    assert plans.plan_kind(hq.get_codec("qsgd"), 2, big) == "allgather"
    assert plans.plan_kind(hq.get_codec("qsgd"), 4, big) == "sra"  # 2(n-1)/n P, not (n-1) P
    assert plans.plan_kind(hq.get_codec("qsgd"), 4, 100) == "allgather"  # fewer rounds
    assert plans.plan_kind(hq.get_codec("qsgd"), 5, big, "allgather") == "allgather"
    gq = _codec("global_qsgd", 8)
    assert plans.plan_kind(gq, 8, big) == "custom"
    assert plans.runnable("custom", custom=False) == "allgather"
    assert plans.runnable("custom", custom=True) == "custom"
    sparse = _codec("global_qsgd", 8, mode="sparse")
    assert plans.plan_kind(sparse, 8, big, "sra") == "allgather"  # global norm: no second norm
    assert plans.plan_kind(_codec("nested_dithered", 4), 4, big) == "allgather"  # no collective
    assert not isinstance(hq.get_codec("qsgd"), GlobalNorm) and isinstance(gq, GlobalNorm)
    with pytest.raises(ValueError, match="gather='ring' is not valid"):
        plans.check_gather("ring")
