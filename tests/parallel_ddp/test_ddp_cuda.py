"""The DDP hook with CUDA parameters: the codecs run on the GPU (CuPy kernels on torch's
stream), payloads travel through the process group (staged through host memory on gloo), and
the buckets' means equal mean_estimate's CPU numbers bit for bit, on every rank. Skipped
without CUDA and CuPy (on every rank alike); ``HQ_TEST_GPU=1`` makes that a failure."""
import os

import numpy as np
import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import horovod_quant as hq
from horovod_quant.torch import ddp

from conftest import codec_params, gather_rows, same_everywhere
from test_ddp_exact import Net, _batch

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
    state = ddp.QuantizationState(codec, seed=5)
    calls = []

    def hook(state, bucket):
        calls.append((bucket.buffer().detach().cpu(), state.seed_of(state.step, bucket.index()),
                      ddp.quantization_hook(state, bucket)))
        return calls[-1][2]

    model.register_comm_hook(state, hook)
    for step in range(2):
        calls.clear()
        model.zero_grad()
        model(_batch(step).to(cuda)).square().mean().backward()
        torch.cuda.synchronize()
        for inp, seed, fut in calls:
            got = fut.wait()
            assert got.is_cuda
            rows = [r.numpy() for r in gather_rows(inp)]
            want, _ = hq.mean_estimate(codec, rows, seed, pipeline_elems=state.pipeline_elems)
            assert np.array_equal(got.cpu().numpy(), want, equal_nan=True), (name, step)
            assert same_everywhere(got.cpu())
