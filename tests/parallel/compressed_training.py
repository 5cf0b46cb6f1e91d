"""One rank of a short training with Horovod's own optimizer and a horovod_quant codec:
``hvd.DistributedOptimizer(opt, compression=hq.Compression.<codec>())``, as a user writes it.

    horovodrun -np 2 -H a:1,b:1 --gloo python3 tests/parallel/compressed_training.py --codec qsgd

Every rank draws its own batches; after the steps the ranks compare a hash of their weights.
Rank 0 prints ``OK <codec>: <size> ranks, <steps> steps, identical weights <hash>`` and every
rank exits 0 when all hashes are equal; otherwise every rank exits 1.
"""
from __future__ import annotations

import argparse
import hashlib
import socket
import sys

import horovod.torch as hvd
import torch

import horovod_quant.torch as hq


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--codec", default="qsgd", help="a hq.Compression attribute")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=getattr(hq.Compression, args.codec)())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(1000 + hvd.rank())
    for _ in range(args.steps):
        x = torch.randn(16, 64, generator=gen)
        y = torch.randint(0, 4, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digest = hashlib.sha256(weights.numpy().tobytes()).digest()
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    every = hvd.allgather(mine.reshape(1, -1))
    hosts = hvd.allgather_object(socket.gethostname())
    same = bool((every == every[0]).all())
    if hvd.rank() == 0:
        if same:
            print(f"OK {args.codec}: {hvd.size()} ranks on {sorted(set(hosts))}, "
                  f"{args.steps} steps, identical weights {digest.hex()[:16]}", flush=True)
        else:
            print(f"FAIL {args.codec}: weights differ between ranks: "
                  f"{[bytes(row.tolist()).hex()[:16] for row in every]}", flush=True)
    hvd.shutdown()
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
