"""Latency of one allreduce waited on by Horovod's ``hvd.synchronize`` (its ``sched_yield``
loop) against :func:`horovod_quant.torch.collectives.synchronize` (polls, sleeping at most
0.1 ms between them), rounds interleaved so that load changes hit both alike.

    horovodrun -np 4 -H localhost:2,127.0.0.1:2 --gloo python3 benchmarks/horovod_wait.py
    horovodrun -np 2 -H localhost:2 --gloo python3 benchmarks/horovod_wait.py --elements 262144

Rank 0 prints, per wait, the median over ``--rounds`` of the mean milliseconds per allreduce
and the CPU milliseconds this rank's process spent per allreduce (all its threads), and with
``--json`` the same as one JSON object.
"""
import argparse
import json
import os
import statistics
import time

import horovod.torch as hvd
import torch

from horovod_quant.torch.collectives import synchronize

WAITS = {"hvd.synchronize": hvd.synchronize, "horovod_quant": synchronize}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--elements", type=int, default=1, help="float32 elements per allreduce")
    parser.add_argument("--calls", type=int, default=200, help="allreduces per round and wait")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (each runs both waits)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    tensor = torch.ones(args.elements)
    wall = {name: [] for name in WAITS}
    cpu = {name: [] for name in WAITS}
    for name, wait in WAITS.items():  # warm-up: Horovod's response cache holds the names
        for _ in range(20):
            wait(hvd.allreduce_async(tensor, name=f"wait.{name}"))
    for _ in range(args.rounds):
        for name, wait in WAITS.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(args.calls):
                wait(hvd.allreduce_async(tensor, name=f"wait.{name}"))
            wall[name].append((time.perf_counter() - start) / args.calls * 1e3)
            cpu[name].append((time.process_time() - start_cpu) / args.calls * 1e3)
    if hvd.rank() != 0:
        return
    result = {"ranks": hvd.size(), "local_ranks": hvd.local_size(), "cores": os.cpu_count(),
              "controller": "gloo" if hvd.gloo_enabled() else "mpi",
              "elements": args.elements, "calls": args.calls, "rounds": args.rounds,
              "load_before": os.getloadavg()[0],
              "waits": {name: {"ms_per_allreduce": statistics.median(wall[name]),
                               "cpu_ms_per_allreduce": statistics.median(cpu[name])}
                        for name in WAITS}}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['ranks']} ranks ({result['controller']}), {args.elements} elements, "
          f"{result['cores']} cores:")
    for name, row in result["waits"].items():
        print(f"  {name:16} {row['ms_per_allreduce']:7.2f} ms per allreduce, "
              f"{row['cpu_ms_per_allreduce']:6.2f} ms CPU (rank 0's process)")


if __name__ == "__main__":
    main()
