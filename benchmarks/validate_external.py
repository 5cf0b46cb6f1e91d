"""The predictor (``python -m horovod_quant.predict``) against other systems' published
training throughput: quantized gradient exchange beside an uncompressed allreduce, each with
the setup its source states (docs/results/external_measurements.json: every row's source,
where in it each number is, and what was assumed).

    python3 benchmarks/validate_external.py docs/results/external_measurements.json \\
        --out docs/results/predictor_external

Each setup is weak scaling: every GPU keeps its batch, so a configuration's step is the
compute of one GPU's batch times ``ranks x one_gpu / throughput``. Each codec row is predicted
twice: a priori (the setup's links as stated) and told the baseline's measured step
(``measured_ms``: the links' rates scaled until the baseline's row is that step). Where the
source does not state the batch, the compute time is unknown: the row is predicted at each
compute time of :data:`COMPUTE_GRID_MS` and reports the error of largest magnitude over them
(and their range). Error: predicted step over measured step, less one. Each row across hosts
also keeps the least step its stated link allows (:func:`floor_ms`): a measured step below it
was not limited by that link as stated.

The statistic covers the codec rows of the sources marked ``counted``: median and largest
absolute error with ``measured_ms``, which must stay within ``--max-median`` and
``--max-error`` (default 15% and 35%; exit status 1 otherwise). A row measured below its
floor is left out of it too: no synchronous step over the stated link carries its bytes in
that time, so the source's step overlaps what this project's does not (or its setup is not the
one stated); the statistic with those rows is reported beside it. The a priori errors, the
baselines' a priori errors and the rows not counted (an implementation unlike this project's)
are reported beside it. Outputs ``PREFIX.json`` (every row, the summary) and ``PREFIX.md``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

predictor = importlib.import_module("horovod_quant.tools.predict")

#: compute times (ms of one GPU's batch) a row whose source does not state its batch is
#: predicted at: ResNet-50 on one V100 at batch 10 to 160, a transformer's step alike
COMPUTE_GRID_MS = (25.0, 100.0, 400.0)
#: the limits with ``measured_ms``: median and largest absolute relative error
MAX_MEDIAN, MAX_ERROR = 0.15, 0.35


def _model(setup: dict) -> dict:
    return ({"model": setup["model"]} if setup.get("model") is not None
            else {"params": setup["params"]})


def measured_steps(setup: dict, compute_ms: float) -> tuple[float, dict[str, float]]:
    """The baseline's and each codec's step (ms) at ``compute_ms`` of one GPU's batch: that
    compute times the ideal throughput (ranks x one GPU's) over the measured one."""
    ideal = setup["hosts"] * setup["ranks_per_host"] * setup["one_gpu"]
    baseline = compute_ms * ideal / setup["baseline"]["throughput"]
    return baseline, {c["config"]: compute_ms * ideal / c["throughput"]
                      for c in setup["codecs"]}


def _predicted(setup: dict, compute_ms: float, predict: Callable,
               measured_ms: tuple[str, float] | None = None):
    return predict(setup["hosts"], setup["ranks_per_host"], setup.get("link_gbit"),
                   compute_ms, codecs=[c["config"] for c in setup["codecs"]],
                   intra_gbyte=setup.get("intra_gbyte"), measured_ms=measured_ms,
                   **_model(setup))


def _at(setup: dict, compute_ms: float, predict: Callable) -> dict:
    """Every figure of ``setup`` at one compute time."""
    base_ms, codec_ms = measured_steps(setup, compute_ms)
    name = setup["baseline"]["config"]
    prior = {r.name: r for r in _predicted(setup, compute_ms, predict).rows}
    fitted = _predicted(setup, compute_ms, predict, (name, base_ms))
    rows = {r.name: r for r in fitted.rows}
    return {"compute_ms": compute_ms, "baseline_ms": base_ms,
            "baseline_a_priori_ms": prior[name].step_ms,
            "baseline_plan": prior[name].plan,
            "rate_scale": fitted.calibration["rate_scale"],
            "codecs": {c: {"measured_ms": ms, "a_priori_ms": prior[c].step_ms,
                           "floor_ms": floor_ms(setup, compute_ms, prior[c].host_bytes),
                           "fitted_ms": rows[c].step_ms, "plan": rows[c].plan,
                           "a_priori_error": prior[c].step_ms / ms - 1,
                           "error": rows[c].step_ms / ms - 1}
                       for c, ms in codec_ms.items()}}


def floor_ms(setup: dict, compute_ms: float, host_bytes: float) -> float | None:
    """The least step the stated link allows a synchronous step: the forward pass (which no
    exchange overlaps) and the busiest host's bytes at the link's line rate; None on one
    host."""
    if setup["hosts"] == 1:
        return None
    forward = compute_ms * (1 - predictor.BACKWARD_SHARE)
    return forward + host_bytes * 8 / (setup["link_gbit"] * 1e9) * 1e3


def _largest(values: list[float]) -> float:
    return max(values, key=abs)


def compare(inputs: dict, predict: Callable = predictor.predict) -> list[dict]:
    """One row per codec of every setup: what was measured, predicted a priori and with the
    baseline's measured step, and the errors (module docstring)."""
    out = []
    for setup in inputs["setups"]:
        source = inputs["sources"][setup["source"]]
        stated = setup.get("compute_ms")
        grid = [stated] if stated is not None else list(COMPUTE_GRID_MS)
        runs = [_at(setup, c, predict) for c in grid]
        for codec in setup["codecs"]:
            config = codec["config"]
            each = [r["codecs"][config] for r in runs]
            errors = [e["error"] for e in each]
            priors = [e["a_priori_error"] for e in each]
            worst = runs[errors.index(_largest(errors))]
            out.append({
                "id": setup["id"], "source": setup["source"],
                "counted": bool(source["counted"]),  # and not below its floor: summarize
                "shape": f"{setup['hosts']}x{setup['ranks_per_host']}",
                "link_gbit": setup.get("link_gbit"),
                "model": setup.get("model") or f"{setup['params'] / 1e6:.0f}M",
                "config": config, "system": codec["system"],
                "baseline_system": setup["baseline"]["system"],
                "compute_ms": stated, "compute_grid_ms": None if stated else grid,
                "measured_ms": worst["codecs"][config]["measured_ms"],
                "baseline_ms": worst["baseline_ms"],
                "fitted_ms": worst["codecs"][config]["fitted_ms"],
                "plan": worst["codecs"][config]["plan"],
                "floor_ms": worst["codecs"][config]["floor_ms"],
                "below_floor": (worst["codecs"][config]["floor_ms"] or 0)
                > worst["codecs"][config]["measured_ms"],
                "rate_scale": worst["rate_scale"],
                "error": _largest(errors), "error_range": [min(errors), max(errors)],
                "a_priori_error": _largest(priors),
                "a_priori_range": [min(priors), max(priors)],
                "baseline_a_priori_error": _largest(
                    [r["baseline_a_priori_ms"] / r["baseline_ms"] - 1 for r in runs]),
                "baseline_plan": worst["baseline_plan"],
                "measured_speedup": codec["throughput"] / setup["baseline"]["throughput"],
                "fitted_speedup": worst["baseline_ms"] / worst["codecs"][config]["fitted_ms"],
            })
    return out


def _stats(errors: list[float]) -> dict:
    if not errors:
        return {"rows": 0, "median_abs_error": None, "max_abs_error": None}
    return {"rows": len(errors), "median_abs_error": statistics.median(abs(e) for e in errors),
            "max_abs_error": max(abs(e) for e in errors)}


def summarize(rows: list[dict], max_median: float = MAX_MEDIAN,
              max_error: float = MAX_ERROR) -> dict:
    """The statistic of the counted rows (with ``measured_ms`` and a priori), the same over
    every row, the rows per source, the counted rows over ``max_error``, and ``passed``."""
    counted = [r for r in rows if r["counted"] and not r["below_floor"]]
    fitted = _stats([r["error"] for r in counted])
    passed = bool(counted) and (fitted["median_abs_error"] <= max_median
                                and fitted["max_abs_error"] <= max_error)
    return {"counted": fitted, "counted_a_priori": _stats([r["a_priori_error"] for r in counted]),
            "with_below_floor": _stats([r["error"] for r in rows if r["counted"]]),
            "all": _stats([r["error"] for r in rows]),
            "all_a_priori": _stats([r["a_priori_error"] for r in rows]),
            "rows_per_source": {s: sum(r["source"] == s for r in rows)
                                for s in dict.fromkeys(r["source"] for r in rows)},
            "over_limit": [r["id"] + " " + r["config"] for r in counted
                           if abs(r["error"]) > max_error],
            "limits": {"max_median": max_median, "max_error": max_error}, "passed": passed}


def _pct(value: float) -> str:
    return f"{100 * value:+.0f}%"


def _range(pair: list[float]) -> str:
    return f"{100 * pair[0]:+.0f}% .. {100 * pair[1]:+.0f}%"


def table(rows: list[dict]) -> str:
    """The rows as Markdown: measured and predicted step, errors, plans."""
    lines = ["| setup | codec (system) | vs baseline (system) | measured ms | with measured fp32 "
             "ms | error | a priori error | baseline a priori | counted |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        compute = (f"compute {r['compute_ms']:.0f} ms" if r["compute_ms"] is not None
                   else f"compute {r['compute_grid_ms'][0]:.0f}-{r['compute_grid_ms'][-1]:.0f}"
                   " ms, worst")
        error = _pct(r["error"]) + ("" if r["compute_ms"] is not None
                                    else f" ({_range(r['error_range'])})")
        prior = (_pct(r["a_priori_error"]) if r["compute_ms"] is not None
                 else _range(r["a_priori_range"]))
        lines.append(
            f"| {r['id']} ({compute}) | `{r['config']}` ({r['system']}) | "
            f"{r['measured_speedup']:.2f}x ({r['baseline_system']}) | {r['measured_ms']:.0f} | "
            f"{r['fitted_ms']:.0f} ({r['plan']}) | {error} | {prior} | "
            f"{_pct(r['baseline_a_priori_error'])} ({r['baseline_plan']}) | "
            f"{'below floor' if r['below_floor'] else 'yes' if r['counted'] else 'no'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", help="JSON of published measurements "
                                   "(docs/results/external_measurements.json)")
    ap.add_argument("--out", default=None, help="write PREFIX.json and PREFIX.md")
    ap.add_argument("--max-median", type=float, default=MAX_MEDIAN)
    ap.add_argument("--max-error", type=float, default=MAX_ERROR)
    args = ap.parse_args(argv)
    with open(args.inputs, encoding="utf-8") as f:
        inputs = json.load(f)
    rows = compare(inputs)
    summary = summarize(rows, args.max_median, args.max_error)
    counted, prior = summary["counted"], summary["counted_a_priori"]
    with_floor = summary["with_below_floor"]
    verdict = (f"{counted['rows']} counted rows with the measured baseline step: median "
               f"absolute error {100 * counted['median_abs_error']:.0f}%, largest "
               f"{100 * counted['max_abs_error']:.0f}% (limits {100 * args.max_median:.0f}% and "
               f"{100 * args.max_error:.0f}%): {'passed' if summary['passed'] else 'failed'}"
               + (f" ({', '.join(summary['over_limit'])} over)" if summary["over_limit"] else "")
               + "." + "".join(f" {r['id']} {r['config']}: measured {r['measured_ms']:.0f}"
                               f" ms, below the {r['floor_ms']:.0f} ms its stated link"
                               " allows a synchronous step, not counted." for r in rows
                               if r["below_floor"])
               + (f" With those: median {100 * with_floor['median_abs_error']:.0f}%, largest "
                  f"{100 * with_floor['max_abs_error']:.0f}%."
                  if any(r["below_floor"] and r["counted"] for r in rows) else "")
               + f" A priori: median {100 * prior['median_abs_error']:.0f}%, largest "
               f"{100 * prior['max_abs_error']:.0f}%. Rows per source: "
               + ", ".join(f"{s} {n}" for s, n in summary["rows_per_source"].items()) + ".")
    text = table(rows) + "\n\n" + verdict
    print(text)
    if args.out:
        with open(args.out + ".json", "w", encoding="utf-8") as f:
            json.dump({"inputs": os.path.relpath(args.inputs),
                       "command": "python3 benchmarks/validate_external.py "
                                  + " ".join(argv if argv is not None else sys.argv[1:]),
                       "compute_grid_ms": list(COMPUTE_GRID_MS),
                       "summary": summary, "rows": rows}, f, indent=1)
        with open(args.out + ".md", "w", encoding="utf-8") as f:
            f.write("# The predictor against published measurements\n\n"
                    f"`{os.path.relpath(args.inputs)}`, every row's source and assumptions; "
                    "`benchmarks/validate_external.py` (its docstring: the method).\n\n"
                    + text + "\n")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
