"""Parallel tests run once per rank under horovodrun/mpirun (tests/parallel/run.sh) and also
under plain pytest as a one-rank world. Every test issues its collectives in the same order on
every rank, and no test skips on some ranks only (that would desynchronize the ranks)."""
import os

import numpy as np
import pytest

from horovod_quant.core.registry import codec_class

hvd = pytest.importorskip("horovod.torch")
torch = pytest.importorskip("torch")


@pytest.fixture(scope="session", autouse=True)
def horovod_world():
    hvd.init()
    if _ranks_on_this_machine() > (os.cpu_count() or 1):
        _poll_horovod_waits()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield hvd


def _ranks_on_this_machine() -> int:
    """The ranks that share this machine's cores (horovodrun's hosts "localhost" and
    "127.0.0.1" are one machine): those whose kernel has this one's boot id."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        machine = f.read().strip()
    return hvd.allgather_object(machine).count(machine)


def _poll_horovod_waits():
    """Horovod's waits (its synchronous collectives, its optimizer's and its functions') poll
    with short sleeps, as the package's own waits do (horovod_quant.torch.collectives
    .synchronize), where a machine's ranks outnumber its cores: there Horovod's
    ``sched_yield`` loop takes the cores the other ranks need (DEVELOPERS.md). Only how a
    rank waits changes, never what a collective returns; worlds with a core per rank keep
    Horovod's own wait, as users run it."""
    import horovod.torch.functions
    import horovod.torch.mpi_ops
    import horovod.torch.optimizer
    import horovod.torch.sync_batch_norm

    from horovod_quant.torch.collectives import synchronize
    for module in (horovod.torch.mpi_ops, horovod.torch.optimizer, horovod.torch.functions,
                   horovod.torch.sync_batch_norm):
        module.synchronize = synchronize


def rank_gradients(shapes, step, rank, scale=1.0):
    """Deterministic per-rank gradients that every rank can recompute for any other rank."""
    rng = np.random.default_rng([step, rank, 1234])
    return [(rng.standard_normal(s) * scale * (rank + 1)).astype(np.float32) for s in shapes]


class Linear(torch.nn.Module):
    """Parameters whose gradient is a chosen tensor: loss = sum_i <p_i, g_i>."""

    def __init__(self, shapes):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])

    def loss(self, grads):
        return sum((p * torch.from_numpy(g)).sum() for p, g in zip(self.ps, grads))


def codec_params(name):
    """Parameters that make every codec valid in this world."""
    if codec_class(name).needs_world_size:
        return {"world_size": hvd.size()}
    return {}


def ids():
    return {"rank": hvd.rank(), "size": hvd.size(),
            "controller": os.environ.get("HQ_CONTROLLER", "?")}
