"""A standard PyTorch DistributedDataParallel training script, plus one line: horovod_quant's
communication hook (an MLP on scikit-learn's digits).

    torchrun --standalone --nproc_per_node 2 examples/ddp_train.py --codec qsgd:8
    torchrun --standalone --nproc_per_node 2 examples/ddp_train.py --codec qsgd:8 --device cuda
    torchrun --standalone --nproc_per_node 2 examples/ddp_train.py --codecs "allreduce qsgd:4"
    torchrun --standalone --nproc_per_node 2 examples/ddp_train.py \\
        --json bench_out/demo_ddp.json        # the codecs `make demo` trains

The line that integrates horovod_quant is marked ``# horovod_quant:`` (and its import). A codec
is ``name`` or ``name:bits``; ``allreduce`` is DDP without a hook (float32 allreduce). With
``--codecs`` the script trains once per configuration in one launch, and rank 0 prints a table
and writes ``--json``.

Needs torch and scikit-learn (``pip install ".[examples]"``). ``--device cuda`` puts each rank on
the GPU of its ``LOCAL_RANK`` (ranks share GPUs when they outnumber them; the process group is
gloo's either way, for CUDA buckets too). The step time leaves out the first ``--warmup`` steps of
each configuration: the first codec's first steps compile its numba kernels (CPU) or load its
CUDA kernels.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel as DDP

from horovod_quant.doors import CodecRequest
from horovod_quant.torch import ddp  # horovod_quant: the DDP hook

DEFAULT_CODECS = "allreduce qsgd:8 qsgd:4 global_qsgd:8 nested_dithered:8"


def train(spec: str, steps: int, batch: int, lr: float, fallback: str, device: torch.device,
          warmup: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32, device=device)
    y = torch.tensor(y, device=device)
    n_test = 297
    x_test, y_test, x, y = x[:n_test], y[:n_test], x[n_test:], y[n_test:]
    x, y = x[rank::world], y[rank::world]
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                    torch.nn.Linear(256, 10)).to(device),
                device_ids=[device.index] if device.type == "cuda" else None)
    state = None
    if spec != "allreduce":
        name, _, bits = spec.partition(":")  # world-sized codecs get the group's size
        codec = CodecRequest(name, {"bits": int(bits)} if bits else {}).build(lambda: world)
        state = ddp.QuantizationState(codec, fallback=fallback)
        model.register_comm_hook(state, ddp.quantization_hook)  # horovod_quant: the one line
    opt = torch.optim.SGD(model.parameters(), lr=lr * world, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        idx = torch.randint(0, x.shape[0], (batch,), generator=gen).to(device)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    step_ms = (time.perf_counter() - t0) / (steps - warmup) * 1e3
    with torch.no_grad():
        logits = model.module(x_test)
        loss = torch.nn.functional.cross_entropy(logits, y_test).item()
        acc = (logits.argmax(1) == y_test).float().mean().item()
    numel = sum(p.numel() for p in model.parameters())
    sent = state.stats.bytes_sent / steps if state is not None else numel * 4.0
    return {"codec": spec, "test_loss": loss, "test_accuracy": acc, "bytes_per_step": sent,
            "ratio": numel * 4.0 / sent, "step_ms": step_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codec", default=None,
                    help="train one configuration, e.g. qsgd:8 or allreduce (default: every "
                         "one of --codecs)")
    ap.add_argument("--codecs", default=DEFAULT_CODECS,
                    help="space-separated configurations, trained one after the other "
                         "(default: %(default)s)")
    ap.add_argument("--steps", type=int, default=150, help="steps per codec (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=32, help="batch per rank (default: %(default)s)")
    ap.add_argument("--lr", type=float, default=0.05,
                    help="learning rate per rank, scaled by the world size (default: %(default)s)")
    ap.add_argument("--fallback", choices=("auto", "never"), default="never",
                    help="the hook's fallback: 'never' trains every listed codec (this script "
                         "compares them); 'auto' lets the faster of float32 and bf16 carry the "
                         "buckets whose codec was slower at step 1 (default: %(default)s)")
    ap.add_argument("--json", default=None, help="rank 0 writes the table's rows to this file")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: each rank on the GPU of its LOCAL_RANK (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=5,
                    help="steps of each configuration left out of its step time "
                         "(default: %(default)s)")
    args = ap.parse_args()
    if not 0 <= args.warmup < args.steps:
        ap.error(f"--warmup {args.warmup} must be at least 0 and below --steps {args.steps}")
    device = torch.device("cpu")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda: this torch sees no GPU (a CPU build, or no device)")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))
                              % torch.cuda.device_count())
        torch.cuda.set_device(device)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = [train(s, args.steps, args.batch, args.lr, args.fallback, device, args.warmup)
            for s in ([args.codec] if args.codec else args.codecs.split())]
    if dist.get_rank() == 0:
        print(f"\nDDP, {dist.get_world_size()} ranks (gloo, {args.device}), {args.steps} steps "
              f"of batch {args.batch} per rank, MLP 64-256-256-10 on digits (test set of 297); "
              f"step ms: the steps after the first {args.warmup}")
        print(f"{'codec':22s} {'test loss':>9s} {'accuracy':>8s} {'bytes/step':>11s} "
              f"{'ratio':>6s} {'step ms':>8s}")
        for r in rows:
            print(f"{r['codec']:22s} {r['test_loss']:9.4f} {r['test_accuracy']:8.3f} "
                  f"{r['bytes_per_step']:11.0f} {r['ratio']:6.2f} {r['step_ms']:8.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": dist.get_world_size(), "steps": args.steps,
                           "warmup": args.warmup, "device": args.device, "rows": rows}, f,
                          indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
