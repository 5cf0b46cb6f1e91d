"""The variance each codec adds to the mean of n workers' gradients at a fixed global batch.

    python3 benchmarks/reduction_variance.py     # writes docs/results/reduction_variance.{json,md}

At a fixed global batch each of n workers averages 1/n of it, so a worker's gradient noise has n
times the variance of the batch mean's. The model here: worker i sends ``x_i = g + sqrt(n) z_i``
(``g`` a fixed vector with entries of sd 0.1, ``z_i`` standard normal, 133,120 elements: the
plateau study's bucket), so the mean of the n vectors has sampling variance 1 per element at
every n. Each codec's :func:`horovod_quant.mean_estimate` (the plan the exchange takes,
``gather="auto"``) adds ``E ||estimate - mean||^2 / d`` to that: the table gives it per n,
the mean over three exchanges. A per-worker codec's added variance stays flat in n (its payloads'
errors average as the workers' noise grows); Global-QSGD's exponent reduction rounds every
partial sum again, once per round of its tree (log2 n rounds), and linear Global-QSGD keeps
floor((2^bits - 1) / (2n)) levels.
"""
from __future__ import annotations

import argparse
import json
import os
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: label -> (codec name, parameters; world-sized codecs get world_size=n)
CODECS = {
    "qsgd 8b": ("qsgd", {"bits": 8}),
    "qsgd 4b": ("qsgd", {"bits": 4}),
    "natural dithering 4b": ("natural_dithering", {"bits": 4}),
    "global-qsgd exp 8b": ("global_qsgd", {"bits": 8}),
    "global-qsgd lin 8b": ("global_qsgd", {"bits": 8, "levels": "linear"}),
}
WORKERS, SIZE, REPEATS = (4, 16, 64), 133_120, 3


def added_variance(label: str, n: int) -> float:
    """The variance per element the codec adds to the n workers' mean (the mean of
    :data:`REPEATS` exchanges)."""
    from plateau import codec_for

    import horovod_quant as hq

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the linear codec's limit note: the point here
        codec = codec_for(*CODECS[label], n)
    rng = np.random.default_rng(n)
    g = (0.1 * rng.standard_normal(SIZE)).astype(np.float32)
    added = []
    for seed in range(REPEATS):
        xs = [g + np.float32(np.sqrt(n)) * rng.standard_normal(SIZE).astype(np.float32)
              for _ in range(n)]
        mean = np.mean(np.stack(xs), axis=0, dtype=np.float64)
        estimate, _ = hq.mean_estimate(codec, xs, seed=seed)
        added.append(float(np.sum((estimate - mean) ** 2) / SIZE))
    return float(np.mean(added))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "reduction_variance"))
    args = ap.parse_args()
    rows = [{"codec": label, "workers": n, "added_variance": added_variance(label, n)}
            for label in CODECS for n in WORKERS]
    with open(args.out + ".json", "w", encoding="utf-8") as fh:
        json.dump({"size": SIZE, "repeats": REPEATS, "rows": rows}, fh, indent=1)
    lines = ["# Variance a codec adds to n workers' mean, fixed global batch", "",
             "Written by `python3 benchmarks/reduction_variance.py` (its docstring has the "
             "model); the batch mean's own sampling variance is 1 per element at every n.", "",
             "| codec | " + " | ".join(f"n = {n}" for n in WORKERS) + " |",
             "|---|" + "---|" * len(WORKERS)]
    for label in CODECS:
        cells = [f"{r['added_variance']:.3g}" for r in rows if r["codec"] == label]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    with open(args.out + ".md", "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
