"""The exchange alone: fp32 allreduce vs each Global-QSGD mode, with the encode/reduce/decode split.

    horovodrun -np 2 -H localhost:2 --mpi python3 benchmarks/exchange.py --sizes 4,64
    horovodrun -np 4 -H localhost:4 --mpi python3 benchmarks/exchange.py --json out.json

Each configuration runs ``--repeat`` exchanges of a float32 vector of the given size (MB) and
reports the median wall time per exchange on rank 0 plus the median split from the exchange's
own counters: encode (incl. the norm statistic), exchange (waiting for collectives; for the
mpi4py exponent allreduce this includes the combine kernel, which runs inside the collective),
decode. ``--kernel`` also times the exponent combine kernel alone on one core.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

CONFIGS = [
    ("fp32 allreduce", "none", {}),
    ("linear 8b", "global_qsgd", {"levels": "linear", "bits": 8}),
    ("linear 4b", "global_qsgd", {"levels": "linear", "bits": 4}),
    ("exponential 8b tree", "global_qsgd", {"levels": "exponential", "bits": 8}),
    ("exponential 8b ring", "global_qsgd", {"levels": "exponential", "bits": 8, "reduction": "ring"}),
    ("exponential 5b tree", "global_qsgd", {"levels": "exponential", "bits": 5}),
    ("sparse linear 4b", "global_qsgd", {"levels": "linear", "bits": 4, "mode": "sparse"}),
]


def kernel_throughput(bits: int, size: int = 1 << 24, repeat: int = 5) -> float:
    """Elements per second of exp_combine on one core (best of ``repeat``), on the codes two
    workers' Gaussian gradients really produce."""
    import horovod_quant as hq
    from horovod_quant.core.exp_reduce import exp_combine

    codec = hq.get_codec("global_qsgd", world_size=2, bits=bits, levels="exponential")
    xs = [np.random.default_rng(r).standard_normal(size).astype(np.float32) for r in range(2)]
    norm = codec.global_norm(xs)
    codes = [codec.encode(x, seed=r, norm=norm).data for r, x in enumerate(xs)]
    out = np.empty_like(codes[0])
    best = float("inf")
    for _ in range(repeat):
        # process CPU time: on a shared machine wall time measures the neighbours too
        t = time.process_time()
        exp_combine(codes[0], codes[1], out, size, 0, bits, np.uint32(1), np.uint32(2))
        best = min(best, time.process_time() - t)
    return size / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="4,64", help="comma-separated sizes in MB of float32")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", default=None)
    ap.add_argument("--kernel", action="store_true", help="also time the combine kernel alone")
    args = ap.parse_args()

    import horovod.torch as hvd
    import horovod_quant as hq
    from horovod_quant.comm import Exchange
    from horovod_quant.torch.collectives import HorovodTorchCollectives

    hvd.init()
    n, rank = hvd.size(), hvd.rank()
    comm = HorovodTorchCollectives()
    rows = []
    for mb in [float(s) for s in args.sizes.split(",")]:
        d = int(mb * (1 << 20)) // 4
        x = np.random.default_rng(rank).standard_normal(d).astype(np.float32)
        for label, name, params in CONFIGS:
            codec = hq.get_codec(name, **({"world_size": n} if name == "global_qsgd" else {}),
                                 **params)
            ex = Exchange(codec, comm)
            times, splits = [], []
            for it in range(args.repeat + 1):
                hvd.barrier()
                t = time.perf_counter()
                p = ex.start(x, it, f"bench.{label}.{mb}")
                p.wait()
                if it:  # the first run compiles kernels
                    times.append(time.perf_counter() - t)
                    splits.append((p.stats.encode_s, p.stats.exchange_s, p.stats.decode_s))
            row = {"ranks": n, "mb": mb, "config": label, "controller": "mpi" if hvd.mpi_enabled() else "gloo",
                   "mpi_reduce": type(ex._custom).__name__ if ex._custom else None,
                   "median_s": statistics.median(times), "bytes_sent": p.stats.bytes_sent,
                   "encode_s": statistics.median(s[0] for s in splits),
                   "exchange_s": statistics.median(s[1] for s in splits),
                   "decode_s": statistics.median(s[2] for s in splits)}
            rows.append(row)
    if rank == 0:
        base = {r["mb"]: r["median_s"] for r in rows if r["config"] == "fp32 allreduce"}
        print(f"\n{n} ranks, {rows[0]['controller']}; median of {args.repeat} exchanges")
        print(f"{'MB':>5s} {'config':22s} {'ms':>8s} {'vs fp32':>8s} {'sent MB':>8s} "
              f"{'encode':>8s} {'exchange':>9s} {'decode':>8s}")
        for r in rows:
            print(f"{r['mb']:5.0f} {r['config']:22s} {r['median_s'] * 1e3:8.1f} "
                  f"{base[r['mb']] / r['median_s']:8.2f} {r['bytes_sent'] / 2**20:8.2f} "
                  f"{r['encode_s'] * 1e3:8.1f} {r['exchange_s'] * 1e3:9.1f} {r['decode_s'] * 1e3:8.1f}")
        if args.kernel:
            for bits in (8, 4):
                eps = kernel_throughput(bits)
                print(f"exp_combine {bits}-bit: {eps / 1e9:.2f} G elements/s = "
                      f"{eps * bits / 8 * 2 / 1e9:.2f} GB/s of packed input (two payloads), "
                      f"{eps * 4 / 1e9:.2f} GB/s of the float32 it stands for")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
