"""Data-parallel training of a small MLP on scikit-learn's digits with horovod_quant.

    horovodrun -np 2 python examples/pytorch_digits.py --codec qsgd --bits 8
    horovodrun -np 2 python examples/pytorch_digits.py --codec nuqsgd:4 --steps 300
    horovodrun -np 2 python examples/pytorch_digits.py --codec qsgd:8 --device cuda
    horovodrun -np 2 python examples/pytorch_digits.py --codecs "none fp16 qsgd:8 natural:8"
    horovodrun -np 2 -H localhost:2 --gloo python examples/pytorch_digits.py \\
        --json bench_out/demo_training.json          # every codec, as `make demo` runs it

The lines that integrate horovod_quant are marked ``# horovod_quant:``. A codec is ``name`` or
``name:bits`` (``--bits`` sets the bits of ``--codec`` too). With ``--codecs`` the script trains
once per listed configuration in one launch and rank 0 prints a table (``make demo`` runs every
codec that way) and writes ``--json``.

Progress: rank 0 shows a progress bar on stderr when that is a terminal. Under ``horovodrun`` or
``mpirun`` the ranks' output goes through a pipe, so pass ``--progress`` to see it there;
``--no-progress`` turns it off everywhere.

Needs Horovod, torch and scikit-learn (``pip install ".[examples]"``). ``--device cuda`` puts each
rank on the GPU of its Horovod local rank (ranks share GPUs when they outnumber them). The step
time leaves out each codec's first ``--warmup`` steps, which compile or load its kernels.
"""
import argparse
import json
import time

import horovod.torch as hvd
import torch
from sklearn.datasets import load_digits

import horovod_quant.torch as hq  # horovod_quant: the PyTorch door
from horovod_quant.stats import progress_bar

DEFAULT_CODECS = ("none fp16 qsgd:8 qsgd:4 nuqsgd:8 nuqsgd:4 natural:8 natural:4 "
                  "natural_dithering:8 standard_dithering:8 global_qsgd:8 global_qsgd:4 "
                  "dithered:8 nested_dithered:8 bf16")


def build_compression(spec: str):
    """``name`` or ``name:bits`` -> a Compressor (horovod_quant builds every codec the same way)."""
    name, _, bits = spec.partition(":")
    params = {"bits": int(bits)} if bits else {}
    return getattr(hq.Compression, name)(**params)  # horovod_quant: pick a codec


def train(spec: str, steps: int, batch: int, lr: float, fallback: str, device: torch.device,
          warmup: int, bar=None):
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32, device=device)
    y = torch.tensor(y, device=device)
    n_test = 297
    x_test, y_test, x, y = x[:n_test], y[:n_test], x[n_test:], y[n_test:]
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9)
    opt = hq.DistributedOptimizer(opt, named_parameters=model.named_parameters(),  # horovod_quant
                                  compression=build_compression(spec),            # horovod_quant
                                  fallback=fallback)                              # horovod_quant
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(hvd.rank())
    sent = raw = 0
    marks = [time.perf_counter()]  # before the first step, then after each step
    for step in range(steps):
        idx = torch.randint(0, x.shape[0], (batch,), generator=gen).to(device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
        sent += opt.last_stats.bytes_sent  # horovod_quant: per-step statistics
        raw += opt.last_stats.bytes_raw
        if bar is not None:
            bar.update()
        if device.type == "cuda" and step in (warmup - 1, steps - 1):
            torch.cuda.synchronize(device)  # the timed steps' GPU work ends inside their time
        marks.append(time.perf_counter())
    step_ms = (marks[-1] - marks[warmup]) / (steps - warmup) * 1e3
    with torch.no_grad():
        logits = model(x_test)
        loss = torch.nn.functional.cross_entropy(logits, y_test).item()
        acc = (logits.argmax(1) == y_test).float().mean().item()
    return {"codec": spec, "test_loss": loss, "test_accuracy": acc,
            "bytes_per_step": sent / steps, "ratio": raw / sent if sent else float("inf"),
            "step_ms": step_ms}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codec", default=None,
                    help="train one codec, name or name:bits, e.g. qsgd or qsgd:4 "
                         "(default: every codec of --codecs)")
    ap.add_argument("--bits", type=int, default=None,
                    help="bits for --codec (the same as writing --codec name:bits)")
    ap.add_argument("--codecs", default=DEFAULT_CODECS,
                    help="space-separated specs, trained one after the other "
                         "(default: %(default)s)")
    ap.add_argument("--steps", type=int, default=150, help="steps per codec (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=32, help="batch per rank (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=0.05,
                    help="learning rate per rank, scaled by the world size (default: %(default)s)")
    ap.add_argument("--fallback", choices=("auto", "never"), default="never",
                    help="hq.DistributedOptimizer's fallback: 'never' trains every listed codec "
                         "(this script compares them); 'auto' lets the faster of Horovod's "
                         "float32 and 16-bit allreduce carry the buckets whose codec was slower "
                         "at step 1 (default: %(default)s)")
    ap.add_argument("--json", default=None, help="rank 0 writes the table's rows to this file")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="progress bar on rank 0's stderr (default: only when it is a terminal)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: each rank on the GPU of its local rank (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=5,
                    help="steps of each codec left out of its step time (default: %(default)s)")
    args = ap.parse_args()
    if not 0 <= args.warmup < args.steps:
        ap.error(f"--warmup {args.warmup} must be at least 0 and below --steps {args.steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this torch sees no GPU (a CPU build, or no device)")
    if args.bits is not None:
        if args.codec is None:
            ap.error("--bits goes with --codec (in --codecs write name:bits)")
        name, _, bits = args.codec.partition(":")
        if bits and int(bits) != args.bits:
            ap.error(f"--codec {args.codec} and --bits {args.bits} disagree")
        args.codec = f"{name}:{args.bits}"
    hvd.init()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    specs = [args.codec] if args.codec else args.codecs.split()
    bar = progress_bar(len(specs) * args.steps, hvd.rank(), args.progress)
    rows = []
    for s in specs:
        bar.set_postfix_str(s, refresh=False)
        rows.append(train(s, args.steps, args.batch, args.lr, args.fallback, device,
                          args.warmup, bar))
    bar.close()
    if hvd.rank() == 0:
        print(f"\n{hvd.size()} ranks ({args.device}), {args.steps} steps of batch {args.batch} "
              f"per rank, MLP 64-256-256-10 on digits (test set of 297); step ms: the steps "
              f"after the first {args.warmup}")
        print(f"{'codec':22s} {'test loss':>9s} {'accuracy':>8s} {'bytes/step':>11s} "
              f"{'ratio':>6s} {'step ms':>8s}")
        for r in rows:
            print(f"{r['codec']:22s} {r['test_loss']:9.4f} {r['test_accuracy']:8.3f} "
                  f"{r['bytes_per_step']:11.0f} {r['ratio']:6.2f} {r['step_ms']:8.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": hvd.size(), "steps": args.steps, "warmup": args.warmup,
                           "device": args.device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
