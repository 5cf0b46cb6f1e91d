#!/usr/bin/env python3
"""Render the measured (and predicted) figures of the docs from docs/results (``PAGES``).

A table that comes from JSON follows the line ``<!-- results: NAME -->``; ``TABLES[NAME]``
renders it. A figure in running text is written ``<!-- figure: NAME -->VALUE<!-- /figure -->``
(on one line); ``FIGURES[NAME]`` renders VALUE. ``scripts/check_docs.py`` fails when a page's
table or figure differs from its rendering; ``--write`` rewrites them in place (after a
benchmark wrote new JSON).

Usage:
    python3 scripts/render_results.py            # print every table and figure
    python3 scripts/render_results.py --write    # rewrite the tables and figures of the pages
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from cluster_report import on_fp32_path, stalled  # noqa: E402 (the benchmark's own rules)

RESULTS = os.path.join(ROOT, "docs", "results")
PAGES = ["README.md", "docs/performance.md", "docs/choosing.md", "docs/scaling.md",
         "docs/will-it-pay.md", "docs/codecs.md", "docs/dev/experiments.md",
         "docs/dev/benchmarks.md"]
MARK = re.compile(r"^<!--\s*results:\s*([\w-]+)\s*-->\s*$")
FIGURE = re.compile(r"<!-- figure: ([\w-]+) -->(.*?)<!-- /figure -->")


@functools.lru_cache(maxsize=None)
def _load(name: str) -> dict:
    with open(os.path.join(RESULTS, name), encoding="utf-8") as fh:
        return json.load(fh)


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms"


def _link(name: str, label: str) -> dict:
    return next(x for x in _load(name)["links"] if x["label"] == label)


def _shared_cores_best_vs_fp32(validation: str) -> list[float]:
    """float32's measured step over the fastest codec's, per link and model, in the predictor's
    validation ``validation`` (a JSON of docs/results; ``predictor_validation_first.json``: the
    runs whose float32 rows kept Horovod's own wait) where the ranks outnumber the cores."""
    rows = _load(validation)["rows"]
    steps: dict[tuple, dict[str, float]] = {}
    for r in rows:
        if r["counted"] and int(r["shape"].split("x")[1]) > r["cores_per_host"]:
            steps.setdefault((r["shape"], r["link_gbit"], r["model"]), {})[r["config"]] = (
                r["measured_ms"])
    return [by_config["fp32"] / min(v for k, v in by_config.items() if _bits(k))
            for by_config in steps.values()]


def _range(values, fmt: str, unit: str = "") -> str:
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    return (lo if lo == hi else f"{lo}-{hi}") + unit


def _bits(config: str) -> int | None:
    """The width of a config id such as ``qsgd:8`` or ``global_qsgd-lin:4``; None for fp32/fp16."""
    return int(config.rsplit(":", 1)[1]) if ":" in config else None


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


EXCHANGE_ROWS = [("fp32", "Horovod fp32"), ("fp16", "Horovod fp16"), ("qsgd:8", "`qsgd:8`"),
                 ("global_qsgd-lin:8", "`global_qsgd` linear 8 bits"),
                 ("global_qsgd-exp:8", "`global_qsgd` exponential 8 bits"),
                 ("qsgd:4", "`qsgd:4`"), ("global_qsgd-lin:4", "`global_qsgd` linear 4 bits"),
                 ("dithered:4", "`dithered:4`")]


def exchange() -> str:
    """Exchange alone: 1 Gbit/s from cluster.json, 10 Gbit/s from cluster_10g.json."""
    cells = {}
    for fname, link in (("cluster.json", "1 Gbit/s"), ("cluster_10g.json", "10 Gbit/s")):
        summary = _load(fname)["summary"]["exchange"][link]
        fell_back = {r["id"] for r in _link(fname, link)["results"] if r.get("fallback")}
        for size in ("64.0", "256.0"):
            for config, _ in EXCHANGE_ROWS:
                row = summary[size][config]
                if f"x-{size[:-2]}MB-{config}" in fell_back:
                    text = "fp32 fallback"
                else:  # against Horovod's fp16 first, then float32
                    text = (f"{_ms(row['wall_s'])} ({row['speedup_vs_fp16']:.2f}x / "
                            f"{row['speedup_vs_fp32']:.2f}x)")
                cells[link, size, config] = text
    cols = [(link, size) for link in ("1 Gbit/s", "10 Gbit/s") for size in ("64.0", "256.0")]
    header = ["config"] + [f"{link}, {size[:-2]} MB" for link, size in cols]
    return _table(header, [[label] + [cells[link, size, config] for link, size in cols]
                           for config, label in EXCHANGE_ROWS])


TRAINING_RUNS = {"1 Gbit/s": ["cluster.json", "cluster_train_run2.json", "cluster_train_run3.json"],
                 "10 Gbit/s": ["cluster_10g.json", "cluster_10g_run2.json",
                               "cluster_10g_run3.json"]}
TRAINING_ROWS = [("fp32", "Horovod fp32"), ("fp16", "Horovod fp16"), ("qsgd:8", "`qsgd:8`"),
                 ("natural:8", "`natural:8`"), ("global_qsgd-lin:8", "`global_qsgd` linear 8 bits"),
                 ("qsgd:4", "`qsgd:4`"), ("natural:4", "`natural:4`"),
                 ("global_qsgd-lin:4", "`global_qsgd` linear 4 bits")]


def _training_medians(link: str, key: str = "speedup_vs_fp32") -> dict:
    """{config: (median of the MLP's ``key`` over the runs of ``link`` that have the config,
    whether it ran on fp32's path in every run)}."""
    runs = [_load(f) for f in TRAINING_RUNS[link]]
    tables = [r["summary"]["training"].get(link, {}).get("mlp", {}) for r in runs]
    out = {}
    for config in dict.fromkeys(c for t in tables for c in t):
        fell_back = all(any(x["id"] == f"t-mlp-{config}" and on_fp32_path(x)
                            for x in _link(f, link)["results"]) for f in TRAINING_RUNS[link])
        out[config] = (statistics.median(t[config][key] for t in tables if config in t),
                       fell_back)
    return out


def training() -> str:
    """MLP training, samples/s against Horovod's fp16 and fp32: the median over the runs that
    have the row."""
    cells = {}
    for link in TRAINING_RUNS:
        vs32, vs16 = _training_medians(link), _training_medians(link, "speedup_vs_fp16")
        for config, _ in TRAINING_ROWS:
            (ratio32, fell_back), (ratio16, _) = vs32[config], vs16[config]
            cells[link, config] = (f"{ratio16:.2f}x", f"{ratio32:.2f}x"
                                   + (" (fp32 fallback)" if fell_back else ""))
    return _table(["config", "1 Gbit/s vs fp16", "vs fp32", "10 Gbit/s vs fp16", "vs fp32"],
                  [[label, *cells["1 Gbit/s", c], *cells["10 Gbit/s", c]]
                   for c, label in TRAINING_ROWS])


TRANSPORT_FILES = ["cluster_transport_gloo.json", "cluster_transport_mpi.json"]


def transport() -> str:
    """64 MB between the 2 emulated hosts at 1 Gbit/s under each Horovod controller: transfer
    times (median) and the stalled share of the overlap probe."""
    cols = []
    for fname in TRANSPORT_FILES:
        rows = {r["id"]: r for r in _link(fname, "1 Gbit/s")["results"]}
        probe = _load(fname)["summary"]["overlap"]["1 Gbit/s"]
        cols.append([_ms(rows["p-64MB-hvd_allgather"]["wall_s"]),
                     _ms(rows["p-64MB-hq_gloo_group_concurrent"]["wall_s"]),
                     f"{stalled(probe, ''):.2f}", f"{stalled(probe, 'torch-'):.2f}"])
    labels = ["Horovod allgather", "this package's gloo group, 4 concurrent all_gathers",
              "stalled while computing: Horovod fp32 allreduce",
              "stalled while computing: 4 concurrent gloo all_gathers"]
    return _table(["transport", "gloo controller", "MPI controller"],
                  [[label] + [c[i] for c in cols] for i, label in enumerate(labels)])


DDP_ROWS = [("fp32", "none (fp32 allreduce)"), ("fp16", "DDP `fp16_compress_hook`"),
            ("powersgd-1", "DDP PowerSGD, rank 1"), ("powersgd-4", "DDP PowerSGD, rank 4"),
            ("qsgd:8", "`qsgd:8`"), ("qsgd:4", "`qsgd:4`"),
            ("global_qsgd:8", "`global_qsgd:8` (exponential)")]


def ddp() -> str:
    """DDP hooks on two emulated hosts: samples/s per link, accuracy after the run."""
    data = _load("cluster_ddp.json")
    rows = {(link["label"], r["config"]): r for link in data["links"] for r in link["rows"]}
    steps = data["steps"] + data["warmup_steps"]
    return _table(["hook", "1 Gbit/s", "10 Gbit/s", f"accuracy after {steps} steps"],
                  [[label, f"{rows['1 Gbit/s', c]['samples_per_s']:.0f}",
                    f"{rows['10 Gbit/s', c]['samples_per_s']:.0f}",
                    f"{rows['1 Gbit/s', c]['test_accuracy']:.3f}"] for c, label in DDP_ROWS])


THROUGHPUT_ROWS = [("qsgd", 8), ("qsgd", 4), ("natural", 8), ("nuqsgd", 4), ("global_qsgd", 8),
                   ("global_qsgd", 4), ("dithered", 4)]


def _throughput_rows() -> dict:
    return {(r["codec"], r["bits"]): r for r in _load("redesign_throughput_after.json")["results"]
            if r["elements"] == 1 << 24}


def throughput() -> str:
    """Encode, decode and combine GB/s at 16M elements, one core."""
    found = _throughput_rows()

    def gbps(v):
        return "-" if v is None else f"{v:.2f}"
    return _table(["codec", "bits", "wire bits/element", "encode", "decode", "combine"],
                  [[f"`{c}`", str(b), f"{found[c, b]['bits_per_element']:.2f}",
                    gbps(found[c, b]["encode_gbps"]), gbps(found[c, b]["decode_gbps"]),
                    gbps(found[c, b]["combine_gbps"])] for c, b in THROUGHPUT_ROWS])


#: (label, variance.json summary row or None, convergence label or None, stress run?)
CODEC_ROWS = [
    ("`fp16` (Horovod)", "fp16", "fp16", False),
    ("**`qsgd` 8b, max norm**", None, None, False),
    ("`qsgd` 8b, L2 norm", "qsgd 8b b512", "qsgd 8b b512", False),
    ("`natural` 8b", "natural 8b b512", "natural 8b", False),
    ("`nuqsgd` 8b", "nuqsgd 8b b512", None, False),
    ("`dithered` 8b", "dithered 8b b512", None, False),
    ("**`qsgd` 4b, max norm**", "qsgd 4b b512 max-norm", "standard_dithering 4b p=inf", False),
    ("`natural_dithering` 4b, p=inf", "natural_dithering 4b p=inf b512",
     "natural_dithering 4b p=inf", False),
    ("`nuqsgd` 4b", "nuqsgd 4b b512", "nuqsgd 4b b512", False),
    ("`dithered` 4b", "dithered 4b b512", "dithered 4b", False),
    ("`qsgd` 4b, L2 norm", "qsgd 4b b512", "qsgd 4b b512", False),
    ("`global_qsgd` linear 8b", "global_qsgd linear 8b", "global_qsgd linear 8b", False),
    ("`global_qsgd` exponential 8b", "global_qsgd exponential 8b", "global_qsgd exp 8b", False),
    ("`global_qsgd` linear 4b", None, "global_qsgd linear 4b", True),
    ("`qsgd` 2b, bucket 128", "qsgd 2b b128", "qsgd 2b b128", True),
]


def _g(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}g}"


@functools.lru_cache(maxsize=None)
def _convergence_gaps(tag: str) -> dict:
    """{(world, label): paired mean-curve loss gap to fp32}, summarized by
    benchmarks/convergence.py itself."""
    import convergence
    runs = {n: _load(f"convergence{tag}_n{n}.json") for n in (2, 4)}
    return {(n, label): row["gap_mean_curve_loss"][0]
            for n, rows in convergence.summarize(runs).items() for label, row in rows.items()}


def _variance() -> tuple[dict, dict, dict]:
    """variance.json's digits-MLP summary rows by label, the 8-bit max-norm QSGD row of the bits
    sweep, and the linear 4-bit Global-QSGD rows of the Global-QSGD sweep by world size."""
    var = _load("variance.json")["results"]
    rows = {r["label"]: r for r in var["summary"]["rows"]}
    max8 = next(x for x in var["bits"]["dists"]["gradient"]["codecs"]["qsgd (max, QSGDinf)"]
                if x["bits"] == 8)
    linear4 = {n: next(x for x in var["global"]["worlds"][str(n)]["levels"]["linear"]
                       if x["bits"] == 4) for n in (2, 4)}
    return rows, max8, linear4


def codecs() -> str:
    """choosing.md's table: variance on digits-MLP gradients (variance.json) and the paired
    change of the mean training loss (convergence_n*.json, convergence_stress_n*.json)."""
    rows, max8, linear4 = _variance()
    gaps = {False: _convergence_gaps(""), True: _convergence_gaps("_stress")}
    out = []
    for label, vrow, clabel, stress in CODEC_ROWS:
        if vrow is not None:
            r = rows[vrow]
            bits = f"{r['wire_bits_2']:.2f}"
            omega = _g(r["omega_1"]["mean"] if r.get("omega_1") else None)
            if r.get("omega_1") and r.get("omega_bound") is not None:
                omega += f" ({_g(r['omega_bound'], 3)})"
            theta = f"{_g(r['theta_2']['mean'])} / {_g(r['theta_4']['mean'])}"
            if r.get("omega_1") is None and r.get("theta_2_bound") is not None:
                theta += f" (bound {_g(r['theta_2_bound'], 3)} / {_g(r['theta_4_bound'], 3)})"
        elif clabel is None:  # 8-bit max norm: the bits table only
            bits, theta = "8.06", "-"
            omega = f"{_g(max8['omega']['mean'])} ({_g(max8['bound'], 3)})"
        else:  # linear 4-bit Global-QSGD: the Global-QSGD table only
            bits, omega = f"{linear4[2]['wire_bits']:.2f}", "-"
            theta = " / ".join(_g(linear4[n]["theta_gradient"]["mean"]) for n in (2, 4))
        loss = ("not run" if clabel is None else
                " / ".join(f"{gaps[stress][n, clabel]:+.4f}" for n in (2, 4)))
        out.append([label, bits, omega, theta, loss])
    return _table(["codec", "bits/element", "omega (bound)", "theta n=2 / n=4",
                   "Δ loss n=2 / n=4"], out)


SCALING_RUNS = ["scaling_run1.json", "scaling_run2.json", "scaling_run3.json"]


def _scaling_best(shape: dict, bits: int) -> tuple[str, dict]:
    """The hq optimizer's config of ``bits`` with the highest median speedup vs fp32."""
    configs = [c for c in shape["configs"] if _bits(c) == bits and not c.startswith("hvd.")]
    return max(((c, shape["configs"][c]) for c in configs),
               key=lambda item: item[1]["speedup_vs_fp32"])


def scaling() -> str:
    """Shapes of emulated hosts (every rank on the same 2 cores), mlp12 at 1 Gbit/s: median
    over the runs of the speedups against Horovod's fp16 and fp32, and the bytes across the
    busiest host against fp32's."""
    runs = [_load(f)["summary"] for f in SCALING_RUNS]
    rows = []
    for label in ("1 Gbit/s, 2 x 2", "1 Gbit/s, 4 x 1", "1 Gbit/s, 4 x 2"):
        shapes = [next(x for x in r["shapes"] if x["label"] == label) for r in runs]
        train = [r["training"][label]["mlp12"] for r in runs]
        cells = [label.split(", ")[1], _range([s["configs"]["fp32"]["step_s"] * 1e3
                                               for s in shapes], ".0f")]
        cells.append(_range([s["configs"]["fp16"]["step_s"] * 1e3 for s in shapes], ".0f"))
        for bits in (8, 4):
            config, _ = _scaling_best(
                {"configs": {c: {"speedup_vs_fp32": statistics.median(
                    t[c]["speedup_vs_fp32"] for t in train if c in t)} for c in train[0]}},
                bits)
            vs16 = statistics.median(t[config]["speedup_vs_fp16"] for t in train)
            vs32 = statistics.median(t[config]["speedup_vs_fp32"] for t in train)
            share = statistics.median(s["configs"][config]["nic_vs_fp32"] for s in shapes)
            cells += [f"{vs16:.2f}x / {vs32:.2f}x (`{config}`)", f"{share:.2f}"]
        rows.append(cells)
    return _table(["shape", "fp32 ms/step", "fp16 ms/step", "best 8-bit vs fp16 / fp32",
                   "8-bit bytes / fp32's", "best 4-bit vs fp16 / fp32", "4-bit bytes / fp32's"],
                  rows)


def prediction() -> str:
    """The predictor's rows of docs/results/predict_resnet50_8x8_25g.json."""
    rows = _load("predict_resnet50_8x8_25g.json")["rows"]
    names = {"fp32": "float32 allreduce", "fp16": "16-bit allreduce"}
    return _table(["config", "plan", "busiest host's MB/step", "step ms",
                   "vs best baseline", "vs 16-bit", "vs fp32"],
                  [[names.get(r["name"], f"`{r['name']}`"), r["plan"],
                    f"{r['host_bytes'] / 1e6:.1f}", f"{r['step_ms']:.1f}",
                    f"{r['vs_best']:.2f}x", f"{r['vs_fp16']:.2f}x", f"{r['vs_fp32']:.2f}x"]
                   for r in rows])


def _best_baseline(name: str) -> str:
    """A prediction's best baseline in words: its name, plan and step."""
    best = _load(name)["best_baseline"]
    words = {"fp32": "float32", "fp16": "16-bit"}[best["name"]]
    return f"{words} by {best['plan']}, {best['step_ms']:.1f} ms"


def external() -> str:
    """The predictor against published measurements (predictor_external.json), per source:
    codec rows, how many count (a counted source's rows but those measured below their link's
    floor), median / largest absolute error told the baseline's measured step, and a priori
    (the range over the compute times where the batch is not stated)."""
    data = _load("predictor_external.json")
    sources = _load("external_measurements.json")["sources"]
    rows = []
    for source in dict.fromkeys(r["source"] for r in data["rows"]):
        mine = [r for r in data["rows"] if r["source"] == source]
        fitted = [abs(r["error"]) for r in mine]
        prior = [abs(v) for r in mine for v in (r["a_priori_range"] if r["compute_ms"] is None
                                                else [r["a_priori_error"]])]
        counted = sum(r["counted"] and not r["below_floor"] for r in mine)
        rows.append([sources[source]["title"].split(":")[0], str(len(mine)), str(counted),
                     f"{100 * statistics.median(fitted):.0f}% / {100 * max(fitted):.0f}%",
                     f"{100 * min(prior):.0f}-{100 * max(prior):.0f}%"])
    return _table(["source", "codec rows", "counted", "measured fp32 given: median / max",
                   "a priori"], rows)


#: (task of benchmarks/convergence.py --task, what its table calls it)
ACCURACY_TASKS = [("cnn", "digits CNN, Δ test loss"), ("bytelm", "byte LM, Δ val loss")]
#: (convergence label, what the table calls it)
ACCURACY_ROWS = [("fp16", "`fp16` (Horovod)"), ("qsgd 8b b512 max", "**`qsgd(bits=8)`**"),
                 ("qsgd 4b b512 max", "**`qsgd(bits=4)`**"),
                 ("global_qsgd exp 8b", "`global_qsgd(bits=8)` (exponential)")]


@functools.lru_cache(maxsize=None)
def _accuracy(task: str) -> dict:
    """{world: benchmarks/convergence.py's summary rows} of ``convergence_<task>_n<N>.json``."""
    import convergence
    return convergence.summarize({n: _load(f"convergence_{task}_n{n}.json") for n in (2, 4)})


def _accuracy_gap(task: str, n: int, label: str) -> str:
    """The paired gap of the final test (validation) loss to fp32, mean ± std over seeds."""
    row = _accuracy(task)[n].get(label)
    if row is None:
        return "not run"
    mean, std = row["gap_test_loss"]
    return f"{mean:+.4f} ± {std:.4f}" if row["seeds"] > 1 else f"{mean:+.4f} (1 seed)"


def accuracy() -> str:
    """dev/experiments.md's table: the final test/validation loss of the README's codecs minus
    float32's on the same seed (convergence_cnn_n*.json, convergence_bytelm_n*.json)."""
    cells = [(t, n) for t, _ in ACCURACY_TASKS for n in (2, 4)]
    head = ["codec", "fewer bytes (CNN / LM)"] + [f"{name}, n={n}" for _, name in ACCURACY_TASKS
                                                  for n in (2, 4)]
    rows = [["fp32: final loss, mean (std) over seeds", "1x / 1x"]
            + ["{:.4f} ({:.4f})".format(*_accuracy(t)[n]["fp32"]["test_loss"]) for t, n in cells]]
    for label, name in ACCURACY_ROWS:
        ratio = " / ".join(f"{r['raw_bytes_per_step'] / r['bytes_per_step']:.1f}x" for r in
                           (_accuracy(t)[2][label] for t, _ in ACCURACY_TASKS))
        rows.append([name, ratio] + [_accuracy_gap(t, n, label) for t, n in cells])
    rows.append(["seeds", "-"] + [str(_accuracy(t)[n]["fp32"]["seeds"]) for t, n in cells])
    return _table(head, rows)


#: (benchmarks/plateau.py label, what the table calls it)
PLATEAU_ROWS = [("bf16", "`bf16`"), ("qsgd 8b", "`qsgd(bits=8)`"), ("qsgd 4b", "`qsgd(bits=4)`"),
                ("global-qsgd exp 8b", "`global_qsgd(bits=8)`"),
                ("global-qsgd lin 8b", "`global_qsgd(bits=8, levels=\"linear\")`"),
                ("natural dithering 4b", "`natural_dithering(bits=4)`"),
                ("ndqsg", "`nested_dithered()`")]


def _plateau_columns() -> list[tuple[str, tuple[int, int]]]:
    """(optimizer, world) of every column the plateau runs fill, in the study's order."""
    import plateau as study
    rows = _load("plateau.json")["rows"]
    return [(opt, w) for opt in study.OPTIMIZERS for w in study.WORLDS
            if any(r["optimizer"] == opt and (r["workers"], r["hosts"]) == w for r in rows)]


def _plateau_gap(optimizer: str, world: tuple[int, int], label: str) -> str:
    """A codec's paired final-loss gap to float32, mean ± sd over seeds (benchmarks/plateau.py)."""
    import plateau_report
    gaps = plateau_report.paired_gaps(_load("plateau.json")["rows"], optimizer, label, world)
    if gaps and not all(math.isfinite(g) for g in gaps):
        return "diverged"
    return plateau_report.format_gaps(gaps)


def _plateau_fp32_sd(optimizer: str, world: tuple[int, int]) -> str:
    """float32's final-loss sd over seeds (plateau.json)."""
    import plateau_report
    finals = [plateau_report.final_loss(r) for r in _load("plateau.json")["rows"]
              if r["codec"] == "fp32" and r["optimizer"] == optimizer
              and (r["workers"], r["hosts"]) == world]
    return f"{statistics.stdev(finals):.4f}" if len(finals) > 1 else "not measured (1 seed)"


def plateau() -> str:
    """choosing.md's table: every codec's final validation loss minus float32's of the same seed,
    per optimizer and world (plateau.json); float32's own final loss and spread first."""
    import plateau_report
    rows = _load("plateau.json")["rows"]
    columns = _plateau_columns()
    head = ["codec"] + [f"{opt}, {plateau_report.world_name(w)}" for opt, w in columns]
    first = ["fp32: final loss (sd), seeds"]
    for opt, w in columns:
        finals = [plateau_report.final_loss(r) for r in rows if r["codec"] == "fp32"
                  and r["optimizer"] == opt and (r["workers"], r["hosts"]) == w]
        sd = f" ({statistics.stdev(finals):.4f})" if len(finals) > 1 else ""
        first.append(f"{statistics.mean(finals):.4f}{sd}, {len(finals)}" if finals else "-")
    return _table(head, [first] + [[name] + [_plateau_gap(opt, w, label) for opt, w in columns]
                                   for label, name in PLATEAU_ROWS])


def validation() -> str:
    """The predictor's validation (predictor_validation.json) per shape and link: the counted
    rows' median and largest absolute error, and how many there are (each link by the rate
    the ranks were told)."""
    cells: dict[tuple[str, float], list[float]] = {}
    for r in _load("predictor_validation.json")["rows"]:
        if r["counted"]:
            cells.setdefault((r["shape"], r["link_told_gbit"]), []).append(abs(r["error"]))
    links = sorted({gbit for _, gbit in cells})
    shapes = list(dict.fromkeys(shape for shape, _ in cells))

    def cell(errors: list[float] | None) -> str:
        return "-" if not errors else (f"{100 * statistics.median(errors):.0f}% / "
                                       f"{100 * max(errors):.0f}% ({len(errors)})")

    return _table(["hosts x ranks"] + [f"{g:g} Gbit/s" for g in links],
                  [[shape.replace("x", " x ")] + [cell(cells.get((shape, g))) for g in links]
                   for shape in shapes])


def fractions() -> str:
    """Every codec's limit over its step at one rank per core (step_fractions.json), 8 / 4 bits,
    the three doors side by side; 16-bit: Horovod's fp16 allreduce and DDP's fp16 hook."""
    doors = _load("step_fractions.json")["doors"]
    cells = {d: {r["config"]: r["fraction"] for r in door["rows"]} for d, door in doors.items()}
    codecs = list(dict.fromkeys(c.rsplit(":", 1)[0] for d in cells for c in cells[d] if ":" in c))

    def pair(door: dict, codec: str) -> str:
        return "/".join(f"{door[f'{codec}:{b}']:.2f}" if f"{codec}:{b}" in door else "-"
                          for b in (8, 4))

    return _table(["codec (8/4 bits)"] + list(doors),
                  [["16-bit"] + [f"{cells[d]['fp16']:.2f}" for d in doors]]
                  + [[f"`{c}`"] + [pair(cells[d], c) for d in doors] for c in codecs])


TABLES = {"exchange": exchange, "training": training, "transport": transport, "ddp": ddp,
          "throughput": throughput, "codecs": codecs, "scaling": scaling,
          "prediction": prediction, "accuracy": accuracy, "validation": validation,
          "external": external, "plateau": plateau, "fractions": fractions}


def _exchange_256mb(name: str, bits: int) -> str:
    """The range of the 256 MB exchange times at 1 Gbit/s of the configs of one width."""
    found = _load(name)["summary"]["exchange"]["1 Gbit/s"]["256.0"]
    return _range([r["wall_s"] * 1e3 for c, r in found.items() if _bits(c) == bits], ".0f", " ms")


def _gloo_training(bits: int) -> str:
    found = _load("cluster_gloo.json")["summary"]["training"]["1 Gbit/s"]["mlp"]
    return _range([r["speedup_vs_fp32"] for c, r in found.items() if _bits(c) == bits], ".2f", "x")


def _wire_overhead() -> str:
    """How far the slowest 256 MB exchange of a codec is above its payload's time on the wire
    at the measured rate (the benchmark's own target rows)."""
    worst = max(t["range"][1] for t in _load("cluster.json")["summary"]["targets"]
                if "payload wire time" in t["target"])
    return f"{(worst - 1) * 100:.0f}%"


def _fp32_step() -> str:
    steps = [next(r for r in _link(f, "1 Gbit/s")["results"] if r["id"] == "t-mlp-fp32")["step_s"]
             for f in TRAINING_RUNS["1 Gbit/s"]]
    return f"{statistics.median(steps):.1f} s"


def _on_fp32_10g() -> dict:
    return {c: m for c, (m, fell_back) in _training_medians("10 Gbit/s").items() if fell_back}


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _omega(label: str) -> float:
    return _variance()[0][label]["omega_1"]["mean"]



#: measured figures of the pages' running text, each rendered from the JSON
FIGURES = {
    "link-rates": lambda: " and ".join(
        f"{_link(f, link)['calibration']['tcp_gbit_s']:.2f}"
        for f, link in (("cluster.json", "1 Gbit/s"), ("cluster_10g.json", "10 Gbit/s"))),
    "exchange-256MB-8bit": lambda: _exchange_256mb("cluster.json", 8),
    "exchange-256MB-4bit": lambda: _exchange_256mb("cluster.json", 4),
    "wire-overhead": _wire_overhead,
    "fp32-step": _fp32_step,
    "training-vs-fp16": lambda: _range(
        [m for c, (m, _) in _training_medians("1 Gbit/s", "speedup_vs_fp16").items()
         if c in dict(TRAINING_ROWS) and c not in ("fp16", "fp32")], ".2f", "x"),
    "on-fp32-10g-configs": lambda: _and([f"`{c}`" for c in _on_fp32_10g()]),
    "on-fp32-10g-ratios": lambda: _range(_on_fp32_10g().values(), ".2f", "x"),
    "fp32-vs-fp32-10g": lambda: _range(
        [_load(f)["summary"]["training"]["10 Gbit/s"]["mlp"]["fp32"]["speedup_vs_fp32"]
         for f in TRAINING_RUNS["10 Gbit/s"]], ".2f", "x"),
    "gloo-training-8bit": lambda: _gloo_training(8),
    "gloo-training-4bit": lambda: _gloo_training(4),
    "gloo-exchange-256MB-8bit": lambda: _exchange_256mb("cluster_gloo.json", 8),
    "gloo-exchange-256MB-4bit": lambda: _exchange_256mb("cluster_gloo.json", 4),
    "throughput-load": lambda: format(float(
        _load("redesign_throughput_after.json")["env"]["load_average"].split()[0]), ".1f"),
    "encode-gbps": lambda: _range([_throughput_rows()[k]["encode_gbps"] for k in THROUGHPUT_ROWS],
                                  ".0f", " GB/s"),
    "decode-gbps": lambda: _range([_throughput_rows()[k]["decode_gbps"] for k in THROUGHPUT_ROWS],
                                  ".0f", " GB/s"),
    "combine-gbps": lambda: _range([_throughput_rows()[k]["combine_gbps"]
                                    for k in THROUGHPUT_ROWS
                                    if _throughput_rows()[k]["combine_gbps"]], ".1f", " GB/s"),
    "prediction-best-vs-baseline": lambda: format(100 * (max(
        r["vs_best"] for r in _load("predict_resnet50_8x8_25g.json")["rows"]) - 1), ".0f") + "%",
    "prediction-best-baseline": lambda: _best_baseline("predict_resnet50_8x8_25g.json"),
    "external-median": lambda: format(
        100 * _load("predictor_external.json")["summary"]["counted"]["median_abs_error"],
        ".0f") + "%",
    "external-max": lambda: format(
        100 * _load("predictor_external.json")["summary"]["counted"]["max_abs_error"],
        ".0f") + "%",
    "external-below-floor": lambda: "; ".join(
        f"{r['measured_ms']:.0f} ms, below the {r['floor_ms']:.0f} ms"
        for r in _load("predictor_external.json")["rows"] if r["below_floor"]),
    "external-a-priori-median": lambda: format(100 * _load("predictor_external.json")[
        "summary"]["counted_a_priori"]["median_abs_error"], ".0f") + "%",
    "external-a-priori-max": lambda: format(100 * _load("predictor_external.json")[
        "summary"]["counted_a_priori"]["max_abs_error"], ".0f") + "%",
    "validation-median": lambda: format(
        100 * _load("predictor_validation.json")["summary"]["median_abs_error"], ".0f") + "%",
    "validation-max": lambda: format(
        100 * _load("predictor_validation.json")["summary"]["max_abs_error"], ".0f") + "%",
    "shared-cores-best-vs-fp32": lambda: _range(
        _shared_cores_best_vs_fp32("predictor_validation.json"), ".2f", "x"),
    "shared-cores-best-vs-fp32-epyc": lambda: _range(
        _shared_cores_best_vs_fp32("predictor_validation_epyc.json"), ".2f", "x"),
    "shared-cores-best-vs-fp32-first": lambda: _range(
        _shared_cores_best_vs_fp32("predictor_validation_first.json"), ".2f", "x"),
    "l2-over-max-4": lambda: f"{_omega('qsgd 4b b512') / _omega('qsgd 4b b512 max-norm'):.0f}x",
    "bound-qsgd-4-max": lambda: _g(_variance()[0]["qsgd 4b b512 max-norm"]["omega_bound"], 3),
    "bound-over-omega-qsgd-4-max": lambda: format(
        _variance()[0]["qsgd 4b b512 max-norm"]["omega_bound"] / _omega("qsgd 4b b512 max-norm"),
        ".0f") + "x",
    "plateau-fp32-sd-4": lambda: _plateau_fp32_sd("adamw", (4, 1)),
    "plateau-qsgd8-4": lambda: _plateau_gap("adamw", (4, 1), "qsgd 8b"),
    "plateau-qsgd4-4": lambda: _plateau_gap("adamw", (4, 1), "qsgd 4b"),
    "plateau-qsgd8-64": lambda: _plateau_gap("adamw", (64, 1), "qsgd 8b"),
    "plateau-qsgd4-64": lambda: _plateau_gap("adamw", (64, 1), "qsgd 4b"),
    "plateau-natural4-64": lambda: _plateau_gap("adamw", (64, 1), "natural dithering 4b"),
    "plateau-exp8-4": lambda: _plateau_gap("adamw", (4, 1), "global-qsgd exp 8b"),
    "plateau-exp8-16": lambda: _plateau_gap("adamw", (16, 1), "global-qsgd exp 8b"),
    "plateau-exp8-64": lambda: _plateau_gap("adamw", (64, 1), "global-qsgd exp 8b"),
    "plateau-lin8-16": lambda: _plateau_gap("adamw", (16, 1), "global-qsgd lin 8b"),
    "plateau-lin8-4x4": lambda: _plateau_gap("adamw", (16, 4), "global-qsgd lin 8b"),
    "plateau-bf16-64": lambda: _plateau_gap("adamw", (64, 1), "bf16"),
}


def page_tables(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, end line) of each marked table of a page (0-based, end exclusive)."""
    lines, out = text.split("\n"), []
    for i, line in enumerate(lines):
        m = MARK.match(line)
        if m:
            j = i + 1
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            out.append((m.group(1), i + 1, j))
    return out


def check_page(path: str, root: str = ROOT, tables: dict | None = None,
               figures: dict | None = None) -> list[str]:
    """Problems: a marked table or figure that differs from its rendering, or an unknown name."""
    tables = TABLES if tables is None else tables
    figures = FIGURES if figures is None else figures
    with open(os.path.join(root, path), encoding="utf-8") as fh:
        text = fh.read()
    lines, problems = text.split("\n"), []
    for number, line in enumerate(lines, 1):
        for m in FIGURE.finditer(line):
            name, value = m.groups()
            if name not in figures:
                problems.append(f"{path}:{number}: no figure named {name!r} in "
                                "scripts/render_results.py")
            elif value != figures[name]():
                problems.append(f"{path}:{number}: figure {name!r} reads {value!r}, its JSON "
                                f"gives {figures[name]()!r} (python3 scripts/render_results.py "
                                "--write)")
    for name, start, end in page_tables(text):
        if name not in tables:
            problems.append(f"{path}:{start}: no table named {name!r} in scripts/render_results.py")
            continue
        want = tables[name]()
        if "\n".join(lines[start:end]) != want:
            got = {line for line in lines[start:end]}
            first = next((w for w in want.split("\n") if w not in got), "(rows missing)")
            problems.append(f"{path}:{start}: table {name!r} differs from its JSON "
                            f"(python3 scripts/render_results.py --write); expected row: {first}")
    return problems


def write_page(path: str) -> None:
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    for name, start, end in reversed(page_tables("\n".join(lines))):
        lines[start:end] = TABLES[name]().split("\n")
    text = FIGURE.sub(lambda m: f"<!-- figure: {m[1]} -->{FIGURES[m[1]]()}<!-- /figure -->",
                      "\n".join(lines))
    with open(os.path.join(ROOT, path), "w", encoding="utf-8") as fh:
        fh.write(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true",
                    help="rewrite the marked tables and figures of the pages")
    args = ap.parse_args(argv)
    if args.write:
        for page in PAGES:
            write_page(page)
        return 0
    for name, render in TABLES.items():
        print(f"<!-- results: {name} -->\n{render()}\n")
    for name, render in FIGURES.items():
        print(f"<!-- figure: {name} -->{render()}<!-- /figure -->")
    return 0


if __name__ == "__main__":
    sys.exit(main())
