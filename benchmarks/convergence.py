"""Convergence of data-parallel training under every codec, with real Horovod ranks.

    python3 benchmarks/convergence.py                            # worlds 2 and 4, 3 seeds
    python3 benchmarks/convergence.py --worlds 2 --seeds 1 --steps 100 --out /tmp/conv  # smoke
    python3 benchmarks/convergence.py --plot-only                # redraw from the JSON
    python3 benchmarks/convergence.py --worlds 2x2 --tag hosts   # 2 host names x 2 ranks

The driver starts ONE launch per world (``horovodrun -np N --gloo`` by default, or
``mpirun -np N --allow-run-as-root`` with ``--launcher mpirun``; a world ``HxK`` is H host
names of this machine with K ranks each, so the optimizer takes its hierarchical plans) that
trains every codec for every seed in sequence, so Horovod's start-up is paid once per world.
Rank 0 of the launch rewrites ``<out>/convergence_n<N>.json`` after every run (a launch cut
short keeps what it finished). The driver then draws the loss curves and writes the tables.

``--task`` picks the model and data (``TASKS``): ``mlp`` (the default, below), ``cnn`` (a small
conv net on the same digits split) or ``bytelm`` (a byte-level GPT on this Python's
standard-library source, split by file into training and validation files; ``ByteLM``). Each
task brings its own defaults for ``--steps``, ``--batch``, ``--lr`` and ``--eval-every``, and
its outputs are named ``convergence_<task>[_<tag>]_n<N>.*`` (the MLP's keep their names):

    python3 benchmarks/convergence.py --task bytelm --worlds 2 --seeds 3 --codecs readme

Task: the 64-256-256-10 MLP (85,002 parameters) on scikit-learn's digits (8x8 images, ships
with scikit-learn: no download), stratified 1,347 / 450 train/test split (random_state=0);
each rank trains on its shard (rank::size) with mini-batches of ``--batch`` per rank, SGD with
momentum 0.9 and learning rate ``--lr`` x world size, for a fixed budget of ``--steps`` steps
(no schedule). Every codec runs through ``hq.DistributedOptimizer`` (fusion into one bucket,
default LayerPolicy: biases and tensors under 1024 elements travel uncompressed, which is
~0.6% of the parameters). For seed k, model initialisation, the mini-batch sequence and the
codec seed are the same across codecs, so differences against fp32 are paired.

Recorded per run: full training-set loss, test loss and test accuracy every ``--eval-every``
steps (rank 0; all ranks hold the same model), bytes sent per step and rank (payloads, norms,
uncompressed tensors), wall time per step. Outputs: ``convergence_n<N>.json``,
``convergence_n<N>.png`` (one small panel per codec with fp32 in every panel: training-set
loss and test error = 1 - accuracy against steps, log axes, mean over seeds, shaded +- std),
``convergence_gap.png`` (final loss and accuracy gap to fp32 per codec) and
``convergence_tables.md``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: label -> (codec name, parameters). Labels are what tables and plots show.
CODECS = {
    "fp32": ("none", {}),
    "fp16": ("fp16", {}),
    "qsgd 8b b512": ("qsgd", {"bits": 8, "bucket_size": 512, "norm": "l2"}),
    "qsgd 4b b512": ("qsgd", {"bits": 4, "bucket_size": 512, "norm": "l2"}),
    "nuqsgd 4b b512": ("nuqsgd", {"bits": 4, "bucket_size": 512}),
    "natural 8b": ("natural", {"bits": 8}),
    "natural_dithering 4b p=inf": ("natural_dithering", {"bits": 4, "p": math.inf}),
    "standard_dithering 4b p=inf": ("standard_dithering", {"bits": 4, "p": math.inf}),
    "global_qsgd linear 8b": ("global_qsgd", {"bits": 8, "levels": "linear"}),
    "global_qsgd exp 8b": ("global_qsgd", {"bits": 8, "levels": "exponential"}),
    "global_qsgd linear 5b": ("global_qsgd", {"bits": 5, "levels": "linear"}),
    "global_qsgd exp 5b": ("global_qsgd", {"bits": 5, "levels": "exponential"}),
    "dithered 4b": ("dithered", {"bits": 4}),
    "nested_dithered 4b": ("nested_dithered", {"bits": 4}),
    # high-variance settings, for --codecs stress
    "qsgd 2b b128": ("qsgd", {"bits": 2, "bucket_size": 128, "norm": "l2"}),
    "global_qsgd linear 4b": ("global_qsgd", {"bits": 4, "levels": "linear"}),
    "global_qsgd exp 4b": ("global_qsgd", {"bits": 4, "levels": "exponential"}),
    # control: no compression, learning rate changed in its 7th digit. It measures how far a
    # run moves from the fp32 run of the same seed through chaos alone (any last-bit change to
    # the trajectory), the noise floor of every paired gap.
    "fp32 control (lr x (1+1e-6))": ("none", {}, 1 + 1e-6),
    # the README's recommendations at their defaults (qsgd: bucket 512, max norm; global_qsgd:
    # exponential levels), for --codecs readme
    "qsgd 8b b512 max": ("qsgd", {"bits": 8, "bucket_size": 512, "norm": "max"}),
    "qsgd 4b b512 max": ("qsgd", {"bits": 4, "bucket_size": 512, "norm": "max"}),
}
#: ``--codecs`` presets
PRESETS = {
    "default": [label for label in CODECS if label not in (
        "qsgd 2b b128", "global_qsgd linear 4b", "global_qsgd exp 4b",
        "fp32 control (lr x (1+1e-6))", "qsgd 8b b512 max", "qsgd 4b b512 max")],
    # float32, Horovod's 16 bits, and the README's "Which codec" list at its defaults
    "readme": ["fp32", "fp16", "qsgd 8b b512 max", "qsgd 4b b512 max", "global_qsgd exp 8b"],
    "control": ["fp32 control (lr x (1+1e-6))"],
    # where the measured variances differ by an order of magnitude (docs/results/variance*):
    # does the difference show in training?
    "stress": ["fp32", "qsgd 4b b512", "qsgd 2b b128", "global_qsgd linear 4b",
               "global_qsgd exp 4b", "global_qsgd linear 5b", "global_qsgd exp 5b"],
}


# ================================================================================ worker ======
def make_data(seed_split: int = 0):
    import numpy as np
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=seed_split,
                                          stratify=y)
    def t(a, dt):
        return torch.tensor(a, dtype=dt)
    return (t(xtr, torch.float32), t(ytr, torch.long), t(xte, torch.float32),
            t(yte, torch.long))


class DigitsMLP:
    """The task of the module docstring: ``data`` is (x_train, y_train, x_test, y_test)."""
    name, title, optimizer_note = "mlp", "digits MLP", "momentum 0.9"
    steps, batch, lr, eval_every = 200, 16, 0.025, 20
    #: the world's learning rate: per-rank lr x size ("linear") or x sqrt(size) ("sqrt")
    lr_scaling = "linear"
    #: the paired gaps of the gap plot (left, right)
    gap_keys = ("gap_train_loss", "gap_test_acc")
    #: what the tables call the test split, its loss and its accuracy
    words = {"test": "test", "loss": "loss", "acc": "accuracy"}
    #: the curves drawn per codec (top, bottom): curve key, title
    curve_keys = (("train_loss", "training-set loss"),
                  ("test_acc", "test error = 1 - test accuracy"))
    #: the tables' metric columns: header, summary key, scale, decimals
    columns = (("train loss", "train_loss", 1, 4), ("test loss", "test_loss", 1, 4),
               ("test acc (%)", "test_acc", 100, 2), ("Δ train loss", "gap_train_loss", 1, 4),
               ("Δ mean-curve loss", "gap_mean_curve_loss", 1, 4),
               ("Δ test acc (pp)", "gap_test_acc", 100, 2))
    #: a line above the tables
    table_note = ""

    def data(self):
        return make_data()

    def meta(self, data) -> dict:
        return {"train": int(data[0].shape[0]), "test": int(data[2].shape[0])}

    def model(self):
        import torch
        return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                   torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                   torch.nn.Linear(256, 10))

    def optimizer(self, params, lr):
        import torch
        return torch.optim.SGD(params, lr=lr, momentum=0.9)

    def shard(self, data, rank, size):
        return data[0][rank::size], data[1][rank::size]

    def batch_of(self, shard, gen, batch):
        import torch
        xs, ys = shard
        idx = torch.randint(0, xs.shape[0], (batch,), generator=gen)
        return xs[idx], ys[idx]

    def loss(self, model, x, y):
        import torch
        return torch.nn.functional.cross_entropy(model(x), y)

    def evaluate(self, model, data) -> dict:
        """Full training-set loss, test loss and test accuracy."""
        import torch
        xtr, ytr, xte, yte = data
        lossf = torch.nn.functional.cross_entropy
        with torch.no_grad():
            tr = lossf(model(xtr), ytr).item()
            logits = model(xte)
            te = lossf(logits, yte).item()
            acc = (logits.argmax(1) == yte).float().mean().item()
        return {"train_loss": tr, "test_loss": te, "test_acc": acc}


def final_gap_columns(test: str) -> tuple:
    """Table columns led by the final ``test`` loss gap (the MLP's tables lead with training)."""
    return (("train loss", "train_loss", 1, 4), (f"{test} loss", "test_loss", 1, 4),
            (f"{test} acc (%)", "test_acc", 100, 2), (f"Δ {test} loss", "gap_test_loss", 1, 4),
            ("Δ mean-curve train loss", "gap_mean_curve_loss", 1, 4),
            (f"Δ {test} acc (pp)", "gap_test_acc", 100, 2))


class DigitsCNN(DigitsMLP):
    """The digits MLP's data, split and optimizer with a small conv net: conv 3x3 1->16, ReLU,
    conv 3x3 16->32, ReLU, 2x2 max pool, 512-64-10 (38,282 parameters)."""
    name, title = "cnn", "digits CNN"
    steps = 300  # the conv net starts slower than the MLP
    gap_keys = ("gap_test_loss", "gap_test_acc")
    columns = final_gap_columns("test")

    def model(self):
        import torch
        nn = torch.nn
        return nn.Sequential(nn.Unflatten(1, (1, 8, 8)), nn.Conv2d(1, 16, 3, padding=1),
                             nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Flatten(), nn.Linear(512, 64), nn.ReLU(),
                             nn.Linear(64, 10))


def stdlib_sources(val_every: int = 10) -> tuple[list[str], list[str]]:
    """This Python's standard-library ``*.py`` files (relative paths, sorted), split by file:
    validation when the first byte of sha1(path) is 0 mod ``val_every``. Tests, idlelib's tests
    and installed packages are left out."""
    import hashlib
    import sysconfig
    root = sysconfig.get_paths()["stdlib"]
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    train, val = [], []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in skip)
        for f in sorted(files):
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), root)
                digest = hashlib.sha1(rel.encode()).digest()[0]
                (val if digest % val_every == 0 else train).append(rel)
    return sorted(train), sorted(val)


class ByteLM(DigitsMLP):
    """A byte-level GPT (vocabulary 256, context 64, 2 pre-norm blocks of d_model 128 with 4
    heads and a 512-wide MLP; 470,528 parameters) on this Python's standard-library source,
    split by file (``stdlib_sources``). Each rank samples windows from its contiguous 1/size
    of the training bytes; Adam. Losses in nats per byte on fixed windows (64 of the training
    bytes, 256 of the held-out files); accuracy is next-byte accuracy."""
    name, title, optimizer_note = "bytelm", "byte GPT, stdlib", "Adam"
    steps, batch, lr, eval_every = 150, 16, 1.5e-3, 30
    lr_scaling = "sqrt"
    gap_keys = ("gap_test_loss", "gap_test_acc")
    words = {"test": "validation", "loss": "loss (nats/byte)", "acc": "next-byte accuracy"}
    curve_keys = (("test_loss", "validation loss (nats/byte)"),
                  ("test_acc", "validation error = 1 - next-byte accuracy"))
    columns = final_gap_columns("val")
    table_note = ("Byte-level GPT on this Python's standard-library source, split by file: "
                  "losses in nats per byte (bits per byte = nats / ln 2) on fixed windows "
                  "(train: 64 windows of the training files; val: 256 windows of the held-out "
                  "files); acc = next-byte accuracy on the validation windows.")
    context, d_model, layers, heads = 64, 128, 2, 4
    eval_train, eval_val = 64, 256

    def data(self):
        import sysconfig

        import numpy as np
        import torch
        root = sysconfig.get_paths()["stdlib"]
        train, val = stdlib_sources()

        def stream(files):
            blob = b"\n\n".join(open(os.path.join(root, f), "rb").read() for f in files)
            return torch.from_numpy(np.frombuffer(blob, np.uint8).copy())
        tr, va = stream(train), stream(val)
        gen = torch.Generator().manual_seed(0)  # fixed evaluation windows
        fixed = [torch.randint(0, len(s) - self.context - 1, (k,), generator=gen)
                 for s, k in ((tr, self.eval_train), (va, self.eval_val))]
        return {"train": tr, "val": va, "fixed": fixed, "files": (len(train), len(val))}

    def meta(self, data) -> dict:
        import sys as _sys
        return {"train": int(data["train"].numel()), "test": int(data["val"].numel()),
                "files_train": data["files"][0], "files_val": data["files"][1],
                "python": _sys.version.split()[0], "context": self.context,
                "d_model": self.d_model, "layers": self.layers, "heads": self.heads}

    def windows(self, stream, starts):
        import torch
        w = stream[starts[:, None] + torch.arange(self.context + 1)].long()
        return w[:, :-1], w[:, 1:]

    def model(self):
        import torch
        nn, F = torch.nn, torch.nn.functional
        ctx, d, h = self.context, self.d_model, self.heads

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
                self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
                self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

            def forward(self, x):
                b, t, _ = x.shape
                q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4)
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
                return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

        class GPT(nn.Module):
            def __init__(self, layers):
                super().__init__()
                self.tok, self.pos = nn.Embedding(256, d), nn.Embedding(ctx, d)
                self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
                self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 256, bias=False)

            def forward(self, x):
                z = self.tok(x) + self.pos(torch.arange(x.shape[1]))
                return self.head(self.ln(self.blocks(z)))
        return GPT(self.layers)

    def optimizer(self, params, lr):
        import torch
        return torch.optim.Adam(params, lr=lr)

    def shard(self, data, rank, size):
        s = data["train"]
        return s[rank * len(s) // size:(rank + 1) * len(s) // size]

    def batch_of(self, shard, gen, batch):
        import torch
        return self.windows(shard, torch.randint(0, len(shard) - self.context - 1, (batch,),
                                                 generator=gen))

    def loss(self, model, x, y):
        import torch
        return torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))

    def evaluate(self, model, data) -> dict:
        import torch
        out = {}
        with torch.no_grad():
            for key, stream, starts in (("train", data["train"], data["fixed"][0]),
                                        ("test", data["val"], data["fixed"][1])):
                x, y = self.windows(stream, starts)
                logits = model(x).reshape(-1, 256)
                out[f"{key}_loss"] = torch.nn.functional.cross_entropy(
                    logits, y.reshape(-1)).item()
                if key == "test":
                    out["test_acc"] = (logits.argmax(1) == y.reshape(-1)).float().mean().item()
        return out


TASKS = {t.name: t for t in (DigitsMLP, DigitsCNN, ByteLM)}
GAP_TITLES = {"gap_train_loss": "final training {loss} - fp32",
              "gap_test_loss": "final {test} {loss} - fp32",
              "gap_test_acc": "final {test} {acc} - fp32"}


def world_lr(task, lr: float, size: int) -> float:
    return lr * (size if task.lr_scaling == "linear" else math.sqrt(size))


def train_one(label: str, seed: int, args, data) -> dict:
    import horovod.torch as hvd
    import torch

    import horovod_quant.torch as hq

    task = TASKS[args.task]()
    name, params, *rest = CODECS[label]
    lr_scale = rest[0] if rest else 1.0
    rank, size = hvd.rank(), hvd.size()
    shard = task.shard(data, rank, size)
    torch.manual_seed(seed)
    model = task.model()
    opt = task.optimizer(model.parameters(), world_lr(task, args.lr, size) * lr_scale)
    compression = getattr(hq.Compression, name)(seed=1000 + seed, **params)
    opt = hq.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                  compression=compression, fallback="never")  # the codec's own
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(10_000 * seed + rank)

    def evaluate(step):
        if rank != 0:
            return None
        return {"step": step, **task.evaluate(model, data)}

    curve = [evaluate(0)]
    sent = raw = 0
    plans: dict[str, int] = {}
    t_train = 0.0
    diverged = False
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        x, y = task.batch_of(shard, gen, args.batch)
        opt.zero_grad()
        loss = task.loss(model, x, y)
        loss.backward()
        opt.step()
        t_train += time.perf_counter() - t
        sent += opt.last_stats.bytes_sent
        raw += opt.last_stats.bytes_raw
        for plan, count in opt.last_stats.plans.items():
            plans[plan] = plans.get(plan, 0) + count
        if step % args.eval_every == 0 or step == args.steps:
            curve.append(evaluate(step))
            if rank == 0 and not math.isfinite(curve[-1]["train_loss"]):
                diverged = True
    out = {"label": label, "codec": name, "params": {k: (str(v) if isinstance(v, float) and
                                                         math.isinf(v) else v)
                                                     for k, v in params.items()},
           "seed": seed, "world": size, "steps": args.steps,
           "bytes_per_step": sent / args.steps, "raw_bytes_per_step": raw / args.steps,
           "ms_per_step": 1e3 * t_train / args.steps, "plans": plans, "diverged": diverged}
    if rank == 0:
        out["curve"] = curve
        out["final"] = curve[-1]
    return out


def worker(args) -> None:
    import horovod.torch as hvd
    import torch

    hvd.init()
    torch.set_num_threads(1)
    task = TASKS[args.task]()
    data = task.data()
    labels = [label for label in args.codecs.split(";") if label]
    runs = []
    meta = {"world": hvd.size(), "command": " ".join(sys.argv),
            "env": {k: os.environ.get(k) for k in ("HOROVOD_FUSION_THRESHOLD",
                                                    "HOROVOD_CYCLE_TIME", "OMP_NUM_THREADS")},
            "steps": args.steps, "batch_per_rank": args.batch,
            "lr_per_rank": args.lr, "lr": world_lr(task, args.lr, hvd.size()),
            "eval_every": args.eval_every,
            "seeds": list(range(args.first_seed, args.first_seed + args.seeds)), "codecs": labels,
            **task.meta(data),
            "mpi_enabled": bool(hvd.mpi_enabled()), "gloo_enabled": bool(hvd.gloo_enabled()),
            "torch": torch.__version__}
    if task.name != "mlp":  # the digits MLP's files predate the option
        meta["task"] = task.name
    if args.append and os.path.exists(args.json):  # add runs to an earlier launch's file
        with open(args.json) as fh:
            old = json.load(fh)
        runs = old["runs"]
        meta["codecs"] = old["meta"]["codecs"] + [label for label in labels
                                                  if label not in old["meta"]["codecs"]]
        meta["seeds"] = sorted(set(old["meta"]["seeds"]) | set(meta["seeds"]))
        meta["appended"] = old["meta"].get("appended", []) + [" ".join(sys.argv)]
    t0 = time.perf_counter()
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for label in labels:
            t = time.perf_counter()
            r = train_one(label, seed, args, data)
            r["wall_s"] = time.perf_counter() - t
            runs.append(r)
            if hvd.rank() == 0:
                f = r["final"]
                print(f"[n={hvd.size()} seed={seed}] {label:28s} train {f['train_loss']:.4f} "
                      f"test {f['test_loss']:.4f} acc {f['test_acc']:.4f} "
                      f"{r['bytes_per_step']:9.0f} B/step {r['ms_per_step']:6.1f} ms/step "
                      f"({time.perf_counter() - t0:5.0f}s)", flush=True)
                meta["elapsed_s"] = time.perf_counter() - t0
                tmp = args.json + ".tmp"
                with open(tmp, "w") as fh:
                    json.dump({"meta": meta, "runs": runs}, fh, indent=1)
                os.replace(tmp, args.json)


# ================================================================================ driver ======
#: host names horovodrun runs on this machine as distinct hosts (worlds HxK)
LOCAL_HOST_NAMES = ("localhost", "127.0.0.1")


def launch(world: str, args) -> tuple[int, float]:
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{prefix(args)}_n{world}.json")
    hosts_, _, per_host = world.partition("x")
    if per_host and (args.launcher != "horovodrun" or int(hosts_) > len(LOCAL_HOST_NAMES)):
        raise SystemExit(f"world {world}: HxK worlds run under horovodrun with H <= "
                         f"{len(LOCAL_HOST_NAMES)}")
    hosts = (",".join(f"{name}:{per_host}" for name in LOCAL_HOST_NAMES[:int(hosts_)])
             if per_host else f"localhost:{world}")
    n = int(hosts_) * int(per_host) if per_host else int(world)
    inner = [sys.executable, os.path.abspath(__file__), "--worker", "--json", path,
             "--task", args.task, "--tag", args.tag, "--first-seed", str(args.first_seed)] + (
                 ["--append"] if args.append else []) + [
             "--steps", str(args.steps), "--seeds", str(args.seeds), "--batch", str(args.batch),
             "--lr", str(args.lr), "--eval-every", str(args.eval_every),
             "--codecs", args.codecs]
    if args.launcher == "horovodrun":
        cmd = ["horovodrun", "-np", str(n), "-H", hosts, "--gloo"] + inner
    else:
        cmd = ["mpirun", "-np", str(n), "--allow-run-as-root", "--oversubscribe",
               "--bind-to", "none", "-x", "OMP_NUM_THREADS", "-x", "OMPI_MCA_mpi_yield_when_idle",
               "-x", "HOROVOD_FUSION_THRESHOLD", "-x", "HOROVOD_CYCLE_TIME"] + inner
    # HOROVOD_FUSION_THRESHOLD=0: with fusion, which uncompressed tensors (biases) share a
    # fused allreduce depends on timing, which changes the float summation order with n > 2
    # ranks and makes runs irreproducible (a last-bit difference grows into a ~2% loss
    # difference after 60 steps). Unfused, every run is bit-reproducible. HOROVOD_CYCLE_TIME:
    # 0.5 ms instead of Horovod's default cuts the per-collective latency of this tiny model.
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_MCA_mpi_yield_when_idle="1",
               PYTHONUNBUFFERED="1", HOROVOD_FUSION_THRESHOLD="0", HOROVOD_CYCLE_TIME="0.5")
    for k in ("HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME"):
        env[k] = os.environ.get(k, env[k])
    print("$ " + " ".join(shlex.quote(c) for c in cmd), flush=True)
    t = time.perf_counter()
    # own process group, so that a launch past --timeout is ended with all its ranks
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True)
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"world {n}: launch exceeded {args.timeout}s; keeping the runs it finished")
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        rc = 124
    return rc, time.perf_counter() - t


def prefix(args) -> str:
    task = getattr(args, "task", "mlp")
    return ("convergence" + (f"_{task}" if task != "mlp" else "")
            + (f"_{args.tag}" if args.tag else ""))


def load(args) -> dict:
    res = {}
    for n in args.worlds:
        path = os.path.join(args.out, f"{prefix(args)}_n{n}.json")
        if os.path.exists(path):
            with open(path) as f:
                res[n] = json.load(f)
    return res


def summarize(res: dict) -> dict:
    """Per world and codec: mean/std over seeds of final metrics and of paired gaps to fp32."""
    import numpy as np

    summary = {}
    for n, blob in res.items():
        runs = [r for r in blob["runs"] if "final" in r]
        base = {r["seed"]: r["final"] for r in runs if r["label"] == "fp32"}
        rows = {}
        for label in blob["meta"]["codecs"]:
            rs = [r for r in runs if r["label"] == label]
            if not rs:
                continue
            paired = [r for r in rs if r["seed"] in base]

            def f(key, rs=rs):
                return np.array([r["final"][key] for r in rs], float)

            def gap(key, paired=paired, base=base):
                return np.array([r["final"][key] - base[r["seed"]][key] for r in paired], float)

            def ms(a):
                return (float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0)
            # area under the training-loss curve (mean loss over the evaluations): a whole-run
            # measure that is less noisy than the last point
            auc = np.array([np.mean([c["train_loss"] for c in r["curve"]]) for r in rs])
            auc_base = {r["seed"]: np.mean([c["train_loss"] for c in r["curve"]])
                        for r in runs if r["label"] == "fp32"}
            auc_gap = np.array([np.mean([c["train_loss"] for c in r["curve"]]) -
                                auc_base[r["seed"]] for r in paired])
            rows[label] = {
                "seeds": len(rs),
                "train_loss": ms(f("train_loss")), "test_loss": ms(f("test_loss")),
                "test_acc": ms(f("test_acc")),
                "gap_train_loss": ms(gap("train_loss")), "gap_test_loss": ms(gap("test_loss")),
                "gap_test_acc": ms(gap("test_acc")),
                "mean_curve_loss": ms(auc), "gap_mean_curve_loss": ms(auc_gap),
                "bytes_per_step": float(np.mean([r["bytes_per_step"] for r in rs])),
                "raw_bytes_per_step": float(np.mean([r["raw_bytes_per_step"] for r in rs])),
                "ms_per_step": ms(np.array([r["ms_per_step"] for r in rs])),
                "diverged": int(sum(r.get("diverged", False) for r in rs)),
            }
        summary[n] = rows
    return summary


def orderings(summary: dict) -> list[dict]:
    """The papers' claims, checked on the measured numbers (paired gaps to fp32)."""
    checks = []
    for n, rows in summary.items():
        for bits in ("8b", "5b", "4b"):
            lin, exp = rows.get(f"global_qsgd linear {bits}"), rows.get(f"global_qsgd exp {bits}")
            if lin and exp:
                for key in ("gap_train_loss", "gap_mean_curve_loss", "gap_test_acc"):
                    better_lower = key != "gap_test_acc"
                    lv, ls = lin[key]
                    ev, es = exp[key]
                    closer = abs(ev) < abs(lv)
                    # "better": lower loss or higher accuracy than linear, whatever fp32 did
                    better = ev < lv if better_lower else ev > lv
                    checks.append({
                        "world": n, "claim": f"Global-QSGD exponential closer to fp32 than "
                        f"linear ({bits}), {key}",
                        "linear": [lv, ls], "exponential": [ev, es], "holds": bool(closer),
                        "better": bool(better),
                        "separated": bool(abs(abs(ev) - abs(lv)) > max(ls, es)),
                    })
        base = rows.get("fp32")
        for label, norm in (("qsgd 8b b512", ""), ("qsgd 8b b512 max", ", max norm")):
            q = rows.get(label)
            if not (q and base):
                continue
            g, gs = q["gap_test_acc"]
            seed_sd = base["test_acc"][1]
            checks.append({
                "world": n, "claim": f"QSGD 8-bit bucket 512{norm} recovers fp32 test accuracy "
                "(paired gap >= -max(0.5 pp, fp32 seed std))",
                "gap_test_acc": [g, gs], "fp32_acc_std": seed_sd,
                "holds": bool(g >= -max(0.005, seed_sd)),
            })
    return checks


def plot(res: dict, summary: dict, out: str, pre: str, task=None) -> list[str]:
    """Per world: small multiples, one panel per codec with fp32 drawn in every panel (training
    loss on top, test error below; both on log axes, nothing cut off). Then the paired gaps."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    def band(rs, key):
        steps = np.array([c["step"] for c in rs[0]["curve"]])
        m = np.array([[c[key] for c in r["curve"]] for r in rs], float)
        if key == "test_acc":
            m = 1.0 - m  # test error: on a log axis the start (0.9) and the end (0.05) both read
        return steps, m.mean(0), m.std(0)

    task = task or DigitsMLP()
    CODEC_COLOR = "tab:orange"
    paths = []
    for n, blob in res.items():
        runs = [r for r in blob["runs"] if "curve" in r]
        by_label = {label: [r for r in runs if r["label"] == label]
                    for label in blob["meta"]["codecs"]}
        base = by_label.get("fp32", [])
        labels = [label for label, rs in by_label.items() if rs and label != "fp32"]
        if not labels:
            continue
        ncols = 5 if len(labels) > 9 else 3
        nrows = -(-len(labels) // ncols)
        fig = plt.figure(figsize=(3.6 * ncols, 2.35 * 2 * nrows + 0.55), layout="constrained")
        head, *subs = fig.subfigures(3, 1, height_ratios=(0.55, 2.35 * nrows, 2.35 * nrows),
                                     hspace=0.02)
        for sub, (key, title) in zip(subs, task.curve_keys):
            axes = sub.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False)
            for ax, label in zip(axes.flat, labels):
                rs = by_label[label]
                for group, color, lw in ((base, "black", 1.6), (rs, CODEC_COLOR, 1.4)):
                    if not group:
                        continue
                    steps, mu, sd = band(group, key)
                    ax.plot(steps, mu, color=color, lw=lw)
                    if len(group) > 1:
                        ax.fill_between(steps, np.maximum(mu - sd, 1e-4), mu + sd,
                                        color=color, alpha=0.2, lw=0)
                ax.set_title(f"{label} ({len(rs)} seeds)", fontsize=9)
                ax.set_yscale("log")
                ax.grid(alpha=0.3, which="both")
            for ax in axes.flat[len(labels):]:
                ax.set_visible(False)
            for ax in axes[-1]:
                ax.set_xlabel("step")
                ax.xaxis.set_tick_params(labelbottom=True)
            for ax in axes[:, 0]:
                ax.set_ylabel(title.split(" =")[0])
            sub.suptitle(f"{title} (log scale)", fontsize=11)
        m = blob["meta"]
        head.suptitle(f"{task.title}, {n} ranks ({'gloo' if m.get('gloo_enabled') else 'MPI'}), "
                      f"{m['steps']} steps, batch {m['batch_per_rank']}/rank, lr {m['lr']:g}, "
                      f"{task.optimizer_note}: each codec against fp32 on the same seeds",
                      fontsize=12)
        handles = [Line2D([], [], color="black", lw=1.6), Patch(color="black", alpha=0.2),
                   Line2D([], [], color=CODEC_COLOR, lw=1.4), Patch(color=CODEC_COLOR, alpha=0.2)]
        head.legend(handles, [f"fp32, mean over {len(base)} seeds (in every panel)",
                              "fp32 ± std over seeds", "the codec named above the panel, mean",
                              "the codec ± std over seeds"],
                    loc="lower center", ncol=4, fontsize=9, frameon=False)
        p = os.path.join(out, f"{pre}_n{n}.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    # gap plot
    worlds = list(summary)
    labels = [label for label in next(iter(res.values()))["meta"]["codecs"] if label != "fp32"]
    fig, axes = plt.subplots(1, 2, figsize=(15, 5.8), layout="constrained")
    width = 0.8 / max(1, len(worlds))
    x = np.arange(len(labels))
    for j, n in enumerate(worlds):
        for ax, key in zip(axes, task.gap_keys):
            title = GAP_TITLES[key].format(**task.words)
            vals = [summary[n].get(label, {}).get(key, (np.nan, 0)) for label in labels]
            scale = 100 if key == "gap_test_acc" else 1
            ax.bar(x + (j - (len(worlds) - 1) / 2) * width, [v[0] * scale for v in vals],
                   width, yerr=[v[1] * scale for v in vals], capsize=2, label=f"{n} ranks",
                   color=f"C{j}")
            ax.set_title(title + (" (pp)" if scale == 100 else "") + ", paired by seed")
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
        ax.axhline(0, color="black", lw=0.8)
        ax.grid(alpha=0.3, axis="y")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, [f"{nm}: mean ± std over seeds" for nm in names],
               loc="outside upper center", ncol=len(worlds), frameon=False)
    p = os.path.join(out, f"{pre}_gap.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


def pm(v, scale=1.0, d=4) -> str:
    """A (mean, std) pair as ``mean ± std``."""
    return f"{v[0] * scale:.{d}f} ± {v[1] * scale:.{d}f}"


def tables(res: dict, summary: dict, checks: list[dict], task=None) -> str:
    task = task or DigitsMLP()
    out = [task.table_note + "\n"] if task.table_note else []
    for n, rows in summary.items():
        m = res[n]["meta"]
        out.append(f"### {n} ranks: {m['steps']} steps, batch {m['batch_per_rank']}/rank, "
                   f"lr {m['lr']:g}, seeds {m['seeds']} (mean ± std over seeds; Δ = paired "
                   f"by seed against fp32)\n")
        out.append("| codec | seeds | " + " | ".join(c[0] for c in task.columns)
                   + " | bytes/step/rank | ratio | ms/step |")
        out.append("|---|---|" + "---|" * (len(task.columns) + 3))
        for label, r in rows.items():
            ratio = r["raw_bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else 0
            out.append(
                f"| {label} | {r['seeds']} | "
                + "".join(f"{pm(r[key], scale, d)} | " for _, key, scale, d in task.columns)
                + f"{r['bytes_per_step']:.0f} | {ratio:.2f} | {r['ms_per_step'][0]:.1f} |"
                + (f" diverged {r['diverged']}" if r["diverged"] else ""))
        out.append("")
    out.append("### The papers' orderings, as measured\n")
    out.append("| world | claim | measured | holds? |")
    out.append("|---|---|---|---|")
    for c in checks:
        if "linear" in c:
            meas = (f"linear {c['linear'][0]:+.4f} ± {c['linear'][1]:.4f}, exponential "
                    f"{c['exponential'][0]:+.4f} ± {c['exponential'][1]:.4f}")
            verdict = (("closer: yes" if c["holds"] else "closer: no")
                       + ("; better: yes" if c["better"] else "; better: no")
                       + ("" if c["separated"] else "; within one std: not resolved"))
        else:
            meas = (f"paired gap {100 * c['gap_test_acc'][0]:+.2f} ± "
                    f"{100 * c['gap_test_acc'][1]:.2f} pp (fp32 seed std "
                    f"{100 * c['fp32_acc_std']:.2f} pp)")
            verdict = "yes" if c["holds"] else "no"
        out.append(f"| {c['world']} | {c['claim']} | {meas} | {verdict} |")
    out.append("")
    return "\n".join(out)


def report(args) -> None:
    pre = prefix(args)
    res = load(args)
    if not res:
        raise SystemExit(f"no {pre}_n*.json under {args.out}")
    summary = summarize(res)
    checks = orderings(summary)
    task = TASKS[args.task]()
    paths = plot(res, summary, args.out, pre, task)
    md = tables(res, summary, checks, task)
    with open(os.path.join(args.out, f"{pre}_tables.md"), "w") as f:
        f.write("<!-- generated by benchmarks/convergence.py; do not edit -->\n\n" + md)
    with open(os.path.join(args.out, f"{pre}_summary.json"), "w") as f:
        json.dump({"summary": {str(k): v for k, v in summary.items()}, "checks": checks}, f,
                  indent=1)
    print(md)
    print("wrote " + ", ".join(paths))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,4",
                    help="world sizes N, or HxK: H host names x K ranks (default: %(default)s)")
    ap.add_argument("--seeds", type=int, default=3, help="number of seeds")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--append", action="store_true",
                    help="add the runs to the existing JSON of that world (e.g. to finish "
                    "codecs a --timeout cut short) instead of replacing it")
    ap.add_argument("--task", choices=list(TASKS), default="mlp",
                    help="mlp: digits MLP; cnn: digits conv net; bytelm: byte-level GPT on "
                    "the standard library's source (the defaults below are the task's)")
    ap.add_argument("--steps", type=int, default=None, help="(mlp 200, cnn 300, bytelm 150)")
    ap.add_argument("--batch", type=int, default=None, help="mini-batch per rank (16)")
    ap.add_argument("--lr", type=float, default=None,
                    help="per-rank lr, x world size (mlp, cnn: 0.025) or x sqrt(world size) "
                    "(bytelm, Adam: 0.0015)")
    ap.add_argument("--eval-every", type=int, default=None, help="(mlp, cnn 20; bytelm 30)")
    ap.add_argument("--codecs", default="default",
                    help="';'-separated labels of CODECS, or a preset: "
                    + ", ".join(PRESETS))
    ap.add_argument("--tag", default="", help="output name suffix: convergence_<tag>_n<N>.*")
    ap.add_argument("--launcher", choices=("horovodrun", "mpirun"), default="horovodrun")
    ap.add_argument("--timeout", type=int, default=720, help="seconds per launch")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results"))
    ap.add_argument("--plot-only", action="store_true",
                    help="train nothing: redraw the PNGs and tables from the JSON under --out")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    task = TASKS[args.task]
    for key in ("steps", "batch", "lr", "eval_every"):
        if getattr(args, key) is None:
            setattr(args, key, getattr(task, key))
    if args.worker:
        worker(args)
        return
    args.worlds = [w for w in str(args.worlds).split(",") if w]
    bad = [w for w in args.worlds if not re.fullmatch(r"\d+(x\d+)?", w)]
    if bad:
        raise SystemExit(f"--worlds: {bad} are not N or HxK")
    args.codecs = ";".join(PRESETS[args.codecs]) if args.codecs in PRESETS else args.codecs
    unknown = [label for label in args.codecs.split(";") if label and label not in CODECS]
    if unknown:
        raise SystemExit(f"unknown codec labels {unknown}; known: {list(CODECS)}")
    args.out = os.path.abspath(args.out)
    if not args.plot_only:
        for n in args.worlds:
            rc, secs = launch(n, args)
            print(f"world {n}: rc={rc}, {secs:.0f}s", flush=True)
    report(args)


if __name__ == "__main__":
    main()
