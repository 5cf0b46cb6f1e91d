"""Where a training step's time goes at one rank per core: the step's time budget.

    sudo python3 benchmarks/step_budget.py                     # MPI and gloo, about 10 min
    sudo python3 benchmarks/step_budget.py --controllers mpi   # one controller
    python3 benchmarks/step_budget.py --render docs/results/step_budget.json   # tables again

2 emulated hosts x 1 rank on a 1 Gbit/s link (benchmarks/cluster.py: one core per rank), the
48 MiB MLP ("mlp48"), float32 and 16-bit through Horovod's optimizer, qsgd at 8 and 4 bits and
exponential Global-QSGD at 8 and 4 bits through ``hq.DistributedOptimizer`` and through Horovod's
``compression=``, the compute-only step; fallback off, so each row is its codec's own step.
Each row's measured steps are sampled by py-spy at 100 Hz (every thread, waits included):
rank 0's main-thread samples, each given to one part by its innermost frame (:data:`PARTS`),
split the slowest rank's mean step; the package's own timers (encode, exchange, decode) stand
beside them. Rank 1's samples are drawn as a flame graph per row. Each row also gets its
fraction of the physical limit: max(compute-only step, float32's communication x b/32) over
its step, with float32's communication = float32's step - the compute-only step.

Outputs (``--out PREFIX``, default docs/results/step_budget): PREFIX.json, PREFIX.md and the
flame graphs of :data:`FLAME_ROWS`, PREFIX_<controller>_<row>.svg.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: the model of every row (benchmarks/cluster_workloads.py's MLPS)
MODEL = "mlp48"
#: what each row sends per float32 element's 32 bits (None: the compute-only floor)
ROWS = {"compute": None, "fp32": 32, "fp16": 16, "qsgd:8": 8, "hvd.qsgd:8": 8,
        "global_qsgd-exp:8": 8, "hvd.global_qsgd-exp:8": 8, "qsgd:4": 4, "hvd.qsgd:4": 4,
        "global_qsgd-exp:4": 4, "hvd.global_qsgd-exp:4": 4}
#: the rows whose flame graphs are kept (the others stay in ``--work``)
FLAME_ROWS = ("qsgd:8", "qsgd:4", "hvd.qsgd:4")
#: the parts of a step, each a test on the innermost frame of a sample: its function's name,
#: its qualified name and its file; the first that matches takes the sample, "rest" the others
PARTS = [
    ("wait", lambda fn, q, f: fn in ("wait", "wait_until_done", "synchronize")
     or f.endswith("threading.py") or "sleep" in fn),
    ("encode", lambda fn, q, f: "encode" in fn),
    ("copies", lambda fn, q, f: "copy" in fn or fn in (
        "flat_input", "flat_array", "as_array", "as_tensor", "to_host", "to_device", "like",
        "hand_over")),
    ("decode and combine", lambda fn, q, f: any(w in fn for w in ("decode", "combine", "mean"))),
    ("framing", lambda fn, q, f: f.endswith("exchange/wire.py")
     or (f.endswith("torch/distributed.py") and "allgather_async" in q)),
    ("compute", lambda fn, q, f: f.startswith("torch/") and not f.startswith("torch/distributed")),
]
FRAME = re.compile(r"^(?P<fn>.*) \((?P<file>[^():]+):\d+\)$")


def classify(frame: str) -> str:
    """The part of a step a sample whose innermost frame is ``frame`` counts to."""
    m = FRAME.match(frame.strip())
    qualified, path = (m["fn"], m["file"]) if m else (frame, "")
    fn = qualified.rsplit(".", 1)[-1]
    return next((name for name, test in PARTS if test(fn, qualified, path)), "rest")


def main_thread_parts(path: str) -> tuple[Counter, int]:
    """Rank 0's main-thread samples of one row per part, and the samples left out: those
    taken while the sampler attached (before the first measured step)."""
    parts, skipped = Counter(), 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            if not frames[0].endswith("MainThread"):
                continue
            if "SampledSteps" in stack or len(frames) < 2:
                skipped += int(count)
                continue
            parts[classify(frames[-1])] += int(count)
    return parts, skipped


def physical_limit(compute: float, fp32: float, bits: int) -> float:
    """A step's limit at ``bits`` per float32 element: max(the compute-only step, float32's
    communication x b/32), float32's communication = its step - the compute-only step."""
    return max(compute, (fp32 - compute) * bits / 32)


def budget(rows: dict[str, dict], profile_dir: str, ranks: int = 2) -> list[dict]:
    """Each row's budget: its step, its parts in ms, the package's timers, its ranks' CPU,
    its limit."""
    floor = rows.get("compute", {}).get("step_s")
    fp32 = rows.get("fp32", {}).get("step_s")
    out = []
    for rid, bits in ROWS.items():
        row = rows.get(rid)
        if row is None or row.get("step_s") is None:
            continue
        step = row["step_s"]
        parts, skipped = main_thread_parts(os.path.join(profile_dir, f"t-{MODEL}-{rid}.txt"))
        total = sum(parts.values()) or 1
        limit = (None if bits is None or floor is None or fp32 is None
                 else physical_limit(floor, fp32, bits))
        out.append({
            "row": rid, "bits": bits, "step_ms": step * 1e3,
            "parts_ms": {name: step * 1e3 * parts[name] / total
                         for name, _ in PARTS + [("rest", None)]},
            "samples": total, "samples_left_out": skipped,
            "timers_ms": {k: row.get(k + "_s", 0.0) * 1e3
                          for k in ("fwd_bwd", "sync", "update", "encode", "exchange", "decode")},
            # CPU of a rank per step (the mean over the ranks): its main thread's, and its
            # other threads' (Horovod's background loop, the transport's), which take the
            # same core; what is left of the step its core idles
            "main_thread_cpu_ms": row["ranks_main_thread_cpu_s_per_step"] * 1e3 / ranks,
            "other_threads_cpu_ms": (row["ranks_cpu_s_per_step"]
                                     - row["ranks_main_thread_cpu_s_per_step"]) * 1e3 / ranks,
            "limit_ms": None if limit is None else limit * 1e3,
            "fraction_of_limit": None if limit is None else limit / step,
            "other_load_cores": row["other_load_cores"]})
    return out


def render(data: dict) -> str:
    lines = [f"# A training step's time budget at one rank per core ({data['controller_note']})",
             "", f"Command: `{data['command']}` ({data['date']})  ",
             f"Machine: {_machine(data['machine'])}; load average before the runs: "
             f"{data['load_before']}; each row's other load (cores busy with anything but the "
             "ranks) in its column", ""]
    for ctrl, table in data["budgets"].items():
        names = [n for n, _ in PARTS] + ["rest"]
        lines += [f"## {ctrl}", "",
                  "| row | step ms | " + " | ".join(names) + " | encode / exchange / decode "
                  "(timers) | CPU: main / other threads | other load | limit ms | of limit |",
                  "|---|" + "---:|" * (len(names) + 6)]
        for b in table:
            t = b["timers_ms"]
            frac = "" if b["fraction_of_limit"] is None else f"{b['fraction_of_limit']:.2f}"
            lim = "" if b["limit_ms"] is None else f"{b['limit_ms']:.0f}"
            lines.append(f"| {b['row']} | {b['step_ms']:.0f} | "
                         + " | ".join(f"{b['parts_ms'][n]:.0f}" for n in names)
                         + f" | {t['encode']:.0f} / {t['exchange']:.0f} / {t['decode']:.0f}"
                         f" | {b['main_thread_cpu_ms']:.0f} / {b['other_threads_cpu_ms']:.0f}"
                         f" | {b['other_load_cores']:.2f} | {lim} | {frac} |")
        lines.append("")
    lines += ["Parts: rank 0's main-thread samples (py-spy, 100 Hz, waits included) by their "
              "innermost frame (benchmarks/step_budget.py, PARTS), times the slowest rank's "
              "mean step. Flame graphs of rank 1: " + ", ".join(
                  f"`{p}`" for p in data["flame_graphs"]) + ".", ""]
    return "\n".join(lines)


def _machine(machine: dict) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in machine.get("versions", {}).items())
    return f"{machine.get('cpus')} cores ({machine.get('cpu')}), {versions}, {machine.get('mpi')}"


def measure(args) -> None:
    """cluster.py's runs, one per controller, into ``args.work``."""
    for ctrl in args.controllers:
        prof = os.path.join(args.work, ctrl)
        shutil.rmtree(prof, ignore_errors=True)
        prefix = os.path.join(args.work, f"cluster_{ctrl}")
        cmd = [sys.executable, os.path.join(HERE, "cluster.py"), "--shapes", "2x1",
               "--controller", ctrl, "--rates", "1gbit", "--models", MODEL, "--no-exchange",
               "--train-codecs", "qsgd,global_qsgd-exp", "--bits", "8,4",
               "--doors", "hq,compression", "--fallback", "never", "--steps", str(args.steps),
               "--min-seconds", str(args.min_seconds), "--profile", prof, "--out", prefix]
        subprocess.run(cmd, check=True)


def collect(args) -> dict:
    """The budgets of the runs in ``args.work``, and their flame graphs copied beside
    ``args.out``."""
    budgets, flames, machine = {}, [], None
    for ctrl in args.controllers:
        prof = os.path.join(args.work, ctrl)
        with open(os.path.join(args.work, f"cluster_{ctrl}.json")) as f:
            data = json.load(f)
        machine, date = machine or data["machine"], data["date"]  # of the runs
        rows = {r["config_id"]: r for link in data["links"] for r in link["results"]
                if r.get("kind") == "train"}
        budgets[ctrl] = budget(rows, prof)
        for rid in FLAME_ROWS:
            svg = os.path.join(prof, f"t-{MODEL}-{rid}.svg")
            if os.path.exists(svg):
                dest = f"{args.out}_{ctrl}_{rid.replace(':', '_').replace('.', '_')}.svg"
                shutil.copy(svg, dest)
                flames.append(os.path.relpath(dest, ROOT))
    command = [a for a in sys.argv[1:] if a != "--from-work"]
    return {"command": " ".join(["sudo python3 benchmarks/step_budget.py", *command]),
            "date": date,
            "machine": machine, "load_before": machine.get("loadavg_before"),
            "controller_note": "2 x 1, 1 Gbit/s, 48 MiB MLP",
            "budgets": budgets, "flame_graphs": flames}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--controllers", default="mpi,gloo")
    ap.add_argument("--steps", type=int, default=10, help="measured steps at least (default 10)")
    ap.add_argument("--min-seconds", type=float, default=6.0)
    ap.add_argument("--work", default="/tmp/hq-step-budget", help="cluster.py's outputs")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "step_budget"))
    ap.add_argument("--render", metavar="JSON", help="re-render the tables of a run")
    ap.add_argument("--from-work", action="store_true",
                    help="no new runs: the budgets of the runs --work holds")
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            data = json.load(f)
    else:
        args.controllers = args.controllers.split(",")
        if shutil.which("py-spy") is None:
            ap.error("py-spy is not installed: pip install py-spy")
        if not args.from_work:
            measure(args)
        data = collect(args)
        with open(args.out + ".json", "w") as f:
            json.dump(data, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(render(data))
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
