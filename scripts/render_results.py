#!/usr/bin/env python3
"""Render the tables of docs/performance.md and docs/choosing.md from the JSON in docs/results.

A table that comes from JSON follows the line ``<!-- results: NAME -->``; ``TABLES[NAME]``
renders it. ``scripts/check_docs.py`` fails when a page's table differs from its rendering;
``--write`` rewrites the tables in place (after a benchmark wrote new JSON).

Usage:
    python3 scripts/render_results.py            # print every table
    python3 scripts/render_results.py --write    # rewrite the tables of the pages
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from cluster_report import on_fp32_path  # noqa: E402 (the benchmark's own rule)

RESULTS = os.path.join(ROOT, "docs", "results")
PAGES = ["docs/performance.md", "docs/choosing.md"]
MARK = re.compile(r"^<!--\s*results:\s*([\w-]+)\s*-->\s*$")


def _load(name: str) -> dict:
    with open(os.path.join(RESULTS, name), encoding="utf-8") as fh:
        return json.load(fh)


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms"


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
        data = _load(fname)
        summary = data["summary"]["exchange"][link]
        results = next(x["results"] for x in data["links"] if x["label"] == link)
        fell_back = {r["id"] for r in results if r.get("fallback")}
        for size in ("64.0", "256.0"):
            for config, _ in EXCHANGE_ROWS:
                row = summary[size][config]
                if f"x-{size[:-2]}MB-{config}" in fell_back:
                    text = "fp32 fallback"
                elif config == "fp32":
                    text = _ms(row["wall_s"])
                else:
                    text = f"{_ms(row['wall_s'])} ({row['speedup_vs_fp32']:.2f}x)"
                cells[link, size, config] = text
    cols = [(link, size) for link in ("1 Gbit/s", "10 Gbit/s") for size in ("64.0", "256.0")]
    header = ["config"] + [f"{link}, {size[:-2]} MB" for link, size in cols]
    return _table(header, [[label] + [cells[link, size, config] for link, size in cols]
                           for config, label in EXCHANGE_ROWS])


TRAINING_RUNS = {"1 Gbit/s": ["cluster.json", "cluster_train_run2.json", "cluster_train_run3.json"],
                 "10 Gbit/s": ["cluster_10g.json", "cluster_10g_run2.json",
                               "cluster_10g_run3.json"]}
TRAINING_ROWS = [("fp16", "Horovod fp16"), ("qsgd:8", "`qsgd:8`"), ("natural:8", "`natural:8`"),
                 ("global_qsgd-lin:8", "`global_qsgd` linear 8 bits"), ("qsgd:4", "`qsgd:4`"),
                 ("natural:4", "`natural:4`"), ("global_qsgd-lin:4", "`global_qsgd` linear 4 bits")]


def training() -> str:
    """MLP training, samples/s against fp32: the median over the runs that have the row."""
    cells = {}
    for link, files in TRAINING_RUNS.items():
        runs = [_load(f) for f in files]
        for config, _ in TRAINING_ROWS:
            ratios = [r["summary"]["training"][link]["mlp"][config]["speedup_vs_fp32"]
                      for r in runs if config in r["summary"]["training"].get(link, {}).get(
                          "mlp", {})]
            fell_back = all(any(x["id"] == f"t-mlp-{config}" and on_fp32_path(x)
                                for x in next(k["results"] for k in r["links"]
                                              if k["label"] == link)) for r in runs)
            cells[link, config] = (f"{statistics.median(ratios):.2f}x"
                                   + (" (fp32 fallback)" if fell_back else ""))
    return _table(["config", "1 Gbit/s", "10 Gbit/s"],
                  [[label, cells["1 Gbit/s", c], cells["10 Gbit/s", c]]
                   for c, label in TRAINING_ROWS])


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


def throughput() -> str:
    """Encode, decode and combine GB/s at 16M elements, one core."""
    found = {(r["codec"], r["bits"]): r for r in _load("redesign_throughput_after.json")["results"]
             if r["elements"] == 1 << 24}

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


def _convergence_gaps(tag: str) -> dict:
    """{(world, label): paired mean-curve loss gap to fp32}, summarized by
    benchmarks/convergence.py itself."""
    import convergence
    runs = {n: _load(f"convergence{tag}_n{n}.json") for n in (2, 4)}
    return {(n, label): row["gap_mean_curve_loss"][0]
            for n, rows in convergence.summarize(runs).items() for label, row in rows.items()}


def codecs() -> str:
    """choosing.md's table: variance on digits-MLP gradients (variance.json) and the paired
    change of the mean training loss (convergence_n*.json, convergence_stress_n*.json)."""
    var = _load("variance.json")["results"]
    rows = {r["label"]: r for r in var["summary"]["rows"]}
    max8 = next(x for x in var["bits"]["dists"]["gradient"]["codecs"]["qsgd (max, QSGDinf)"]
                if x["bits"] == 8)
    linear4 = {n: next(x for x in var["global"]["worlds"][str(n)]["levels"]["linear"]
                       if x["bits"] == 4) for n in (2, 4)}
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


TABLES = {"exchange": exchange, "training": training, "ddp": ddp, "throughput": throughput,
          "codecs": codecs}


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


def check_page(path: str, root: str = ROOT, tables: dict | None = None) -> list[str]:
    """Problems: a marked table that differs from its rendering, or an unknown name."""
    tables = TABLES if tables is None else tables
    with open(os.path.join(root, path), encoding="utf-8") as fh:
        text = fh.read()
    lines, problems = text.split("\n"), []
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
    with open(os.path.join(ROOT, path), "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite the marked tables of the pages")
    args = ap.parse_args(argv)
    if args.write:
        for page in PAGES:
            write_page(page)
        return 0
    for name, render in TABLES.items():
        print(f"<!-- results: {name} -->\n{render()}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
