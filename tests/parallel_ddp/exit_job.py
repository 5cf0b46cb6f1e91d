"""A small DDP training job with the horovod_quant hook, written as docs/ddp.md shows (nothing
to call at the end), run as torchrun runs it (``torchrun --nproc_per_node 2 exit_job.py``) or
by tests/parallel_ddp/exit_runs.py many times, as 2 ranks and as 2 nodes x 2 ranks (the
hierarchical exchange, its worker thread and shared memory): every rank must exit 0.

A gloo worker thread that frees a collective's tensor after the interpreter has begun to
finalize aborts the process; to free a Python object it needs the GIL, and asks the main
thread to hand it over only after the switch interval. The job sets a long one (1 s), so that,
as on an idle machine, the main thread runs on to finalization first: without the package's
release of collective tensors (horovod_quant.torch.distributed.HANDED) 3 of 10 two-rank and 6
of 10 two-node runs aborted (``exit_runs.py --without-release``).
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import horovod_quant as hq
from horovod_quant.torch import ddp


def main() -> None:
    sys.setswitchinterval(1.0)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 4)))
    # the codec at every step: the plans checked below are its exchanges'
    state = ddp.QuantizationState(hq.get_codec("qsgd", bits=4), fallback="never")
    model.register_comm_hook(state, ddp.quantization_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(30):
        opt.zero_grad()
        model(torch.randn(16, 32, generator=gen)).square().mean().backward()
        opt.step()
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:  # several nodes: the hierarchical plans
        assert state.topology is not None and state.topology.hierarchical, state.topology
        plans = state.stats.plans
        assert plans and all(plan.startswith("hierarchical") for plan in plans), state.stats
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
