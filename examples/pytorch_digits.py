"""Data-parallel training of a small MLP on scikit-learn's digits with horovod_quant.

    horovodrun -np 2 python examples/pytorch_digits.py --codec qsgd --bits 8

The lines that integrate horovod_quant are marked ``# horovod_quant:``. With ``--codecs`` the
script trains once per listed configuration (``name`` or ``name:bits``) in one launch and rank 0
prints a table (``make demo`` runs it that way) and writes ``--json``.
"""
import argparse
import json
import time

import horovod.torch as hvd
import torch
from sklearn.datasets import load_digits

import horovod_quant.torch as hq  # horovod_quant: the PyTorch adapter

DEFAULT_CODECS = ("none fp16 qsgd:8 qsgd:4 nuqsgd:8 nuqsgd:4 natural:8 natural:4 "
                  "natural_dithering:8 standard_dithering:8 global_qsgd:8 global_qsgd:4 "
                  "dithered:8 nested_dithered:8 bf16")


def build_compression(spec: str):
    """``name`` or ``name:bits`` -> a Compressor (horovod_quant builds every codec the same way)."""
    name, _, bits = spec.partition(":")
    params = {"bits": int(bits)} if bits else {}
    return getattr(hq.Compression, name)(**params)  # horovod_quant: pick a codec


def train(spec: str, steps: int, batch: int, lr: float):
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    n_test = 297
    x_test, y_test, x, y = x[:n_test], y[:n_test], x[n_test:], y[n_test:]
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9)
    opt = hq.DistributedOptimizer(opt, named_parameters=model.named_parameters(),  # horovod_quant
                                  compression=build_compression(spec))            # horovod_quant
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(hvd.rank())
    sent = raw = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (batch,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        sent += opt.last_stats.bytes_sent  # horovod_quant: per-step statistics
        raw += opt.last_stats.bytes_raw
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    with torch.no_grad():
        logits = model(x_test)
        loss = torch.nn.functional.cross_entropy(logits, y_test).item()
        acc = (logits.argmax(1) == y_test).float().mean().item()
    return {"codec": spec, "test_loss": loss, "test_accuracy": acc,
            "bytes_per_step": sent / steps, "ratio": raw / sent if sent else float("inf"),
            "step_ms": step_ms}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--codec", default=None, help="one codec spec, e.g. qsgd:4")
    ap.add_argument("--codecs", default=DEFAULT_CODECS, help="space-separated specs")
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    specs = [args.codec] if args.codec else args.codecs.split()
    rows = [train(s, args.steps, args.batch, args.lr) for s in specs]
    if hvd.rank() == 0:
        print(f"\n{hvd.size()} ranks, {args.steps} steps of batch {args.batch} per rank, "
              f"MLP 64-256-256-10 on digits (test set of 297)")
        print(f"{'codec':22s} {'test loss':>9s} {'accuracy':>8s} {'bytes/step':>11s} "
              f"{'ratio':>6s} {'step ms':>8s}")
        for r in rows:
            print(f"{r['codec']:22s} {r['test_loss']:9.4f} {r['test_accuracy']:8.3f} "
                  f"{r['bytes_per_step']:11.0f} {r['ratio']:6.2f} {r['step_ms']:8.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": hvd.size(), "steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
