"""The optimizer's transports: a gloo group beside Horovod (``transport="gloo"``, what "auto"
picks for CPU gradients; its collectives pair by call order) against Horovod's collectives."""
import socket
import time

import horovod.torch as hvd
import numpy as np
import pytest
import torch

import horovod_quant as hq
import horovod_quant.torch as hqt
from horovod_quant.core.rng import payload_seed
from horovod_quant.exchange import Exchange, mean_estimate
from horovod_quant.exchange.mpi_exponent_allreduce import EXPONENT_LANES
from horovod_quant.torch.collectives import HorovodTorchCollectives
from horovod_quant.torch.distributed import StandaloneGroupCollectives
from horovod_quant.torch.transport import (
    gloo_group_beside_horovod,
    resolve_transport,
    transport_collectives,
)

from conftest import Linear, codec_params, rank_gradients

EVERYTHING = hqt.LayerPolicy.everything()


def _peers():
    comm = transport_collectives(transport="gloo")
    assert isinstance(comm, StandaloneGroupCollectives) == (hvd.size() > 1)
    return comm


def test_transport_argument_is_validated_and_reported(monkeypatch):
    with pytest.raises(ValueError, match="transport='tcp' is not valid"):
        resolve_transport("tcp")
    model = Linear([(8, 8)])
    monkeypatch.setenv("HQ_TRANSPORT", "horovod")  # read by the optimizer's door, once
    monkeypatch.setenv("HQ_LINK_GBIT", "7")
    opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hqt.Compression.qsgd())
    monkeypatch.delenv("HQ_TRANSPORT")
    monkeypatch.delenv("HQ_LINK_GBIT")
    # built at the first synchronize(), as the door read it
    assert opt.transport == (None if hvd.size() > 1 else "horovod")
    opt.synchronize()
    assert opt.transport == "horovod" and opt.fabric.link_gbit == 7.0
    assert resolve_transport() == "auto"  # below the door, nothing reads it
    for transport, want in (("auto", "gloo"), ("horovod", "horovod"), ("gloo", "gloo")):
        opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters(),
                                       compression=hqt.Compression.qsgd(), transport=transport)
        opt.synchronize()
        assert opt.transport == (want if hvd.size() > 1 else "horovod")


def test_allgather_of_lengths_that_change_between_calls():
    """Fixed layouts reuse the last bound (one round); a payload that grows or shrinks, or is
    empty, takes the second round: every case equals Horovod's allgather."""
    peers, horovod = _peers(), HorovodTorchCollectives()
    r = hvd.rank()
    for step, length in enumerate([5, 5, 9 + r, 9 + r, 3 * r, 0, (1 << 19) + 7 * r + 1]):
        arr = (np.arange(length, dtype=np.int64) * 7 + r * 1000 + step).astype(np.uint8)
        got = peers.allgather_async(arr, "t.len").wait()
        want = horovod.allgather_async(arr, f"t.len.ref.{step}").wait()
        assert got.dtype == np.uint8 and np.array_equal(got, want), step


def test_allreduce_is_exact_and_the_same_on_every_rank():
    """Integer sums wrap as Horovod's do; float sums are the same bits on every rank."""
    peers, horovod = _peers(), HorovodTorchCollectives()
    r = hvd.rank()
    ints = np.array([np.iinfo(np.int64).max, -5, 3], np.int64) * (r + 1)
    got = peers.allreduce_async(ints, "t.int").wait()
    assert np.array_equal(got, horovod.allreduce_async(ints, "t.int.ref").wait())
    floats = np.random.default_rng(r).standard_normal((1 << 16) + 3)
    got = peers.allreduce_async(floats.astype(np.float32), "t.float").wait()
    everyone = horovod.allgather_async(got, "t.float.all").wait().reshape(hvd.size(), -1)
    assert all(np.array_equal(everyone[0], row) for row in everyone)
    np.testing.assert_allclose(got, sum(np.random.default_rng(q).standard_normal(floats.size)
                                        for q in range(hvd.size())), rtol=1e-5, atol=1e-5)


def test_buckets_start_in_bucket_order_whatever_order_the_hooks_run_in():
    """The gloo transport pairs collectives by call order: a rank whose first buckets fill
    last (it did not use their parameters) still issues every bucket's collectives in bucket
    order, so the ranks' weights stay identical and equal to Horovod's transport."""
    shapes = [(64, 64), (64, 64), (64, 64)]
    results = {}
    for transport in ("gloo", "horovod"):
        model = Linear(shapes)
        opt = hqt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=model.named_parameters(),
            # linear levels: their buckets start from the hooks (exponential ones, a custom
            # collective, start at synchronize() under every transport)
            compression=hqt.Compression.global_qsgd(world_size=hvd.size(), levels="linear",
                                                    policy=EVERYTHING),
            # flat plans: over the gloo transport ranks sharing hosts would take the
            # hierarchical ones, which Horovod's collectives do not have
            gather="allgather", transport=transport, fusion_bytes=64 * 64 * 4,
            fallback="never")
        grads = rank_gradients(shapes, 0, hvd.rank())
        opt.zero_grad()
        # buckets form in reverse parameter order: on odd ranks bucket 0 (the last parameter)
        # fills at synchronize(), after buckets 1 and 2
        used = [0, 1] if hvd.rank() % 2 else [0, 1, 2]
        sum((model.ps[i] * torch.from_numpy(grads[i])).sum() for i in used).backward()
        opt.step()
        results[transport] = [p.grad.clone() for p in model.ps]
    for a, b in zip(results["gloo"], results["horovod"]):
        assert torch.equal(a, b)
    everyone = hvd.allgather(torch.cat([g.reshape(1, -1) for g in results["gloo"]], 1))
    assert all(torch.equal(everyone[0], row) for row in everyone)


@pytest.mark.parametrize("name", ["qsgd", "natural", "global_qsgd", "nested_dithered"])
def test_optimizer_transports_give_the_same_bits(name):
    """The transport moves bytes, it does not change them: both give mean_estimate's result,
    bucket by bucket, with pieces in flight together."""
    shapes = [(300, 70), (40, 50)]
    results = {}
    for transport in ("gloo", "horovod"):
        model = Linear(shapes)
        opt = hqt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=model.named_parameters(),
            compression=hqt.Compression.__getattr__(name)(seed=3, policy=EVERYTHING,
                                                          **codec_params(name)),
            gather="allgather", transport=transport, pipeline_elems=4096,
            fusion_bytes=1 << 30)
        opt.zero_grad()
        model.loss(rank_gradients(shapes, 0, hvd.rank())).backward()
        opt.step()
        results[transport] = np.concatenate([p.grad.reshape(-1).numpy()
                                             for p in reversed(list(model.ps))])
    assert np.array_equal(results["gloo"], results["horovod"], equal_nan=True)
    if hvd.size() > 1:
        codec = hq.get_codec(name, **codec_params(name))
        flats = [np.concatenate([g.reshape(-1) for g in reversed(rank_gradients(shapes, 0, q))])
                 for q in range(hvd.size())]
        want, _ = mean_estimate(codec, flats, seed=payload_seed(3, 0, "ps.1,ps.0"),
                                pipeline_elems=4096)
        assert np.array_equal(results["gloo"], want, equal_nan=True)


def test_exponent_allreduce_over_the_gloo_group():
    """Exponential Global-QSGD's own reduction runs over the group's point-to-point messages
    under either controller (no mpi4py needed) and gives mean_estimate's bits."""
    codec = hq.get_codec("global_qsgd", bits=4, levels="exponential", world_size=hvd.size())
    xs = [np.random.default_rng(q).standard_normal(5000).astype(np.float32)
          for q in range(hvd.size())]
    peers = _peers()
    exchange = Exchange(codec, peers)
    topology = getattr(peers.hierarchy, "topology", None)
    kind = "hierarchical-custom" if topology is not None else "custom"
    assert (exchange.kind_for(5000) == kind) == (hvd.size() > 1)
    got = exchange.start(xs[hvd.rank()], 11, "t.exp").wait()
    want, _ = mean_estimate(codec, xs, seed=11, gather="auto", topology=topology)
    assert np.array_equal(got, want)


def test_exponent_lanes_keep_many_pieces_apart():
    """Two pipelined exchanges of 7 pieces each in flight at once: 14 reductions spread over
    the lanes (each its own channel), out of step with each other; every piece still gives
    mean_estimate's bits."""
    if hvd.size() == 1:
        pytest.skip("needs two ranks")
    codec = hq.get_codec("global_qsgd", bits=8, levels="exponential", world_size=hvd.size())
    peers = _peers()
    exchange = Exchange(codec, peers, pipeline_elems=4096)
    assert len(exchange._custom.comms) == EXPONENT_LANES > 1
    topology = getattr(peers.hierarchy, "topology", None)
    vectors = [[np.random.default_rng(10 * k + q).standard_normal(7 * 4096 - 5)
                .astype(np.float32) for q in range(hvd.size())] for k in range(2)]
    pending = [exchange.start(xs[hvd.rank()], 20 + k, f"t.lanes.{k}")
               for k, xs in enumerate(vectors)]
    for k, (p, xs) in enumerate(zip(pending, vectors)):
        want, _ = mean_estimate(codec, xs, seed=20 + k, pipeline_elems=4096, gather="auto",
                                topology=topology)
        assert np.array_equal(p.wait(), want), k


def test_ranks_that_ask_for_different_transports_fail_alike():
    if hvd.size() == 1:
        pytest.skip("needs two ranks")
    model = Linear([(8, 8)])
    opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hqt.Compression.qsgd(),
                                   transport="gloo" if hvd.rank() == 0 else "horovod")
    with pytest.raises(ValueError, match="differs between ranks"):
        opt.synchronize()  # the check, before either transport is built


@pytest.mark.parametrize("variable, value", [
    ("GLOO_SOCKET_IFNAME", "doesnotexist"),
    ("HQ_PEER_ADDR", "192.0.2.254"),        # an address no host has
    ("NCCL_SOCKET_IFNAME", "=nosuchnic"),
])
def test_a_rank_with_a_wrong_network_setting_fails_every_rank_fast(monkeypatch, variable, value):
    """One rank names an interface or address its host lacks: every rank raises the same
    error naming that rank, within seconds (no rank goes on alone, nothing waits for a
    connection timeout), and the next build on a sound setting works."""
    if hvd.size() == 1:
        pytest.skip("needs two ranks")
    if hvd.rank() == hvd.size() - 1:
        for name in ("HQ_PEER_ADDR", "GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE"):
            monkeypatch.delenv(name, raising=False)  # horovodrun --gloo sets the interface
        monkeypatch.setenv(variable, value)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        gloo_group_beside_horovod(HorovodTorchCollectives())
    assert time.monotonic() - start < 10
    assert f"rank {hvd.size() - 1}: AddressError: {variable}=" in str(error.value)
    everyone = hvd.allgather_object(str(error.value))
    assert all(e == everyone[0] for e in everyone)
    monkeypatch.undo()
    group = gloo_group_beside_horovod(HorovodTorchCollectives())
    assert group.allgather_object(hvd.rank(), "t.after") == list(range(hvd.size()))


def test_the_host_name_is_never_resolved(monkeypatch):
    """Where the host name maps to a loopback address (Debian, Ubuntu), or to nothing, the
    group is built all the same, on the addresses of the interfaces (the emulated hosts of
    tests/emulated check the whole job on such hosts)."""
    if hvd.size() == 1:
        pytest.skip("needs two ranks")

    def unresolvable(*_):
        raise socket.gaierror("this test resolves no host name")

    monkeypatch.setattr(socket, "gethostname", lambda: "no-such-host.invalid")
    monkeypatch.setattr(socket, "gethostbyname", unresolvable)
    monkeypatch.setattr(socket, "gethostbyname_ex", unresolvable)
    group = gloo_group_beside_horovod(HorovodTorchCollectives())
    assert group.allgather_object(hvd.rank(), "t.noname") == list(range(hvd.size()))
