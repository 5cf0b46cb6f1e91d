"""Both PyTorch doors give exactly mean_estimate's numbers, on every rank, for every codec."""
import horovod.torch as hvd
import numpy as np
import pytest
import torch

import horovod_quant as hq
import horovod_quant.torch as hqt
from horovod_quant.core.rng import payload_seed
from horovod_quant.exchange import driver
from horovod_quant.exchange.wire import FRAME_HEADER_BYTES

from conftest import Linear, codec_params, rank_gradients

CODECS = [c for c in hq.available_codecs() if c not in ("none", "fp16")]
EVERYTHING = hqt.LayerPolicy.everything()


def _expected(name, shapes, step, seed, factor=1.0, key="ps.0"):
    """The mean the compressor door gives the parameter Horovod names ``key``: its u-th
    exchange (here u = step) has seed payload_seed(seed, u, key)."""
    n = hvd.size()
    codec = hq.get_codec(name, **codec_params(name))
    per_rank = [rank_gradients(shapes, step, r) for r in range(n)]
    flats = [np.concatenate([g.reshape(-1) for g in gs]) for gs in per_rank]
    est, _ = hq.mean_estimate(codec, flats, seed=payload_seed(seed, step, key),
                              gather="auto")
    return est * np.float32(factor)


def _all_equal_across_ranks(t):
    everyone = hvd.allgather(t.detach().reshape(1, -1))
    return all(torch.equal(everyone[0], everyone[r]) for r in range(everyone.shape[0]))


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("op", ["average", "sum"])
def test_horovod_optimizer_door_matches_reference(name, op):
    shapes = [(37, 81)]
    model = Linear(shapes)
    comp = hqt.Compression.__getattr__(name)(seed=5, policy=EVERYTHING, **codec_params(name))
    hop = hvd.Average if op == "average" else hvd.Sum
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(),
                                   compression=comp, op=hop)
    for step in range(2):
        opt.zero_grad()
        model.loss(rank_gradients(shapes, step, hvd.rank())).backward()
        opt.step()
        if hvd.size() == 1:
            continue  # Horovod registers no hooks in a one-rank world
        factor = hvd.size() if op == "sum" else 1.0
        want = _expected(name, shapes, step, 5, factor)
        got = model.ps[0].grad.reshape(-1).numpy()
        assert np.array_equal(got, want, equal_nan=True), (name, op, step)
        assert _all_equal_across_ranks(model.ps[0].grad)


@pytest.mark.parametrize("name", ["qsgd", "natural", "global_qsgd"])
def test_backward_passes_and_groups(name):
    shapes = [(16, 64), (8, 128)]
    model = Linear(shapes)
    comp = hqt.Compression.__getattr__(name)(seed=9, policy=EVERYTHING, **codec_params(name))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), compression=comp,
                                   backward_passes_per_step=2, num_groups=1)
    opt.zero_grad()
    grads = rank_gradients(shapes, 0, hvd.rank())
    model.loss(grads).backward()
    model.loss(grads).backward()
    opt.step()
    if hvd.size() > 1:
        # grouped tensors are matched by their parameter names too
        codec = hq.get_codec(name, **codec_params(name))
        for j in range(len(shapes)):
            flats = [rank_gradients(shapes, 0, r)[j].reshape(-1) * np.float32(2)
                     for r in range(hvd.size())]
            want, _ = hq.mean_estimate(codec, flats, seed=payload_seed(9, 0, f"ps.{j}"))
            assert np.array_equal(model.ps[j].grad.reshape(-1).numpy(), want)


@pytest.mark.parametrize("name", CODECS + ["none"])
def test_quant_optimizer_matches_reference(name):
    shapes = [(33, 40), (50,), (7, 9)]
    model = Linear(shapes)
    opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hqt.Compression.__getattr__(name)(
                                       seed=3, policy=EVERYTHING, **codec_params(name)),
                                   fallback="never")  # the codec at every step, not timings
    for step in range(3):
        opt.zero_grad()
        model.loss(rank_gradients(shapes, step, hvd.rank())).backward()
        opt.step()
        if hvd.size() == 1:
            continue
        codec = hq.get_codec(name, **codec_params(name))
        per_rank = [rank_gradients(shapes, step, r) for r in range(hvd.size())]
        # one fused bucket, gradients in reverse parameter order
        flats = [np.concatenate([g.reshape(-1) for g in reversed(gs)]) for gs in per_rank]
        names = ",".join(f"ps.{i}" for i in reversed(range(len(shapes))))  # the bucket's
        want, _ = hq.mean_estimate(codec, flats, seed=payload_seed(3, step, names), gather="auto",
                                   topology=opt.topology)
        got = np.concatenate([p.grad.reshape(-1).numpy() for p in reversed(list(model.ps))])
        if name in ("none", "fp16") and hvd.size() > 2:  # Horovod's own float sum, its order
            tol = 1e-5 if name == "none" else 2e-3
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
        else:
            assert np.array_equal(got, want, equal_nan=True), (name, step)
        assert opt.last_stats.bytes_sent > 0
    for p in model.ps:
        assert _all_equal_across_ranks(p.data)


def test_wire_bytes_measured_at_the_collective(monkeypatch):
    """The bytes handed to the collectives (whichever transport carries them) are what the
    codec promises and what the stats count."""
    sent = []
    issue = driver.issue

    def rec(comm, request, name, custom=None):
        sent.append(request.array.nbytes)
        return issue(comm, request, name, custom)
    monkeypatch.setattr(driver, "issue", rec)
    d = 64 * 512
    shapes = [(64, 512)]
    model = Linear(shapes)
    opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hqt.Compression.qsgd(bits=4, bucket_size=512),
                                   gather="allgather")
    opt.zero_grad()
    model.loss(rank_gradients(shapes, 0, hvd.rank())).backward()
    opt.step()
    if hvd.size() > 1:
        budget = d * 4 // 8 + 4 * (d // 512)  # 4 bits per element + one float32 per bucket
        assert sent == [budget + FRAME_HEADER_BYTES]  # plus the frame header
        assert opt.last_stats.bytes_raw == d * 4
        assert opt.last_stats.compression_ratio > 7.5


@pytest.mark.parametrize("levels", ["linear", "exponential"])
def test_global_qsgd_buckets_take_their_own_norm(levels):
    """Several buckets of one Global-QSGD codec: each bucket's result is mean_estimate of that
    bucket's vectors alone (its own norm), pipelined in pieces, and the weights stay identical
    on every rank. From the second step on, buckets start from the backward hooks, except
    where the exchange pairs by call order (the exponent allreduce under MPI): those start at
    synchronize(), as every bucket of the first step does (after the ranks' check)."""
    shapes = [(33, 40), (50,), (7, 9), (64,), (20, 30)]
    scales = [1.0, 100.0, 0.01, 10.0, 1.0]  # buckets of very different norms
    model = Linear(shapes)
    params = {"bits": 4, "levels": levels, **codec_params("global_qsgd")}
    opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hqt.Compression.global_qsgd(
                                       seed=8, policy=EVERYTHING, **params),
                                   fusion_bytes=600, pipeline_elems=500,
                                   fallback="never")  # the same buckets at every step
    assert len(opt._exchanger.layout.buckets) >= 3
    position = {id(p): i for i, p in enumerate(model.ps)}

    def grads(step, rank):
        return [g * np.float32(s) for g, s in zip(rank_gradients(shapes, step, rank), scales)]

    for step in range(2):
        opt.zero_grad()
        model.loss(grads(step, hvd.rank())).backward()
        if hvd.size() > 1 and step > 0:
            ex = opt._exchanger
            for b in ex.layout.buckets:
                # over a transport that pairs by call order (gloo) every bucket starts in
                # bucket order from the hooks; over Horovod's, custom collectives wait
                blocks = ex.schedule.exchange_of(b).blocks_on_peers
                assert (b.pending is not None) == (ex.comm.pairs_by_order or not blocks)
        elif hvd.size() > 1:  # the first step's exchanges wait for synchronize()
            assert not any(b.pending for b in opt._exchanger.layout.buckets)
        opt.step()
        if hvd.size() == 1:
            continue
        per_rank = [grads(step, r) for r in range(hvd.size())]
        for b in opt._exchanger.layout.buckets:
            flats = [np.concatenate([gs[position[id(p)]].reshape(-1) for p in b.params])
                     for gs in per_rank]
            want, _ = hq.mean_estimate(hq.get_codec("global_qsgd", **params), flats,
                                       seed=payload_seed(8, step, ",".join(
                                           f"ps.{position[id(p)]}" for p in b.params)),
                                       pipeline_elems=500,
                                       gather="auto", topology=opt.topology)
            got = np.concatenate([p.grad.reshape(-1).numpy() for p in b.params])
            assert np.array_equal(got, want), (levels, step, b.index)
    for p in model.ps:
        assert _all_equal_across_ranks(p.data)


class ChannelsLast(torch.nn.Module):
    """Convolution-shaped parameters in ``channels_last`` (their gradients are strided too):
    loss = sum_i <p_i, g_i>."""

    def __init__(self, shapes):
        super().__init__()
        self.ps = torch.nn.ParameterList([
            torch.nn.Parameter(torch.zeros(s).to(memory_format=torch.channels_last))
            for s in shapes])

    def loss(self, grads):
        return sum((p * torch.from_numpy(g).to(memory_format=torch.channels_last)).sum()
                   for p, g in zip(self.ps, grads))


@pytest.mark.parametrize("door", ["horovod", "quant"])
def test_channels_last_gradients(door):
    """Strided gradients, which Horovod's allreduce refuses: the exempt one (under the default
    policy's 1024 elements) is Horovod's exact average, the compressed one mean_estimate's,
    each written back in its own layout."""
    shapes = [(32, 16, 3, 3), (16, 3, 3, 3)]
    model = ChannelsLast(shapes)
    comp = hqt.Compression.qsgd(seed=3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    if door == "horovod":
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                       compression=comp)
    else:
        opt = hqt.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                       compression=comp, fallback="never")
    for step in range(2):
        opt.zero_grad()
        model.loss(rank_gradients(shapes, step, hvd.rank())).backward()
        opt.step()
        per_rank = [rank_gradients(shapes, step, r) for r in range(hvd.size())]
        exempt = model.ps[1].grad
        np.testing.assert_allclose(exempt.numpy(), np.mean([g[1] for g in per_rank], axis=0),
                                   rtol=1e-6, atol=1e-6)
        # one seed in both doors: the tensor ps.0 (a bucket of it alone) at this step
        seed, topology = (payload_seed(3, step, "ps.0"),
                          None if door == "horovod" else opt.topology)
        want, _ = hq.mean_estimate(hq.get_codec("qsgd"), [g[0].reshape(-1) for g in per_rank],
                                   seed=seed, gather="auto", topology=topology)
        if hvd.size() > 1:
            assert np.array_equal(model.ps[0].grad.reshape(-1).numpy(), want), step
        if door == "quant":
            assert all(p.grad.is_contiguous(memory_format=torch.channels_last)
                       for p in model.ps)
    for p in model.ps:
        assert _all_equal_across_ranks(p.data)
