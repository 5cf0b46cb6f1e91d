"""The predictor (``python -m horovod_quant.predict``) against the emulated cluster's training
runs: each measured step beside the step the predictor gives for the same shape, link, model
and compute, told how many cores the ranks share.

    python3 benchmarks/validate_predictor.py docs/results/predictor_runs.json \\
        --out docs/results/predictor_validation

Input: JSON of ``benchmarks/cluster.py`` with training rows (the gloo controller;
``--paired-from`` above the link rates so that no row steps a second model) and, for the
calibration, exchange rows of one bucket (``--sizes-mb 32``). Per link (shape and rate) and
model the ``compute`` row's median step is the predictor's compute; the link rate is the
link's TCP calibration's; the cores the ranks of a host share are the machine's cores over the
hosts (every emulated host runs on the same cores). The CPU the ranks' collectives cost per
byte sent (``transport_ns``) is the link's TCP calibration's. The codecs' speed comes from the
link's exchange rows where they timed the ranks' CPU
(:func:`horovod_quant.tools.predict.calibrate`: each codec's exchange of the bucket, by the
plan the ranks chose for that link, less its bytes at that CPU per byte); for a codec without
one, from one process timing it as one rank runs
the link's plans (the link's ``codec_throughput``), or its kernels alone
(``machine.codec_throughput``), or the built-in table. Each row says which
(``codec_speed``).
Compared: fp32, Horovod's fp16 and every ``hq.DistributedOptimizer`` codec row, each row's
median step. A codec's CPU beyond its exchanges (``step_overhead_ns``) is the predictor's default,
which other runs fixed (:func:`step_overhead_ns` of them); each row keeps the CPU it measured over
its compute row and the CPU predicted, and the summary what these runs would give instead.

The statistic (median and largest absolute relative error) covers fp32 and the codecs. The
fp16 rows are listed apart: gloo sums float16 on the CPU, which the predictor does not model
(it predicts the 16-bit allreduce of GPUs, whose NCCL sum costs nothing), so on this machine
they measure something else. Each row keeps the load measured beside it (other cores busy
during the row, the load average before and after the run): figures measured under foreign
load are not validation. Each row also keeps how far its rounds (cluster.py's repeats) differ,
and its compute row's: a row whose own measurement moves by more than the limit between rounds
cannot test the predictor to that limit, and the summary counts such rows among the misses.

Outputs ``PREFIX.json`` (every row) and ``PREFIX.md`` (the table). Exit status 1 when the
errors exceed ``--max-median`` or ``--max-error`` (default 15% and 30%).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
from typing import Callable, Iterable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

predictor = importlib.import_module("horovod_quant.tools.predict")
Topology = importlib.import_module("horovod_quant.exchange.topology").Topology
MB = 1 << 20

#: the rows the statistic leaves out, and why (the table says it)
NOT_MODELLED = {"fp16": "gloo sums float16 on the CPU; the predictor's 16-bit is NCCL's"}
#: the configurations that are not a codec: Horovod's own optimizer, and compute alone
BASELINES = ("fp32", "fp16", "compute")
#: the limits of the acceptance: median and largest absolute relative error
MAX_MEDIAN, MAX_ERROR = 0.15, 0.30


def _training_rows(link: dict) -> dict[tuple[str, str], dict]:
    """(model, configuration) -> the link's training row that ran without error."""
    return {(r["model"], r["config_id"]): r for r in link.get("results", [])
            if r.get("kind") == "train" and not r.get("error")}


def exchange_cpu(link: dict) -> tuple[int, dict[str, float]] | None:
    """The link's codec exchange rows closest to a bucket (``DEFAULT_FUSION_BYTES``) that
    timed the ranks' CPU (not those the fallback handed to Horovod's float32 allreduce):
    (elements, codec spec -> CPU seconds of one exchange), or None."""
    rows = [r for r in link.get("results", []) if r.get("kind") == "exchange"
            and not r.get("error") and not r.get("fallback") and (r.get("cpu_s") or 0) > 0
            and r["config_id"] not in BASELINES]
    if not rows:
        return None
    size = min({r["size_mb"] for r in rows},
               key=lambda mb: abs(mb * MB - predictor.DEFAULT_FUSION_BYTES))
    return int(size * MB) // 4, {r["config_id"]: r["cpu_s"] for r in rows
                                 if r["size_mb"] == size}


def rounds_spread(row: dict) -> float | None:
    """How far a row's rounds differ: the slowest round's step over the fastest's, minus 1
    (None with fewer than two rounds)."""
    steps = [r["step_s"] for r in row.get("rounds", []) if r.get("step_s")]
    return max(steps) / min(steps) - 1 if len(steps) > 1 else None


def _cpu_per_rank_ms(row: dict, compute: dict, ranks: int) -> float | None:
    """A training row's CPU per rank and step over its compute row's, ms (None unrecorded)."""
    if row.get("ranks_cpu_s_per_step") is None or compute.get("ranks_cpu_s_per_step") is None:
        return None
    return (row["ranks_cpu_s_per_step"] - compute["ranks_cpu_s_per_step"]) / ranks * 1e3


def compare(runs: Iterable[dict], predict: Callable = predictor.predict) -> list[dict]:
    """Every fp32, fp16 and hq codec row of ``runs`` (cluster.py JSON) beside its prediction.

    Args:
        runs: the parsed JSON of one or more cluster.py runs.
        predict: the predictor (a test passes one with a term broken on purpose).

    Returns:
        One dict per row: shape, link (its calibrated rate, and ``link_told_gbit`` the rate
        the ranks were told), model and its ``params``, config, measured and
        predicted ms, the relative error (predicted / measured - 1), whether the statistic
        counts it, the load, how far the row's and its compute row's rounds differ
        (:func:`rounds_spread`), the predictor's ``step_overhead_ns``, and a rank's CPU per
        step beyond compute, measured (``cpu_over_compute_ms``; None where the run did not
        record it) and predicted (``predicted_cpu_ms``).
    """
    out = []
    for run in runs:
        cores = run["machine"]["cpus"]
        loads = (run["machine"].get("loadavg_before"), run["machine"].get("loadavg_after"))
        for link in run["links"]:
            hosts, per_host = link["hosts"], link["ranks_per_host"]
            calibration = link.get("calibration") or {}
            gbit = calibration.get("tcp_gbit_s") or link["rate_bps"] / 1e9
            told = link.get("ranks_link_gbit") or link["rate_bps"] / 1e9
            transport_ns = calibration.get("tcp_cpu_ns_per_byte", predictor.CPU_TRANSPORT_NS)
            source = ("plans" if link.get("codec_throughput") else
                      "kernels" if run["machine"].get("codec_throughput") else "table")
            measured_rates = {**(run["machine"].get("codec_throughput") or {}),
                              **(link.get("codec_throughput") or {})}
            rates = None if not measured_rates else {
                spec: predictor.Throughput(*r) for spec, r in measured_rates.items()}
            exchanges = exchange_cpu(link)
            calibrated: set[str] = set()
            if exchanges is not None and rates is not None:
                numel, cpu_s = exchanges
                rates = predictor.calibrate(
                    rates, cpu_s, numel, Topology.grid(hosts, per_host),
                    predictor.cluster_fabric("cpu", told), transport_ns)
                calibrated = set(cpu_s)
            rows = _training_rows(link)
            for model in sorted({m for m, _ in rows}):
                compute = rows.get((model, "compute"))
                if compute is None:
                    continue
                codecs = [c for (m, c) in rows if m == model and c not in BASELINES
                          and rows[m, c].get("door") == "hq"]
                prediction = predict(hosts, per_host, gbit, compute["step_median_s"] * 1e3,
                                     params=compute["model_params"], device="cpu",
                                     codecs=codecs, cores_per_host=cores / hosts,
                                     throughput=rates, transport_ns=transport_ns)
                for row in prediction.rows:
                    measured = rows.get((model, row.name))
                    if measured is None or row.step_ms <= 0:
                        continue
                    ms = measured["step_median_s"] * 1e3
                    # Horovod's allreduce ran its default, the flat ring: that plan's step
                    plan = predictor.RING if predictor.RING in row.plans_ms else row.plan
                    step_ms = row.plans_ms.get(plan, row.step_ms)
                    out.append({
                        "shape": f"{hosts}x{per_host}", "link_gbit": round(gbit, 3),
                        "link_told_gbit": told,
                        "model": model, "params": compute["model_params"],
                        "config": row.name, "plan": plan,
                        "plans_measured": measured.get("plans"),
                        "measured_ms": ms, "predicted_ms": step_ms,
                        "error": step_ms / ms - 1, "counted": row.name not in NOT_MODELLED,
                        "compute_ms": compute["step_median_s"] * 1e3,
                        "codec_speed": ("exchanges" if row.name in calibrated else
                                        None if row.name in BASELINES else source),
                        "transport_ns": transport_ns,
                        "step_overhead_ns": prediction.step_overhead_ns,
                        "cpu_over_compute_ms": _cpu_per_rank_ms(measured, compute,
                                                                hosts * per_host),
                        "predicted_cpu_ms": row.codec_ms * prediction.core_share,
                        "cores_per_host": cores / hosts,
                        "other_load_cores": measured.get("other_load_cores"),
                        "rounds_spread": rounds_spread(measured),
                        "compute_rounds_spread": rounds_spread(compute),
                        "loadavg_before_after": loads})
    return out


def step_overhead_ns(runs: Iterable[dict]) -> float | None:
    """The CPU per gradient element that the codec rows of ``runs`` cost a rank and step
    beyond what the predictor gives their exchanges and copies (with ``step_overhead_ns=0``,
    at the codec speed :func:`compare` takes for each row): the median over the rows that
    recorded their CPU (None if none did).

    Args:
        runs: the parsed JSON of one or more cluster.py runs.
    """
    def without_overhead(*args, **kwargs):
        return predictor.predict(*args, **dict(kwargs, step_overhead_ns=0.0))

    beyond_ns = [(r["cpu_over_compute_ms"] - r["predicted_cpu_ms"]) * 1e6 / r["params"]
                 for r in compare(runs, predict=without_overhead)
                 if r["config"] not in BASELINES and r["cpu_over_compute_ms"] is not None]
    return statistics.median(beyond_ns) if beyond_ns else None


def summarize(rows: list[dict], max_median: float = MAX_MEDIAN,
              max_error: float = MAX_ERROR) -> dict:
    """The statistic over the counted rows: their count, median and largest absolute error,
    whether both are within the limits, the rows over ``max_error`` and how many of those
    were measured with rounds (their own or their compute row's) that differ by more than
    ``max_error``."""
    counted = [r for r in rows if r["counted"]]
    if not counted:
        return {"rows": 0, "median_abs_error": None, "max_abs_error": None, "passed": False}
    errors = [abs(r["error"]) for r in counted]
    median, worst = statistics.median(errors), max(errors)
    over = [r for r in counted if abs(r["error"]) > max_error]
    unrepeatable = [r for r in over if max(r.get("rounds_spread") or 0.0,
                                           r.get("compute_rounds_spread") or 0.0) > max_error]
    return {"rows": len(errors), "median_abs_error": median, "max_abs_error": worst,
            "max_median": max_median, "max_error": max_error,
            "passed": median <= max_median and worst <= max_error,
            "over_max_error": len(over), "over_max_error_unrepeatable": len(unrepeatable)}


def table(rows: list[dict], summary: dict) -> str:
    """The markdown table of ``rows`` and the statistic's line."""
    def percent(value: float | None) -> str:
        return "-" if value is None else f"{100 * value:.0f}%"

    lines = ["| shape | link | model | config | measured ms | predicted ms | error | "
             "rounds differ (row / compute) | other cores busy |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        config = r["config"] + ("" if r["counted"] else " (not counted)")
        load = "-" if r["other_load_cores"] is None else f"{r['other_load_cores']:.2f}"
        spread = (f"{percent(r.get('rounds_spread'))} / "
                  f"{percent(r.get('compute_rounds_spread'))}")
        lines.append(f"| {r['shape']} | {r['link_gbit']:g} Gbit/s | {r['model']} | {config} | "
                     f"{r['measured_ms']:.0f} | {r['predicted_ms']:.0f} | "
                     f"{100 * r['error']:+.0f}% | {spread} | {load} |")
    if summary["rows"]:
        lines.append("")
        lines.append(f"{summary['rows']} rows counted: median absolute error "
                     f"{100 * summary['median_abs_error']:.0f}%, largest "
                     f"{100 * summary['max_abs_error']:.0f}% (limits "
                     f"{100 * summary['max_median']:.0f}% and {100 * summary['max_error']:.0f}%"
                     f"): {'passed' if summary['passed'] else 'failed'}.")
        if summary["over_max_error"]:
            lines.append(f"{summary['over_max_error']} rows over "
                         f"{100 * summary['max_error']:.0f}%; in "
                         f"{summary['over_max_error_unrepeatable']} of them the row's rounds or "
                         f"its compute row's differ by more than that.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="cluster.py JSON files with training rows")
    ap.add_argument("--out", default=None,
                    help="output prefix (PREFIX.json, PREFIX.md); default: print only")
    ap.add_argument("--max-median", type=float, default=MAX_MEDIAN,
                    help=f"largest median absolute error accepted (default {MAX_MEDIAN})")
    ap.add_argument("--max-error", type=float, default=MAX_ERROR,
                    help=f"largest absolute error accepted (default {MAX_ERROR})")
    args = ap.parse_args(argv)
    runs = []
    for path in args.runs:
        with open(path) as f:
            runs.append(json.load(f))
    rows = compare(runs)
    summary = summarize(rows, args.max_median, args.max_error)
    summary["own_step_overhead_ns"] = step_overhead_ns(runs)
    text = table(rows, summary)
    if summary["own_step_overhead_ns"] is not None:
        text += (f"\nThe predictor's step_overhead_ns: {rows[0]['step_overhead_ns']:.2f} ns; "
                 f"these runs' own: {summary['own_step_overhead_ns']:.2f} ns.")
    print(text)
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"inputs": args.runs, "commands": [r.get("command") for r in runs],
                       "summary": summary, "rows": rows}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(f"Predictor against {', '.join(args.runs)} "
                    "(`python3 benchmarks/validate_predictor.py`)\n\n" + text + "\n")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
