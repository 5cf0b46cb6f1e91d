"""Which transport carries ``hq.torch.DistributedOptimizer``'s payloads (``torch/transport.py``),
without Horovod: threaded ranks stand in for Horovod's collectives. The ``transport=`` and
``HQ_TRANSPORT`` choice (read at the optimizer's door), the hosts from Horovod's places, when a
gloo group beside the ranks carries the exchanges (built for real on the threads), and a
failed build."""
from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import horovod_quant as hq  # noqa: E402
from horovod_quant.doors import (  # noqa: E402
    OPTIMIZER_DOOR,
    TRANSPORT_ENV,
    DoorEnvironment,
    DoorOptions,
)
from horovod_quant.exchange import Exchange, HostStaged, LocalCollectives  # noqa: E402
from horovod_quant.exchange.topology import Topology  # noqa: E402
from horovod_quant.torch import transport  # noqa: E402

from threaded_comm import run_ranks  # noqa: E402

CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def fresh_groups(monkeypatch):
    """Each test builds its own groups (they are kept per process set and device)."""
    monkeypatch.setattr(transport, "_groups", {})
    monkeypatch.delenv(TRANSPORT_ENV, raising=False)


def _door_transport(options: DoorOptions) -> str:
    """The transport the optimizer's door resolves: ``transport=``, else ``HQ_TRANSPORT``
    read at the door, else "auto"; then validated below it."""
    environment = DoorEnvironment.read(OPTIMIZER_DOOR)
    return transport.resolve_transport(environment.transport_for(options.transport))


def test_transport_argument_then_environment_then_auto(monkeypatch) -> None:
    assert _door_transport(DoorOptions()) == "auto"
    monkeypatch.setenv(TRANSPORT_ENV, "horovod")
    assert _door_transport(DoorOptions()) == "horovod"
    assert _door_transport(DoorOptions(transport="gloo")) == "gloo"  # the argument wins
    assert transport.resolve_transport() == "auto"  # below the door: no environment read
    with pytest.raises(ValueError, match=r"transport='nccl' is not valid: choose one of"):
        transport.resolve_transport("nccl")
    monkeypatch.setenv(TRANSPORT_ENV, "fast")
    with pytest.raises(ValueError, match="HQ_TRANSPORT='fast' is not valid"):
        _door_transport(DoorOptions())


@pytest.mark.parametrize("places,hosts", [
    ([[0, 0, 2], [0, 1, 2], [1, 0, 2], [1, 1, 2]], [[0, 1], [2, 3]]),
    ([[1, 0, 2], [0, 0, 2], [0, 1, 2], [1, 1, 2]], [[0, 3], [1, 2]]),  # hosts interleaved
    ([[0, 0, 3], [0, 1, 3], [0, 2, 3], [1, 0, 1]], [[0], [1], [2], [3]]),  # uneven hosts: flat
    ([[0, 0, 2], [0, 0, 2], [1, 0, 2], [1, 1, 2]], [[0], [1], [2], [3]]),  # a local rank twice
])
def test_hosts_from_horovods_places(places, hosts) -> None:
    topologies = run_ranks(4, lambda comm: transport.topology_of_places(comm, places[comm.rank]))
    assert all([list(h) for h in t.hosts] == hosts for t in topologies)


class Ranks(LocalCollectives):
    """Rank 0 of ``size`` ranks whose collectives are never called (the choice is made before)."""

    def __init__(self, size: int) -> None:
        self.size, self.group_id = size, f"ranks{id(self)}"


def choose(monkeypatch, size: int, choice: str, device=None, hierarchical: bool = False,
           build=None):
    """``collectives_for`` over ``size`` ranks, every GPU seen; the gloo groups it asks for are
    ``build(...)`` (default: a stand-in). Returns (the ranks, the result, what was built for)."""
    built = []

    def stand_in(comm, topology, on):
        built.append(on)
        return Ranks(size)

    monkeypatch.setattr(transport, "gloo_group_beside_horovod", build or stand_in)
    monkeypatch.setattr(transport.gpu, "available", lambda: True)
    ranks = Ranks(size)
    topology = Topology.grid(2, size // 2) if hierarchical else Topology.grid(size, 1)
    return ranks, transport.collectives_for(ranks, choice, device, lambda comm: topology), built


def test_one_rank_and_transport_horovod_keep_horovods_collectives(monkeypatch) -> None:
    for size, choice in [(1, "gloo"), (4, "horovod")]:
        ranks, comm, built = choose(monkeypatch, size, choice)
        assert comm is ranks and built == []


def test_auto_builds_a_group_for_cpu_gradients_and_for_gpus_sharing_hosts(monkeypatch) -> None:
    ranks, comm, built = choose(monkeypatch, 4, "auto")
    assert comm is not ranks and built == [None]
    ranks, comm, built = choose(monkeypatch, 4, "auto", CUDA, hierarchical=True)
    assert isinstance(comm, HostStaged) and comm.inner is not ranks and built == [CUDA]


def test_auto_keeps_horovods_collectives_for_flat_cuda_exchanges(monkeypatch) -> None:
    ranks, comm, built = choose(monkeypatch, 4, "auto", CUDA)
    assert isinstance(comm, HostStaged) and comm.inner is ranks and built == []
    ranks, comm, built = choose(monkeypatch, 4, "gloo", CUDA)  # unless gloo is asked for
    assert comm.inner is not ranks and built == [CUDA]


def test_a_failed_build_falls_back_once_under_auto_and_raises_under_gloo(monkeypatch,
                                                                         caplog) -> None:
    calls = []

    def fails(comm, topology, on):
        calls.append(on)
        raise RuntimeError("rank 1: no route")

    with caplog.at_level(logging.WARNING, logger="horovod_quant"):
        ranks, comm, _ = choose(monkeypatch, 4, "auto", build=fails)
        assert comm is ranks and "no gloo group beside Horovod (rank 1: no route)" in caplog.text
        assert transport.collectives_for(ranks, "auto", None, lambda c: Topology.grid(4, 1)) \
            is ranks
    assert calls == [None]  # the failure is kept: no second try
    with pytest.raises(RuntimeError, match="transport='gloo': rank 1: no route"):
        choose(monkeypatch, 4, "gloo", build=fails)


def test_threaded_ranks_build_a_gloo_group_and_its_host_groups() -> None:
    """A real gloo world (and where ranks share hosts, host and shard groups) beside threaded
    ranks; a hierarchical exchange over it gives the reference's bits."""
    codec = hq.get_codec("qsgd")
    xs = [np.random.default_rng(r).standard_normal(5000).astype(np.float32) for r in range(4)]

    def rank(comm):
        place = [comm.rank // 2, comm.rank % 2, 2]  # two hosts of two ranks
        group = transport.collectives_for(
            comm, "auto", topology_of=lambda c: transport.topology_of_places(c, place))
        mean = Exchange(codec, group, gather="hierarchical").start(xs[comm.rank], 7, "x").wait()
        return transport.transport_of(group), group.pairs_by_order, group.hierarchy, mean

    want, _ = hq.mean_estimate(codec, xs, 7, gather="hierarchical", topology=Topology.grid(2, 2))
    for kind, by_order, hierarchy, mean in run_ranks(4, rank):
        assert kind == "gloo" and by_order and hierarchy is not None
        assert np.array_equal(mean, want)
