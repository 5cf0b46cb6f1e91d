"""The hierarchical exchange between real processes: where ranks share hosts (run.sh launches
2 x 2 as ``horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo``), the gloo transport builds
each host's group and each shard's group between the hosts, and the exchanges give
mean_estimate's bits for that topology; elsewhere nothing changes."""
import horovod.torch as hvd
import numpy as np
import pytest
import torch

import horovod_quant as hq
import horovod_quant.torch as hqt
from horovod_quant.core.contract import HorovodWire
from horovod_quant.core.rng import payload_seed
from horovod_quant.exchange import Exchange, mean_estimate, plans
from horovod_quant.exchange.wire import exchange_tag
from horovod_quant.torch.collectives import HorovodTorchCollectives
from horovod_quant.torch.transport import horovod_topology, transport_collectives

from conftest import Linear, codec_params, rank_gradients


def _topology():
    return horovod_topology(HorovodTorchCollectives())


def _reference_topology():
    """The topology mean_estimate needs to reproduce the gloo transport's exchanges."""
    topology = _topology()
    return topology if topology.hierarchical else None


def test_the_transport_builds_a_group_per_host_and_per_shard():
    comm = transport_collectives(transport="gloo")
    topology = _topology()
    assert topology.size == hvd.size()
    assert topology.hierarchical == (hvd.local_size() > 1 and hvd.cross_size() > 1)
    if not topology.hierarchical:
        assert comm.hierarchy is None
        return
    h = comm.hierarchy
    assert (h.local.size, h.cross.size) == (hvd.local_size(), hvd.cross_size())
    assert h.local.allgather_object(hvd.rank(), "t.local") == list(
        topology.local_group(hvd.rank()))
    assert h.cross.allgather_object(hvd.rank(), "t.cross") == list(
        topology.cross_group(hvd.rank()))


@pytest.mark.parametrize("name", hq.available_codecs())
def test_every_codec_gives_the_reference_bits(name):
    """Pieces in flight together on the hierarchy's worker thread; every rank ends with
    mean_estimate's bits for this topology."""
    codec = hq.get_codec(name, **codec_params(name))
    xs = [np.random.default_rng([q, 5]).standard_normal(70_001).astype(np.float32)
          for q in range(hvd.size())]
    exchange = Exchange(codec, transport_collectives(transport="gloo"), pipeline_elems=1 << 14)
    pending = exchange.start(xs[hvd.rank()], 13, f"t.h.{name}")
    got = pending.wait()
    want, _ = mean_estimate(codec, xs, seed=13, gather="auto", pipeline_elems=1 << 14,
                            topology=_reference_topology())
    hierarchical = any(k.startswith(plans.HIERARCHICAL) for k in pending.stats.plans)
    ranks_summing = _topology().host_count if hierarchical else hvd.size()
    wire = codec.traits.horovod_wire
    if wire is not None and ranks_summing > 2:  # gloo's float sum order
        tol = 1e-5 if wire is HorovodWire.KEEP else 4e-3  # float32; 16-bit words
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    else:
        assert np.array_equal(got, want, equal_nan=True)
    assert hierarchical == (_reference_topology() is not None)
    assert (pending.stats.bytes_local > 0) == hierarchical


@pytest.mark.parametrize("name", ["qsgd", "global_qsgd", "nested_dithered"])
def test_optimizer_defaults_take_the_hierarchy(name):
    """hq.DistributedOptimizer with its defaults (but no fallback, so every step runs the
    codec): each bucket's averaged gradient is mean_estimate's for the topology, the stats
    name the plans, and every rank ends with the same weights."""
    shapes = [(300, 70), (64, 50)]
    model = Linear(shapes)
    opt = hqt.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5), named_parameters=model.named_parameters(),
        compression=getattr(hqt.Compression, name)(seed=3, policy=hqt.LayerPolicy.everything(),
                                                   **codec_params(name)),
        fallback="never")
    codec = hq.get_codec(name, **codec_params(name))
    for step in range(2):
        opt.zero_grad()
        model.loss(rank_gradients(shapes, step, hvd.rank())).backward()
        opt.step()
        flats = [np.concatenate([g.reshape(-1) for g in reversed(rank_gradients(shapes, step, q))])
                 for q in range(hvd.size())]
        want, _ = mean_estimate(codec, flats, seed=payload_seed(3, step, "ps.1,ps.0"),
                                gather="auto",
                                pipeline_elems=opt.pipeline_elems, topology=_reference_topology())
        got = np.concatenate([p.grad.reshape(-1).numpy() for p in reversed(list(model.ps))])
        assert np.array_equal(got, want, equal_nan=True), step
    kinds = opt.last_stats.plans
    assert all(k.startswith(plans.HIERARCHICAL) for k in kinds) == \
        (_reference_topology() is not None), kinds
    weights = hvd.allgather(torch.cat([p.detach().reshape(1, -1) for p in model.ps], 1))
    assert all(torch.equal(weights[0], row) for row in weights)


def test_a_rank_exchanging_another_tensor_fails_every_rank():
    """One rank's tag differs: its host finds out first, spoils its tag, and every rank raises
    the same kind of error at the first collective between hosts; nothing hangs."""
    if hvd.size() == 1:
        pytest.skip("needs several ranks")
    exchange = Exchange(hq.get_codec("qsgd"), transport_collectives(transport="gloo"))
    key = "other" if hvd.rank() == hvd.size() - 1 else "t.tag"
    with pytest.raises(ValueError, match="different tensors"):
        exchange.start(np.ones(5000, np.float32), 1, "t.tag",
                       tag=exchange_tag(key, (5000,))).wait()
