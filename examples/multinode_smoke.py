"""A 10-step smoke run of a new multi-host setup: a 1M-parameter MLP trained by
``hq.DistributedOptimizer`` with qsgd 8 bits; each rank prints its host, the bytes it handed to
collectives in the last step against their float32 size, and whether its weights equal rank 0's.

    horovodrun -np 8 -H a:4,b:4 --gloo --network-interface eth0 python3 examples/multinode_smoke.py
    horovodrun -np 8 -H a:4,b:4 --mpi --network-interface eth0 python3 examples/multinode_smoke.py
    horovodrun -np 8 -H a:4,b:4 python3 examples/multinode_smoke.py --device cuda

Look for the same ``bytes_sent`` on every rank, on the hosts you expect, and ``True``
(docs/multinode.md, "Check the setup"). ``--device cuda`` puts each rank on the GPU of its
Horovod local rank.
"""
import argparse
import socket
import time

import horovod.torch as hvd
import torch

import horovod_quant.torch as hq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda: torch sees no CUDA device here")
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                                torch.nn.Linear(1024, 10)).to(device)
    opt = hq.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
                                  named_parameters=model.named_parameters(),
                                  compression=hq.Compression.qsgd(bits=8),
                                  fallback="never")  # the codec's bytes, whatever the link
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    torch.manual_seed(hvd.rank())  # every rank its own batch
    x = torch.randn(64, 1024, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    start = time.perf_counter()
    for _ in range(args.steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    stats, weight = opt.last_stats, model[0].weight.detach()
    same = torch.equal(hvd.broadcast(weight, root_rank=0, name="smoke.weight"), weight)
    print(f"rank {hvd.rank()}/{hvd.size()} on {socket.gethostname()}: bytes_sent "
          f"{stats.bytes_sent} vs bytes_raw {stats.bytes_raw} per step "
          f"({stats.bytes_raw / stats.bytes_sent:.2f}x less), weights equal to rank 0's: "
          f"{same}, {args.steps} steps in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
