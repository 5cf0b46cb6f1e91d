"""The DDP hook's part of tests/doors: the same codec, seed and gradients through
``QuantizationState``/``quantization_hook``, written for tests/doors/test_doors_agree.py. Runs in
2-rank worlds only (the comparison's), on every rank alike."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from horovod_quant.doors import DoorOptions
from horovod_quant.torch import ddp

from conftest import same_everywhere

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "doors"))
import agreement  # noqa: E402


class _Weight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.doors_weight = torch.nn.Parameter(torch.zeros(agreement.SHAPE))

    def forward(self, grad):
        return (self.doors_weight * grad).sum()


def test_ddp_hook_door():
    if dist.get_world_size() != agreement.WORLD:
        pytest.skip(f"the doors are compared in {agreement.WORLD}-rank worlds")
    model = DDP(_Weight())
    state = ddp.QuantizationState(agreement.codec(), seed=agreement.SEED,
                                  named_parameters=model.module.named_parameters())
    assert state.pipeline_elems == DoorOptions().pipeline_elems
    model.register_comm_hook(state, ddp.quantization_hook)
    model(torch.from_numpy(agreement.gradients(dist.get_rank()))).backward()
    mean = model.module.doors_weight.grad.numpy().copy()
    seed = state.seed_of(0, agreement.NAME)  # its bucket holds that parameter alone
    assert np.array_equal(mean, agreement.reference(seed))
    assert same_everywhere(model.module.doors_weight.grad)
    if dist.get_rank() == 0:
        agreement.write("ddp", mean, seed)
