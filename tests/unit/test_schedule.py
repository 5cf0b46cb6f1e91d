"""When ``hq.torch.DistributedOptimizer``'s bucket exchanges start and finish
(``torch/schedule.py``), on threaded ranks without Horovod: each bucket's mean is the reference's
for the seed ``payload_seed(seed, step, its parameters' names)``, whatever order the hooks run in;
over collectives that pair by call order every rank starts the buckets in bucket order; an exchange
that blocks on its peers waits for ``finish``."""
from __future__ import annotations

import re
from unittest import mock

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import horovod_quant as hq  # noqa: E402
from horovod_quant.core.rng import payload_seed  # noqa: E402
from horovod_quant.exchange import Exchange, plans, runtime  # noqa: E402
from horovod_quant.torch.buckets import form_buckets  # noqa: E402
from horovod_quant.torch.schedule import ExchangeSchedule  # noqa: E402

from threaded_comm import ThreadCollectives, run_ranks  # noqa: E402

SEED, STEP, PREFIX = 11, 4, "hq.test"
SIZES = (3000, 500, 2500, 1200)  # float32 elements of each parameter
FUSION_BYTES = 8000  # buckets (in backward order): [3, 2], [1, 0]


def gradients(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(rank)
    return [rng.standard_normal(n).astype(np.float32) for n in SIZES]


def flat(bucket) -> np.ndarray:
    return bucket.flat_input(lambda p: True)


class Recording(ThreadCollectives):
    """Threaded collectives that remember the bucket index of each collective they issue."""

    def __init__(self, comm: ThreadCollectives, pairs_by_order: bool) -> None:
        super().__init__(comm.world, comm.rank, comm.asynchronous)
        self.pairs_by_order = pairs_by_order
        self.issued: list[int] = []

    def _issue(self, name, value, result):
        bucket = re.search(r"\.b(\d+)", name)
        if bucket is not None:  # (not the runtime's configuration check)
            self.issued.append(int(bucket.group(1)))
        return super()._issue(name, value, result)


class Blocking(Exchange):
    """An exchange that pairs with its peers by call order, as a custom collective's does."""

    blocks_on_peers = True


def run_step(comm, codec, hook_order, exchange_type=Exchange, watch=None):
    """One step on this rank: the gradients' hooks in ``hook_order`` (parameter indices), then
    ``finish``. Returns the buckets' means by index, and what ``watch(schedule, buckets)``
    saw after each hook."""
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in SIZES]
    for p, g in zip(ps, gradients(comm.rank)):
        p.grad = torch.from_numpy(g)
    buckets = form_buckets(ps, codec, None, FUSION_BYTES, 0)
    exchanges = runtime.ExchangeRuntime(SEED, "allgather", plans.DEFAULT_PIPELINE_ELEMS)
    exchanges.check(comm, {"test": "schedule"})
    with mock.patch.object(runtime, "Exchange", exchange_type):
        exchanges.open([codec], comm)
    schedule = ExchangeSchedule(comm, exchanges, {id(p): f"p{i}" for i, p in enumerate(ps)},
                                PREFIX)
    schedule.use(buckets)
    seen = []
    for i in hook_order:
        bucket = next(b for b in buckets if any(p is ps[i] for p in b.params))
        schedule.bucket_ready(bucket, STEP, flat)
        schedule.advance()
        if watch is not None:
            seen.append(watch(schedule, buckets))
    assert schedule.in_flight == any(b.pending is not None for b in buckets)
    means = {b.index: mean.numpy().copy() for b, mean in schedule.finish(STEP, flat)}
    assert not schedule.in_flight and all(b.ready == 0 for b in buckets)
    return means, seen


def reference(codec, members: list[int]) -> np.ndarray:
    xs = [np.concatenate([gradients(r)[i] for i in members]) for r in range(2)]
    key = ",".join(f"p{i}" for i in members)  # the bucket's parameters' names
    mean, _ = hq.mean_estimate(codec, xs, payload_seed(SEED, STEP, key), gather="allgather",
                               pipeline_elems=plans.DEFAULT_PIPELINE_ELEMS)
    return mean


@pytest.mark.parametrize("name,params", [("qsgd", {}), ("global_qsgd", {"world_size": 2})])
def test_each_bucket_gets_the_mean_of_its_seed_whatever_the_hook_order(name, params) -> None:
    codec = hq.get_codec(name, **params)  # global_qsgd: a global norm first (advance())
    orders = [[3, 2, 1, 0], [0, 2, 1, 3]]  # rank 1's hooks run in another order
    results = run_ranks(2, lambda comm: run_step(comm, codec, orders[comm.rank])[0],
                        asynchronous=True)
    want = {0: reference(codec, [3, 2]), 1: reference(codec, [1, 0])}
    for means in results:
        assert sorted(means) == [0, 1]
        assert all(np.array_equal(means[i], want[i]) for i in want)


def test_over_collectives_that_pair_by_order_buckets_start_in_bucket_order() -> None:
    codec = hq.get_codec("qsgd")
    orders = [[0, 1, 3, 2], [1, 0, 2, 3]]  # bucket 1 is complete first on both ranks

    def rank(comm):
        comm = Recording(comm, pairs_by_order=True)
        means, started = run_step(comm, codec, orders[comm.rank], watch=lambda schedule, buckets: [
            b.index for b in buckets if b.pending is not None])
        return comm.issued, started, means

    (issued0, started0, means0), (issued1, started1, _) = run_ranks(2, rank, asynchronous=True)
    assert issued0 == issued1 and issued0 == sorted(issued0)  # one order on every rank
    assert started0 == [[], [], [], [0, 1]]  # bucket 1 waited for bucket 0
    assert started1 == [[], [], [], [0, 1]]
    assert np.array_equal(means0[1], reference(codec, [1, 0]))


def test_a_complete_bucket_starts_at_its_last_hook_unless_it_blocks_on_peers() -> None:
    codec = hq.get_codec("qsgd")

    def started(exchange_type):
        def rank(comm):
            return run_step(comm, codec, [3, 2, 1, 0], exchange_type, watch=lambda schedule,
                            buckets: [b.index for b in buckets if b.pending is not None])[1]
        return run_ranks(2, rank, asynchronous=True)

    assert started(Exchange) == [[[], [0], [0], [0, 1]]] * 2  # by name: at the last hook
    assert started(Blocking) == [[[], [], [], []]] * 2  # at finish, in bucket order
