"""Accuracy at 4 to 64 workers, trained past float32's plateau, through simulated workers.

    python3 benchmarks/plateau.py                    # every run, two processes (one per core)
    python3 benchmarks/plateau.py --workers 4 --seeds 1 --steps 60 --out /tmp/plateau  # smoke
    python3 benchmarks/plateau.py --report-only      # tables and plots from the JSON lines

A byte-level GPT (``PlateauLM``: 2 pre-norm blocks of width 64, context 32, 134,912
parameters) trains on the first 0.5 MB of this Python's standard-library training files and
validates on 1,024 fixed windows of the held-out files (``benchmarks/convergence.py``'s split),
so float32 reaches the step where validation stops improving well inside the step budget and
trains past it. Each of n workers draws its own mini-batch from its own contiguous shard of the
training bytes (a fixed global batch of 64 windows split n ways; one vectorised pass gives every
worker's gradient); :class:`horovod_quant.tools.simulated.SimulatedWorkers` averages them as an
n-rank ``hq.DistributedOptimizer`` with the default policy and ``fallback="never"`` would, bit
for bit (tests/parallel/test_simulated_workers.py). Learning rate: the same at every worker
count, as the global batch is. Each finished run appends one JSON line to
``<out>/plateau.jsonl``; a rerun skips the runs already there. The report
(benchmarks/plateau_report.py) writes ``plateau.json``, ``plateau.md`` and the plots.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

#: label -> (codec name, parameters): the study's codecs, float32 first
CODECS = {
    "fp32": ("none", {}),
    "bf16": ("bf16", {}),
    "qsgd 8b": ("qsgd", {"bits": 8}),
    "qsgd 4b": ("qsgd", {"bits": 4}),
    "global-qsgd exp 8b": ("global_qsgd", {"bits": 8}),
    "global-qsgd lin 8b": ("global_qsgd", {"bits": 8, "levels": "linear"}),
    "natural dithering 4b": ("natural_dithering", {"bits": 4}),
    "ndqsg": ("nested_dithered", {}),
}
#: (workers, hosts): flat worlds, and 16 workers as 4 hosts x 4 (the hierarchical plans)
WORLDS = [(4, 1), (16, 1), (16, 4), (64, 1)]
#: optimizer -> learning rate, the same at every worker count (the global batch is fixed)
OPTIMIZERS = {"adamw": 3e-3, "sgd": 0.3}
GLOBAL_BATCH, TRAIN_BYTES, EVAL_EVERY = 64, 500_000, 50
#: a run's plateau: the first evaluation within this fraction of its best validation loss
PLATEAU_TOLERANCE = 0.01


def plateau_task():
    """The byte GPT of ``benchmarks/convergence.py`` at the size this study trains."""
    from convergence import ByteLM

    class PlateauLM(ByteLM):
        context, d_model, layers, heads = 32, 64, 2, 4
        eval_train, eval_val = 256, 1024

        def data(self):
            """The split's validation files; the first :data:`TRAIN_BYTES` of its training
            files, the fixed training-loss windows drawn there."""
            import torch
            data = super().data()
            data["train"] = data["train"][:TRAIN_BYTES]
            gen = torch.Generator().manual_seed(0)
            data["fixed"][0] = torch.randint(0, TRAIN_BYTES - self.context - 1,
                                             (self.eval_train,), generator=gen)
            return data

    return PlateauLM()


def build_codec(label: str, workers: int):
    """The codec of ``label`` for ``workers`` ranks (world-sized codecs built for them)."""
    return codec_for(*CODECS[label], workers)


def codec_for(name: str, params: dict, workers: int):
    """``get_codec(name, **params)``, a world-sized codec built for ``workers`` ranks."""
    import horovod_quant as hq
    from horovod_quant.core.registry import codec_class

    if codec_class(name).needs_world_size:
        params = {**params, "world_size": workers}
    return hq.get_codec(name, **params)


def worker_gradients(model, xs, ys):
    """Each worker's mean gradient over its own windows (``xs``: workers x batch x context),
    from one vectorised pass, as one flat vector per worker in ``named_parameters`` order."""
    import torch
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, y):
        logits = functional_call(model, p, (x,))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))

    grads = vmap(grad(loss), in_dims=(None, 0, 0))(params, xs, ys)
    return torch.cat([grads[k].reshape(xs.shape[0], -1) for k in params], dim=1)


def plateau_step(curve: list[list[float]]) -> int:
    """The step of the first evaluation within :data:`PLATEAU_TOLERANCE` of the run's best
    validation loss (``curve``: ``[step, val_loss, ...]`` rows)."""
    finite = [c for c in curve if math.isfinite(c[1])]
    if not finite:
        return 0
    best = min(c[1] for c in finite)
    return next(c[0] for c in finite if c[1] <= best * (1 + PLATEAU_TOLERANCE))


def train_one(task, data, label: str, optimizer: str, workers: int, hosts: int, seed: int,
              steps: int) -> dict:
    """One run: ``steps`` steps, validation every :data:`EVAL_EVERY` steps; stops at a
    non-finite validation loss (flagged ``diverged``)."""
    import warnings

    import torch

    from horovod_quant.doors import DoorOptions
    from horovod_quant.tools.simulated import SimulatedWorkers

    torch.manual_seed(seed)
    model = task.model()
    named = list(model.named_parameters())
    lr = OPTIMIZERS[optimizer]
    opt = (torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
           if optimizer == "adamw" else torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    with warnings.catch_warnings(record=True) as caught:  # a codec's limit note, kept
        warnings.simplefilter("always")
        codec = build_codec(label, workers)
    sim = SimulatedWorkers(named, codec, workers, hosts,
                           options=DoorOptions(seed=seed, fallback="never"))
    shards = [task.shard({"train": data["train"]}, r, workers) for r in range(workers)]
    gens = [torch.Generator().manual_seed(1_000 * seed + r) for r in range(workers)]
    per = GLOBAL_BATCH // workers
    curve, sent, start, load = [], 0, time.perf_counter(), os.getloadavg()[0]
    for step in range(steps + 1):
        if step % EVAL_EVERY == 0 or step == steps:
            model.eval()
            ev = task.evaluate(model, data)
            model.train()
            curve.append([step, ev["test_loss"], ev["test_acc"], ev["train_loss"]])
            if not math.isfinite(ev["test_loss"]):
                break
        if step == steps:
            break
        batches = [task.batch_of(shards[r], gens[r], per) for r in range(workers)]
        xs = torch.stack([b[0] for b in batches])
        ys = torch.stack([b[1] for b in batches])
        means = sim.average(list(worker_gradients(model, xs, ys)))
        sent += sim.last_wire_bytes
        for name, p in named:
            p.grad = means[name]
        opt.step()
    best = min((c for c in curve if math.isfinite(c[1])), key=lambda c: c[1], default=curve[-1])
    last = curve[-1]
    return {"task": "bytelm-plateau", "optimizer": optimizer, "workers": workers,
            "hosts": hosts, "codec": label, "seed": seed, "steps": last[0],
            "val_loss": last[1], "val_acc": last[2], "train_loss": last[3],
            "plateau_step": plateau_step(curve), "best_val_loss": best[1],
            "diverged": not math.isfinite(last[1]), "lr": lr,
            "limit_note": "; ".join(str(w.message) for w in caught) or None,
            "payload_bytes_per_step": sent / max(1, last[0]),
            "s_per_step": (time.perf_counter() - start) / max(1, last[0]),
            "load_1min": [round(load, 2), round(os.getloadavg()[0], 2)],
            "cores": os.cpu_count(), "curve": curve}


def run_key(label: str, optimizer: str, workers: int, hosts: int, seed: int) -> tuple:
    return (label, optimizer, workers, hosts, seed)


def planned(args) -> list[tuple]:
    """The runs asked for, seed by seed (a cut-short study has whole seeds), the smaller
    worlds first within a seed."""
    worlds = [w for w in WORLDS if w[0] in args.workers]
    return [run_key(label, opt, w, h, seed) for seed in range(args.seeds)
            for opt in args.optimizers for (w, h) in worlds for label in args.codecs]


def _run(spec: tuple) -> dict:
    """One run in a process of its own (one thread: the processes share the cores)."""
    import torch

    torch.set_num_threads(1)
    task = plateau_task()
    label, opt, workers, hosts, seed = spec
    return train_one(task, task.data(), label, opt, workers, hosts, seed, _run.steps)


def read_rows(out: str) -> list[dict]:
    """The runs in ``out``: ``plateau.jsonl`` (a line as each run ends), else the rows of the
    report's ``plateau.json`` (the committed file); a run's last row where it ran twice."""
    log, report_file = os.path.join(out, "plateau.jsonl"), os.path.join(out, "plateau.json")
    rows = []
    if os.path.exists(log):
        with open(log, encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    elif os.path.exists(report_file):
        with open(report_file, encoding="utf-8") as fh:
            rows = json.load(fh)["rows"]
    last = {run_key(r["codec"], r["optimizer"], r["workers"], r["hosts"], r["seed"]): r
            for r in rows}
    return list(last.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results"))
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    ap.add_argument("--codecs", nargs="+", default=list(CODECS), choices=CODECS)
    ap.add_argument("--processes", type=int, default=2, help="runs at once (one per core)")
    ap.add_argument("--report-only", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "plateau.jsonl")
    if not args.report_only:
        rows = read_rows(args.out)
        if rows and not os.path.exists(path):  # resuming from the report's rows: keep them
            with open(path, "w", encoding="utf-8") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in rows)
        done = {run_key(r["codec"], r["optimizer"], r["workers"], r["hosts"], r["seed"])
                for r in rows if r["steps"] == args.steps or r["diverged"]}
        todo = [spec for spec in planned(args) if spec not in done]
        _run.steps = args.steps
        with multiprocessing.get_context("fork").Pool(args.processes, maxtasksperchild=1) as pool:
            for row in pool.imap_unordered(_run, todo):
                with open(path, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps(row) + "\n")
                print(f"{row['optimizer']:5s} n={row['workers']:2d} hosts={row['hosts']} "
                      f"{row['codec']:20s} seed {row['seed']}: val {row['val_loss']:.4f} "
                      f"best {row['best_val_loss']:.4f}, plateau at {row['plateau_step']} "
                      f"({row['s_per_step'] * 1e3:.0f} ms/step)", flush=True)
    from plateau_report import report

    rows = read_rows(args.out)
    if not rows:
        sys.exit(f"no runs in {args.out} (plateau.jsonl or plateau.json): nothing to report")
    report(rows, args)


if __name__ == "__main__":
    main()
