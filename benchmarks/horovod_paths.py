"""Time per step of Horovod's own fp32/fp16 allreduce against the same tensors through
``hq.DistributedOptimizer`` (``none`` and ``fp16`` ride Horovod's allreduce there too), side by
side in one run, rounds interleaved so that load changes hit every path alike.

    horovodrun -np 2 -H localhost:2 --gloo python3 benchmarks/horovod_paths.py
    horovodrun -np 2 -H localhost:2 --mpi python3 benchmarks/horovod_paths.py --hidden 1024

Rank 0 prints, per path, the median milliseconds of a training step (backward, whose hooks
start the exchanges, then ``step()``) over ``--rounds`` rounds of ``--steps`` steps, and its
ratio to Horovod's own door with the same dtype.
"""
import argparse
import statistics
import time

import horovod.torch as hvd
import torch

import horovod_quant.torch as hq


def paths():
    return {
        "horovod fp32": lambda opt, m: hvd.DistributedOptimizer(
            opt, named_parameters=m.named_parameters()),
        "horovod fp16": lambda opt, m: hvd.DistributedOptimizer(
            opt, named_parameters=m.named_parameters(), compression=hvd.Compression.fp16),
        "hq none": lambda opt, m: hq.DistributedOptimizer(
            opt, named_parameters=m.named_parameters(), compression=hq.Compression.none()),
        "hq fp16": lambda opt, m: hq.DistributedOptimizer(
            opt, named_parameters=m.named_parameters(), compression=hq.Compression.fp16()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048, help="width of the two hidden layers")
    parser.add_argument("--steps", type=int, default=5, help="steps per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (each runs every path)")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    setups = {}
    for name, wrap in paths().items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1024, args.hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(args.hidden, 10))
        opt = wrap(torch.optim.SGD(model.parameters(), lr=1e-6), model)
        x = torch.randn(8, 1024)
        setups[name] = (model, opt, x)
    times = {name: [] for name in setups}
    for _ in range(args.rounds):
        for name, (model, opt, x) in setups.items():
            t = time.perf_counter()
            for _ in range(args.steps):
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
            times[name].append((time.perf_counter() - t) / args.steps)
    if hvd.rank() == 0:
        mb = sum(p.numel() for p in setups["hq none"][0].parameters()) * 4 / 1e6
        print(f"{hvd.size()} ranks, {mb:.1f} MB of float32 gradient per step, median of "
              f"{args.rounds} rounds x {args.steps} steps (step = backward + exchange + update)")
        base = {"fp32": statistics.median(times["horovod fp32"]),
                "fp16": statistics.median(times["horovod fp16"])}
        for name, ts in times.items():
            ms = statistics.median(ts) * 1e3
            ref = base["fp16" if "fp16" in name else "fp32"] * 1e3
            print(f"  {name:14s} {ms:8.1f} ms/step   {ms / ref:5.2f}x Horovod's own")


if __name__ == "__main__":
    main()
