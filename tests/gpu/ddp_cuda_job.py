"""A DDP job with the horovod_quant hook on CUDA parameters: 20 steps of a small MLP, then every
rank's parameters hashed and compared. Ranks may share one GPU (gloo groups, payloads staged
through host memory). Rank 0 prints whether the ranks ended identical and finite, and the plans
the exchanges took. Not collected by pytest: launch it, as docs/dev/gpu.md does,

    torchrun --nproc_per_node 2 tests/gpu/ddp_cuda_job.py qsgd:8
    torchrun --nnodes 2 --node_rank {0,1} --nproc_per_node 2 --master_addr 127.0.0.1 \\
        --master_port 29611 tests/gpu/ddp_cuda_job.py global_qsgd:8    # hierarchical
"""
import hashlib
import sys

import torch
import torch.distributed as dist

from horovod_quant.doors import CodecRequest
from horovod_quant.torch import ddp

name, bits = (sys.argv[1] if len(sys.argv) > 1 else "qsgd:8").split(":")
dist.init_process_group("gloo")
torch.manual_seed(0)
cuda = torch.cuda.is_available()
dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
    torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)).to(dev),
    device_ids=[0] if cuda else None)
state = ddp.QuantizationState(CodecRequest(name, {"bits": int(bits)}).build(dist.get_world_size))
model.register_comm_hook(state, ddp.quantization_hook)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(dist.get_rank())
losses = []
for _ in range(20):
    opt.zero_grad()
    x = torch.randn(64, 256, generator=gen).to(dev)
    y = torch.randint(0, 10, (64,), generator=gen).to(dev)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
params = [p.detach().cpu() for p in model.parameters()]
digest = hashlib.sha256(b"".join(p.numpy().tobytes() for p in params)).hexdigest()[:16]
finite = all(torch.isfinite(p).all().item() for p in params)
out = [None] * dist.get_world_size()
dist.all_gather_object(out, (digest, finite))
if dist.get_rank() == 0:
    print(f"{name}:{bits}", "ranks", dist.get_world_size(),
          "identical" if len(set(out)) == 1 else f"DIFFER {out}", "finite", finite,
          "loss %.3f -> %.3f" % (losses[0], losses[-1]), "plans", dict(state.stats.plans),
          "topology", state.topology)
dist.destroy_process_group()
