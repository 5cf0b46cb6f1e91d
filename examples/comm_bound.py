"""A communication-bound model: wide dense layers, little compute per byte of gradient.

    horovodrun -np 2 python examples/comm_bound.py
    horovodrun -np 2 python examples/comm_bound.py --hidden 4096 --steps 30 \\
        --codecs "none fp16 qsgd:4 nuqsgd:4 global_qsgd:8"
    mpirun -np 2 --allow-run-as-root python examples/comm_bound.py
    horovodrun -np 2 python examples/comm_bound.py --device cuda    # a GPU per local rank

The model is an MLP ``--inputs`` -> ``--hidden`` -> ``--hidden`` -> 10 (default 1024-2048-2048-10,
6.3M parameters, 25 MB of float32 gradient per step) trained on a deterministic synthetic
classification set (a fixed random linear teacher; nothing is downloaded) with a small batch,
so each step computes little and exchanges a lot: the regime where gradient compression pays.

For each codec (``name`` or ``name:bits``) rank 0 prints the bytes this rank sent per step, the
compression ratio, the wall time per step and its split (encode, waiting for collectives,
decode) from ``opt.last_stats``; ``none`` goes through Horovod's own allreduce, which those
statistics do not time, so its split shows "-"), and the loss reached. On one host ranks
exchange through shared memory at several GB/s, so compression often does not cut wall time
here: encoding costs CPU time that a fast link does not give back. The column
``payload @ --link-gbps`` is only an estimate (bytes / link bandwidth) of the payload's transfer
time on a slower network, to show where the bytes start to dominate; it is not measured.

Progress: rank 0 shows a progress bar on stderr when that is a terminal. Under ``horovodrun`` or
``mpirun`` the ranks' output goes through a pipe, so pass ``--progress`` to see it there;
``--no-progress`` turns it off everywhere. Needs Horovod and torch (``pip install
".[examples]"``).
"""
import argparse
import time

import horovod.torch as hvd
import torch

import horovod_quant.torch as hq  # horovod_quant: the PyTorch door
from horovod_quant.stats import progress_bar


def synthetic(n, inputs, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, inputs, generator=g)
    teacher = torch.randn(inputs, 10, generator=g)
    y = (x @ teacher + 0.5 * torch.randn(n, 10, generator=g)).argmax(1)
    return x, y


def build_compression(spec):
    name, _, bits = spec.partition(":")
    params = {"bits": int(bits)} if bits else {}
    return getattr(hq.Compression, name)(**params)  # horovod_quant: pick a codec


def run(spec, args, x, y, bar, device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.inputs, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    opt = hq.DistributedOptimizer(opt, named_parameters=model.named_parameters(),  # horovod_quant
                                  compression=build_compression(spec),            # horovod_quant
                                  fallback=args.fallback)                         # horovod_quant
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(hvd.rank())
    xs, ys = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    tot = {"sent": 0, "raw": 0, "enc": 0.0, "xch": 0.0, "dec": 0.0, "wall": 0.0}
    for step in range(args.warmup + args.steps):
        idx = torch.randint(0, xs.shape[0], (args.batch,), generator=gen).to(device)
        t = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx])
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t
        bar.update()
        if step >= args.warmup:  # the first steps compile kernels and set up collectives
            st = opt.last_stats  # horovod_quant: per-step statistics
            tot["sent"] += st.bytes_sent
            tot["raw"] += st.bytes_raw
            tot["enc"] += st.encode_s
            tot["xch"] += st.exchange_s
            tot["dec"] += st.decode_s
            tot["wall"] += wall
    with torch.no_grad():
        full = torch.nn.functional.cross_entropy(model(x), y).item()
    n = args.steps
    return {"codec": spec, "bytes": tot["sent"] / n, "ratio": tot["raw"] / max(tot["sent"], 1),
            "ms": 1e3 * tot["wall"] / n, "enc": 1e3 * tot["enc"] / n,
            "xch": 1e3 * tot["xch"] / n, "dec": 1e3 * tot["dec"] / n, "loss": full}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The docstring's commands one per line, every option's default in its help."""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--codecs", default="none fp16 qsgd:8 qsgd:4 nuqsgd:4 global_qsgd:8",
                    help="space-separated codec specs (name or name:bits), one run each")
    ap.add_argument("--inputs", type=int, default=1024, help="input features")
    ap.add_argument("--hidden", type=int, default=2048, help="width of both hidden layers")
    ap.add_argument("--batch", type=int, default=16, help="per rank")
    ap.add_argument("--samples", type=int, default=4096, help="synthetic training samples")
    ap.add_argument("--steps", type=int, default=15, help="timed steps per codec")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    ap.add_argument("--lr", type=float, default=0.01, help="per rank (scaled by the world size)")
    ap.add_argument("--fallback", choices=("auto", "never"), default="never",
                    help="hq.DistributedOptimizer's fallback: 'never' trains every listed codec "
                         "(this script compares them); 'auto' lets Horovod's float32 "
                         "allreduce carry the buckets whose codec was slower at step 1 "
                         "(default: %(default)s)")
    ap.add_argument("--link-gbps", type=float, default=10.0,
                    help="bandwidth for the estimated payload transfer time column")
    ap.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="progress bar on rank 0's stderr; unset: only if stderr is a terminal")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: each rank on the GPU of its local rank")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this torch sees no GPU (a CPU build, or no device)")
    hvd.init()
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.set_device(device)
    x, y = (t.to(device) for t in synthetic(args.samples, args.inputs))
    specs = args.codecs.split()
    bar = progress_bar(len(specs) * (args.warmup + args.steps), hvd.rank(), args.progress)
    rows = []
    for spec in specs:
        bar.set_postfix_str(spec, refresh=False)
        rows.append(run(spec, args, x, y, bar, device))
    bar.close()
    if hvd.rank() == 0:
        params = args.inputs * args.hidden + args.hidden * args.hidden + args.hidden * 10
        print(f"\n{hvd.size()} ranks, MLP {args.inputs}-{args.hidden}-{args.hidden}-10 "
              f"(~{params / 1e6:.1f}M parameters, {4 * params / 2**20:.0f} MiB float32 gradient), "
              f"batch {args.batch}/rank, {args.steps} timed steps after {args.warmup} warm-up")
        est_head = f"payload @ {args.link_gbps:g} Gb/s (est.)"
        print(f"{'codec':16s} {'MB/step':>8s} {'ratio':>6s} {'ms/step':>8s} {'encode':>7s} "
              f"{'exchange':>8s} {'decode':>7s} {est_head:>26s} {'loss':>7s}")
        for r in rows:
            est = 1e3 * r["bytes"] * 8 / (args.link_gbps * 1e9)
            split = (f"{r['enc']:7.1f} {r['xch']:8.1f} {r['dec']:7.1f}" if r["enc"] + r["xch"] > 0
                     else f"{'-':>7s} {'-':>8s} {'-':>7s}")  # Horovod's own allreduce: untimed
            print(f"{r['codec']:16s} {r['bytes'] / 1e6:8.2f} {r['ratio']:6.2f} {r['ms']:8.1f} "
                  f"{split} {est:23.1f} ms {r['loss']:7.4f}")


if __name__ == "__main__":
    main()
