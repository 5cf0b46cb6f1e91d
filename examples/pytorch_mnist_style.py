"""Horovod's classic PyTorch MNIST example, on scikit-learn's 8x8 digits, with horovod_quant.

    horovodrun -np 2 python examples/pytorch_mnist_style.py
    horovodrun -np 2 python examples/pytorch_mnist_style.py --codec nuqsgd --bits 4
    horovodrun -np 2 python examples/pytorch_mnist_style.py --codec global_qsgd --bits 8 \\
        --hq-optimizer            # horovod_quant's DistributedOptimizer (fusion, global norm)
    mpirun -np 2 --allow-run-as-root python examples/pytorch_mnist_style.py
    horovodrun -np 2 python examples/pytorch_mnist_style.py --device cuda   # a GPU per local rank

Same structure as horovod/examples/pytorch/pytorch_mnist.py (conv-conv-pool-dropout-fc-fc,
DistributedSampler, lr scaled by the world size, parameter and optimizer-state broadcast,
metric averaging), on the digits that ship with scikit-learn, so nothing is downloaded. Every
line that differs from a plain Horovod script is marked ``# horovod_quant:``. Needs Horovod,
torch and scikit-learn (``pip install ".[examples]"``).
"""
import argparse
import logging
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F
import torch.utils.data
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import horovod_quant.torch as hq  # horovod_quant: the PyTorch door


class Net(nn.Module):
    """The MNIST example's network, sized for 1x8x8 inputs (151,306 parameters)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.dropout1 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(64 * 4 * 4, 128)
        self.dropout2 = nn.Dropout(0.5)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


def datasets():
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0 - 0.5).reshape(-1, 1, 8, 8)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    def as_ds(a, b):
        return torch.utils.data.TensorDataset(
            torch.tensor(a, dtype=torch.float32), torch.tensor(b, dtype=torch.long))
    return as_ds(xtr, ytr), as_ds(xte, yte)


def metric_average(val, name):
    return hvd.allreduce(torch.tensor(val), name=name).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05, help="per rank (scaled by hvd.size())")
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--codec", default="qsgd", help="a horovod_quant codec name, or none")
    ap.add_argument("--bits", type=int, default=8)
    ap.add_argument("--bucket-size", type=int, default=512,
                    help="elements per scale, for codecs that take one")
    ap.add_argument("--hq-optimizer", action="store_true",
                    help="use hq.DistributedOptimizer instead of hvd.DistributedOptimizer")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: each rank on the GPU of its local rank (default: %(default)s)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this torch sees no GPU (a CPU build, or no device)")

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)

    train_ds, test_ds = datasets()
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_ds, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_ds, batch_size=args.batch_size,
                                               sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_ds, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_ds, batch_size=256, sampler=test_sampler)

    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(),
                                momentum=args.momentum)

    # horovod_quant: build the codec's Compressor; bits/bucket_size only where the codec has them
    params = {}
    if args.codec not in ("none", "fp16", "bf16"):
        params["bits"] = args.bits
        if args.codec in ("qsgd", "nuqsgd", "natural", "natural_dithering",
                          "standard_dithering", "dithered", "nested_dithered"):
            params["bucket_size"] = args.bucket_size
    compression = getattr(hq.Compression, args.codec)(**params)  # horovod_quant: the codec
    # horovod_quant: a logging line of bytes sent/saved and codec time every 20 steps and per
    # epoch, on rank 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    stats_log = hq.StatsLogger(every=20)

    if args.hq_optimizer:
        optimizer = hq.DistributedOptimizer(  # horovod_quant: fusion, global norm, policy
            optimizer, named_parameters=model.named_parameters(), compression=compression,
            on_step=stats_log)
    else:
        optimizer = hvd.DistributedOptimizer(  # horovod_quant: only compression= changes
            optimizer, named_parameters=model.named_parameters(), compression=compression)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    if hvd.rank() == 0:
        print(f"{hvd.size()} ranks, codec {args.codec} {params}, "
              f"{'hq' if args.hq_optimizer else 'hvd'}.DistributedOptimizer, "
              f"{sum(p.numel() for p in model.parameters())} parameters")
    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        for data, target in train_loader:
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            if not args.hq_optimizer:
                stats_log.step(compression)  # horovod_quant: the compressor's totals
        epoch_s = time.perf_counter() - t0
        stats_log.epoch_end(epoch)  # horovod_quant
        model.eval()
        test_loss = correct = 0.0
        with torch.no_grad():
            for data, target in test_loader:
                data, target = data.to(device), target.to(device)
                out = model(data)
                test_loss += F.nll_loss(out, target, reduction="sum").item()
                correct += (out.argmax(1) == target).sum().item()
        test_loss = metric_average(test_loss, "avg_loss") * hvd.size() / len(test_ds)
        test_acc = metric_average(correct, "avg_acc") * hvd.size() / len(test_ds)
        if hvd.rank() == 0:
            print(f"epoch {epoch}: last batch loss {loss.item():.4f}  test loss {test_loss:.4f}"
                  f"  test accuracy {100 * test_acc:.2f}%  ({epoch_s:.1f}s)")


if __name__ == "__main__":
    main()
