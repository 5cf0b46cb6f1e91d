"""The Horovod torch doors' part of tests/doors: the same codec, seed and gradients through
``hvd.DistributedOptimizer(compression=hq.torch.Compression.<codec>(...))`` and through
``hq.torch.DistributedOptimizer``, each written for tests/doors/test_doors_agree.py. Runs in the
2-rank worlds only (the comparison's), on every rank alike."""
import sys
from pathlib import Path

import horovod.torch as hvd
import numpy as np
import pytest
import torch

import horovod_quant.torch as hqt
from horovod_quant.core.rng import payload_seed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "doors"))
import agreement  # noqa: E402

# the doors' results of one 2-rank world, compared across frameworks (tests/doors):
# the same bits under every controller (test_torch_exact.py)
pytestmark = [pytest.mark.controller_independent, pytest.mark.size_independent]


@pytest.fixture
def two_ranks():
    if hvd.size() != agreement.WORLD:
        pytest.skip(f"the doors are compared in {agreement.WORLD}-rank worlds")


def _averaged(opt, param):
    """One step of ``opt`` on this rank's gradient (lr 0: the weights stay); its gradient."""
    opt.zero_grad()
    (param * torch.from_numpy(agreement.gradients(hvd.rank()))).sum().backward()
    opt.step()
    return param.grad.numpy().copy()


def _check_and_write(door, mean, seed):
    assert np.array_equal(mean, agreement.reference(seed)), door
    everyone = hvd.allgather(torch.from_numpy(mean).reshape(1, -1), name=f"doors.{door}")
    assert all(torch.equal(everyone[0], row) for row in everyone)
    if hvd.rank() == 0:
        agreement.write(door, mean, seed)


def test_horovod_compression_door(two_ranks):
    param = torch.nn.Parameter(torch.zeros(agreement.SHAPE))
    name, params = agreement.CODEC
    compression = getattr(hqt.Compression, name)(seed=agreement.SEED, **params)
    opt = hvd.DistributedOptimizer(torch.optim.SGD([param], lr=0.0),
                                   named_parameters=[(agreement.NAME, param)],
                                   compression=compression)
    mean = _averaged(opt, param)
    _check_and_write("torch_compressor", mean,
                     payload_seed(agreement.SEED, 0, agreement.NAME))


def test_hq_optimizer_door(two_ranks):
    param = torch.nn.Parameter(torch.zeros(agreement.SHAPE))
    opt = hqt.DistributedOptimizer(torch.optim.SGD([param], lr=0.0),
                                   named_parameters=[(agreement.NAME, param)],
                                   compression=agreement.codec(), seed=agreement.SEED)
    assert opt.pipeline_elems == hqt.DoorOptions().pipeline_elems
    mean = _averaged(opt, param)
    _check_and_write("optimizer", mean, payload_seed(agreement.SEED, 0, agreement.NAME))
