"""Empirical normalized variance of the codecs, measured on real encode/decode runs, with the
codecs' own theoretical bounds drawn next to the measurements.

    python3 benchmarks/variance.py                      # everything, ~3-4 min on 2 cores
    python3 benchmarks/variance.py --quick              # fewer vectors, for a smoke test
    python3 benchmarks/variance.py --parts fig16,bits   # a subset
    python3 benchmarks/variance.py --plot-only          # redraw PNGs + tables from the JSON

Every number plotted as a measurement comes from ``codec.encode`` + ``codec.decode`` (or
``horovod_quant.mean_estimate`` for the multi-worker exchanges) on concrete vectors; formulas are
used only for the curves labelled "bound" (``codec.omega(d)``, ``GlobalQSGD.theta(d)``,
``d Delta^2 / 12`` for dithered quantization). Bounds that coincide (QSGD's L2 and max scale,
NUQSGD and natural dithering) are drawn once and named together in the legend.

Parts (``--parts``):

* ``fig16`` / ``fig17``: the natural-compression paper's Appendix A.4 (Fig. 16-17): natural
  dithering D_nat^{p,s} against standard dithering D_sta^{p,u} with u = s (Fig. 16) and
  u = 2^(s-1) (Fig. 17), p in {1, 2, inf}, one bucket = the whole vector (d = 10^5), the norm
  sent uncompressed. Box plots over ``--vectors`` vectors per distribution (Gaussian as in the
  paper, plus Laplace, uniform and real gradients of the digits MLP).
* ``bits``: QSGD (L2 and max norm), NUQSGD and natural dithering at bucket 512 against bits.
* ``bucket``: the same codecs at 4 and 8 bits against bucket size.
* ``global``: Global-QSGD linear ("standard dithering") vs exponential levels: the variance of
  the n-worker mean estimate (Definition 2.2's theta) for n = 2, 4 against bits, with
  ``codec.theta(d)``.
* ``summary``: every codec at the configurations the convergence benchmark trains with: wire bits
  per element, one-worker omega and n-worker theta (n = 2, 4) on gradients, bounds.

Outputs (``--out``, default docs/results/): ``variance_fig16.png``, ``variance_fig17.png``,
``variance_bits.png``, ``variance_bucket.png``, ``variance_global_qsgd.png``,
``variance.json`` (every measurement: mean, std, quartiles per box), ``variance_tables.md``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import numpy as np

import horovod_quant as hq
from horovod_quant.core import get_codec
from horovod_quant.core.registry import codec_class
from horovod_quant.exchange.codec_states import CodecStates

INF = float("inf")
P_VALUES = (1.0, 2.0, INF)
DISTS = ("gaussian", "laplace", "uniform", "gradient")


def bits_for_levels(s: int) -> int:
    """Fewest wire bits (sign included) whose magnitude field holds s nonzero levels."""
    return max(2, math.ceil(math.log2(s + 1)) + 1)


def p_label(p: float) -> str:
    return "inf" if math.isinf(p) else str(int(p))


# -- data ----------------------------------------------------------------------------------------
def synthetic(dist: str, d: int, count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if dist == "gaussian":
        def make():
            return rng.standard_normal(d)
    elif dist == "laplace":
        def make():
            return rng.laplace(size=d)
    elif dist == "uniform":
        def make():
            return rng.uniform(-1.0, 1.0, d)
    else:
        raise ValueError(dist)
    # "several norms": each vector gets its own scale, 10^U(-3, 3); normalized variance does not
    # depend on it in exact arithmetic, float32 rounding would show if it did.
    return [(make() * 10.0 ** rng.uniform(-3, 3)).astype(np.float32) for _ in range(count)]


_GRAD_CACHE: dict = {}


def digits_gradients(count: int, workers: int = 1, seed: int = 0) -> list[list[np.ndarray]]:
    """Real gradients: the digits MLP of benchmarks/convergence.py (64-256-256-10, 85,002
    parameters) trained with plain SGD; at snapshots spread over 400 steps, ``workers``
    gradients of independent mini-batches of 32 (what ``workers`` ranks would hold at one step).
    Returns ``count`` groups of ``workers`` flat float32 vectors."""
    key = (count, workers, seed)
    if key in _GRAD_CACHE:
        return _GRAD_CACHE[key]
    import torch
    from sklearn.datasets import load_digits

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(seed)
    snapshots = 5
    per_snap = -(-count // snapshots)
    at = {round(i * 400 / (snapshots - 1)) for i in range(snapshots)}
    groups: list[list[np.ndarray]] = []

    def grad_of(idx):
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy()

    for step in range(401):
        if step in at:
            for _ in range(per_snap):
                groups.append([grad_of(torch.randint(0, len(x), (32,), generator=gen))
                               for _ in range(workers)])
        idx = torch.randint(0, len(x), (32,), generator=gen)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    groups = groups[:count]
    _GRAD_CACHE[key] = groups
    return groups


def vectors(dist: str, d: int, count: int, seed: int) -> list[np.ndarray]:
    if dist == "gradient":
        return [g[0] for g in digits_gradients(count, 1, seed)]
    return synthetic(dist, d, count, seed)


# -- measurement ---------------------------------------------------------------------------------
def omega_hat(codec, x: np.ndarray, seed: int) -> float:
    """||Q(x) - x||^2 / ||x||^2 of one real encode/decode, in float64."""
    y = codec.decode(codec.encode(x, seed=seed))
    x64 = x.astype(np.float64)
    return float(np.sum((y.astype(np.float64) - x64) ** 2) / np.sum(x64 * x64))


def theta_hat(codec, xs: list[np.ndarray], seed: int,
              states: CodecStates | None = None) -> tuple[float, int]:
    """||mean estimate - mean||^2 / ((1/n) sum ||x_i||^2) of one simulated n-worker exchange
    (bit-identical to the distributed one, see mean_estimate), and the wire bytes per worker;
    ``states``: the codec states successive exchanges carry (NDQSG's adaptive ratio)."""
    est, wire = hq.mean_estimate(codec, xs, seed=seed, states=states)
    x64 = [x.astype(np.float64) for x in xs]
    mean = sum(x64) / len(xs)
    denom = sum(float(np.sum(v * v)) for v in x64) / len(xs)
    return float(np.sum((est.astype(np.float64) - mean) ** 2) / denom), wire


def box(values) -> dict:
    a = np.asarray(values, np.float64)
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if a.size > 1 else 0.0,
            "median": float(med), "q1": float(q1), "q3": float(q3),
            "min": float(a.min()), "max": float(a.max()), "n": int(a.size)}


# -- part: Fig. 16 / 17 --------------------------------------------------------------------------
def part_dithering(args, fig: str) -> dict:
    """D_nat^{p,s} vs D_sta^{p,u}: u = s (fig16) or u = 2^(s-1) (fig17)."""
    s_values = list(range(1, 9)) if fig == "fig16" else list(range(1, 8))
    out = {"d": args.d, "s": s_values, "p": [p_label(p) for p in P_VALUES], "dists": {}}
    for di, dist in enumerate(DISTS):
        count = args.vectors if dist == "gaussian" else max(10, args.vectors // 2)
        xs = vectors(dist, args.d, count, seed=100 + di)
        d = xs[0].size
        res = {"d": int(d), "vectors": count}
        for p in P_VALUES:
            rows = []
            for s in s_values:
                u = s if fig == "fig16" else 2 ** (s - 1)
                nat = get_codec("natural_dithering", bits=bits_for_levels(s), levels=s, p=p,
                                bucket_size=None)
                sta = get_codec("standard_dithering", bits=bits_for_levels(u), levels=u, p=p,
                                bucket_size=None)
                wn = [omega_hat(nat, x, seed=7 * i + 1) for i, x in enumerate(xs)]
                ws = [omega_hat(sta, x, seed=7 * i + 2) for i, x in enumerate(xs)]
                rows.append({"s": s, "u": u, "nat": box(wn), "sta": box(ws),
                             "nat_bound": nat.omega(d), "sta_bound": sta.omega(d),
                             "nat_bits": nat.bits, "sta_bits": sta.bits,
                             "nat_raw": [float(v) for v in wn] if dist == "gaussian" else None,
                             "sta_raw": [float(v) for v in ws] if dist == "gaussian" else None})
            res[p_label(p)] = rows
            log(f"{fig} {dist:8s} p={p_label(p):3s} done")
        out["dists"][dist] = res
    return out


def plot_dithering(res: dict, fig: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dists = list(res["dists"])
    fig_, axes = plt.subplots(len(dists), 3, figsize=(15, 3.3 * len(dists) + 0.5),
                              squeeze=False, layout="constrained")
    for r, dist in enumerate(dists):
        dres = res["dists"][dist]
        for c, pl in enumerate(res["p"]):
            ax = axes[r][c]
            rows = dres[pl]
            s = np.array([row["s"] for row in rows])
            for key, color, dx, lab in (("nat", "tab:blue", -0.18, "D_nat^{p,s}"),
                                        ("sta", "tab:red", 0.18,
                                         "D_sta^{p,s}" if fig == "fig16" else "D_sta^{p,2^(s-1)}")):
                stats = [{"med": row[key]["median"], "q1": row[key]["q1"], "q3": row[key]["q3"],
                          "whislo": row[key]["min"], "whishi": row[key]["max"], "fliers": []}
                         for row in rows]
                bp = ax.bxp(stats, positions=s + dx, widths=0.3, patch_artist=True,
                            showfliers=False, manage_ticks=False)
                for patch in bp["boxes"]:
                    patch.set_facecolor(color)
                    patch.set_alpha(0.55)
                for med in bp["medians"]:
                    med.set_color("black")
                ax.plot([], [], color=color, lw=6, alpha=0.55, label=f"{lab} measured")
            bound_lines(ax, [(lab, list(s), [row[f"{key}_bound"] for row in rows])
                             for key, lab in (("nat", "D_nat^{p,s}"),
                                              ("sta", "D_sta^{p,s}" if fig == "fig16"
                                               else "D_sta^{p,2^(s-1)}"))],
                        "bound (codec.omega)")
            ax.set_yscale("log")
            ax.set_xticks(s)
            ax.set_xlabel("s (levels of D_nat)")
            ax.set_ylabel("||Q(x)-x||^2 / ||x||^2")
            ax.set_title(f"{dist} (d={dres['d']}, {dres['vectors']} vectors), p={pl}",
                         fontsize=9)
            ax.grid(alpha=0.3, which="both")
    legend_below(fig_, axes.flat, ncol=4)
    title = ("Fig. 16 reproduction: natural vs standard dithering, same number of levels s"
             if fig == "fig16" else
             "Fig. 17 reproduction: natural dithering with s levels vs standard with 2^(s-1)")
    fig_.suptitle(title + " (boxes: quartiles, whiskers: min/max; black: bounds)")
    fig_.savefig(path, dpi=110)
    plt.close(fig_)


def band(ax, x, boxes, color, label, marker, ls) -> None:
    """Measured means (markers and line) with the interquartile range shaded: on a log axis
    mean - std goes negative for heavy-tailed cells, quartiles do not."""
    ax.plot(x, [b["mean"] for b in boxes], marker=marker, ls=ls, color=color, ms=4,
            label=label + " (mean)")
    ax.fill_between(x, [b["q1"] for b in boxes], [b["q3"] for b in boxes], color=color,
                    alpha=0.15, lw=0)


BOUND_STYLES = ((0, (6, 3)), (0, (6, 2, 1.5, 2)), (0, (12, 3)), (0, (1.5, 2)))


def bound_lines(ax, curves, what="bound", rel_tol=0.05) -> None:
    """Draw each distinct bound curve once. ``curves``: (name, xs, ys). Codecs whose bound
    points all lie on a curve already drawn, to within ``rel_tol`` (closer than a log axis
    shows; e.g. QSGD's L2 and max scale share Lemma 3.1's omega), join its legend entry
    instead of hiding under it: "a = b" when equal, "a ~ b" when only close.
    Black, one dash pattern per curve, so a bound never reads as a measured line."""
    drawn = []  # [points dict, names, xs, ys, largest relative difference]
    for name, xs, ys in sorted(curves, key=lambda c: -len(c[1])):
        pts = dict(zip(xs, ys))
        for d in drawn:
            if all(x in d[0] and math.isclose(y, d[0][x], rel_tol=rel_tol)
                   for x, y in pts.items()):
                d[1].append(name)
                d[4] = max([d[4]] + [abs(y - d[0][x]) / max(abs(y), abs(d[0][x]))
                                     for x, y in pts.items() if y != d[0][x]])
                break
        else:
            drawn.append([pts, [name], xs, ys, 0.0])
    for i, (_, names, xs, ys, diff) in enumerate(drawn):
        joined = (" = ".join(names) if diff < 1e-9 else
                  " ~ ".join(names) + f" (less than {100 * rel_tol:g}% apart)")
        ax.plot(xs, ys, color="black", lw=1.1, ls=BOUND_STYLES[i % len(BOUND_STYLES)],
                label=f"{what}: {joined}")


def legend_below(fig, axes, ncol=2) -> None:
    """One legend for the whole figure, under the panels (never over the data): every entry
    of any of ``axes`` (one axes or several), each label once."""
    entries = {}
    for ax in ([axes] if hasattr(axes, "get_legend_handles_labels") else axes):
        for h, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, h)
    fig.legend(list(entries.values()), list(entries), loc="outside lower center", ncol=ncol,
               fontsize=8, frameon=False)


# -- part: bits / bucket -------------------------------------------------------------------------
LEVEL_CODECS = (
    ("qsgd (L2)", "qsgd", {"norm": "l2"}, 2),
    ("qsgd (max, QSGDinf)", "qsgd", {"norm": "max"}, 2),
    ("nuqsgd", "nuqsgd", {}, 3),
    ("natural_dithering (p=inf)", "natural_dithering", {"p": INF}, 2),
)
# natural_dithering with p=2 is NUQSGD's grid and norm exactly (levels 2^(1-s)..1, L2 scale),
# so it is not drawn twice: its max-norm form pairs with QSGDinf (Fig. 16 at bucket 512).


def _bits_bucket_data(args):
    return {"gaussian": synthetic("gaussian", args.d_bits, args.vectors_bits, seed=11),
            "gradient": [g[0] for g in digits_gradients(args.vectors_bits, 1, seed=1)]}


def part_bits(args) -> dict:
    data = _bits_bucket_data(args)
    out = {"bucket_size": 512, "dists": {}}
    for dist, xs in data.items():
        d = xs[0].size
        res = {"d": int(d), "vectors": len(xs), "codecs": {}}
        for label, name, extra, lo in LEVEL_CODECS:
            rows = []
            for bits in range(lo, 9):
                codec = get_codec(name, bits=bits, bucket_size=512, **extra)
                w = [omega_hat(codec, x, seed=13 * i + bits) for i, x in enumerate(xs)]
                wire = codec.encode(xs[0], seed=0).nbytes
                rows.append({"bits": bits, "levels": codec.s, "omega": box(w),
                             "bound": codec.omega(512), "wire_bits": 8 * wire / d})
            res["codecs"][label] = rows
            log(f"bits {dist:8s} {label} done")
        out["dists"][dist] = res
    return out


BUCKETS = (16, 64, 256, 512, 2048, 8192, 32768, None)


def part_bucket(args) -> dict:
    data = _bits_bucket_data(args)
    out = {"buckets": [b if b is not None else "whole" for b in BUCKETS], "dists": {}}
    for dist, xs in data.items():
        d = xs[0].size
        res = {"d": int(d), "vectors": len(xs), "codecs": {}}
        for bits in (4, 8):
            for label, name, extra, lo in LEVEL_CODECS:
                if label.startswith("natural_dithering"):
                    continue
                rows = []
                for b in BUCKETS:
                    codec = get_codec(name, bits=bits, bucket_size=b, **extra)
                    w = [omega_hat(codec, x, seed=17 * i + bits) for i, x in enumerate(xs)]
                    wire = codec.encode(xs[0], seed=0).nbytes
                    rows.append({"bucket": b if b is not None else d, "omega": box(w),
                                 "bound": codec.omega(b if b is not None else d),
                                 "wire_bits": 8 * wire / d})
                res["codecs"][f"{label} {bits}b"] = rows
                log(f"bucket {dist:8s} {label} {bits}b done")
        out["dists"][dist] = res
    return out


def plot_bits(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = ["tab:red", "tab:orange", "tab:green", "tab:purple"]
    fig, axes = plt.subplots(1, len(res["dists"]), figsize=(13, 5.6), squeeze=False,
                             layout="constrained")
    for ax, (dist, dres) in zip(axes[0], res["dists"].items()):
        for color, (label, rows) in zip(colors, dres["codecs"].items()):
            b = [r["bits"] for r in rows]
            band(ax, b, [r["omega"] for r in rows], color, f"{label} measured", "o", "-")
        bound_lines(ax, [(label, [r["bits"] for r in rows], [r["bound"] for r in rows])
                         for label, rows in dres["codecs"].items()], "bound (codec.omega)")
        ax.set_yscale("log")
        ax.set_xlabel("bits per element on the wire (sign included; + 32/512 for the scale)")
        ax.set_ylabel("||Q(x)-x||^2 / ||x||^2")
        ax.set_title(f"{dist} (d={dres['d']}, {dres['vectors']} vectors), bucket 512",
                     fontsize=10)
        ax.grid(alpha=0.3, which="both")
    legend_below(fig, axes[0], ncol=3)
    fig.suptitle("QSGD / NUQSGD / natural dithering: normalized variance vs bits "
                 "(shaded: quartiles over the vectors)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bucket(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(res["dists"]), figsize=(13, 5.8), squeeze=False,
                             layout="constrained")
    style = {"qsgd (L2)": "tab:red", "qsgd (max, QSGDinf)": "tab:orange", "nuqsgd": "tab:green"}
    for ax, (dist, dres) in zip(axes[0], res["dists"].items()):
        bounds = []
        for label, rows in dres["codecs"].items():
            base, bits = label.rsplit(" ", 1)
            ls = "-" if bits == "4b" else ":"
            b = [r["bucket"] for r in rows]
            band(ax, b, [r["omega"] for r in rows], style[base], f"{label} measured", "o", ls)
            if bits == "4b":
                bounds.append((label, b, [r["bound"] for r in rows]))
        bound_lines(ax, bounds, "bound (codec.omega)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("bucket size (last point: whole vector)")
        ax.set_ylabel("||Q(x)-x||^2 / ||x||^2")
        ax.set_title(f"{dist} (d={dres['d']}, {dres['vectors']} vectors); solid 4 bits, "
                     f"dotted 8 bits", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    legend_below(fig, axes[0], ncol=3)
    fig.suptitle("QSGD / NUQSGD: normalized variance vs bucket size (bounds drawn for 4 bits; "
                 "shaded: quartiles over the vectors)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- part: Global-QSGD ---------------------------------------------------------------------------
def part_global(args) -> dict:
    out = {"worlds": {}}
    for n in (2, 4):
        groups = digits_gradients(args.groups, n, seed=3)
        d = groups[0][0].size
        gauss = [synthetic("gaussian", d, n, seed=500 + g) for g in range(args.groups)]
        res = {"d": int(d), "groups": len(groups), "levels": {}}
        for levels in ("linear", "exponential"):
            rows = []
            for bits in range(2, 9):
                try:
                    codec = get_codec("global_qsgd", world_size=n, bits=bits, levels=levels)
                except ValueError:
                    continue
                tg = [theta_hat(codec, xs, seed=31 * i + bits)[0] for i, xs in enumerate(groups)]
                tz = [theta_hat(codec, xs, seed=37 * i + bits)[0] for i, xs in enumerate(gauss)]
                rows.append({"bits": bits, "s": codec.s, "theta_gradient": box(tg),
                             "theta_gaussian": box(tz), "bound": codec.theta(d),
                             "wire_bits": 8 * codec.payload_nbytes(d) / d})
            res["levels"][levels] = rows
            log(f"global n={n} {levels} done")
        out["worlds"][str(n)] = res
    return out


def plot_global(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.6), layout="constrained")
    for ax, (n, wres) in zip(axes, res["worlds"].items()):
        for levels, color in (("linear", "tab:red"), ("exponential", "tab:blue")):
            rows = wres["levels"][levels]
            b = [r["bits"] for r in rows]
            for key, mk, ls, lab in (("theta_gradient", "o", "-", "gradients"),
                                     ("theta_gaussian", "s", ":", "Gaussian")):
                band(ax, b, [r[key] for r in rows], color, f"{levels}: measured, {lab}", mk, ls)
            ax.plot(b, [r["bound"] for r in rows], ls="--", lw=1, color=color,
                    label=f"{levels}: bound (codec.theta)")
        ax.set_yscale("log")
        ax.set_xticks(b)
        ax.set_xlabel("bits (code width; linear fields pack 64 // bits per word: "
                      "5 bits cost 5.33)")
        ax.set_ylabel("||mean est - mean||^2 / ((1/n) sum ||x_i||^2)")
        ax.set_title(f"Global-QSGD, n = {n} workers, d = {wres['d']} "
                     f"({wres['groups']} exchanges)", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    legend_below(fig, axes[0], ncol=2)
    fig.suptitle("Global-QSGD: linear levels (standard dithering) vs exponential levels "
                 "(shaded: quartiles over the exchanges)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- part: summary -------------------------------------------------------------------------------
#: label, codec name, parameters (world_size added where needed). The configurations of
#: benchmarks/convergence.py, plus a few neighbours.
SUMMARY = (
    ("fp16", "fp16", {}),
    ("bf16", "bf16", {}),
    ("qsgd 8b b512", "qsgd", {"bits": 8, "bucket_size": 512, "norm": "l2"}),
    ("qsgd 4b b512", "qsgd", {"bits": 4, "bucket_size": 512, "norm": "l2"}),
    ("qsgd 4b b512 max-norm", "qsgd", {"bits": 4, "bucket_size": 512, "norm": "max"}),
    ("qsgd 2b b128", "qsgd", {"bits": 2, "bucket_size": 128, "norm": "l2"}),
    ("nuqsgd 8b b512", "nuqsgd", {"bits": 8, "bucket_size": 512}),
    ("nuqsgd 4b b512", "nuqsgd", {"bits": 4, "bucket_size": 512}),
    ("natural 8b b512", "natural", {"bits": 8}),
    ("natural_dithering 4b p=inf b512", "natural_dithering", {"bits": 4, "p": INF}),
    ("standard_dithering 4b p=inf b512", "standard_dithering", {"bits": 4, "p": INF}),
    ("natural_dithering 4b p=2 b512", "natural_dithering", {"bits": 4, "p": 2.0}),
    ("global_qsgd linear 8b", "global_qsgd", {"bits": 8, "levels": "linear"}),
    ("global_qsgd exponential 8b", "global_qsgd", {"bits": 8, "levels": "exponential"}),
    ("global_qsgd linear 16b", "global_qsgd", {"bits": 16, "levels": "linear"}),
    ("dithered 8b b512", "dithered", {"bits": 8}),
    ("dithered 4b b512", "dithered", {"bits": 4}),
    ("nested_dithered 4b", "nested_dithered", {"bits": 4}),
    ("nested_dithered 8b", "nested_dithered", {"bits": 8}),
)


def theta_bound(codec, d: int, n: int):
    """The bound on theta for n workers: codec.theta for Global-QSGD; omega/n for independent
    per-worker codecs (the mean of n independent unbiased estimates); d Delta^2/12 / n per
    bucket for dithered (Lemma 3 with kappa^2 <= ||x_bucket||^2); None where none is known."""
    if hasattr(codec, "theta"):
        return codec.theta(d)
    if hasattr(codec, "omega"):
        b = codec.bucket_size or d
        return codec.omega(min(b, d)) / n
    if codec.name == "dithered":
        b = codec.bucket_size or d
        return min(b, d) * codec.delta ** 2 / 12 / n
    return None


def part_summary(args) -> dict:
    rows = []
    cache = {n: digits_gradients(args.groups, n, seed=5) for n in (1, 2, 4)}
    d = cache[1][0][0].size
    for label, name, params in SUMMARY:
        row = {"label": label, "codec": name, "params": params}
        for n in (2, 4):
            p = dict(params)
            if codec_class(name).needs_world_size:
                p["world_size"] = n
            try:
                codec = get_codec(name, **p)
            except ValueError as exc:
                row[f"theta_{n}"] = None
                row[f"error_{n}"] = str(exc)
                continue
            vals, wires, states = [], [], CodecStates()
            for i, xs in enumerate(cache[n]):
                t, w = theta_hat(codec, xs, seed=41 * i + n, states=states)
                vals.append(t)
                wires.append(w)
            row[f"theta_{n}"] = box(vals)
            row[f"theta_{n}_bound"] = theta_bound(codec, d, n)
            row[f"wire_bits_{n}"] = 8 * float(np.mean(wires)) / d
            if name == "nested_dithered":
                # the P2 ranks send coarse_bits(k) bits; report the mean over the n ranks
                st = states.of(codec).last_stats
                row[f"nested_k_{n}"] = st.get("k")
                row[f"nested_bits_p2_{n}"] = st.get("bits_p2")
                row[f"nested_outside_{n}"] = st.get("outside_share")
                n1 = codec.n1
                mean_bits = (n1 * codec.bits + (n - n1) * st.get("bits_p2", codec.bits)) / n
                row[f"wire_bits_mean_{n}"] = mean_bits + 32 / (codec.bucket_size or d)
        if not codec_class(name).needs_world_size:
            codec = get_codec(name, **params)
            w = [omega_hat(codec, g[0], seed=43 * i) for i, g in enumerate(cache[1])]
            row["omega_1"] = box(w)
            row["omega_bound"] = codec.omega(min(codec.bucket_size or d, d)) \
                if hasattr(codec, "omega") else None
        rows.append(row)
        log(f"summary {label} done")
    return {"d": int(d), "groups": args.groups, "rows": rows}


# -- tables --------------------------------------------------------------------------------------
def fmt(v, digits=3):
    if v is None:
        return "-"
    if isinstance(v, dict):
        return f"{v['mean']:.{digits}g} ± {v['std']:.2g}"
    return f"{v:.{digits}g}"


def md_table(title: str, header: list[str], rows: list[list[str]]) -> list[str]:
    """A titled markdown table as lines (with a blank line after it)."""
    lines = [f"### {title}\n"] if title else []
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "---|" * len(header))
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines + [""]


def tables(results: dict) -> str:
    out = []
    for fig in ("fig16", "fig17"):
        if fig not in results:
            continue
        res = results[fig]
        g = res["dists"]["gaussian"]
        out += md_table(
            f"{fig}: median normalized variance, Gaussian, d = {res['d']} "
            f"(nat / sta, bound nat / sta)",
            ["s", "u"] + [f"p={pl} {kind}" for pl in ("1", "2", "inf") for kind in ("nat", "sta")],
            [[str(s), str(g["2"][i]["u"])]
             + [f"{g[pl][i][kind]['median']:.3g}" for pl in res["p"] for kind in ("nat", "sta")]
             for i, s in enumerate(res["s"])])
        out.append(f"Ratio sta/nat of the medians, every distribution ({fig}):\n")
        out += md_table("", ["distribution", "p"] + [f"s={s}" for s in res["s"]],
                        [[dist, pl] + [f"{r['sta']['median'] / r['nat']['median']:.3g}"
                                       for r in dres[pl]]
                         for dist, dres in res["dists"].items() for pl in res["p"]])
    if "bits" in results:
        res = results["bits"]
        for dist, dres in res["dists"].items():
            codecs = list(dres["codecs"])
            rows = []
            for bits in range(2, 9):
                cells = []
                for c in codecs:
                    row = next((r for r in dres["codecs"][c] if r["bits"] == bits), None)
                    cells.append("-" if row is None else
                                 f"{fmt(row['omega'])} ({row['bound']:.3g})")
                rows.append([str(bits)] + cells)
            out += md_table(f"Variance vs bits, bucket 512, {dist} (d = {dres['d']}): "
                            f"measured mean ± std (bound)", ["bits"] + codecs, rows)
    if "bucket" in results:
        res = results["bucket"]
        for dist, dres in res["dists"].items():
            codecs = list(dres["codecs"])
            out += md_table(
                f"Variance vs bucket size, {dist} (d = {dres['d']}): measured mean (bound)",
                ["bucket"] + codecs,
                [[str(b)] + [f"{dres['codecs'][c][i]['omega']['mean']:.3g} "
                             f"({dres['codecs'][c][i]['bound']:.3g})" for c in codecs]
                 for i, b in enumerate(res["buckets"])])
    if "global" in results:
        res = results["global"]
        for n, wres in res["worlds"].items():
            lin = {r["bits"]: r for r in wres["levels"]["linear"]}
            exp = {r["bits"]: r for r in wres["levels"]["exponential"]}
            rows = []
            for bits in range(2, 9):
                cells = [str(bits)]
                for tab in (lin, exp):
                    r = tab.get(bits)
                    cells += (["-"] * 4 if r is None else
                              [str(r["s"]), fmt(r["theta_gradient"]), fmt(r["theta_gaussian"]),
                               f"{r['bound']:.3g}"])
                rows.append(cells)
            out += md_table(f"Global-QSGD theta, n = {n}, d = {wres['d']}: measured on "
                            f"gradients / Gaussian (bound)",
                            ["bits"] + [f"{lv} {col}" for lv in ("linear", "exp")
                                        for col in ("s", "grad", "gauss", "bound")], rows)
    if "summary" in results:
        res = results["summary"]
        rows = []
        for r in res["rows"]:
            om = "-" if "omega_1" not in r else (
                f"{fmt(r['omega_1'])} ({fmt(r.get('omega_bound'))})")
            th = ["n/a" if r.get(f"theta_{n}") is None else
                  f"{fmt(r[f'theta_{n}'])} ({fmt(r.get(f'theta_{n}_bound'))})" for n in (2, 4)]
            wb = fmt(r.get("wire_bits_2"))
            if r.get("wire_bits_mean_2") is not None:
                wb += (f" (P1 rank; mean over ranks {r['wire_bits_mean_2']:.3g}, "
                       f"P2 k={r.get('nested_k_2')}, outage {fmt(r.get('nested_outside_2'))})")
            rows.append([r["label"], wb, om, th[0], th[1]])
        out += md_table(f"Every codec on digits-MLP gradients (d = {res['d']}, {res['groups']} "
                        f"exchanges per cell): measured (bound)",
                        ["codec", "wire bits/elem (n=2)", "omega, 1 worker", "theta, n=2",
                         "theta, n=4"], rows)
    return "\n".join(out)


# -- main ----------------------------------------------------------------------------------------
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[variance {time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="fig16,fig17,bits,bucket,global,summary")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "..", "docs", "results"))
    ap.add_argument("--d", type=int, default=100_000, help="Fig. 16/17 vector size (paper: 1e5)")
    ap.add_argument("--vectors", type=int, default=100, help="Fig. 16/17 Gaussian vectors "
                    "(paper: 100); other distributions use half")
    ap.add_argument("--d-bits", type=int, default=1 << 18, help="Gaussian size for bits/bucket")
    ap.add_argument("--vectors-bits", type=int, default=20)
    ap.add_argument("--groups", type=int, default=20, help="exchanges per Global-QSGD/summary cell")
    ap.add_argument("--quick", action="store_true", help="10 vectors, 5 groups, d=2^16")
    ap.add_argument("--plot-only", action="store_true",
                    help="redraw the PNGs and tables from variance.json, measuring nothing")
    args = ap.parse_args()
    if args.quick:
        args.vectors, args.vectors_bits, args.groups, args.d_bits = 10, 5, 5, 1 << 16
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, "variance.json")
    results = {}
    if os.path.exists(json_path):  # keep the parts not rerun
        with open(json_path) as f:
            results = json.load(f).get("results", {})
    if args.plot_only:
        def out(name):
            return os.path.join(args.out, name)
        for part, res in results.items():
            if part in ("fig16", "fig17"):
                plot_dithering(res, part, out(f"variance_{part}.png"))
            elif part == "bits":
                plot_bits(res, out("variance_bits.png"))
            elif part == "bucket":
                plot_bucket(res, out("variance_bucket.png"))
            elif part == "global":
                plot_global(res, out("variance_global_qsgd.png"))
        parts = []
    for part in parts:
        t = time.perf_counter()
        if part in ("fig16", "fig17"):
            results[part] = part_dithering(args, part)
            plot_dithering(results[part], part, os.path.join(args.out, f"variance_{part}.png"))
        elif part == "bits":
            results[part] = part_bits(args)
            plot_bits(results[part], os.path.join(args.out, "variance_bits.png"))
        elif part == "bucket":
            results[part] = part_bucket(args)
            plot_bucket(results[part], os.path.join(args.out, "variance_bucket.png"))
        elif part == "global":
            results[part] = part_global(args)
            plot_global(results[part], os.path.join(args.out, "variance_global_qsgd.png"))
        elif part == "summary":
            results[part] = part_summary(args)
        else:
            raise SystemExit(f"unknown part {part!r}")
        results[part]["seconds"] = time.perf_counter() - t
        results[part]["command"] = " ".join(sys.argv)
    if not args.plot_only:  # --plot-only measured nothing: the JSON stays as it was
        meta = {"python": platform.python_version(), "numpy": np.__version__,
                "machine": platform.machine(), "cpus": os.cpu_count(),
                "codecs": hq.available_codecs()}
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    md = tables(results)
    with open(os.path.join(args.out, "variance_tables.md"), "w") as f:
        f.write("<!-- generated by benchmarks/variance.py; do not edit -->\n\n" + md)
    print(md)
    log("redrew the PNGs and tables" if args.plot_only else f"wrote {json_path}")


if __name__ == "__main__":
    main()
