"""Tables and curves of benchmarks/plateau.py's runs (``plateau.jsonl``).

Writes ``plateau.md`` (float32's plateau per world; every codec's final validation loss and its
gap to float32 paired by seed, with the seed spread; steps to come within 1 % of float32's
final loss; divergence and growing-gap flags; Global-QSGD's levels per world) and one
``plateau_<optimizer>.png`` per optimizer (validation loss against steps and its gap to
float32, a column per world, mean over seeds), next to the JSON lines.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import warnings

from plateau import CODECS, EVAL_EVERY, WORLDS, build_codec

#: a run's final loss: the mean of its last this many evaluations
FINAL_EVALUATIONS = 5
#: a codec's final loss counts as float32's within this fraction of it
REACH_TOLERANCE = 0.01
#: a gap that grows by more than this (nats/byte) between float32's plateau and the end is
#: flagged as growing
GROWING_GAP = 0.02


def final_loss(row: dict) -> float:
    """A run's final validation loss: the mean of its last :data:`FINAL_EVALUATIONS`
    evaluations (one evaluation moves by about 0.01 nats/byte from the next), non-finite where
    the run diverged."""
    if row["diverged"]:
        return math.inf
    return statistics.mean(c[1] for c in row["curve"][-FINAL_EVALUATIONS:])


def paired_gaps(rows: list[dict], optimizer: str, label: str, world: tuple[int, int]
                ) -> list[float]:
    """``label``'s :func:`final_loss` minus float32's, per seed both ran (float32 not
    diverged)."""
    runs = {(r["codec"], r["seed"]): r for r in rows
            if r["optimizer"] == optimizer and _world(r) == world}
    return [final_loss(r) - final_loss(runs[("fp32", seed)])
            for (codec, seed), r in sorted(runs.items(), key=lambda kv: kv[0][1])
            if codec == label and ("fp32", seed) in runs and not runs[("fp32", seed)]["diverged"]]


def _world(row: dict) -> tuple[int, int]:
    return row["workers"], row["hosts"]


def world_name(world: tuple[int, int]) -> str:
    workers, hosts = world
    return f"{workers}" if hosts == 1 else f"{workers} = {hosts} hosts x {workers // hosts}"


def _mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    lost = sum(not math.isfinite(v) for v in values)
    if lost:
        return f"non-finite in {lost} of {len(values)} seeds"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def format_gaps(values: list[float]) -> str:
    """Paired gaps as ``+mean ± sd`` (the mean alone for one seed; '-' for none)."""
    if not values or not all(math.isfinite(v) for v in values):
        return "-"
    mean = f"{statistics.mean(values):+.4f}".replace("-0.0000", "+0.0000")
    return mean + (f" ± {statistics.stdev(values):.4f}" if len(values) > 1 else "")


def _val_at(curve: list[list[float]], step: int) -> float:
    return next((c[1] for c in curve if c[0] >= step), curve[-1][1])


def _window_to(curve: list[list[float]], step: int) -> float:
    """The mean validation loss of the :data:`FINAL_EVALUATIONS` evaluations up to ``step``
    that precede the final ones (:func:`final_loss`'s)."""
    earlier = [c[1] for c in curve[:-FINAL_EVALUATIONS] if c[0] <= step][-FINAL_EVALUATIONS:]
    return statistics.mean(earlier) if earlier else curve[0][1]


def steps_to_reach(curve: list[list[float]], target: float) -> int | None:
    """The first evaluated step whose validation loss is within :data:`REACH_TOLERANCE` of
    ``target``, or None."""
    return next((c[0] for c in curve if math.isfinite(c[1])
                 and c[1] <= target * (1 + REACH_TOLERANCE)), None)


def codec_levels(label: str, world: tuple[int, int]) -> str:
    """The levels a summed codec keeps in ``world`` (a hierarchical world sums one payload per
    host), or '' for a codec without ``num_levels``."""
    workers, hosts = world
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        codec = build_codec(label, workers)
        if hosts > 1 and codec.needs_world_size:
            codec = codec.for_world_size(hosts)
    levels = codec.params.get("num_levels")
    return "" if levels is None or not codec.needs_world_size else str(levels)


def optimizer_tables(rows: list[dict], optimizer: str) -> list[str]:
    """The markdown of one optimizer's runs."""
    runs = {(r["codec"], _world(r), r["seed"]): r for r in rows if r["optimizer"] == optimizer}
    worlds = [w for w in WORLDS if any(k[1] == w for k in runs)]
    codecs = [c for c in CODECS if any(k[0] == c for k in runs)]
    if not worlds:
        return []
    out = [f"### {optimizer} (learning rate {next(iter(runs.values()))['lr']:g})", ""]
    out += ["float32's plateau (the first evaluation within 1 % of its best validation loss), "
            "mean over seeds:", "",
            "| workers | seeds | plateau step | val loss there | best val loss | final val loss* "
            "| final train loss | next-byte acc | steps |",
            "|---|---|---|---|---|---|---|---|---|"]
    for w in worlds:
        base = [r for (c, rw, _), r in runs.items() if c == "fp32" and rw == w]
        if base:
            out.append(
                f"| {world_name(w)} | {len(base)} "
                f"| {statistics.mean(r['plateau_step'] for r in base):.0f} "
                f"| {_mean_sd([_val_at(r['curve'], r['plateau_step']) for r in base])} "
                f"| {_mean_sd([r['best_val_loss'] for r in base])} "
                f"| {_mean_sd([final_loss(r) for r in base])} "
                f"| {_mean_sd([r['train_loss'] for r in base])} "
                f"| {statistics.mean(r['val_acc'] for r in base):.3f} | {base[0]['steps']} |")
    out += ["", "\\* final: the mean of the last "
            f"{FINAL_EVALUATIONS} evaluations (the last {FINAL_EVALUATIONS - 1} x {EVAL_EVERY} "
            "steps).", "",
            "Final validation loss (nats/byte; mean ± sample sd over seeds) and its gap to "
            "float32 of the same seed (paired; ± its sd). Flags: **diverged** (a non-finite "
            "loss), **growing** (the gap grew by more than "
            f"{GROWING_GAP} nats/byte from the {FINAL_EVALUATIONS} evaluations up to float32's "
            "plateau, before the final ones, to the final ones), **spread** (the "
            "gap exceeds twice the seed spread of float32's final loss, or 0.01 nats/byte where "
            "one seed ran).", ""]
    out += ["| codec | " + " | ".join(world_name(w) for w in worlds) + " |",
            "|---|" + "---|" * len(worlds)]
    for label in codecs:
        cells = []
        for w in worlds:
            mine = {s: r for (c, rw, s), r in runs.items() if c == label and rw == w}
            base = {s: r for (c, rw, s), r in runs.items() if c == "fp32" and rw == w}
            if not mine:
                cells.append("-")
                continue
            cell = _mean_sd([final_loss(r) for r in mine.values()])
            paired = [s for s in mine if s in base and not base[s]["diverged"]]
            if label != "fp32" and paired:
                gaps = paired_gaps(rows, optimizer, label, w)
                cell += f" ({format_gaps(gaps)})"
                flags = _flags(mine, base, paired, gaps)
                cell += "".join(f" **{f}**" for f in flags)
            elif any(r["diverged"] for r in mine.values()):
                cell += " **diverged**"
            levels = codec_levels(label, w)
            cells.append(cell + (f" [{levels} levels]" if levels else ""))
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    out += ["", "Steps until the validation loss is within 1 % of float32's final loss of the "
            "same seed (mean over seeds; 'never' where a seed did not get there):", "",
            "| codec | " + " | ".join(world_name(w) for w in worlds) + " |",
            "|---|" + "---|" * len(worlds)]
    for label in codecs:
        cells = []
        for w in worlds:
            reached = []
            for (c, rw, s), r in runs.items():
                base = runs.get(("fp32", w, s))
                if c == label and rw == w and base:
                    reached.append(steps_to_reach(r["curve"], final_loss(base)))
            cells.append("-" if not reached else "never" if None in reached
                         else f"{statistics.mean(reached):.0f}")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out + [""]


def _flags(mine: dict, base: dict, paired: list[int], gaps: list[float]) -> list[str]:
    if any(mine[s]["diverged"] for s in paired):
        return ["diverged"]
    flags = []
    grown = [(final_loss(mine[s]) - final_loss(base[s]))
             - (_window_to(mine[s]["curve"], base[s]["plateau_step"])
                - _window_to(base[s]["curve"], base[s]["plateau_step"])) for s in paired]
    if statistics.mean(grown) > GROWING_GAP:
        flags.append("growing")
    finals = [final_loss(base[s]) for s in paired]
    spread = 2 * statistics.stdev(finals) if len(finals) > 1 else 0.01
    if statistics.mean(gaps) > spread:
        flags.append("spread")
    return flags


def plot(rows: list[dict], optimizer: str, path: str) -> None:
    """One column per world: validation loss against steps (top) and its gap to float32 of
    the same seed (bottom), each the mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = [r for r in rows if r["optimizer"] == optimizer]
    worlds = [w for w in WORLDS if any(_world(r) == w for r in mine)]
    if not worlds:
        return
    colors = dict(zip(CODECS, ["black"] + [f"C{i}" for i in range(len(CODECS))]))
    fig, axes = plt.subplots(2, len(worlds), figsize=(4.2 * len(worlds), 6.4), squeeze=False,
                             sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for column, w in enumerate(worlds):
        runs = {(r["codec"], r["seed"]): r for r in mine if _world(r) == w}
        top, bottom = axes[0][column], axes[1][column]
        floor = math.inf
        for label in CODECS:
            curves = [r["curve"] for (c, _), r in runs.items() if c == label]
            if not curves:
                continue
            length = min(len(c) for c in curves)
            steps = [c[0] for c in curves[0][:length]]
            mean = [statistics.mean(c[i][1] for c in curves) for i in range(length)]
            floor = min([floor] + [v for v in mean if math.isfinite(v)])
            width = 2.2 if label == "fp32" else 1.1
            top.plot(steps, mean, label=label, lw=width, color=colors[label])
            gaps = [[a[1] - b[1] for a, b in zip(r["curve"], runs[("fp32", s)]["curve"])]
                    for (c, s), r in runs.items() if c == label and ("fp32", s) in runs]
            if gaps:
                length = min(len(g) for g in gaps)
                bottom.plot(steps[:length], [statistics.mean(g[i] for g in gaps)
                                             for i in range(length)], lw=width,
                            color=colors[label])
        top.set_ylim(floor - 0.03, floor + 0.45)
        top.set_title(f"{optimizer}, {world_name(w)} workers", fontsize=9)
        bottom.set_ylim(-0.04, 0.12)
        bottom.axhline(0, color="black", lw=0.8)
        bottom.set_xlabel("step")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss (nats/byte)")
    axes[1][0].set_ylabel("gap to float32")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def meta(rows: list[dict]) -> dict:
    """What the runs ran on: versions, cores, and the 1-minute load seen at their starts and
    ends (their speed only; the runs' numbers do not depend on it)."""
    import platform

    import numpy
    import torch

    loads = [x for r in rows for x in r.get("load_1min", [])]
    return {"python": platform.python_version(), "torch": torch.__version__,
            "numpy": numpy.__version__, "cores": os.cpu_count(), "runs": len(rows),
            "load_1min": [min(loads), max(loads)] if loads else None}


def report(rows: list[dict], args) -> None:
    """Write ``plateau.json`` (the rows and :func:`meta`), ``plateau.md`` and the plots into
    ``args.out``."""
    optimizers = [o for o in ("adamw", "sgd") if any(r["optimizer"] == o for r in rows)]
    with open(os.path.join(args.out, "plateau.json"), "w", encoding="utf-8") as fh:
        json.dump({"meta": meta(rows), "rows": rows}, fh)
    lines = ["# Accuracy at 4 to 64 workers, trained past float32's plateau", "",
             "Written by `python3 benchmarks/plateau.py --report-only` from `plateau.json` "
             "(one row per run; the set-up and the commands: docs/dev/experiments.md, "
             "\"Accuracy at 4 to 64 workers\").", ""]
    for optimizer in optimizers:
        lines += optimizer_tables(rows, optimizer)
        name = f"plateau_{optimizer}.png"
        plot(rows, optimizer, os.path.join(args.out, name))
        lines += [f"![validation loss, {optimizer}]({name})", ""]
    with open(os.path.join(args.out, "plateau.md"), "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines))
