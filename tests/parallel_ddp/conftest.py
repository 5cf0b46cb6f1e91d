"""DDP door tests, run once per rank under ``torchrun`` (tests/parallel_ddp/run.sh) and also
under plain pytest as a one-rank world. Every test issues its collectives in the same order on
every rank, and no test skips on some ranks only."""
import os

import numpy as np
import pytest
from torchrun_env import free_port, rank_environment

from horovod_quant.core.registry import codec_class

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")


@pytest.fixture(scope="session", autouse=True)
def process_group():
    if "RANK" not in os.environ:  # plain pytest: a one-rank world
        os.environ.update(rank_environment(0, 1, 1, free_port()))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield dist
    dist.destroy_process_group()


@pytest.fixture
def several_ranks(process_group):
    if dist.get_world_size() == 1:
        pytest.skip("needs several ranks")


def codec_params(name):
    """Parameters that make every codec valid in this world."""
    if codec_class(name).needs_world_size:
        return {"world_size": dist.get_world_size()}
    return {}


def gather_rows(t, group=None):
    """Every rank's flat float tensor ``t`` (equal lengths), as a list in rank order."""
    n = dist.get_world_size(group)
    flat = t.detach().reshape(-1).contiguous()
    out = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(out, flat, group=group)
    return out


def same_everywhere(t, group=None):
    rows = gather_rows(t, group)
    return all(torch.equal(rows[0], r) or (torch.isnan(rows[0]).any()
               and np.array_equal(rows[0].numpy(), r.numpy(), equal_nan=True)) for r in rows)
