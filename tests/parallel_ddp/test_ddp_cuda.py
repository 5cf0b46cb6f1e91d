"""The DDP hook with CUDA parameters: the codecs run on the GPU (CuPy kernels on torch's
stream), payloads travel through the process group (staged through host memory on gloo), and
the buckets' means equal mean_estimate's CPU numbers bit for bit, on every rank. Skipped
without CUDA and CuPy (on every rank alike); ``HQ_TEST_GPU=1`` makes that a failure."""
import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import horovod_quant as hq
from horovod_quant.torch import ddp

from conftest import codec_params
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
    state = ddp.QuantizationState(codec, seed=5)
    rec = Recorder(state)
    model.register_comm_hook(state, rec.hook)
    for step in range(2):
        model.zero_grad()
        model(_batch(step).to(cuda)).square().mean().backward()
        torch.cuda.synchronize()
        assert all(got.is_cuda for got in rec.check()), (name, step)
