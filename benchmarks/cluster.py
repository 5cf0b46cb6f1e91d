"""An emulated cluster on one machine, H hosts x K ranks (2 x 1 by default): the exchange and
training benchmark at 1 and 10 Gbit/s per host NIC.

    sudo python3 benchmarks/cluster.py                 # default run (26 min on 2 idle cores)
    sudo python3 benchmarks/cluster.py --quick         # subset, 2.5 min on 2 idle cores
    sudo python3 benchmarks/cluster.py --shapes 2x1,2x2,4x1,4x2 --controller gloo \
        --rates 1gbit --models mlp12 --no-exchange --doors hq,compression --repeats 3
    sudo python3 benchmarks/cluster.py --cleanup       # remove leftovers of killed runs
    python3 benchmarks/cluster.py --render docs/results/cluster.json   # tables + plots again
    python3 benchmarks/cluster.py --render docs/results/cluster.json --plots-only   # plots only

The parts (root needed; see docs/dev/benchmarks.md):

* ``emulator.py``: the hosts (network namespaces on a bridge, each host's NIC shaped both ways
  with ``tc``), the launch of the ranks under ``mpirun`` or Horovod's gloo controller, the
  NICs' byte counters, the cleanup;
* ``cluster_workloads.py``: the ranks' side: exchanges, training steps (bytes across hosts
  read from the NICs' kernel counters around the measured steps), probes;
* ``cluster_report.py``: analysis, tables, targets; ``cluster_plots.py``: the plots;
* this file: the plan, the runs and the command line. Per shape one emulated cluster, per link
  rate one launch running ``cluster_workloads.py``; rank 0 writes one JSON line per finished
  item, which this script tails for its progress bar. A stalled or crashed launch is stopped
  (every rank's Python stacks dumped into its log first), the item recorded as failed, and the
  remaining items relaunched. The ranks are told the link's rate (``HQ_LINK_GBIT``), as the
  predictor tells a user to; with training rows the codecs are timed first, alone and per
  link in its shape's plans (``measure_codecs``: what the predictor's validation takes).

Everything created (namespaces and their processes, temp dir) is removed when a cluster is
left, also on an error, SIGINT or SIGTERM; ``--cleanup`` removes what killed runs left behind
(``emulator.cleanup_leftovers``).

Outputs (``--out PREFIX``, default ``docs/results/cluster``): ``PREFIX.json`` (every figure,
with the command, machine and link calibration), ``PREFIX.md`` (tables), ``PREFIX_speedup.png``,
``PREFIX_bytes.png``, ``PREFIX_split.png``, and ``PREFIX_shapes.png`` when the bytes across
hosts were counted.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time

from horovod_quant.doors import LINK_ENV, CodecRequest
from horovod_quant.exchange.plans import DEFAULT_PIPELINE_ELEMS

from cluster_report import (
    OVERLAP_TRANSPORTS,
    analyse,
    median_of_runs,
    merge_rounds,
    plots,
    write_outputs,
)
from emulator import EmulatedCluster, cleanup_leftovers, parse_rate

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKLOADS = os.path.join(HERE, "cluster_workloads.py")
#: the transports of the probe (benchmarks/cluster_workloads.transports; mpi4py under MPI only)
TRANSPORTS = ("hvd_allgather", "hvd_allgather_concurrent", "hvd_grouped_allgather",
              "hvd_alltoall", "hvd_allreduce_int32", "hvd_allreduce_fp32_same_bytes",
              "torch_dist_all_gather", "torch_dist_all_gather_concurrent", "hq_gloo_group",
              "hq_gloo_group_concurrent", "hq_gloo_group_allreduce_int32", "mpi4py_iallgather")
CODECS = ("qsgd", "nuqsgd", "natural", "natural_dithering", "standard_dithering",
          "global_qsgd-lin", "global_qsgd-exp", "dithered")
#: doors a training codec can go through (--doors)
DOORS = ("hq", "compression")


# -- configurations -------------------------------------------------------------------------
def config(spec: str) -> dict:
    """``fp32``, ``fp16`` (Horovod's optimizer), ``compute`` (no communication), ``codec:bits``
    (``hq.DistributedOptimizer``; ``global_qsgd-lin:8`` / ``global_qsgd-exp:8``) or
    ``hvd.codec:bits`` (Horovod's optimizer with ``compression=hq.Compression.<codec>``)."""
    if spec in ("fp32", "fp16", "compute"):
        return {"id": spec, "codec": "fp16" if spec == "fp16" else "none", "params": {},
                "door": "compute" if spec == "compute" else "horovod"}
    door, name = ("compression", spec[4:]) if spec.startswith("hvd.") else ("hq", spec)
    request = CodecRequest.from_spec(name)
    return {"id": spec, "codec": request.name, "params": request.params, "door": door}


def default_specs(codecs, bits) -> list[str]:
    return ["fp32", "fp16"] + [f"{c}:{b}" for b in bits for c in codecs]


def link_label(rate_bps: float, hosts: int, ranks_per_host: int) -> str:
    """``1 Gbit/s`` for 2 hosts x 1 rank (the runs before shapes), else ``1 Gbit/s, 4 x 2``."""
    shape = "" if (hosts, ranks_per_host) == (2, 1) else f", {hosts} x {ranks_per_host}"
    return f"{rate_bps / 1e9:g} Gbit/s{shape}"


# -- plan and runs ---------------------------------------------------------------------------
def rank_env() -> dict[str, str]:
    """What every rank's process (and the codecs' timing beside them) runs with: this checkout
    first on the path, one thread each (the hosts' cores are shared out by the ranks)."""
    return {"PYTHONPATH": ROOT + (os.pathsep + os.environ["PYTHONPATH"]
                                  if os.environ.get("PYTHONPATH") else ""),
            "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def build_plan(args, rate_bps: float, first_rate: bool) -> list[dict]:
    """The items of one launch (the probes' rendezvous address is filled in by run_phase)."""
    items = []
    if args.transport_probe:
        for size in args.transport_sizes_mb:
            items.append({"kind": "transport", "id": f"p-{size:g}MB", "size_mb": size,
                          "warmup": 1, "repeats": args.repeats,
                          "configs": [{"id": t, "codec": "none", "params": {}}
                                      for t in TRANSPORTS]})
    if args.overlap_probe and first_rate:
        items.append({"kind": "overlap", "id": "o-64MB", "size_mb": 64.0, "busy_s": 0.3,
                      "warmup": 1, "repeats": 7, "transports": list(OVERLAP_TRANSPORTS),
                      "configs": [{"id": p + m, "codec": "none", "params": {}}
                                  for p in OVERLAP_TRANSPORTS
                                  for m in ("idle", "sleep", "compute")]})
    if not args.no_exchange:
        for size in args.sizes_mb:
            items.append({"kind": "exchange", "id": f"x-{size:g}MB", "size_mb": size,
                          "configs": [config(s) for s in args.exchange_specs], "warmup": 1,
                          "repeats": args.exchange_repeats or (
                              args.repeats_large if size >= 128 else
                              args.repeats * 10 if size < 16 else args.repeats),
                          "pipeline_elems": args.pipeline_elems, "transport": args.transport,
                          "fallback": args.fallback})
    if not args.no_training:
        models = args.models if first_rate else args.models_other_rates
        for rnd in range(args.train_rounds):  # round-major: drifts hit every row alike
            for model in models:
                for spec in args.train_specs:
                    row_id = f"t-{model}-{spec}"
                    items.append({"kind": "train", "row_id": row_id, "round": rnd,
                                  "id": row_id + (f"-r{rnd}" if args.train_rounds > 1 else ""),
                                  "model": model, "config": config(spec),
                                  "batch": args.batch[model], "warmup": args.warmup_steps,
                                  "steps": args.steps, "min_seconds": args.min_seconds,
                                  "paired": rate_bps >= args.paired_from_bps,
                                  "pipeline_elems": args.pipeline_elems,
                                  "transport": args.transport, "fallback": args.fallback,
                                  "profile": args.profile})
    return items


def ticks(item: dict) -> int:
    if item["kind"] in ("exchange", "overlap", "transport"):
        return item.get("warmup", 0) + item.get("repeats", 0)
    return 1


def result_rows(items: list[dict], results: dict) -> list[dict]:
    """One row per (item, configuration), with the plan's description added; a training
    row's rounds merged into one (``cluster_report.merge_rounds``)."""
    rows, rounds = [], {}
    for it in items:
        cfgs = it["configs"] if "configs" in it else [it["config"]]
        for cfg in cfgs:
            rid = f"{it['id']}-{cfg['id']}" if "configs" in it else it["id"]
            r = dict(results.get(rid, {"id": rid, "error": "missing"}))
            r.pop("type", None)
            r.update(kind=it["kind"], config_id=cfg["id"], codec=cfg["codec"],
                     codec_params=cfg["params"])
            if it["kind"] in ("exchange", "overlap", "transport"):
                r.update(size_mb=it["size_mb"], repeats=it["repeats"])
                rows.append(r)
                continue
            r.update(model=it["model"], batch=it["batch"], steps=it["steps"],
                     door=cfg["door"], id=it["row_id"])
            if it["row_id"] not in rounds:
                rounds[it["row_id"]] = []
                rows.append(it["row_id"])  # placeholder, keeps the first round's position
            rounds[it["row_id"]].append(r)
    return [merge_rounds(rounds[r]) if isinstance(r, str) else r for r in rows]


def run_phase(cluster: EmulatedCluster, label: str, items: list[dict], bar,
              args, link_gbit: float) -> tuple[dict, list[str]]:
    """Run ``items`` on ``cluster`` (relaunching after a failed item), the ranks told the
    link's rate as a user tells the optimizer (``HQ_LINK_GBIT``: the plans the predictor
    gives that link); returns ({id: result}, log notes)."""
    results: dict[str, dict] = {}
    notes: list[str] = []
    remaining = list(items)
    attempt = 0
    env = {**rank_env(), "OMPI_MCA_mpi_yield_when_idle": "1", LINK_ENV: f"{link_gbit:g}"}
    if args.controller == "mpi":
        env.update(HOROVOD_CONTROLLER="mpi", HOROVOD_CPU_OPERATIONS="mpi")
    rendezvous = f"{cluster.hosts[0].address}:{29500 + os.getpid() % 1000}"
    for it in remaining:
        if it["kind"] in ("overlap", "transport"):  # their torch.distributed group
            it["rendezvous"] = rendezvous
    while remaining and attempt <= args.max_relaunch:
        attempt += 1
        plan = os.path.join(cluster.tmp, f"plan-{label}-{attempt}.json")
        rows = os.path.join(cluster.tmp, f"rows-{label}-{attempt}.jsonl")
        with open(plan, "w") as f:
            json.dump({"items": remaining}, f)
        open(rows, "w").close()
        launch = cluster.start([sys.executable, WORKLOADS, "--plan", plan, "--out", rows],
                               controller=args.controller, env=env, timeout=args.timeout,
                               log_dir=os.path.join(cluster.tmp, f"logs-{label}-{attempt}"))
        seen, last = 0, time.monotonic()
        stalled = False
        done: set[str] = set()
        while True:
            with open(rows) as f:
                lines = [text for text in f.read().splitlines() if text.strip()]
            for line in lines[seen:]:
                row = json.loads(line)
                last = time.monotonic()
                if row["type"] == "result":
                    results[row["id"]] = row
                elif row["type"] == "done":
                    done.add(row["id"])
                    bar.set_postfix_str(f"{label} {row['id']}", refresh=False)
                if row["type"] == "progress" or (row["type"] == "done"
                                                 and not row["id"].startswith(("x-", "o-"))):
                    bar.update(1)
            seen = len(lines)
            outcome = launch.poll()
            if outcome is not None:
                break
            if time.monotonic() - last > args.stall_timeout:
                stalled = True
                launch.kill()  # the ranks' stacks go to their logs first
                outcome = launch.poll()
                break
            time.sleep(0.5)
        remaining = [it for it in remaining if it["id"] not in done]
        if remaining:
            # a stall's tail holds the ranks' stacks
            tail = outcome.report(tail=6000 if stalled else 1500)
            why = (f"stalled > {args.stall_timeout:g} s" if stalled else
                   "timed out" if outcome.timed_out else
                   f"ranks exited with {outcome.returncodes}")
            failed = remaining.pop(0)
            cfgs = failed["configs"] if failed["kind"] == "exchange" else [failed["config"]]
            for cfg in cfgs:
                rid = (f"{failed['id']}-{cfg['id']}" if failed["kind"] == "exchange"
                       else failed["id"])
                results.setdefault(rid, {"id": rid, "error": f"{why}; log tail: {tail}"})
            notes.append(f"{label}: {failed['id']}: {why}")
            bar.update(ticks(failed))
            print(f"\n[cluster] {label}: {failed['id']} failed ({why}); log tail:\n{tail}",
                  file=sys.stderr)
    return results, notes


# -- main -----------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a small subset (2.5 min on 2 idle cores)")
    ap.add_argument("--hosts", type=int, default=2, help="emulated hosts (default 2)")
    ap.add_argument("--ranks-per-host", type=int, default=1,
                    help="ranks on each emulated host (default 1)")
    ap.add_argument("--shapes", default=None,
                    help="comma-separated HxK shapes run one after the other, e.g. "
                         "2x1,2x2,4x1,4x2 (replaces --hosts/--ranks-per-host)")
    ap.add_argument("--cleanup", action="store_true",
                    help="remove leftovers of earlier (dead) runs and exit")
    ap.add_argument("--render", metavar="JSON", nargs="+",
                    help="re-render tables and plots from JSON(s) (links concatenated; written "
                         "to --out if given, else next to the first JSON)")
    ap.add_argument("--median-of", metavar="JSON", nargs="+",
                    help="training speedups of separate runs side by side with their median "
                         "and the training targets on it (markdown; to --out PREFIX.md if given)")
    ap.add_argument("--plots-only", action="store_true",
                    help="with --render: redraw only the PNGs (the JSON and tables stay)")
    ap.add_argument("--rates", default=None, help="comma-separated link rates (1gbit,10gbit)")
    ap.add_argument("--delay-ms", type=float, default=0.1)
    ap.add_argument("--sizes-mb", default=None, help="exchange sizes in MB (4,64,256)")
    ap.add_argument("--codecs", default=None, help=f"comma-separated ({','.join(CODECS)})")
    ap.add_argument("--train-codecs", default=None,
                    help="codecs of the training runs (default: those of --codecs)")
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--doors", default="hq",
                    help="doors the training codecs go through: hq (hq.DistributedOptimizer), "
                         "compression (hvd.DistributedOptimizer(compression=hq.Compression."
                         "<codec>(bits=b)), rows 'hvd.<codec>:<bits>'); comma-separated "
                         "(default hq)")
    ap.add_argument("--models", default=None,
                    help="training models at the first rate (mlp,cnn; mlp48, mlp12: MLPs of "
                         "48 and 12 MiB; resnet18: ResNet-18 on 32x32 images, 11.2M "
                         "parameters; gpt25: a GPT-style decoder, 25.2M parameters)")
    ap.add_argument("--models-other-rates", default=None,
                    help="training models at the other rates (default mlp: the cnn is "
                         "compute-bound already at 1 Gbit/s)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="exchange repetitions (< 128 MB; 10x that below 16 MB, where one "
                         "exchange takes milliseconds), and rounds of the training rows: each "
                         "round runs every training row once, in the same order, and a row's "
                         "figures are medians over the rounds (default: one round)")
    ap.add_argument("--repeats-large", type=int, default=None, help="repetitions at >= 128 MB")
    ap.add_argument("--exchange-repeats", type=int, default=None,
                    help="repetitions of every exchange row, whatever its size (default: "
                         "--repeats, ten times that below 16 MB, --repeats-large from 128 MB)")
    ap.add_argument("--steps", type=int, default=None,
                    help="measured training steps at least (default 5)")
    ap.add_argument("--min-seconds", type=float, default=None,
                    help="measured training steps add up to this many seconds at least "
                         "(default 5; at most 60 steps)")
    ap.add_argument("--paired-from", default="10gbit",
                    help="from this link rate on, each training row steps a float32 reference "
                         "model beside its own, alternating, and its speedup vs fp32 is that "
                         "pair's (default 10gbit, where codecs and fp32 differ by little)")
    ap.add_argument("--warmup-steps", type=int, default=None,
                    help="untimed training steps once the optimizer's layout is final "
                         "(default 1; the fallback's trial and step check come before)")
    ap.add_argument("--no-exchange", action="store_true")
    ap.add_argument("--no-training", action="store_true")
    ap.add_argument("--stall-timeout", type=float, default=300.0)
    ap.add_argument("--max-relaunch", type=int, default=4)
    ap.add_argument("--controller", choices=("mpi", "gloo"), default="mpi",
                    help="Horovod's controller and CPU collectives: mpi (mpirun, the mpi4py "
                         "exponent allreduce) or gloo (Horovod's rendezvous, no busy polling)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds a launch may run in all before its ranks are stopped "
                         "(default: none; --stall-timeout still applies)")
    ap.add_argument("--overlap-probe", action="store_true",
                    help="first measure whether a transfer progresses while its rank computes "
                         "(64 MB fp32 allreduce vs a 0.3 s busy loop or sleep)")
    ap.add_argument("--transport-probe", action="store_true",
                    help="first measure every way of moving a uint8 payload to all ranks "
                         "(Horovod allgather / alltoall / grouped / concurrent, integer "
                         "allreduce, torch.distributed gloo, mpi4py) at --transport-sizes-mb")
    ap.add_argument("--transport-sizes-mb", default="16,64",
                    help="payload MB per rank of the transport probe (default 16,64)")
    ap.add_argument("--pipeline-elems", type=int, default=DEFAULT_PIPELINE_ELEMS,
                    help="piece length of the codecs' pipelined exchanges in elements "
                         f"(default {DEFAULT_PIPELINE_ELEMS}, as Exchange); 0: whole vectors")
    ap.add_argument("--transport", choices=("auto", "gloo", "horovod"), default="auto",
                    help="what carries the codecs' payloads (DistributedOptimizer's transport=; "
                         "default auto: a gloo group beside Horovod for CPU gradients)")
    ap.add_argument("--fallback", choices=("auto", "never"), default="auto",
                    help="DistributedOptimizer's fallback= (default auto: a bucket whose codec "
                         "exchange is slower than Horovod's float32 allreduce, measured at step "
                         "1, falls back to it, and a narrow win is checked in training steps); "
                         "exchange rows apply the trial's rule after their warm-up round")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "cluster"),
                    help="output prefix (PREFIX.json, .md, _*.png)")
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="sample the measured training steps with py-spy (every thread, waits "
                         "included): rank 0's collapsed stacks DIR/<row>.txt, rank 1's flame "
                         "graph DIR/<row>.svg (benchmarks/step_budget.py reads them)")
    args = ap.parse_args(argv)
    try:
        args.shapes = ([tuple(int(v) for v in s.lower().split("x")) for s in
                        args.shapes.split(",")] if args.shapes
                       else [(args.hosts, args.ranks_per_host)])
        if any(len(s) != 2 or s[0] < 2 or s[1] < 1 for s in args.shapes):
            raise ValueError
    except ValueError:
        ap.error(f"--shapes {args.shapes!r}: comma-separated HxK with H >= 2, K >= 1, "
                 "e.g. 2x1,2x2,4x1,4x2")
    args.doors = args.doors.split(",")
    if not args.doors or set(args.doors) - set(DOORS):
        ap.error(f"--doors {','.join(args.doors)}: comma-separated of {','.join(DOORS)}")
    args.out_given = args.out != os.path.join(ROOT, "docs", "results", "cluster")
    args.pipeline_elems = args.pipeline_elems or None
    if args.exchange_repeats is not None and args.exchange_repeats < 1:
        ap.error(f"--exchange-repeats {args.exchange_repeats}: at least 1")
    q = args.quick
    try:
        args.rates = [parse_rate(r) for r in (args.rates or ("1gbit" if q else "1gbit,10gbit"))
                      .split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    args.sizes_mb = [float(z) for z in (args.sizes_mb or ("4,64" if q else "4,64,256"))
                     .split(",")]
    args.transport_sizes_mb = [float(z) for z in args.transport_sizes_mb.split(",")]
    codecs = (args.codecs or ("qsgd,nuqsgd,natural,global_qsgd-lin,global_qsgd-exp,dithered"
                              if q else ",".join(CODECS))).split(",")
    bits = [int(b) for b in args.bits.split(",")]
    args.exchange_specs = default_specs(codecs, bits)
    if args.train_codecs:
        specs = default_specs(args.train_codecs.split(","), bits)
    elif q:
        specs = ["fp32", "fp16", "natural:8", "global_qsgd-lin:8", "natural:4"]
    else:
        specs = args.exchange_specs
    # the compute-only floor after the baselines; each codec once per door
    args.train_specs = specs[:2] + ["compute"] + [
        ("hvd." if door == "compression" else "") + spec
        for spec in specs[2:] for door in args.doors]
    args.models = (args.models or "mlp,cnn").split(",")
    args.models_other_rates = [m for m in (args.models_other_rates or "mlp").split(",") if m]
    args.train_rounds = args.repeats or 1
    args.repeats = args.repeats or (3 if q else 4)
    args.repeats_large = args.repeats_large or (2 if q else 3)
    # counted from the step the layout is final: with fallback="auto" the optimizer measures
    # its buckets at the end of step FALLBACK_STEP and may check in training steps after it,
    # so those steps are warm-up too (run_train waits for opt.fallback_settled)
    args.warmup_steps = args.warmup_steps if args.warmup_steps is not None else 1
    args.steps = args.steps or (2 if q else 5)
    args.min_seconds = args.min_seconds if args.min_seconds is not None else (1.0 if q else 5.0)
    args.paired_from_bps = parse_rate(args.paired_from)
    args.batch = {"mlp": 32, "mlp48": 32, "mlp12": 32, "cnn": 16, "resnet18": 4, "gpt25": 2}
    args.profile = args.profile and os.path.abspath(args.profile)  # the ranks' cwd may differ
    if args.quick and args.out == os.path.join(ROOT, "docs", "results", "cluster"):
        args.out += "_quick"
    return args



def main(argv=None) -> int:
    args = parse_args(argv)
    if args.median_of:
        text = median_of_runs(args.median_of, args.out if args.out_given else None)
        print(text)
        if args.out_given:
            with open(args.out + ".md", "w") as f:
                f.write(text + "\n")
        return 0
    if args.render:
        datas = []
        for path in args.render:
            with open(path) as f:
                datas.append(json.load(f))
        data = datas[0]
        for extra in datas[1:]:  # runs made separately: links added, same-rate rows merged
            for link in extra["links"]:
                same = [other for other in data["links"] if other["label"] == link["label"]]
                if same:
                    same[0]["results"] += link["results"]
                    same[0].setdefault("calibration_other_runs", []).append(
                        link.get("calibration"))
                else:
                    data["links"].append(link)
            data["command"] += " ; " + extra["command"]
            data["wall_s"] = data.get("wall_s", 0) + extra.get("wall_s", 0)
            data.setdefault("parts", []).append({k: extra.get(k) for k in
                                                 ("command", "date", "machine", "wall_s")})
        prefix = args.out if args.out_given else (
            args.render[0][:-5] if args.render[0].endswith(".json") else args.render[0])
        if args.plots_only:
            data["summary"] = analyse(data)
            paths = plots(data, prefix)
        else:
            paths = write_outputs(data, prefix)
        for p in paths:
            print(p)
        return 0
    if args.plots_only:
        print("--plots-only goes with --render JSON", file=sys.stderr)
        return 2
    if os.geteuid() != 0:
        print("cluster.py needs root (network namespaces, tc)", file=sys.stderr)
        return 2
    if args.cleanup:
        removed = cleanup_leftovers()
        print("\n".join(removed) if removed else "nothing to clean up")
        return 0
    for tool in ("ip", "tc") + (("mpirun",) if args.controller == "mpi" else ()):
        if shutil.which(tool) is None:
            print(f"cluster.py needs `{tool}` on PATH", file=sys.stderr)
            return 2
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)  # (before the runs)
    from tqdm import tqdm

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    t_start = time.time()
    data = {"command": "python3 benchmarks/cluster.py " + " ".join(
                shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": machine_info(), "controller": args.controller,
            "transport": args.transport, "fallback": args.fallback,
            "shapes": [list(s) for s in args.shapes], "links": [], "notes": []}
    plans = [build_plan(args, rate, i == 0) for i, rate in enumerate(args.rates)]
    bar = tqdm(total=len(args.shapes) * sum(ticks(it) for p in plans for it in p), unit="step",
               dynamic_ncols=True, mininterval=1.0)
    try:
        codec_specs = sorted({s.removeprefix("hvd.") for s in args.train_specs[3:]})
        if not args.no_training:
            data["machine"]["codec_throughput"] = measure_codecs(codec_specs)
        for hosts, per_host in args.shapes:
            with EmulatedCluster(hosts=hosts, ranks_per_host=per_host,
                                 delay_ms=args.delay_ms) as cluster:
                for rate, items in zip(args.rates, plans):
                    label = link_label(rate, hosts, per_host)
                    bar.set_postfix_str(f"{label}: shaping + calibration", refresh=True)
                    shaping = cluster.shape(rate, args.delay_ms)
                    calib = cluster.calibrate()
                    in_plans = None if args.no_training else measure_codecs(
                        codec_specs, (hosts, per_host), rate / 1e9)
                    tag = label.replace(" ", "").replace("/", "p").replace(",", "_")
                    results, notes = run_phase(cluster, tag, items, bar, args, rate / 1e9)
                    data["links"].append({"label": label, "hosts": hosts,
                                          "ranks_per_host": per_host, "rate_bps": rate,
                                          "ranks_link_gbit": rate / 1e9,
                                          "shaping": shaping, "calibration": calib,
                                          "subnet": cluster.subnet,
                                          "codec_throughput": in_plans,
                                          "results": result_rows(items, results)})
                    data["notes"] += notes
                    # partial results survive a later failure or Ctrl-C
                    with open(f"{args.out}.partial.json", "w") as f:
                        json.dump(data, f)
        bar.close()
        data["wall_s"] = time.time() - t_start
        data["machine"]["loadavg_after"] = " ".join(open("/proc/loadavg").read().split()[:3])
        for p in write_outputs(data, args.out):
            print(p)
        os.remove(f"{args.out}.partial.json")
        return 0
    except KeyboardInterrupt as exc:
        print(f"\n[cluster] interrupted ({exc}); cleaned up", file=sys.stderr)
        return 130
    finally:
        bar.close()
        for sig, h in old.items():
            signal.signal(sig, h)


def measure_codecs(specs: list[str], shape: tuple[int, int] | None = None,
                   link_gbit: float | None = None) -> dict:
    """The codecs' encode / decode / combine GB/s on this machine, measured as
    ``python -m horovod_quant.predict --measure`` measures them, in a process set up as the
    ranks are (:func:`rank_env`): the predictor's validation takes the codec speed of the
    machine that measured the steps, not the built-in table of another. Given a ``shape``
    (hosts, ranks per host) and the link the ranks are told (``HQ_LINK_GBIT``), also as one
    rank runs them in that shape's plans
    (:func:`horovod_quant.tools.predict.measure_throughput`)."""
    code = ("import json, sys; from horovod_quant.tools import predict as p; "
            "from horovod_quant.exchange.topology import Topology; "
            "shape = json.loads(sys.argv[1]); kw = {} if shape is None else dict("
            "topology=Topology.grid(*shape[:2]), fabric=p.cluster_fabric('cpu', shape[2])); "
            "print(json.dumps(p.measure_throughput(sys.argv[2:], 'cpu', repeat=7, **kw)))")
    env = dict(os.environ, **rank_env())
    where = None if shape is None else [*shape, link_gbit]
    done = subprocess.run([sys.executable, "-c", code, json.dumps(where), *specs],
                          capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"timing the codecs failed:\n{done.stderr}")
    return json.loads(done.stdout)


def machine_info() -> dict:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    versions = {}
    for mod in ("torch", "horovod", "numpy", "numba"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # pragma: no cover - informative only
            versions[mod] = None
    mpi = (subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
           if shutil.which("mpirun") else "")
    return {"cpus": os.cpu_count(), "cpu": cpu, "kernel": platform.release(),
            "python": platform.python_version(), "versions": versions,
            "mpi": mpi.splitlines()[0] if mpi else None,
            "loadavg_before": " ".join(open("/proc/loadavg").read().split()[:3])}


if __name__ == "__main__":
    sys.exit(main())
