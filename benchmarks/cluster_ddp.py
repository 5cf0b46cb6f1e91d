"""DDP's own hooks and horovod_quant's side by side on the emulated 2-host cluster.

    sudo python3 benchmarks/cluster_ddp.py                      # 1 Gbit/s, every configuration
    sudo python3 benchmarks/cluster_ddp.py --rates 1gbit,10gbit --steps 60
    sudo python3 benchmarks/cluster_ddp.py --configs fp32,qsgd:8 --steps 10 --out /tmp/mine
    python3 benchmarks/cluster_ddp.py --render docs/results/cluster_ddp.json   # table + plot

The two hosts are those of ``benchmarks/cluster.py`` (``benchmarks/emulator.py``'s
``EmulatedCluster``: network namespaces on a bridge, each host's NIC shaped with ``tc`` at the link
rate both ways; root needed; see docs/dev/benchmarks.md), removed whatever happens. One rank runs
in each host (``torch.distributed`` gloo over its NIC, ``GLOO_SOCKET_IFNAME``), and trains the same
communication-bound MLP on scikit-learn's digits (64 -> 3 x 2048 -> 10, 8.5M parameters, 34 MB of
float32 gradients per step in one DDP bucket, see ``BUCKET_MB``, batch 32 per rank) once per
configuration, in one launch, the configurations interleaved (step k of each in turn, so a load
change on the shared machine hits all of them alike):

* ``fp32``: DDP without a hook (its float32 allreduce);
* ``fp16``: DDP's ``fp16_compress_hook``;
* ``powersgd-1``, ``powersgd-4``: DDP's ``PowerSGD`` hook at rank 1 and 4 (error feedback,
  warm start, compression from step 2 on: the warm-up steps below);
* ``<codec>:<bits>``: ``horovod_quant.torch.ddp.quantization_hook`` with that codec.

Per configuration: the median step (forward, backward with DDP's communication, SGD update)
of the measured steps; *exchange* = that step minus the median of the same step without
communication (``no_sync()``, measured once), i.e. the time the step waited for the network
beyond what overlapped with backward; samples/s = 2 x batch / step; bytes one rank hands to
collectives per step (horovod_quant: ``state.stats``; DDP's Python hooks: the tensors passed to
``dist.all_reduce``; fp32: the gradients); test accuracy and loss after the same steps
(warm-up included). Outputs: ``PREFIX.json``, ``PREFIX.md``, ``PREFIX.png``.

``--hidden-layers 4`` makes the MLP 48.5 MiB (benchmarks/step_fractions.py's DDP rows);
``--bucket-mb`` cuts the gradients into several DDP buckets (the hooks can then overlap
backward; not with PowerSGD, see ``BUCKET_MB``); ``--package-root DIR`` runs the ranks on the
``horovod_quant`` under DIR (another version, e.g. ``git archive <commit> | tar -x -C DIR``), to
compare hooks across versions on the same link.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # the sibling benchmark modules

DEFAULT_CONFIGS = "fp32,fp16,powersgd-1,powersgd-4,qsgd:8,qsgd:4,global_qsgd:8"
HIDDEN = 2048
PORT = 29517
#: one DDP bucket for the whole model (first bucket included): DDP's PowerSGD hook issues its
#: second allreduce from a future callback, so with several buckets under gloo the ranks can
#: order their collectives differently; it hung at the default 25 MB buckets here
BUCKET_MB = 64


# -- one rank ---------------------------------------------------------------------------------
def _model(hidden_layers: int = 3):
    """64 -> ``hidden_layers`` x 2048 -> 10 (3: 8.5M parameters; 4: 12.7M, 48.5 MiB)."""
    import torch

    torch.manual_seed(0)
    layers, width = [], 64
    for _ in range(hidden_layers):
        layers += [torch.nn.Linear(width, HIDDEN), torch.nn.ReLU()]
        width = HIDDEN
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))


def _hook(spec: str, model):
    """Register ``spec``'s hook on the DDP ``model``; returns the horovod_quant state or None."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if spec == "fp32":
        return None
    if spec == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return None
    if spec.startswith("powersgd-"):
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=int(spec.split("-")[1]),
            start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return None
    import horovod_quant.torch as hqt
    from horovod_quant.doors import CodecRequest
    from horovod_quant.torch import ddp

    request = CodecRequest.from_spec(spec)  # qsgd:8, global_qsgd-lin:8
    # the codec's own step times: no fallback to DDP's allreduce in the middle of a run
    state = ddp.QuantizationState(getattr(hqt.Compression, request.name)(**request.params),
                                  fallback="never")
    model.register_comm_hook(state, ddp.quantization_hook)
    return state


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from sklearn.datasets import load_digits
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", rank=args.rank, world_size=2,
                            init_method=f"tcp://{args.master}:{PORT}")
    torch.set_num_threads(1)
    counted = [0]
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *a, **k):  # DDP's Python hooks call it per step
        counted[0] += tensor.numel() * tensor.element_size()
        return all_reduce(tensor, *a, **k)

    dist.all_reduce = counting_all_reduce
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    x_test, y_test, x, y = x[:297], y[:297], x[297:], y[297:]
    x, y = x[args.rank::2], y[args.rank::2]

    def step(model, opt, gen) -> float:
        idx = torch.randint(0, x.shape[0], (args.batch,), generator=gen)
        dist.barrier()
        t = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        return time.perf_counter() - t

    local = DDP(_model(args.hidden_layers), bucket_cap_mb=args.bucket_mb)
    opt = torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(args.rank)
    with local.no_sync():
        local_s = statistics.median(step(local, opt, gen) for _ in range(args.steps // 2 + 2))
    numel = sum(p.numel() for p in local.parameters())
    del local, opt
    runs = []  # every configuration's model, trained side by side: step k of each in turn
    for spec in args.configs.split(","):
        model = DDP(_model(args.hidden_layers), bucket_cap_mb=args.bucket_mb)
        runs.append({"spec": spec, "model": model, "state": _hook(spec, model),
                     "opt": torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                     "gen": torch.Generator().manual_seed(args.rank), "times": [], "sent": 0})
    for k in range(args.warmup_steps + args.steps):
        for run in runs:
            counted[0] = 0
            if run["state"] is not None:
                run["state"].stats.reset()
            t = step(run["model"], run["opt"], run["gen"])
            if k < args.warmup_steps:
                continue
            run["times"].append(t)
            if run["state"] is not None:
                run["sent"] += run["state"].stats.bytes_sent
            else:
                run["sent"] += numel * 4 if run["spec"] == "fp32" else counted[0]
    rows = []
    for run in runs:
        with torch.no_grad():
            logits = run["model"].module(x_test)
            loss = torch.nn.functional.cross_entropy(logits, y_test).item()
            acc = (logits.argmax(1) == y_test).float().mean().item()
        mine = torch.tensor([statistics.median(run["times"])], dtype=torch.float64)
        everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(2)]
        dist.all_gather(everyone, mine)
        step_s = max(float(t) for t in everyone)  # the slower rank
        rows.append({"config": run["spec"], "step_ms": step_s * 1e3,
                     "exchange_ms": max(0.0, step_s - local_s) * 1e3,
                     "samples_per_s": 2 * args.batch / step_s,
                     "bytes_per_step": run["sent"] / args.steps,
                     "ratio": numel * 4 * args.steps / run["sent"],
                     "test_accuracy": acc, "test_loss": loss})
        if args.rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    if args.rank == 0:
        with open(args.rows, "w") as f:
            json.dump({"local_step_ms": local_s * 1e3, "params": numel, "rows": rows}, f)
    dist.destroy_process_group()


# -- the driver -------------------------------------------------------------------------------
def run_rate(cluster, rate: float, args) -> dict:
    from emulator import NIC, kill_netns_processes

    shaping = cluster.shape(rate, 0.0)
    calib = cluster.calibrate()
    rows_path = os.path.join(cluster.tmp, f"rows_{int(rate)}.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", GLOO_SOCKET_IFNAME=NIC,
               PYTHONPATH=os.path.abspath(args.package_root) + os.pathsep
               + os.environ.get("PYTHONPATH", ""))
    procs = []
    try:
        for rank, host in enumerate(cluster.hosts):
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--rank", str(rank),
                   "--master", cluster.hosts[0].address, "--configs", args.configs,
                   "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps),
                   "--batch", str(args.batch), "--bucket-mb", str(args.bucket_mb),
                   "--hidden-layers", str(args.hidden_layers), "--rows", rows_path]
            procs.append(subprocess.Popen(cluster.in_host(host, cmd), env=env,
                                          start_new_session=True))
        deadline = time.time() + args.timeout
        while any(p.poll() is None for p in procs):
            if time.time() > deadline or any(p.returncode not in (None, 0) for p in procs):
                raise RuntimeError(f"ranks failed or stalled: {[p.returncode for p in procs]}")
            time.sleep(0.5)
        with open(rows_path) as f:
            res = json.load(f)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for host in cluster.hosts:
            kill_netns_processes(host.namespace)
    return {"label": f"{rate / 1e9:g} Gbit/s", "rate_bps": rate, "shaping": shaping,
            "calibration": calib, **res}


def render(data: dict, prefix: str) -> list[str]:
    widths = "-".join(["64"] + ["2048"] * data.get("hidden_layers", 3) + ["10"])
    lines = [f"Command: `{data['command']}` ({data['date']}, {data['wall_s']:.0f} s). MLP "
             f"{widths} on digits ({data['links'][0]['params'] / 1e6:.2f}M "
             f"parameters), 2 ranks (one per emulated host, gloo), batch {data['batch']} per "
             f"rank, DDP buckets of {data.get('bucket_mb', BUCKET_MB):g} MB, "
             f"{data['warmup_steps']} warm-up + {data['steps']} measured steps; step = "
             "median of the slower rank; accuracy on the 297 held-out digits after all steps.",
             ""]
    for link in data["links"]:
        cal = link["calibration"]
        lines += [f"**{link['label']}** (TCP {cal['tcp_gbit_s']:.2f} Gbit/s, rtt "
                  f"{cal['tcp_rtt_ms_median']:.3f} ms; step without communication "
                  f"{link['local_step_ms']:.0f} ms)", "",
                  "| configuration | step ms | exchange ms | samples/s | MB/step | vs fp32 | "
                  "accuracy | test loss |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in link["rows"]:
            lines.append(f"| {r['config']} | {r['step_ms']:.0f} | {r['exchange_ms']:.0f} | "
                         f"{r['samples_per_s']:.0f} | {r['bytes_per_step'] / 1e6:.2f} | "
                         f"{r['ratio']:.1f}x | {r['test_accuracy']:.3f} | "
                         f"{r['test_loss']:.3f} |")
        lines.append("")
    with open(prefix + ".md", "w") as f:
        f.write("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(data["links"]), 2, figsize=(11, 3.6 * len(data["links"])),
                             squeeze=False)
    for (ax_s, ax_b), link in zip(axes, data["links"]):
        names = [r["config"] for r in link["rows"]]
        colors = ["tab:gray" if ":" not in n else "tab:blue" for n in names]
        ax_s.barh(names, [r["samples_per_s"] for r in link["rows"]], color=colors)
        ax_s.set_xlabel("samples/s (higher is better)")
        ax_s.set_title(f"{link['label']}: throughput")
        ax_s.invert_yaxis()
        for i, r in enumerate(link["rows"]):
            ax_s.text(r["samples_per_s"], i, f" acc {r['test_accuracy']:.2f}", va="center",
                      fontsize=8)
        ax_b.barh(names, [r["bytes_per_step"] / 1e6 for r in link["rows"]], color=colors)
        ax_b.set_xscale("log")
        ax_b.set_xlabel("MB per step per rank (log)")
        ax_b.set_title("bytes handed to collectives")
        ax_b.invert_yaxis()
    fig.suptitle("DDP on two emulated hosts: DDP's hooks (gray) and horovod_quant's (blue)")
    fig.tight_layout()
    fig.savefig(prefix + ".png", dpi=110)
    with open(prefix + ".json", "w") as f:
        json.dump(data, f, indent=1)
    return [prefix + ".json", prefix + ".md", prefix + ".png"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1gbit", help="comma-separated link rates (1gbit,10gbit)")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS,
                    help="comma-separated configurations (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=40, help="measured steps (default: %(default)s)")
    ap.add_argument("--warmup-steps", type=int, default=3,
                    help="steps before measuring, trained too (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=32, help="batch per rank (default: %(default)s)")
    ap.add_argument("--bucket-mb", type=float, default=BUCKET_MB,
                    help="DDP's bucket_cap_mb (default: %(default)s, one bucket)")
    ap.add_argument("--hidden-layers", type=int, default=3,
                    help="2048-wide hidden layers (default: %(default)s; 4: 48.5 MiB)")
    ap.add_argument("--package-root", default=ROOT,
                    help="the folder holding the horovod_quant the ranks run (default: this "
                         "checkout)")
    ap.add_argument("--timeout", type=float, default=1800.0,
                    help="seconds per link rate before the ranks are stopped")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "cluster_ddp"),
                    help="output prefix (PREFIX.json, .md, .png)")
    ap.add_argument("--render", metavar="JSON", default=None,
                    help="only render the table and plot of a JSON written before")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--master", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rows", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.render:
        with open(args.render) as f:
            data = json.load(f)
        prefix = args.render[:-5] if args.render.endswith(".json") else args.render
        print("\n".join(render(data, prefix)))
        return 0
    if os.geteuid() != 0:
        print("cluster_ddp.py needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    from cluster import machine_info
    from emulator import EmulatedCluster, parse_rate

    rates = [parse_rate(r) for r in args.rates.split(",")]

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    t0 = time.time()
    data = {"command": "python3 benchmarks/cluster_ddp.py " + " ".join(
                sys.argv[1:] if argv is None else argv),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine_info(), "steps": args.steps, "warmup_steps": args.warmup_steps,
            "batch": args.batch, "bucket_mb": args.bucket_mb,
            "hidden_layers": args.hidden_layers,
            "package_root": os.path.abspath(args.package_root), "links": []}
    try:
        with EmulatedCluster(hosts=2) as cluster:
            for rate in rates:
                data["links"].append(run_rate(cluster, rate, args))
        data["wall_s"] = time.time() - t0
        print("\n".join(render(data, args.out)))
        return 0
    except KeyboardInterrupt as exc:
        print(f"[cluster_ddp] interrupted ({exc}); cleaned up", file=sys.stderr)
        return 130
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


if __name__ == "__main__":
    sys.exit(main())
