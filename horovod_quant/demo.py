"""What every codec does to real gradients: ``python3 -m horovod_quant.demo``.

Trains a small MLP (64-256-128-10) on scikit-learn's digits for a few steps with PyTorch, takes
the flattened gradients of two mini-batches (the gradients two workers would send), and prints,
for every registered codec:

* bits/element on the wire (payload bytes * 8 / elements) and the compression ratio vs fp32;
* the measured normalized variance E||Q(g) - g||^2 / ||g||^2 over 20 seeds, next to the bound
  the codec states (``omega(bucket)``, or ``theta(d)`` for codecs whose exchange combines n
  workers, where the measure is E||estimate - mean||^2 / ((1/n) sum ||g_i||^2) for n = 2);
* encode and decode throughput of one process, GB/s of float32 input (decode into a
  preallocated buffer), on the gradient tiled to 2^20 elements.

Without PyTorch (or scikit-learn) it says so and uses synthetic NumPy gradients instead.
Options: ``--seeds N`` (default 20), ``--no-throughput``, ``--codecs a,b``.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import horovod_quant as hq

WORLD = 2
THROUGHPUT_ELEMS = 1 << 20


# ---------------------------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------------------------
def _digits():
    """(features, labels) of scikit-learn's digits, or a synthetic stand-in with a note."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        print("note: scikit-learn is not installed; using synthetic 8x8 'digits' "
              "(pip install scikit-learn for the real data set)")
        rng = np.random.default_rng(0)
        y = rng.integers(0, 10, 1797)
        centers = rng.random((10, 64)) * 16
        x = centers[y] + rng.standard_normal((1797, 64)) * 3
        return x.astype(np.float32), y
    x, y = load_digits(return_X_y=True)
    return x.astype(np.float32), y


def torch_gradients(n_workers: int, warmup_steps: int = 30, batch: int = 64):
    """Flattened gradients of ``n_workers`` mini-batches of an MLP partly trained on digits."""
    import torch

    torch.manual_seed(0)
    x, y = _digits()
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    xt, yt = torch.from_numpy(x), torch.from_numpy(np.asarray(y, np.int64))
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(1)
    for _ in range(warmup_steps):
        idx = torch.randint(0, len(xt), (batch,), generator=g)
        opt.zero_grad()
        loss_fn(model(xt[idx]), yt[idx]).backward()
        opt.step()
    grads = []
    for _ in range(n_workers):
        idx = torch.randint(0, len(xt), (batch,), generator=g)
        opt.zero_grad()
        loss = loss_fn(model(xt[idx]), yt[idx])
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        grads.append(flat.detach().numpy().astype(np.float32).copy())
    n_params = sum(p.numel() for p in model.parameters())
    return grads, f"MLP 64-256-128-10 on digits, {n_params} parameters, after {warmup_steps} " \
                  f"SGD steps (loss {loss.item():.3f}); {n_workers} mini-batches of {batch}"


def numpy_gradients(n_workers: int):
    """Synthetic stand-in: per-layer Gaussian gradients with layer-dependent scales."""
    rng = np.random.default_rng(0)
    sizes = [64 * 256, 256, 256 * 128, 128, 128 * 10, 10]
    scales = [1e-3, 1e-2, 5e-4, 5e-3, 2e-3, 2e-2]
    base = np.concatenate([rng.standard_normal(n) * s for n, s in zip(sizes, scales)])
    grads = [(base + 0.5 * base * rng.standard_normal(base.size)).astype(np.float32)
             for _ in range(n_workers)]
    return grads, f"synthetic NumPy gradients, {base.size} elements, {n_workers} workers"


# ---------------------------------------------------------------------------------------------
# codecs
# ---------------------------------------------------------------------------------------------
def demo_codecs(names=None):
    """(label, codec) for every registered codec at its defaults, plus a row at the other of 4
    and 8 bits for the level quantizers. Codecs that need world_size get 2."""
    rows = []
    for name in hq.available_codecs():
        if names and name not in names:
            continue
        variants = [{}]
        if name in ("qsgd", "nuqsgd", "natural_dithering", "standard_dithering"):
            variants.append({"bits": 4 if hq.get_codec(name).params["bits"] == 8 else 8})
        for params in variants:
            try:
                codec = hq.get_codec(name, **params)
            except ValueError as exc:
                if "world_size" not in str(exc):
                    raise
                codec = hq.get_codec(name, world_size=WORLD, **params)
            rows.append((name, codec))
    return rows


def describe(codec) -> str:
    short = {"bucket_size": "bucket", "world_size": "n", "num_levels": "s"}
    parts = []
    for k, v in codec.params.items():
        if isinstance(v, float) and v == float("inf"):
            v = "inf"
        key = "s" if k == "levels" and isinstance(v, int) else short.get(k, k)
        parts.append(f"{key}={v}")
    return " ".join(parts) or "-"


def bound_of(codec, d: int):
    """The codec's own variance bound for a vector of d elements, or None."""
    n = getattr(codec, "world_size", 1)
    if hasattr(codec, "theta") and n > 1:
        return float(codec.theta(d)), "theta"
    if hasattr(codec, "omega"):
        bucket = getattr(codec, "bucket_size", None) or d
        return float(codec.omega(min(bucket, d))), "omega"
    if codec.name == "none":
        return 0.0, "exact"
    # round to nearest: relative error <= half an ulp (normal range), squared
    half_ulp = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}.get(codec.name)
    if half_ulp is not None:
        return half_ulp ** 2, "rounding"
    return None, ""


def measured_variance(codec, grads, seeds: int):
    """E||estimate - mean||^2 / ((1/n) sum ||g_i||^2) over seeds (n = 1: E||Q(g)-g||^2/||g||^2),
    and the largest payload one worker sends."""
    n = getattr(codec, "world_size", 1)
    xs = grads[:n]
    mean = np.mean(np.stack(xs).astype(np.float64), axis=0)
    denom = np.mean([np.sum(x.astype(np.float64) ** 2) for x in xs])
    errs, wire = [], 0
    for s in range(seeds):
        est, wire = hq.mean_estimate(codec, xs, seed=1000 + s)
        errs.append(np.sum((est.astype(np.float64) - mean) ** 2) / denom)
    return float(np.mean(errs)), int(wire)


def throughput(codec, x: np.ndarray, repeat: int = 3):
    """(encode GB/s, decode GB/s) of float32 input, best of ``repeat``."""
    gb = x.nbytes / 1e9
    payload = codec.encode(x, seed=1)
    out = np.empty(x.size, np.float32)
    codec.decode(payload, out)
    te = td = float("inf")
    for r in range(repeat):
        t0 = time.perf_counter()
        payload = codec.encode(x, seed=r)
        t1 = time.perf_counter()
        codec.decode(payload, out)
        t2 = time.perf_counter()
        te, td = min(te, t1 - t0), min(td, t2 - t1)
    return gb / te, gb / td


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=20, help="seeds for the variance (default 20)")
    ap.add_argument("--no-throughput", action="store_true", help="skip the GB/s columns")
    ap.add_argument("--codecs", default="", help="comma-separated subset of codecs")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    try:
        import torch  # noqa: F401
        grads, source = torch_gradients(WORLD)
    except ImportError:
        print("note: PyTorch is not installed, so there are no real gradients to show; using "
              "synthetic NumPy gradients instead (pip install torch==2.13.0, or `make demo`, "
              "for the real ones)")
        grads, source = numpy_gradients(WORLD)
    d = grads[0].size
    print(f"gradients: {source}")
    print(f"variance: mean over {args.seeds} seeds of E||Q(g)-g||^2/||g||^2 (n = 1), or of "
          f"E||est-mean||^2/((1/n) sum||g_i||^2) for codecs built for n = {WORLD} workers")
    if not args.no_throughput:
        print(f"throughput: one process, gradient tiled to {THROUGHPUT_ELEMS} elements, best "
              f"of 3, GB/s of float32 input")
    big = np.resize(grads[0], THROUGHPUT_ELEMS)

    names = [s for s in args.codecs.split(",") if s] or None
    header = ["codec", "params", "bits/elem", "ratio", "variance", "bound"]
    if not args.no_throughput:
        header += ["enc GB/s", "dec GB/s"]
    rows = []
    for name, codec in demo_codecs(names):
        var, wire = measured_variance(codec, grads, args.seeds)
        bits = wire * 8 / d
        bound, kind = bound_of(codec, d)
        bound_s = "-" if bound is None else (f"{bound:.4g} ({kind})" if kind else f"{bound:.4g}")
        if bound is not None and var > bound * 1.2 + 1e-12:
            bound_s += " !"
        row = [name, describe(codec), f"{bits:.3f}", f"{32 / bits:.2f}x", f"{var:.4g}", bound_s]
        if not args.no_throughput:
            e, dd = throughput(codec, big)
            row += [f"{e:.2f}", f"{dd:.2f}"]
        rows.append(row)

    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    print()
    print(line)
    print("-" * len(line))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print()
    print("bits/elem counts every byte one worker sends (scales, norms, packing); ratio = 32 / "
          "bits. A '!' marks a measured variance above its bound (there should be none).")
    print(f"done in {time.perf_counter() - t_start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
