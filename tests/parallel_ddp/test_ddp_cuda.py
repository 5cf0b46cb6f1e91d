"""The DDP hook with CUDA parameters: the codecs run on the GPU (CuPy kernels on torch's
stream), payloads travel through the process group (staged through host memory on gloo), and
the buckets' means equal mean_estimate's CPU numbers bit for bit, on every rank; on several
nodes of several ranks (run.sh's 2 x 2) through the hierarchical exchange, on the hierarchy's
worker thread. Skipped without CUDA and CuPy (on every rank alike); ``HQ_TEST_GPU=1`` makes
that a failure."""
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import horovod_quant as hq
from horovod_quant.exchange import plans
from horovod_quant.exchange.cost import Fabric
from horovod_quant.policy import LayerPolicy
from horovod_quant.torch import ddp

from conftest import codec_params, gather_rows
from test_ddp_exact import Net, Recorder, _batch

CODECS = [c for c in hq.available_codecs() if c not in ("none", "fp16")]


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
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


@pytest.mark.parametrize("name", CODECS)
def test_cuda_buckets_match_cpu_reference(cuda, name):
    codec = hq.get_codec(name, **codec_params(name))
    torch.manual_seed(0)
    model = DDP(Net().to(cuda), device_ids=[cuda.index], bucket_cap_mb=0.25)
    state = ddp.QuantizationState(codec, seed=5, fallback="never")
    rec = Recorder(state)
    model.register_comm_hook(state, rec.hook)
    for step in range(2):
        model.zero_grad()
        model(_batch(step).to(cuda)).square().mean().backward()
        torch.cuda.synchronize()
        assert all(got.is_cuda for got in rec.check()), (name, step)


@pytest.mark.parametrize("name", ["qsgd", "global_qsgd", "natural"])
def test_cuda_buckets_take_the_hierarchy_on_nodes_of_several_ranks(cuda, name):
    """2 nodes x 2 ranks: every bucket takes a hierarchical plan (host means on the GPU by the
    exact kernel, the codec between the nodes), equal to mean_estimate with the state's
    topology and the GPU fabric bit for bit; one node: flat plans. Ranks end identical."""
    nodes = [int(n) for n in gather_rows(torch.tensor([int(os.environ.get("GROUP_RANK", 0))]))]
    hierarchical = len(set(nodes)) > 1 and min(nodes.count(n) for n in set(nodes)) > 1
    torch.manual_seed(0)
    model = DDP(Net().to(cuda), device_ids=[cuda.index], bucket_cap_mb=0.25)
    state = ddp.QuantizationState(hq.get_codec(name, **codec_params(name)), seed=9,
                                  policy=LayerPolicy.everything(), fallback="never")
    rec = Recorder(state)
    model.register_comm_hook(state, rec.hook)
    for step in range(2):
        model.zero_grad()
        model(_batch(step).to(cuda)).square().mean().backward()
        torch.cuda.synchronize()
        rec.check()  # every bucket against mean_estimate(topology=..., fabric=...), every rank
    assert (state.fabric == Fabric.for_ranks(on_gpu=True)
            and (state.topology is not None) == hierarchical)
    kinds = state.stats.plans
    if dist.get_world_size() > 1:
        assert kinds and all(k.startswith(plans.HIERARCHICAL) == hierarchical for k in kinds)
        assert (state.stats.bytes_local > 0) == hierarchical
    grads = gather_rows(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu())
    assert all(np.array_equal(grads[0], g, equal_nan=True) for g in grads)
