"""The DDP hook needs nothing beyond PyTorch: with every import of ``horovod`` failing, a DDP step
runs the hook's exchange, and the Horovod doors' names raise an ImportError that says what to
use; where ``dist.new_group`` sorts ranks (older PyTorch), the hierarchy is built only where
that keeps its order."""
from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

SCRIPT = """
import sys, tempfile
sys.modules["horovod"] = None  # as where Horovod is not installed: importing it fails
import torch, torch.distributed as dist
import horovod_quant as hq
import horovod_quant.torch as hqt
from horovod_quant.torch import ddp

dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 4))
state = ddp.QuantizationState(hq.get_codec("qsgd", bits=8))
model.register_comm_hook(state, ddp.quantization_hook)
model(torch.randn(8, 64)).square().sum().backward()
assert state.step == 1 and state.stats.tensors > 0, state.stats
assert all(torch.isfinite(p.grad).all() for p in model.parameters())
try:
    hqt.Compression
except ImportError as exc:
    print(exc)
else:
    raise AssertionError("hqt.Compression without Horovod")
dist.destroy_process_group()
"""


def test_ddp_hook_runs_without_horovod():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "needs Horovod, which is not installed" in run.stdout
    assert "horovod_quant.torch.ddp" in run.stdout


def test_subgroups_where_new_group_sorts_ranks(monkeypatch):
    """Where ``dist.new_group`` sorts the ranks it is given (older PyTorch), the hierarchy is
    built only when every host and shard group's ranks ascend; else the exchange stays flat."""
    from horovod_quant.exchange.topology import Topology
    from horovod_quant.torch import distributed

    class Comm:
        _ranks = [0, 1, 2, 3]

    in_a_row = Topology.grid(2, 2)  # torchrun: each node's ranks numbered in a row
    interleaved = Topology.from_host_keys(["a", "b", "b", "a"])  # shard groups (0, 1), (3, 2)
    monkeypatch.setattr(distributed, "_GROUPS_KEEP_ORDER", False)
    assert distributed._subgroups_possible(Comm(), in_a_row)
    assert not distributed._subgroups_possible(Comm(), interleaved)
    monkeypatch.setattr(distributed, "_GROUPS_KEEP_ORDER", True)
    assert distributed._subgroups_possible(Comm(), interleaved)
