"""The plots of ``benchmarks/cluster.py``'s results, drawn from its JSON (no root needed):

    python3 benchmarks/cluster.py --render docs/results/cluster.json --plots-only

``PREFIX_speedup.png``, ``PREFIX_bytes.png``, ``PREFIX_split.png`` (:func:`render_plots`) and,
for runs that counted the bytes across hosts, ``PREFIX_shapes.png`` (:func:`render_shapes_plot`).
"""
from __future__ import annotations

MB = 1 << 20
OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.005, 1.0), "borderaxespad": 0.0,
           "fontsize": 8}


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ranks(link: dict, cpus) -> str:
    """``2 x 1 ranks on 2 shared cores``: the shape of a link's run."""
    return (f"{link.get('hosts', 2)} x {link.get('ranks_per_host', 1)} ranks on {cpus} "
            "shared cores")


def render_plots(data: dict, prefix: str) -> list[str]:
    """PREFIX_speedup.png, PREFIX_bytes.png, PREFIX_split.png. Legends sit right of the
    panels, targets are legend entries (no text on the data), every axis holds its tallest
    bar, and bytes are drawn on a linear axis with each bar's MB and ratio written on it."""
    plt = _pyplot()
    s = data["summary"]
    cpus = data.get("machine", {}).get("cpus", "?")
    links = data["links"]
    files = []
    colors = {"encode": "#e4a11b", "exchange": "#3b75af", "decode": "#7bb661",
              "compute": "#999999", "other": "#dddddd"}

    def xlabels(ax, names, pos=None):
        ax.set_xticks(range(len(names)) if pos is None else pos)
        ax.set_xticklabels(names, rotation=45, ha="right", rotation_mode="anchor", fontsize=8)
        ax.set_xlim(-0.6, len(names) - 0.4)

    # 1. speedups
    panels = [(link, "exchange") for link in links if s["exchange"].get(link["label"])]
    panels += [(link, "train") for link in links if s["training"].get(link["label"])]
    if panels:
        fig, axes = plt.subplots(len(panels), 1, figsize=(13, 3.4 * len(panels)), squeeze=False,
                                 layout="constrained")
        for ax, (link, kind) in zip(axes[:, 0], panels):
            lab = link["label"]
            groups = (s["exchange"][lab] if kind == "exchange" else s["training"][lab])
            keys = sorted(groups, key=lambda k: float(k)) if kind == "exchange" else list(groups)
            cids = list(dict.fromkeys(c for k in keys for c in groups[k]))
            w = 0.8 / max(1, len(keys))
            top = 1.0
            for j, k in enumerate(keys):
                vals = [groups[k].get(c, {}).get("speedup_vs_fp32") or 0 for c in cids]
                top = max([top] + vals)
                ax.bar([i + (j - (len(keys) - 1) / 2) * w for i in range(len(cids))], vals, w,
                       label=f"{float(k):g} MB" if kind == "exchange" else k)
            ax.axhline(1, color="k", lw=0.8)
            targets = []
            if abs(link["rate_bps"] - 1e9) < 1:
                targets = ([(3.3, "--", "8-bit target 3.3x"), (6, "-.", "4-bit target 6x")]
                           if kind == "exchange" else [(2.5, "--", "mlp 8-bit target 2.5x"),
                                                       (4, "-.", "mlp 4-bit target 4x")])
            for y, ls, txt in targets:
                ax.axhline(y, color="r", ls=ls, lw=1.0, label=txt)
                top = max(top, y)
            ax.set_ylim(0, top * 1.08)
            xlabels(ax, cids)
            ax.set_ylabel("speedup vs fp32")
            ax.grid(alpha=0.3, axis="y")
            what = "exchange time" if kind == "exchange" else "training samples/s"
            ax.set_title(f"{what}, {lab} ({_ranks(link, cpus)})", fontsize=10)
            ax.legend(**OUTSIDE)
        path = f"{prefix}_speedup.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)

    # 2. bytes (first link; the bytes do not depend on the link)
    link = links[0]
    ex = [r for r in link["results"] if r.get("kind") == "exchange" and not r.get("error")]
    tr = [r for r in link["results"] if r.get("kind") == "train" and not r.get("error")]
    panels = []
    if ex:
        z = max(r["size_mb"] for r in ex)
        panels.append((f"MB one rank sends per exchange of {z:g} MB",
                       [r for r in ex if r["size_mb"] == z]))
    for m in dict.fromkeys(r["model"] for r in tr):
        panels.append((f"MB one rank sends per training step, {m}",
                       [r for r in tr if r["model"] == m and r["bytes_sent"]]))
    if panels:
        fig, axes = plt.subplots(len(panels), 1, figsize=(13, 3.3 * len(panels)), squeeze=False,
                                 layout="constrained")
        for ax, (title, rows) in zip(axes[:, 0], panels):
            mbs = [r["bytes_sent"] / MB for r in rows]
            bars = ax.bar(range(len(rows)), mbs, 0.7, color="#3b75af")
            ax.bar_label(bars, [(f"{v:.1f}" if v >= 10 else f"{v:.2f}")
                                + f"\n{r['bytes_raw'] / r['bytes_sent']:.2f}x"
                                for v, r in zip(mbs, rows)], fontsize=7, padding=2)
            ax.set_ylim(0, max(mbs) * 1.3)
            xlabels(ax, [r["config_id"] for r in rows])
            ax.set_ylabel("MB")
            ax.grid(alpha=0.3, axis="y")
            ax.set_title(title + " (on each bar: MB, and fp32's bytes / these bytes)",
                         fontsize=10)
        path = f"{prefix}_bytes.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)

    # 3. time split (first link = the 1 Gbit/s one in the default run)
    panels = []
    if ex:
        z = max(r["size_mb"] for r in ex)
        panels.append((f"exchange of {z:g} MB, {link['label']}",
                       [r for r in ex if r["size_mb"] == z], ("encode", "exchange", "decode",
                                                              "other")))
    for m in dict.fromkeys(r["model"] for r in tr):
        panels.append((f"training step, {m}, {link['label']}",
                       [r for r in tr if r["model"] == m],
                       ("compute", "encode", "exchange", "decode")))
    if panels:
        fig, axes = plt.subplots(len(panels), 1, figsize=(13, 3.3 * len(panels)), squeeze=False,
                                 layout="constrained")
        for ax, (title, rows, parts) in zip(axes[:, 0], panels):
            bottom = [0.0] * len(rows)
            for part in parts:
                if part == "other":
                    vals = [max(0.0, r["wall_s"] - r["encode_s"] - r["exchange_s"] -
                                r["decode_s"]) for r in rows]
                else:
                    key = "compute_s" if part == "compute" else f"{part}_s"
                    vals = [max(0.0, r[key]) for r in rows]
                vals = [v * 1e3 for v in vals]
                ax.bar(range(len(rows)), vals, 0.7, bottom=bottom, label=part,
                       color=colors[part])
                bottom = [b + v for b, v in zip(bottom, vals)]
            # the stacked bars' sticky edges would stop the axis exactly at the tallest top
            ax.set_ylim(0, max(bottom) * 1.08)
            xlabels(ax, [r["config_id"] for r in rows])
            ax.set_ylabel("ms")
            ax.grid(alpha=0.3, axis="y")
            ax.set_title(f"{title} ({_ranks(link, cpus)})", fontsize=10)
            handles, names = ax.get_legend_handles_labels()
            ax.legend(handles[::-1], names[::-1], **OUTSIDE)  # same order as the stack
        path = f"{prefix}_split.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files




def render_shapes_plot(shapes: list[dict], prefix: str, cpus) -> list[str]:
    """PREFIX_shapes.png: per cluster shape (x axis), the bytes that crossed the hosts' NICs
    per step against fp32's (top) and the samples/s against fp32's (bottom), one bar per
    configuration; the compute-only floor is the speed bound. ``shapes``: the rows of
    ``cluster_report.shape_summary`` (one model and link rate: the first of each)."""
    if not shapes:
        return []
    plt = _pyplot()
    model, rate = shapes[0]["model"], shapes[0]["rate_bps"]
    rows = [e for e in shapes if e["model"] == model and e["rate_bps"] == rate]
    names = [f"{e['hosts']} x {e['ranks_per_host']}" for e in rows]
    cids = list(dict.fromkeys(c for e in rows for c in e["configs"] if c != "compute"))
    w = 0.8 / max(1, len(cids))
    fig, axes = plt.subplots(2, 1, figsize=(13, 7.5), layout="constrained")
    for ax, key, label in ((axes[0], "nic_vs_fp32", "bytes across hosts / fp32's"),
                           (axes[1], "speedup_vs_fp32", "samples/s vs fp32")):
        top = 1.0
        for j, cid in enumerate(cids):
            vals = [e["configs"].get(cid, {}).get(key) or 0.0 for e in rows]
            top = max([top] + vals)
            ax.bar([i + (j - (len(cids) - 1) / 2) * w for i in range(len(rows))], vals, w,
                   label=cid)
        if key == "speedup_vs_fp32":
            floor = [e["fp32_step_s"] / e["compute_step_s"] if e.get("compute_step_s")
                     else None for e in rows]
            xs = [i for i, f in enumerate(floor) if f]
            ax.hlines([floor[i] for i in xs], [i - 0.45 for i in xs], [i + 0.45 for i in xs],
                      colors="k", linestyles="--", label="compute only (no communication)")
            top = max([top] + [f for f in floor if f])
        ax.axhline(1, color="k", lw=0.8)
        ax.set_ylim(0, top * 1.08)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(names)
        ax.set_xlim(-0.6, len(rows) - 0.4)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(**OUTSIDE)
    axes[0].set_title(f"{model} at {rate / 1e9:g} Gbit/s per host NIC, by cluster shape (hosts x "
                      f"ranks per host; all ranks on {cpus} shared cores)", fontsize=10)
    path = f"{prefix}_shapes.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
