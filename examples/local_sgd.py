"""Local SGD with DiLoCo-style outer steps through a compressed all-reduce (an MLP on
scikit-learn's digits).

    torchrun --standalone --nproc_per_node 2 examples/local_sgd.py
    torchrun --standalone --nproc_per_node 4 examples/local_sgd.py --compression nested_dithered
    torchrun --standalone --nproc_per_node 2 examples/local_sgd.py --device cuda

Each rank trains its own shard of the data for ``--inner-steps`` AdamW steps; then the ranks
average the pseudo-gradient (the parameters at the start of the round minus the current ones)
through ``horovod_quant.torch.allreduce`` with ``--compression`` (a codec, or ``name:bits``),
and take one outer step of SGD with Nesterov momentum from the round's start, as DiLoCo does.
Every rank gets the same average bit for bit, so the models stay identical without a
broadcast. Rank 0 prints, per outer step, the test loss and the bytes this rank sent in the
all-reduce against the same pseudo-gradient in float32. The lines that integrate horovod_quant
are marked ``# horovod_quant:``.

Needs torch and scikit-learn (``pip install ".[examples]"``). ``--device cuda`` puts each rank on
the GPU of its ``LOCAL_RANK`` (the process group is gloo's either way).
"""
import argparse
import os

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.nn.utils import parameters_to_vector, vector_to_parameters

import horovod_quant.torch as hqt  # horovod_quant: the compressed all-reduce


def data(device: torch.device):
    """This rank's shard of the training digits, and the test set (297 digits)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32, device=device)
    y = torch.tensor(y, device=device)
    n_test = 297
    return x[n_test:][rank::world], y[n_test:][rank::world], x[:n_test], y[:n_test]


def train(args, device: torch.device) -> list:
    """DiLoCo on every rank; returns rank 0's rows (outer step, test loss, accuracy, bytes
    sent, float32 bytes)."""
    x, y, x_test, y_test = data(device)
    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10)).to(device)
    inner = torch.optim.AdamW(model.parameters(), lr=args.inner_lr)
    outer_opt = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=0.9,
                                nesterov=True)
    # horovod_quant: built once on every rank; its state_dict() goes into a checkpoint
    outer = hqt.OuterAllreduce(args.compression)
    gen = torch.Generator().manual_seed(dist.get_rank())
    rows = []
    for step in range(args.outer_steps):
        start = parameters_to_vector(model.parameters()).detach().clone()
        for _ in range(args.inner_steps):
            idx = torch.randint(0, x.shape[0], (args.batch,), generator=gen).to(device)
            inner.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            inner.step()
        delta = start - parameters_to_vector(model.parameters()).detach()
        outer.stats.reset()
        delta = hqt.allreduce(delta, outer, key=step)  # horovod_quant: the same key everywhere
        sent = outer.stats.reset()
        vector_to_parameters(start, model.parameters())  # back to the round's start, then
        at = 0                                           # the outer step along the mean
        for p in model.parameters():
            p.grad = delta[at:at + p.numel()].view_as(p).clone()
            at += p.numel()
        outer_opt.step()
        with torch.no_grad():
            logits = model(x_test)
            loss = torch.nn.functional.cross_entropy(logits, y_test).item()
            acc = (logits.argmax(1) == y_test).float().mean().item()
        rows.append((step, loss, acc, sent.bytes_sent, sent.bytes_raw))
        if dist.get_rank() == 0:
            print(f"outer step {step}: test loss {loss:.4f}, accuracy {acc:.3f}; all-reduce sent "
                  f"{sent.bytes_sent} bytes, float32 {sent.bytes_raw} "
                  f"({sent.bytes_raw / sent.bytes_sent:.2f}x fewer)", flush=True)
    return rows


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compression", default="qsgd:8",
                    help="the codec: a name, or name:bits (default: %(default)s)")
    ap.add_argument("--outer-steps", type=int, default=10,
                    help="outer steps, each one compressed all-reduce (default: %(default)s)")
    ap.add_argument("--inner-steps", type=int, default=20,
                    help="local AdamW steps per outer step (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=32, help="batch per rank (default: %(default)s)")
    ap.add_argument("--inner-lr", type=float, default=1e-3,
                    help="AdamW's learning rate (default: %(default)s)")
    ap.add_argument("--outer-lr", type=float, default=0.4,
                    help="the outer SGD's learning rate, Nesterov momentum 0.9 (default: "
                         "%(default)s)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: each rank on the GPU of its LOCAL_RANK (default: %(default)s)")
    args = ap.parse_args(argv)
    device = torch.device("cpu")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            ap.error("--device cuda: this torch sees no GPU (a CPU build, or no device)")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))
                              % torch.cuda.device_count())
        torch.cuda.set_device(device)
    started = not dist.is_initialized()  # (a test calls main() in its own process group)
    if started:
        dist.init_process_group("gloo")
        torch.set_num_threads(1)
    rows = train(args, device)
    if started:
        dist.destroy_process_group()
    return rows


if __name__ == "__main__":
    main()
