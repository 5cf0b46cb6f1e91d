"""Every codec's step against its physical limit at one rank per core, through the three doors.

    sudo python3 benchmarks/step_fractions.py                 # MPI controller, about 10 min
    python3 benchmarks/step_fractions.py --render docs/results/step_fractions.json

2 emulated hosts x 1 rank on a 1 Gbit/s link, a 48 MiB MLP, each codec at 8 and 4 bits through
``hq.DistributedOptimizer`` and Horovod's ``compression=`` (benchmarks/cluster.py, ``mlp48``,
fallback off) and through the DDP comm hook (benchmarks/cluster_ddp.py, ``--hidden-layers 4``:
48.5 MiB, one DDP bucket, the configurations interleaved step by step). A row's limit is
max(compute-only step, float32's communication x b/32), with float32's communication = the
float32 step - the compute-only step, both measured in the same run as the row (the DDP run's
compute-only step is its ``no_sync()`` step); its fraction is limit / step (1: the wire at its
b/32 share, or the compute alone). 16-bit rows take b = 16. The targets: the best 8-bit and the
best 4-bit step of a door >= 0.85 of their limits, and its best 4-bit step faster than its best
8-bit one by at least half the wire time 4 bits save (float32's communication x 4/32).
Outputs (``--out PREFIX``, default docs/results/step_fractions): PREFIX.json and PREFIX.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # the sibling benchmark modules
from step_budget import physical_limit  # noqa: E402

#: the codecs (cluster.py's specs, without bits), each at 8 and 4 bits
CODECS = ("qsgd", "nuqsgd", "natural", "natural_dithering", "standard_dithering",
          "global_qsgd-lin", "global_qsgd-exp", "dithered", "nested_dithered")
BITS = (8, 4)
#: the baselines' bits per float32 element (a codec row's are its spec's, ``qsgd:8``)
BASELINE_BITS = {"fp32": 32, "fp16": 16}
TARGET_FRACTION = 0.85


def measure(args) -> None:
    """cluster.py's rows (both Horovod doors) and cluster_ddp.py's rows, into ``args.work``."""
    os.makedirs(args.work, exist_ok=True)
    horovod, ddp = run_prefixes(args)
    subprocess.run([sys.executable, os.path.join(HERE, "cluster.py"), "--shapes", "2x1",
                    "--controller", args.controller, "--rates", "1gbit", "--models", "mlp48",
                    "--no-exchange", "--train-codecs", ",".join(args.codecs),
                    "--bits", ",".join(map(str, BITS)), "--doors", "hq,compression",
                    "--fallback", "never", "--steps", str(args.steps),
                    "--min-seconds", str(args.min_seconds), "--out", horovod], check=True)
    configs = ["fp32", "fp16"] + [f"{c}:{b}" for b in BITS for c in args.codecs]
    subprocess.run([sys.executable, os.path.join(HERE, "cluster_ddp.py"), "--rates", "1gbit",
                    "--hidden-layers", "4", "--configs", ",".join(configs),
                    "--steps", str(args.ddp_steps), "--out", ddp], check=True)


def run_prefixes(args) -> tuple[str, str]:
    """The prefixes of the two runs' outputs in ``args.work``."""
    return (os.path.join(args.work, f"cluster_{args.controller}"),
            os.path.join(args.work, "ddp"))


def load_runs(args) -> dict:
    """The two runs' JSON."""
    runs = {}
    for key, prefix in zip(("horovod", "ddp"), run_prefixes(args)):
        with open(prefix + ".json") as f:
            runs[key] = json.load(f)
    return runs


def door_rows(steps_ms: dict[str, float], compute_ms: float) -> dict:
    """One door's rows, {config: step ms} with ``fp32`` among them: each row's limit and
    fraction, and the door's targets."""
    wire = steps_ms["fp32"] - compute_ms
    rows = []
    for config, step in steps_ms.items():
        bits = BASELINE_BITS.get(config) or int(config.rpartition(":")[2])
        limit = physical_limit(compute_ms, steps_ms["fp32"], bits)
        rows.append({"config": config, "bits": bits, "step_ms": step, "limit_ms": limit,
                     "fraction": limit / step})
    best = {b: min((r for r in rows if r["bits"] == b and ":" in r["config"]),
                   key=lambda r: r["step_ms"], default=None) for b in BITS}
    targets = {f"best {b}-bit >= {TARGET_FRACTION}": None if best[b] is None else {
        "row": best[b]["config"], "value": round(best[b]["fraction"], 3),
        "met": best[b]["fraction"] >= TARGET_FRACTION} for b in BITS}
    if best[8] and best[4]:
        saved = best[8]["step_ms"] - best[4]["step_ms"]
        targets["4-bit saves >= half the wire time it removes"] = {
            "row": f"{best[4]['config']} vs {best[8]['config']}",
            "value": f"{saved:.0f} of {wire * 4 / 32:.0f} ms",
            "met": saved >= 0.5 * wire * 4 / 32}
    return {"compute_ms": compute_ms, "fp32_communication_ms": wire, "rows": rows,
            "targets": targets}


def fractions(measured: dict) -> dict:
    """The three doors' rows from the runs' JSON."""
    link = measured["horovod"]["links"][0]
    train = {r["config_id"]: r["step_s"] * 1e3 for r in link["results"]
             if r.get("kind") == "train" and r.get("step_s") is not None}
    compute = train.pop("compute")
    common = {k: v for k, v in train.items() if k in ("fp32", "fp16")}
    doors = {
        "hq.DistributedOptimizer": door_rows(
            {**common, **{k: v for k, v in train.items() if ":" in k and
                          not k.startswith("hvd.")}}, compute),
        "compression=": door_rows(
            {**common, **{k[4:]: v for k, v in train.items() if k.startswith("hvd.")}},
            compute)}
    ddp_link = measured["ddp"]["links"][0]
    doors["DDP hook"] = door_rows({r["config"]: r["step_ms"] for r in ddp_link["rows"]},
                                  ddp_link["local_step_ms"])
    h, d = measured["horovod"], measured["ddp"]
    return {"horovod_run": {"command": h.get("command"), "date": h.get("date"),
                            "machine": h.get("machine")},
            "ddp_run": {"command": d.get("command"), "date": d.get("date"),
                        "load_before": d.get("machine", {}).get("loadavg_before")},
            "other_load_cores": {r["config_id"]: r.get("other_load_cores")
                                 for r in link["results"] if r.get("kind") == "train"},
            "doors": doors}


def render(data: dict) -> str:
    """The fractions as markdown: one table, a column per door, and the targets."""
    machine = data["horovod_run"]["machine"] or {}
    doors = list(data["doors"])
    by_door = {d: {r["config"]: r for r in data["doors"][d]["rows"]} for d in doors}
    configs = list(dict.fromkeys(c for d in doors for c in by_door[d]))
    loads = [v for v in data["other_load_cores"].values() if v is not None]
    lines = ["# Every codec's step against its limit (2 x 1, 1 Gbit/s, 48 MiB, one core per "
             "rank)", "",
             f"Command: `{data['command']}`; Horovod doors: {data['horovod_run']['date']} "
             f"({data['controller']} controller), DDP: {data['ddp_run']['date']} (gloo).  ",
             f"Machine: {machine.get('cpus')} cores ({machine.get('cpu')}); load average "
             f"before: {machine.get('loadavg_before')} (Horovod doors), "
             f"{data['ddp_run']['load_before']} (DDP); other load during the Horovod rows "
             f"{min(loads, default=0):.2f}-{max(loads, default=0):.2f} cores.", "",
             "Step ms (fraction of the limit: max(compute, float32's communication x b/32) / "
             "step).", "",
             "| config | " + " | ".join(doors) + " |", "|---|" + "---:|" * len(doors)]
    for c in configs:
        cells = [f"{by_door[d][c]['step_ms']:.0f} ({by_door[d][c]['fraction']:.2f})"
                 if c in by_door[d] else "" for d in doors]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += ["", "| door | compute ms | float32 communication ms | target | row | value | "
              "met |", "|---|---:|---:|---|---|---|---|"]
    for d in doors:
        door = data["doors"][d]
        for name, t in door["targets"].items():
            if t is not None:
                lines.append(f"| {d} | {door['compute_ms']:.0f} | "
                             f"{door['fp32_communication_ms']:.0f} | {name} | {t['row']} | "
                             f"{t['value']} | {'yes' if t['met'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--controller", choices=("mpi", "gloo"), default="mpi")
    ap.add_argument("--codecs", default=",".join(CODECS), help="comma-separated (default: all)")
    ap.add_argument("--steps", type=int, default=10, help="cluster.py's measured steps at least")
    ap.add_argument("--min-seconds", type=float, default=6.0)
    ap.add_argument("--ddp-steps", type=int, default=20, help="cluster_ddp.py's measured steps")
    ap.add_argument("--work", default="/tmp/hq-step-fractions", help="the runs' own outputs")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "step_fractions"))
    ap.add_argument("--render", metavar="JSON", help="the tables of an earlier run again")
    ap.add_argument("--from-work", action="store_true",
                    help="no new runs: the fractions of the runs --work holds")
    args = ap.parse_args(argv)
    if args.render:
        with open(args.render) as f:
            data = json.load(f)
    else:
        args.codecs = args.codecs.split(",")
        if not args.from_work:
            measure(args)
        data = fractions(load_runs(args))
        data["command"] = " ".join(["sudo python3 benchmarks/step_fractions.py", *[
            a for a in (sys.argv[1:] if argv is None else argv) if a != "--from-work"]])
        data["controller"] = args.controller
        with open(args.out + ".json", "w") as f:
            json.dump(data, f, indent=1)
    text = render(data)
    with open((args.render[:-5] if args.render else args.out) + ".md", "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
