"""The PyTorch doors with CUDA parameters: the codecs run on the GPU (CuPy kernels on torch's
stream), payloads travel through Horovod (its GPU collectives, or staged through host memory
when it has none) or, where ranks share hosts, through hq.DistributedOptimizer's groups beside
Horovod (the hierarchical exchange: NCCL where every rank of a host has a GPU of its own, else
gloo staged through host memory, as when run.sh's 2 x 2 ranks share one GPU), and the
gradients equal mean_estimate's CPU numbers bit for bit, on every rank. Skipped without CUDA
and CuPy (on every rank alike); ``HQ_TEST_GPU=1`` makes that a failure."""
import os

import horovod.torch as hvd
import numpy as np
import pytest
import torch

import horovod_quant as hq
import horovod_quant.torch as hqt
from horovod_quant.core.rng import payload_seed
from horovod_quant.exchange import plans

from conftest import codec_params, rank_gradients

CODECS = [c for c in hq.available_codecs() if c not in ("none", "fp16")]
EVERYTHING = hqt.LayerPolicy.everything()


@pytest.fixture(scope="module")
def cuda():
    import horovod_quant.gpu as G

    reason = None
    if not torch.cuda.is_available():
        reason = "torch sees no CUDA device"
    elif not G.available():
        reason = "CuPy missing or sees no CUDA device"
    if reason is not None:
        if os.environ.get("HQ_TEST_GPU") == "1":
            pytest.fail(f"HQ_TEST_GPU=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


class CudaLinear(torch.nn.Module):
    """loss = sum_i <p_i, g_i> with parameters on ``device``: the gradients are the g_i."""

    def __init__(self, shapes, device):
        super().__init__()
        self.ps = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(s, device=device)) for s in shapes])

    def loss(self, grads):
        return sum((p * torch.from_numpy(g).to(p.device)).sum() for p, g in zip(self.ps, grads))


def _bucket_seed(seed, step, shapes):
    """The seed of the one fused bucket of ``ps.*`` (gradients in reverse order) at ``step``:
    its key is its parameters' names."""
    return payload_seed(seed, step, ",".join(f"ps.{i}" for i in reversed(range(len(shapes)))))


def _want(name, shapes, step, seed, reverse, opt=None):
    """mean_estimate of the step's gradients, exchanged with ``seed`` (``opt``:
    hq.DistributedOptimizer, whose topology, fabric and pieces choose its plans; None:
    Horovod's optimizer, flat plans)."""
    codec = hq.get_codec(name, **codec_params(name))
    per_rank = [rank_gradients(shapes, step, r) for r in range(hvd.size())]
    order = (lambda gs: list(reversed(gs))) if reverse else list
    flats = [np.concatenate([g.reshape(-1) for g in order(gs)]) for gs in per_rank]
    shape = {} if opt is None else {"topology": opt.topology, "fabric": opt.fabric,
                                    "pipeline_elems": opt.pipeline_elems}
    want, _ = hq.mean_estimate(codec, flats, seed=seed, gather="auto", **shape)
    return want


def _trained_steps(model, opt, shapes, steps=2):
    """Run ``steps`` optimizer steps on this rank's gradients; yield each step's index after it
    ran (none in a one-rank world, where Horovod exchanges nothing)."""
    for step in range(steps):
        opt.zero_grad()
        model.loss(rank_gradients(shapes, step, hvd.rank())).backward()
        opt.step()
        if hvd.size() > 1:
            yield step


@pytest.mark.parametrize("name", CODECS)
def test_quant_optimizer_on_cuda_matches_cpu_reference(cuda, name):
    shapes = [(33, 40), (7, 9)]
    model = CudaLinear(shapes, cuda)
    opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(),
                                   compression=hqt.Compression.__getattr__(name)(
                                       seed=3, policy=EVERYTHING, **codec_params(name)),
                                   pipeline_elems=500)
    for step in _trained_steps(model, opt, shapes):
        grads = [p.grad for p in reversed(list(model.ps))]
        assert all(g.is_cuda for g in grads)
        got = torch.cat([g.reshape(-1) for g in grads]).cpu().numpy()
        assert np.array_equal(got, _want(name, shapes, step, _bucket_seed(3, step, shapes),
                                         reverse=True, opt=opt), equal_nan=True), (name, step)


@pytest.mark.parametrize("name", ["qsgd", "global_qsgd", "natural", "nested_dithered"])
def test_quant_optimizer_on_cuda_takes_the_hierarchy_where_ranks_share_hosts(cuda, name):
    """hq.DistributedOptimizer with CUDA parameters and its defaults (no fallback, so every
    step runs the codec): where ranks share hosts (run.sh's 2 x 2: ``horovodrun -np 4 -H
    localhost:2,127.0.0.1:2 --gloo``) every bucket takes a hierarchical plan over the groups
    beside Horovod; elsewhere (2 x 1, one host) flat plans over Horovod's collectives. Either
    way each step's gradients are mean_estimate's for the optimizer's topology and fabric, bit
    for bit, and every rank ends with the same weights."""
    shapes = [(300, 70), (64, 50)]
    model = CudaLinear(shapes, cuda)
    opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                   named_parameters=model.named_parameters(),
                                   compression=hqt.Compression.__getattr__(name)(
                                       seed=3, policy=EVERYTHING, **codec_params(name)),
                                   fallback="never")
    hierarchical = hvd.local_size() > 1 and hvd.cross_size() > 1
    for step in _trained_steps(model, opt, shapes):
        got = torch.cat([p.grad.reshape(-1) for p in reversed(list(model.ps))]).cpu().numpy()
        assert np.array_equal(got, _want(name, shapes, step, _bucket_seed(3, step, shapes),
                                         reverse=True, opt=opt), equal_nan=True), (name, step)
    if hvd.size() > 1:
        kinds = opt.last_stats.plans
        assert kinds and all(k.startswith(plans.HIERARCHICAL) == hierarchical for k in kinds)
        assert (opt.topology is not None) == hierarchical
        assert opt.transport == ("gloo" if hierarchical else "horovod")
        assert (opt.last_stats.bytes_local > 0) == hierarchical
    weights = hvd.allgather(torch.cat([p.detach().reshape(1, -1) for p in model.ps], 1).cpu())
    assert all(torch.equal(weights[0], row) for row in weights)


@pytest.mark.parametrize("name", ["qsgd", "global_qsgd", "nested_dithered", "natural"])
def test_horovod_optimizer_door_on_cuda(cuda, name):
    shapes = [(37, 81)]
    model = CudaLinear(shapes, cuda)
    comp = hqt.Compression.__getattr__(name)(seed=5, policy=EVERYTHING, **codec_params(name))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), compression=comp)
    for step in _trained_steps(model, opt, shapes):
        grad = model.ps[0].grad
        assert grad.is_cuda
        # the compressor's seed: the tensor's name and its use (the step), docs/pytorch.md
        assert np.array_equal(grad.reshape(-1).cpu().numpy(),
                              _want(name, shapes, step, payload_seed(5, step, "ps.0"),
                                    reverse=False), equal_nan=True)
