r"""The exchange alone: Horovod's own fp32 and fp16 allreduce against the codecs people pick and
every Global-QSGD mode, in one run, with the encode / exchange / decode split.

examples:
  horovodrun -np 2 -H localhost:2 --mpi python3 benchmarks/exchange.py --sizes 4,64
  horovodrun -np 2 -H localhost:2 --gloo python3 benchmarks/exchange.py --sizes 4 \
      --configs horovod,codecs
  horovodrun -np 2 -H localhost:2 --mpi python3 benchmarks/exchange.py --kernel \
      --json bench_out/exchange_n2.json --plot bench_out/exchange_n2.png
  horovodrun -np 4 -H localhost:4 --mpi python3 benchmarks/exchange.py --repeat 3 \
      --json bench_out/exchange_n4.json
  python3 benchmarks/exchange.py --from-json docs/results/exchange_n2.json \
      --plot bench_out/exchange_n2_old.png

Each configuration runs --repeat exchanges (after one untimed, which compiles kernels) of a
float32 vector of each size in --sizes (MB) and reports, on rank 0, the median wall time per
exchange, the speedup against Horovod's fp32 allreduce of the same size, the MB this rank's
payload holds, and the median split from the exchange's own counters: encode (with the norm
statistic), exchange (waiting for collectives; for the mpi4py exponent allreduce this includes
the combine kernel, which runs inside the collective) and decode.

Configurations (--configs takes groups or labels, comma-separated):
  horovod  "horovod fp32", "horovod fp16": hvd.allreduce of a torch tensor with
           hvd.Compression.none / .fp16 (no split: Horovod does not time its parts)
  codecs   "qsgd 8b" ... "nuqsgd 4b": qsgd, natural and nuqsgd at 8 and 4 bits through
           horovod_quant.exchange.Exchange (allgather of the payloads, combine on every rank)
  global   "global linear 8b" ... "global sparse linear 4b": Global-QSGD linear (integer
           words summed by Horovod's allreduce), exponential (the mpi4py exponent allreduce
           under MPI, tree and ring; an allgather under gloo) and sparse

--kernel also times the exponent combine kernel alone on one core. --plot FILE.png draws the
table (one panel per size); --from-json JSON draws it from an earlier --json without running
anything (no horovodrun needed). Progress: rank 0 shows a bar on stderr when it is a
terminal; under horovodrun its stderr is a pipe, so pass --progress to see it there.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

#: label -> (group, codec name, parameters); group "horovod" is hvd.allreduce itself
CONFIGS = {
    "horovod fp32": ("horovod", "none", {}),
    "horovod fp16": ("horovod", "fp16", {}),
    "qsgd 8b": ("codecs", "qsgd", {"bits": 8}),
    "qsgd 4b": ("codecs", "qsgd", {"bits": 4}),
    "natural 8b": ("codecs", "natural", {"bits": 8}),
    "natural 4b": ("codecs", "natural", {"bits": 4}),
    "nuqsgd 8b": ("codecs", "nuqsgd", {"bits": 8}),
    "nuqsgd 4b": ("codecs", "nuqsgd", {"bits": 4}),
    "global linear 8b": ("global", "global_qsgd", {"levels": "linear", "bits": 8}),
    "global linear 4b": ("global", "global_qsgd", {"levels": "linear", "bits": 4}),
    "global exp 8b tree": ("global", "global_qsgd", {"levels": "exponential", "bits": 8}),
    "global exp 8b ring": ("global", "global_qsgd",
                           {"levels": "exponential", "bits": 8, "reduction": "ring"}),
    "global exp 5b tree": ("global", "global_qsgd", {"levels": "exponential", "bits": 5}),
    "global sparse linear 4b": ("global", "global_qsgd",
                                {"levels": "linear", "bits": 4, "mode": "sparse"}),
}
GROUPS = ("horovod", "codecs", "global")
#: the baseline of "vs fp32"; "fp32 allreduce" (codec none through Exchange) in older JSON
BASELINES = ("horovod fp32", "fp32 allreduce")


def select_configs(text: str) -> list[str]:
    labels = []
    for item in (t.strip() for t in text.split(",")):
        if item in GROUPS:
            labels += [label for label, cfg in CONFIGS.items() if cfg[0] == item]
        elif item in CONFIGS:
            labels.append(item)
        elif item:
            raise ValueError(f"unknown configuration {item!r}: groups {', '.join(GROUPS)}, "
                             f"labels {', '.join(CONFIGS)}")
    return list(dict.fromkeys(labels))


def kernel_throughput(bits: int, size: int = 1 << 24, repeat: int = 5) -> float:
    """Elements per second of exp_combine on one core (best of ``repeat``), on the codes two
    workers' Gaussian gradients really produce."""
    import horovod_quant as hq
    from horovod_quant.backends.numba.global_qsgd import exp_combine

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


def baseline(rows: list[dict]) -> tuple[str, dict[float, float]]:
    """The fp32 baseline's label and its median seconds per size."""
    for label in BASELINES:
        base = {r["mb"]: r["median_s"] for r in rows if r["config"] == label}
        if base:
            return label, base
    return "", {}


def _ms(v) -> str:
    return f"{'-':>8s}" if v is None else f"{v * 1e3:8.1f}"


def _of_repeat(row: dict) -> str:
    return f" of {row['repeat']}" if row.get("repeat") else ""


def print_table(rows: list[dict]) -> None:
    base_label, base = baseline(rows)
    print(f"\n{rows[0]['ranks']} ranks, {rows[0]['controller']}; median{_of_repeat(rows[0])} "
          f"exchanges; vs fp32: {base_label or 'no fp32 row'}'s time / this time")
    print(f"{'MB':>5s} {'config':24s} {'ms':>8s} {'vs fp32':>8s} {'sent MB':>8s} "
          f"{'encode':>8s} {'exchange':>8s} {'decode':>8s}")
    for r in rows:
        vs = f"{base[r['mb']] / r['median_s']:8.2f}" if r["mb"] in base else f"{'-':>8s}"
        print(f"{r['mb']:5g} {r['config']:24s} {r['median_s'] * 1e3:8.1f} {vs} "
              f"{r['bytes_sent'] / 2**20:8.2f} {_ms(r.get('encode_s'))} "
              f"{_ms(r.get('exchange_s'))} {_ms(r.get('decode_s'))}")


def plot(rows: list[dict], path: str) -> None:
    """One panel per size: a bar per configuration, split into encode / exchange / decode /
    the rest where the exchange counts them, one block for Horovod's allreduce (not split);
    on each bar its ms and its speedup against fp32."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"encode": "#e4a11b", "exchange": "#3b75af", "decode": "#7bb661",
              "other": "#dddddd", "allreduce": "#8c6bb1"}
    base_label, base = baseline(rows)
    sizes = list(dict.fromkeys(r["mb"] for r in rows))
    ncfg = max(sum(r["mb"] == z for r in rows) for z in sizes)
    fig, axes = plt.subplots(len(sizes), 1,
                             figsize=(max(9.0, 0.75 * ncfg + 3), 3.6 * len(sizes) + 0.3),
                             squeeze=False, layout="constrained")
    for ax, z in zip(axes[:, 0], sizes):
        sel = [r for r in rows if r["mb"] == z]
        x = np.arange(len(sel))
        split = [r.get("encode_s") is not None for r in sel]
        parts = {
            "encode": [r["encode_s"] if s else 0.0 for r, s in zip(sel, split)],
            "exchange": [r["exchange_s"] if s else 0.0 for r, s in zip(sel, split)],
            "decode": [r["decode_s"] if s else 0.0 for r, s in zip(sel, split)],
        }
        parts["other"] = [max(0.0, r["median_s"] - sum(parts[k][i] for k in ("encode", "exchange",
                                                                               "decode")))
                          if s else 0.0 for i, (r, s) in enumerate(zip(sel, split))]
        parts["allreduce"] = [0.0 if s else r["median_s"] for r, s in zip(sel, split)]
        bottom = np.zeros(len(sel))
        for part in ("allreduce", "encode", "exchange", "decode", "other"):
            vals = np.array(parts[part]) * 1e3
            if not vals.any():
                continue
            label = "Horovod allreduce (not split)" if part == "allreduce" else part
            if part == "other":
                label = "other (median total - median parts)"
            ax.bar(x, vals, 0.7, bottom=bottom, color=colors[part], label=label)
            bottom += vals
        tops = [max(b, r["median_s"] * 1e3) for b, r in zip(bottom, sel)]
        for i, r in enumerate(sel):
            vs = f"\n{base[z] / r['median_s']:.2f}x" if z in base else ""
            ax.text(i, tops[i], f"{r['median_s'] * 1e3:.1f}{vs}", ha="center", va="bottom",
                    fontsize=7)
        ax.set_ylim(0, max(tops) * 1.28)
        ax.set_xticks(x)
        ax.set_xticklabels([r["config"] for r in sel], rotation=35, ha="right",
                           rotation_mode="anchor", fontsize=8)
        ax.set_xlim(-0.6, len(sel) - 0.4)
        ax.set_ylabel("ms per exchange (median)")
        ax.grid(alpha=0.3, axis="y")
        r0 = sel[0]
        ax.set_title(f"{z:g} MB of float32, {r0['ranks']} ranks, {r0['controller']}, "
                     f"median{_of_repeat(r0)} exchanges", fontsize=10)
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.005, 1.0),
                  borderaxespad=0.0, fontsize=8)
    fig.suptitle(f"One exchange (on each bar: median ms, and {base_label or 'fp32'}'s ms / "
                 "its ms)", fontsize=10)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def measure(args, labels: list[str]) -> list[dict]:
    import horovod.torch as hvd
    import torch

    import horovod_quant as hq
    from horovod_quant.exchange import Exchange
    from horovod_quant.stats import progress_bar
    from horovod_quant.torch.collectives import HorovodTorchCollectives

    hvd.init()
    n, rank = hvd.size(), hvd.rank()
    controller = "mpi" if hvd.mpi_enabled() else "gloo"
    comm = HorovodTorchCollectives()
    sizes = [float(s) for s in args.sizes.split(",") if s]
    bar = progress_bar(len(sizes) * len(labels) * (args.repeat + 1), rank, args.progress,
                       unit="exchange")
    rows = []
    for mb in sizes:
        d = int(mb * (1 << 20)) // 4
        x = np.random.default_rng(rank).standard_normal(d).astype(np.float32)
        for label in labels:
            group, name, params = CONFIGS[label]
            bar.set_postfix_str(f"{mb:g} MB {label}", refresh=False)
            times, splits = [], []
            if group == "horovod":
                comp = hvd.Compression.fp16 if name == "fp16" else hvd.Compression.none
                t_in = torch.from_numpy(x)
                for it in range(args.repeat + 1):
                    hvd.barrier()
                    t = time.perf_counter()
                    hvd.allreduce(t_in, op=hvd.Average, name=f"bench.{label}.{mb}",
                                  compression=comp)
                    if it:
                        times.append(time.perf_counter() - t)
                    bar.update()
                sent, reduce_kind = d * (2 if name == "fp16" else 4), "hvd.allreduce"
            else:
                codec = hq.get_codec(name, **({"world_size": n} if name == "global_qsgd" else {}),
                                     **params)
                ex = Exchange(codec, comm)
                for it in range(args.repeat + 1):
                    hvd.barrier()
                    t = time.perf_counter()
                    p = ex.start(x, it, f"bench.{label}.{mb}")
                    p.wait()
                    if it:  # the first run compiles kernels
                        times.append(time.perf_counter() - t)
                        splits.append((p.stats.encode_s, p.stats.exchange_s, p.stats.decode_s))
                    bar.update()
                sent = p.stats.bytes_sent
                reduce_kind = type(ex._custom).__name__ if ex._custom else ex.kind
            med = [statistics.median(s[i] for s in splits) if splits else None
                   for i in range(3)]
            rows.append({
                "ranks": n, "mb": mb, "config": label, "group": group, "codec": name,
                "params": params, "controller": controller, "reduce": reduce_kind,
                "repeat": args.repeat, "median_s": statistics.median(times),
                "min_s": min(times), "bytes_sent": sent,
                "encode_s": med[0], "exchange_s": med[1], "decode_s": med[2]})
    bar.close()
    return rows if rank == 0 else []


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help; the epilog's commands one per line."""


def main() -> None:
    summary, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(description=summary, epilog=rest,
                                 formatter_class=HelpFormatter)
    ap.add_argument("--sizes", default="4,64", help="comma-separated sizes in MB of float32")
    ap.add_argument("--repeat", type=int, default=7,
                    help="timed exchanges per configuration and size (median reported)")
    ap.add_argument("--configs", default=",".join(GROUPS),
                    help="comma-separated groups (horovod, codecs, global) or labels")
    ap.add_argument("--json", default=None, help="rank 0 writes the rows to this file")
    ap.add_argument("--plot", default=None, metavar="FILE.png",
                    help="rank 0 draws the table to this PNG")
    ap.add_argument("--from-json", default=None, metavar="JSON",
                    help="measure nothing: print and --plot the rows of an earlier --json")
    ap.add_argument("--kernel", action="store_true", help="also time the combine kernel alone")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="progress bar on rank 0's stderr; unset: only if stderr is a terminal")
    args = ap.parse_args()
    try:
        labels = select_configs(args.configs)
    except ValueError as exc:
        ap.error(str(exc))

    if args.from_json:
        with open(args.from_json) as f:
            blob = json.load(f)
        rows = blob["rows"] if isinstance(blob, dict) else blob
        print_table(rows)
        if args.plot:
            plot(rows, args.plot)
            print(f"wrote {args.plot}")
        return

    rows = measure(args, labels)
    if not rows:  # ranks other than 0
        return
    print_table(rows)
    if args.kernel:
        for bits in (8, 4):
            eps = kernel_throughput(bits)
            print(f"exp_combine {bits}-bit: {eps / 1e9:.2f} G elements/s = "
                  f"{eps * bits / 8 * 2 / 1e9:.2f} GB/s of packed input (two payloads), "
                  f"{eps * 4 / 1e9:.2f} GB/s of the float32 it stands for")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
