"""The rank side of ``benchmarks/cluster.py``: runs as every rank of an emulated cluster
(``benchmarks/emulator.py``: ``mpirun`` or Horovod's gloo controller).

    python3 benchmarks/cluster_workloads.py --plan plan.json --out rows.jsonl

``plan.json`` (written by cluster.py) lists items; rank 0 appends JSON lines to ``--out``
(``progress`` per exchange round, ``result`` per configuration, ``done`` per item), which
cluster.py tails for its progress bar and its results. The main kinds of item:

* ``exchange``: one flat float32 gradient of ``size_mb`` MB on every rank, averaged by
  Horovod itself for the baselines (``none`` = ``hvd.allreduce(op=hvd.Average)`` of the
  float32 tensor, ``fp16`` = the same with ``compression=hvd.Compression.fp16``) and through
  :class:`horovod_quant.exchange.Exchange` over Horovod's torch collectives for the codecs
  (encode, their collective, decode, pipelined in pieces of ``pipeline_elems``). The
  configurations of one size run interleaved (round r runs each once). Each repetition
  starts after a barrier; its wall time is the slowest
  rank's, its encode / exchange / decode split comes from the exchange's statistics (the same
  numbers ``StepStats`` sums per step), its CPU is every thread of a rank's process beyond
  what the process burns while the ranks sleep (the ranks' mean; the predictor's validation
  calibrates with it). The codecs' plans are chosen for the link the ranks are told.
* ``train``: SGD steps of a model on synthetic data through one door (:class:`_Trainer`):
  ``fp32`` and ``fp16`` Horovod's own ``hvd.DistributedOptimizer``, ``compute`` no
  communication at all (the floor), the codecs ``hq.torch.DistributedOptimizer`` or Horovod's
  optimizer with ``compression=hq.Compression.<codec>(...)``. A step is timed as
  forward+backward, ``synchronize()`` and the update; the codecs' encode / exchange / decode
  come from their statistics and compute is the rest of the step; for Horovod's optimizer the
  exchange is the time in ``synchronize()``. The hosts' NIC counters are read around the
  measured steps (the bytes that crossed between hosts). With ``paired`` a float32 reference
  model steps beside each row, step for step (see :func:`run_train`).

A stalled launch is stopped by the launcher with SIGABRT first: ``PYTHONFAULTHANDLER`` (set by
the emulator) writes every thread's stack to the rank's log.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import time
import traceback

import horovod.torch as hvd
import numpy as np
import torch

from horovod_quant.doors import OPTIMIZER_DOOR, CodecRequest, DoorEnvironment
from horovod_quant.exchange import Exchange
from horovod_quant.tools.predict import machine_busy_s
from horovod_quant.torch.collectives import (
    HorovodTorchCollectives,
    synchronize,
    wait_until_done,
)
from horovod_quant.torch.transport import transport_collectives

from emulator import NIC_ENV, nic_counters

MB = 1 << 20


def build_codec(cfg: dict):
    """The configuration's codec as the doors build it: for the world, or for the hosts where
    only a hierarchical exchange can combine that many ranks' payloads."""
    return CodecRequest(cfg["codec"], cfg.get("params", {})).build(hvd.size, hvd.cross_size)


def barrier() -> None:
    hvd.allreduce(torch.zeros(1), name="hqcl.barrier", op=hvd.Sum)


def gather_rows(obj):
    # one name on every rank: Horovod's default is the object's type name, which differs
    # where some ranks gather None
    return hvd.allgather_object(obj, name="hqcl.gather")


# -- exchange -------------------------------------------------------------------------------
_DATA: dict[int, np.ndarray] = {}


def gradient(n: int) -> np.ndarray:
    """A gradient-like vector: Gaussian with a heavier-tailed per-512 scale (same on re-use)."""
    if n not in _DATA:
        _DATA.clear()
        rng = np.random.default_rng(1000 + hvd.rank())
        x = rng.standard_normal(n, dtype=np.float32)
        scales = np.exp(rng.standard_normal(-(-n // 4096), dtype=np.float32)).astype(np.float32)
        x *= np.repeat(scales, 4096)[:n]
        _DATA[n] = x
    return _DATA[n]


def exact_mean_error(out: np.ndarray, n: int) -> float:
    """Relative squared error of ``out`` vs the exact mean (every rank regenerates the data)."""
    xs = []
    for rk in range(hvd.size()):
        rng = np.random.default_rng(1000 + rk)
        v = rng.standard_normal(n, dtype=np.float32)
        v *= np.repeat(np.exp(rng.standard_normal(-(-n // 4096), dtype=np.float32)), 4096)[:n]
        xs.append(v)
    mean = np.mean(xs, axis=0).astype(np.float64)
    return float(np.sum((out.astype(np.float64) - mean) ** 2) / np.sum(mean ** 2))


class HorovodAllreduce:
    """The baselines as ``hvd.DistributedOptimizer`` runs them: Horovod's in-place averaging
    allreduce of the (compressed) gradient, ``hvd.Compression.none`` or ``fp16``, behind
    Exchange's start/wait/stats. ``out`` is the gradient buffer reduced in place (the copy of
    ``x`` into it is made before the timed region, as the gradient already is in place)."""

    def __init__(self, codec_name: str) -> None:
        self.compression = hvd.Compression.fp16 if codec_name == "fp16" else hvd.Compression.none
        self.wire_bytes = 2 if codec_name == "fp16" else 4

    def start(self, x: np.ndarray, seed: int, name: str, out: np.ndarray):
        from horovod_quant.exchange.driver import ExchangeStats, Pending

        stats = ExchangeStats(x.size * 4)
        stats.bytes_sent = x.size * self.wire_bytes
        t = time.perf_counter()
        tensor, ctx = self.compression.compress(torch.from_numpy(out))
        stats.encode_s = time.perf_counter() - t
        handle = hvd.allreduce_async_(tensor, name=name, op=hvd.Average)

        def finish() -> np.ndarray:
            t0 = time.perf_counter()
            out = hvd.synchronize(handle)
            t1 = time.perf_counter()
            out = self.compression.decompress(out, ctx)
            stats.exchange_s, stats.decode_s = t1 - t0, time.perf_counter() - t1
            return out.numpy()

        return Pending(finish, stats)


def make_exchange(cfg: dict, comm, pipeline_elems):
    """The exchange of one configuration, its plans chosen for the links the ranks are told
    (``HQ_LINK_GBIT``), as the optimizer chooses them: read as its door reads them."""
    if cfg["codec"] in ("none", "fp16"):
        return HorovodAllreduce(cfg["codec"])
    return Exchange(build_codec(cfg), comm, pipeline_elems=pipeline_elems,
                    fabric=DoorEnvironment.read(OPTIMIZER_DOOR).fabric(False))


def choose_fallbacks(item: dict, state: dict, x: np.ndarray) -> None:
    """What ``hq.DistributedOptimizer(fallback="auto")`` does for a bucket of this size, with
    the package's own rule (``fallback.measure_and_decide``: the median of 3-15
    blocking runs of the codec exchange and of Horovod's float32 allreduce of the same vector,
    alternating, slowest rank; a codec must save 5% and 2 ms): the configurations whose codec
    did not run Horovod's float32 allreduce from here on, and their rows say so."""
    from horovod_quant.fallback import BucketTrial, measure_and_decide

    buf = torch.from_numpy(x.copy())
    trials, ids = [], []
    for cfg in item["configs"]:
        st = state[cfg["id"]]
        if st["error"] or isinstance(st["ex"], HorovodAllreduce):
            continue
        name = f"hqcl.fb.{item['id']}.{cfg['id']}"
        trials.append(BucketTrial(
            len(trials), cfg["id"], x.nbytes,
            lambda ex=st["ex"], nm=name, out=st["buf"]: ex.start(x, seed=0, name=nm,
                                                                 out=out).wait(),
            lambda nm=name: hvd.allreduce_(buf, name=nm + ".fp32", op=hvd.Average)))
        ids.append(cfg["id"])
    for cfg_id, decision in zip(ids, measure_and_decide(
            HorovodTorchCollectives(), trials, 1, f"hqcl.fb.{item['id']}")):
        state[cfg_id]["fallback"] = decision
        if decision.fallback:
            state[cfg_id]["ex"] = HorovodAllreduce("none")


def run_exchange(item: dict, emit) -> None:
    """All configurations of one size, interleaved: round r runs every configuration once, so
    load changes on a shared machine hit every configuration alike."""
    n = int(item["size_mb"] * MB) // 4
    comm = transport_collectives(transport=item.get("transport", "horovod"))
    x = gradient(n)
    state = {}
    for cfg in item["configs"]:
        try:
            state[cfg["id"]] = {"ex": make_exchange(cfg, comm, item.get("pipeline_elems")),
                                "reps": [], "error": None, "out": None}
        except Exception as exc:
            state[cfg["id"]] = {"error": f"{type(exc).__name__}: {exc}"}
    rounds = item["warmup"] + item["repeats"]
    idle = idle_cpu_cores()
    for r in range(rounds):
        if r == item["warmup"] and item.get("fallback") == "auto":
            choose_fallbacks(item, state, x)
        for cfg in item["configs"]:
            st = state[cfg["id"]]
            if st["error"]:
                continue
            try:
                if "buf" not in st:  # the output buffer, reused as the optimizer does
                    st["buf"] = np.empty_like(x)
                if isinstance(st["ex"], HorovodAllreduce):
                    st["buf"][:] = x
                barrier()
                cpu = process_cpu_s()
                t = time.perf_counter()
                # one name per configuration, as the optimizer names a bucket every step
                pending = st["ex"].start(x, seed=r, name=f"hqcl.x.{cfg['id']}",
                                         out=st["buf"])
                out = pending.wait()
                wall = time.perf_counter() - t
                cpu = process_cpu_s() - cpu - idle * wall
            except Exception as exc:  # codec errors are deterministic: every rank gets them
                traceback.print_exc()
                st["error"] = f"{type(exc).__name__}: {exc}"
                continue
            s = pending.stats
            if r >= item["warmup"]:
                st["reps"].append({"wall_s": wall, "cpu_s": cpu, "encode_s": s.encode_s,
                                   "exchange_s": s.exchange_s, "decode_s": s.decode_s,
                                   "bytes_sent": s.bytes_sent, "bytes_raw": s.bytes_raw})
            st["last_stats"] = s
            if r == rounds - 1 and n <= 16 * MB // 4:
                st["out"] = exact_mean_error(out, n)
            del out, pending
        emit({"type": "progress", "id": item["id"], "round": r})
    idle = statistics.fmean(gather_rows(idle))  # the ranks' mean, as their CPU per exchange
    for cfg in item["configs"]:
        st = state[cfg["id"]]
        row_id = f"{item['id']}-{cfg['id']}"
        if st["error"]:
            emit({"type": "result", "id": row_id, "error": st["error"]})
            continue
        reps = st["reps"]
        per_rank = gather_rows(reps)
        walls = [max(pr[i]["wall_s"] for pr in per_rank) for i in range(len(reps))]

        def med(key):
            return statistics.median(statistics.fmean(pr[i][key] for pr in per_rank)
                                     for i in range(len(reps)))

        decision = st.get("fallback")
        emit({"type": "result", "id": row_id, "error": None,
              "fallback": decision is not None and decision.fallback,
              "fallback_codec_s": decision.codec_s if decision else None,
              "fallback_fp32_s": decision.fp32_s if decision else None,
              "wall_s": statistics.median(walls), "wall_all_s": walls,
              "wall_min_s": min(walls), "cpu_s": med("cpu_s"), "idle_cpu_cores": idle,
              "plans": getattr(st.get("last_stats"), "plans", None),
              "encode_s": med("encode_s"),
              "exchange_s": med("exchange_s"), "decode_s": med("decode_s"),
              "bytes_sent": reps[-1]["bytes_sent"], "bytes_raw": reps[-1]["bytes_raw"],
              "rel_sq_error": st["out"],
              # True: the mpi4py exponent allreduce ran (not the allgather fallback)
              "custom_collective": getattr(st["ex"], "_custom", None) is not None})


# -- training -------------------------------------------------------------------------------
#: MLP models: name -> (width, hidden layers); "mlp" = 3 hidden 4096x4096 layers, 50.4M
#: parameters, 192 MiB of float32 gradients; "mlp48" = 3 hidden 2048x2048 layers, 12.6M
#: parameters, 48 MiB; "mlp12" = 3 hidden 1024x1024 layers, 3.16M parameters, 12 MiB
MLPS = {"mlp": (4096, 3), "mlp48": (2048, 3), "mlp12": (1024, 3)}
#: the GPT-style model "gpt25": vocabulary, context, width, layers, heads (25.3M parameters)
GPT25 = {"vocab": 12288, "context": 64, "width": 512, "layers": 6, "heads": 8}


def _basic_block(cin: int, cout: int, stride: int) -> torch.nn.Module:
    """ResNet's basic block: two 3x3 convolutions with batch norm, and a projection shortcut
    where the shape changes."""
    conv, norm = torch.nn.Conv2d, torch.nn.BatchNorm2d

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(
                conv(cin, cout, 3, stride, 1, bias=False), norm(cout), torch.nn.ReLU(),
                conv(cout, cout, 3, 1, 1, bias=False), norm(cout))
            self.skip = (torch.nn.Sequential(conv(cin, cout, 1, stride, bias=False), norm(cout))
                         if stride != 1 or cin != cout else torch.nn.Identity())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.body(x) + self.skip(x))

    return Block()


def resnet18(classes: int = 10) -> torch.nn.Module:
    """ResNet-18 for 32x32 images (a 3x3 stem, no max-pool): 11.2M parameters."""
    layers: list[torch.nn.Module] = [torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False),
                                     torch.nn.BatchNorm2d(64), torch.nn.ReLU()]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_basic_block(cin, cout, stride), _basic_block(cout, cout, 1)]
        cin = cout
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(512, classes)]
    return torch.nn.Sequential(*layers)


class TinyGPT(torch.nn.Module):
    """A GPT-style decoder (pre-norm blocks, causal self-attention, tied embeddings): the next
    token's logits for every position, flattened to (batch * context, vocab)."""

    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(context, width)
        block = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0,
                                                 activation="gelu", batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(
            context), persistent=False)
        for table in (self.tokens, self.positions):  # GPT-2's scale: logits near 0 at first
            torch.nn.init.normal_(table.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        h = self.tokens(idx) + self.positions(torch.arange(t, device=idx.device))
        h = self.norm(self.blocks(h, mask=self.mask[:t, :t], is_causal=True))
        return (h @ self.tokens.weight.T).reshape(-1, self.tokens.num_embeddings)


def build_model(name: str) -> tuple[torch.nn.Module, tuple, int]:
    """(model, input shape without batch, number of classes); the GPT's input shape is
    ``("tokens", context)``: integer tokens, a target per position (:func:`synthetic_batch`)."""
    if name in MLPS:
        width, depth = MLPS[name]
        mods = []
        for _ in range(depth):
            mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        mods.append(torch.nn.Linear(width, 10))
        return torch.nn.Sequential(*mods), (width,), 10
    if name == "cnn":
        # small VGG-style conv net on 32x32 RGB: 0.96M parameters, compute-bound
        c = torch.nn.Conv2d
        model = torch.nn.Sequential(
            c(3, 64, 3, padding=1), torch.nn.ReLU(),
            c(64, 128, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            c(128, 256, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            c(256, 256, 3, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(256, 10))
        return model, (3, 32, 32), 10
    if name == "resnet18":
        return resnet18(), (3, 32, 32), 10
    if name == "gpt25":
        return TinyGPT(**GPT25), ("tokens", GPT25["context"]), GPT25["vocab"]
    raise ValueError(f"unknown model {name!r}")


def synthetic_batch(shape: tuple, classes: int, batch: int,
                    gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fixed batch for a model of :func:`build_model`: Gaussian inputs and a class
    each, or (the GPT) random tokens and the next token of each position."""
    if shape[0] == "tokens":
        tokens = torch.randint(0, classes, (batch, shape[1] + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:].reshape(-1)
    return (torch.randn((batch,) + shape, generator=gen),
            torch.randint(0, classes, (batch,), generator=gen))


class _Trainer:
    """A model, its optimizer and this rank's synthetic batch; :meth:`step` times one step.

    ``codec_cfg["door"]``: "horovod" (Horovod's own optimizer, float32 or its fp16 cast),
    "compression" (Horovod's optimizer with ``compression=hq.Compression.<codec>(...)``), "hq"
    (``hq.DistributedOptimizer``) or "compute" (no communication: the plain optimizer; the
    ranks start each step together, as a training step's exchange holds them together, so that
    the slowest rank's step is the compute of a synchronized step where ranks share cores; they
    wait for each other without spinning, as the package's waits do, so that a rank that is
    done takes no core from one still computing)."""

    def __init__(self, item: dict, codec_cfg: dict, prefix: str = "") -> None:
        import horovod_quant.torch as hq

        torch.manual_seed(0)
        self.model, shape, classes = build_model(item["model"])
        self.door = codec_cfg.get("door", "horovod" if codec_cfg["codec"] in ("none", "fp16")
                                  else "hq")
        self.horovod_path = self.door in ("horovod", "compute")
        named = [(prefix + n, p) for n, p in self.model.named_parameters()]
        base = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.compressor = None
        if self.door == "compute":
            self.opt = base
        elif self.door == "horovod":
            self.opt = hvd.DistributedOptimizer(
                base, named_parameters=named,
                compression=(hvd.Compression.fp16 if codec_cfg["codec"] == "fp16"
                             else hvd.Compression.none))
        elif self.door == "compression":
            self.compressor = getattr(hq.Compression, codec_cfg["codec"])(**codec_cfg["params"])
            self.opt = hvd.DistributedOptimizer(base, named_parameters=named,
                                                compression=self.compressor)
        else:
            self.opt = hq.DistributedOptimizer(
                base, named_parameters=named,
                compression=getattr(hq.Compression, codec_cfg["codec"])(**codec_cfg["params"]),
                pipeline_elems=item.get("pipeline_elems"),
                transport=item.get("transport", "horovod"),
                fallback=item.get("fallback", "never"))
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        gen = torch.Generator().manual_seed(hvd.rank())
        self.xb, self.yb = synthetic_batch(shape, classes, item["batch"], gen)
        self.loss = None

    @property
    def settled(self) -> bool:
        return self.door != "hq" or self.opt.fallback_settled

    def step(self) -> dict:
        if self.door == "compute":
            synchronize(hvd.allreduce_async(torch.zeros(1), name="hqcl.train.lockstep"))
        t0 = time.perf_counter()
        self.opt.zero_grad()
        self.loss = torch.nn.functional.cross_entropy(self.model(self.xb), self.yb)
        self.loss.backward()
        t1 = time.perf_counter()
        if self.door in ("horovod", "compression"):
            # Horovod's optimizer waits in a sched_yield loop (docs/dev/benchmarks.md): where
            # ranks outnumber cores, the baselines would lose to their own wait, which a rank
            # with its own core never pays. Its allreduces are waited for as the package waits.
            for handle, _ in list(self.opt._handles.values()):
                if handle is not None and not callable(handle):
                    wait_until_done(handle)
        if self.door != "compute":
            self.opt.synchronize()
        t2 = time.perf_counter()
        if self.door == "compute":
            self.opt.step()
        else:
            with self.opt.skip_synchronize():
                self.opt.step()
        t3 = time.perf_counter()
        return {"step_s": t3 - t0, "fwd_bwd_s": t1 - t0, "sync_s": t2 - t1, "update_s": t3 - t2}

    def exchange_stats(self, row: dict, nparams: int, codec: str) -> None:
        """Add this step's encode / exchange / decode seconds and bytes to ``row``."""
        if self.door == "compute":
            row.update(encode_s=0.0, exchange_s=0.0, decode_s=0.0, bytes_sent=0,
                       bytes_raw=nparams * 4)
        elif self.door == "horovod":
            row.update(encode_s=0.0, exchange_s=row["sync_s"], decode_s=0.0,
                       bytes_sent=nparams * (2 if codec == "fp16" else 4),
                       bytes_raw=nparams * 4)
        elif self.door == "compression":
            st = self.compressor.stats.reset()
            # Horovod's synchronize() holds the wait; the codec's own timers split it
            row.update(encode_s=st.encode_s, exchange_s=max(0.0, row["sync_s"] - st.decode_s),
                       decode_s=st.decode_s, bytes_sent=st.bytes_sent, bytes_raw=st.bytes_raw)
        else:
            st = self.opt.last_stats
            check = self.opt.fallback_step_check
            row["fallback_buckets"] = sum(d.fallback or (check is not None and check.fallback)
                                          for d in self.opt.fallback_decisions)
            row["step_check"] = None if check is None else {
                "codec_step_s": check.codec_step_s, "fp32_step_s": check.fp32_step_s,
                "fallback": check.fallback}
            row.update(encode_s=st.encode_s, exchange_s=st.exchange_s, decode_s=st.decode_s,
                       bytes_sent=st.bytes_sent, bytes_raw=st.bytes_raw, plans=dict(st.plans))


def _measured_steps(item: dict, last_step_s: float) -> int:
    """How many steps to time: ``steps``, more until they add up to ``min_seconds`` (at the
    slowest rank's pace of the last warm-up step, so that every rank runs as many), at most
    ``MAX_STEPS``."""
    slowest = float(hvd.allreduce(torch.tensor([last_step_s], dtype=torch.float64),
                                  op=hvd.Max, name="hqcl.train.pace")[0])
    wanted = int(np.ceil(item.get("min_seconds", 0.0) / max(slowest, 1e-6)))
    return min(max(item["steps"], wanted), MAX_STEPS)


#: the most steps a training row times (a fast model's ``min_seconds``)
MAX_STEPS = 60


class SampledSteps:
    """py-spy sampling this rank (every thread, waits included) from now until :meth:`stop`:
    rank 0 writes collapsed stacks (``<profile>/<id>.txt``, for benchmarks/step_budget.py),
    rank 1 a flame graph (``<profile>/<id>.svg``). Collective (a barrier once py-spy runs)."""

    def __init__(self, item: dict) -> None:
        os.makedirs(item["profile"], exist_ok=True)
        raw = hvd.rank() == 0
        self.path = os.path.join(item["profile"], item["id"] + (".txt" if raw else ".svg"))
        self.proc = subprocess.Popen(
            ["py-spy", "record", "--pid", str(os.getpid()), "--rate", "100", "--idle",
             "--threads", "--nonblocking", "--format", "raw" if raw else "flamegraph",
             "-o", self.path],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # py-spy attaches before the first measured step
        barrier()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)  # py-spy writes its output when interrupted
        self.proc.wait(timeout=60)


def host_nic_bytes() -> dict | None:
    """This host's NIC counters (``emulator.nic_counters``), read by its local rank 0 when the
    launcher named the NIC; None on other ranks and outside the emulator."""
    if hvd.local_rank() != 0 or NIC_ENV not in os.environ:
        return None
    return nic_counters()


def crossed_hosts(before: list, after: list, steps: int) -> dict | None:
    """Bytes per step that left the hosts' NICs (kernel counters; every byte between hosts
    leaves one NIC), all hosts together and the busiest host's more loaded direction."""
    pairs = [(b, a) for b, a in zip(before, after) if b is not None and a is not None]
    if not pairs:
        return None
    tx = [(a["tx_bytes"] - b["tx_bytes"]) / steps for b, a in pairs]
    rx = [(a["rx_bytes"] - b["rx_bytes"]) / steps for b, a in pairs]
    return {"nic_bytes_per_step": sum(tx), "nic_busiest_host_bytes_per_step":
            max(max(t, r) for t, r in zip(tx, rx)), "nic_hosts": len(pairs)}


def run_train(item: dict) -> dict:
    """Warm up until the optimizer's layout is final (hq's fallback measures, and may check in
    training steps, first; every rank settles at the same step) plus ``warmup`` steps, then time
    the steps (:func:`_measured_steps`). With ``paired``, a second model under Horovod's
    float32 DistributedOptimizer (the reference) steps beside it, alternating which goes first,
    so that load changes of a shared machine hit both; the row then carries the reference's
    steps and the paired speedup. Unpaired, on emulated hosts, the hosts' NIC counters are read
    around the measured steps, between barriers, so that nothing of the set-up is counted."""
    cfg = item["config"]
    run = _Trainer(item, cfg)
    ref = _Trainer(item, {"codec": "none"}, prefix="ref.") if item.get("paired") else None
    if ref is not None:
        for _ in range(2):  # its first steps fill Horovod's caches
            ref.step()
    nparams = sum(p.numel() for p in run.model.parameters())
    settled_at, s, last = None, -1, 0.0
    # the last warm-up step sets the pace of _measured_steps: never the settling step itself
    # (Horovod's first step fills its caches)
    while settled_at is None or s < settled_at + max(item["warmup"], 1):
        s += 1
        last = run.step()["step_s"]
        if settled_at is None and run.settled:
            settled_at = s
    steps, ref_steps = [], []
    measured = _measured_steps(item, last)
    barrier()
    nic_before = host_nic_bytes()
    barrier()  # every host read its counters before any step's traffic
    profiler = SampledSteps(item) if item.get("profile") else None
    cpu_before, main_before = cpu_snapshot(), time.thread_time()
    for i in range(measured):
        if ref is not None and i % 2 == 0:
            ref_steps.append(ref.step()["step_s"])
        row = run.step()
        if ref is not None and i % 2 == 1:
            ref_steps.append(ref.step()["step_s"])
        run.exchange_stats(row, nparams, cfg["codec"])
        row["compute_s"] = row["step_s"] - row["encode_s"] - row["exchange_s"] - row["decode_s"]
        row["ref_step_s"] = ref_steps[-1] if ref_steps else None
        steps.append(row)
    cpu_after, main_after = cpu_snapshot(), time.thread_time()
    if profiler is not None:
        profiler.stop()
    barrier()  # every step's traffic arrived
    nic_after = host_nic_bytes()
    per_rank = gather_rows(steps)
    nic = crossed_hosts(gather_rows(nic_before), gather_rows(nic_after), measured)
    keys = ("step_s", "fwd_bwd_s", "sync_s", "update_s", "encode_s", "exchange_s", "decode_s",
            "compute_s")
    rank_means = [{k: statistics.fmean(r[k] for r in pr) for k in keys} for pr in per_rank]
    slow = max(rank_means, key=lambda m: m["step_s"])
    # the ranks step in lockstep: the slowest rank's mean step sets the throughput
    out = dict(slow)
    batch = item["batch"]
    out["samples_per_s"] = batch * hvd.size() / slow["step_s"]
    def slowest(key: str) -> list[float]:  # each step's slowest rank
        return [max(pr[i][key] for pr in per_rank) for i in range(len(steps))]

    out["step_all_s"] = slowest("step_s")
    out["step_median_s"] = statistics.median(out["step_all_s"])
    out["measured_steps"] = len(steps)
    # whether the steps were CPU-bound: the ranks' CPU time per step (all ranks together) and
    # how many cores the whole machine kept busy while they ran
    out["ranks_cpu_s_per_step"] = ranks_cpu_s(cpu_before, cpu_after) / len(steps)
    # of which the ranks' main threads (forward, backward, the optimizer's codec work)
    out["ranks_main_thread_cpu_s_per_step"] = sum(gather_rows(main_after - main_before)) / len(
        steps)
    out["busy_cores"] = (cpu_after[1] - cpu_before[1]) / (cpu_after[0] - cpu_before[0])
    if ref is not None:  # the two models' steps interleave, pair by pair
        out["ref_step_all_s"] = slowest("ref_step_s")
        out["ref_samples_per_s"] = batch * hvd.size() * len(steps) / sum(out["ref_step_all_s"])
        out["paired_speedup"] = sum(out["ref_step_all_s"]) / sum(out["step_all_s"])
    elif nic is not None:
        out.update(nic)
    out["bytes_sent"] = steps[-1]["bytes_sent"]
    out["plans"] = steps[-1].get("plans")  # the pieces of each plan kind in the last step
    out["fallback_buckets"] = steps[-1].get("fallback_buckets", 0)
    out["step_check"] = steps[-1].get("step_check")
    out["warmup_steps"] = s + 1  # steps 0..s ran untimed
    out["bytes_raw"] = steps[-1]["bytes_raw"]
    out["model_params"] = nparams
    out["final_loss"] = float(run.loss.detach())
    out["world"] = {"size": hvd.size(), "local_size": hvd.local_size(),
                    "cross_size": hvd.cross_size()}
    return out


def process_cpu_s() -> float:
    """CPU seconds of this process, every thread (Horovod's and the transport's included)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def idle_cpu_cores(seconds: float = 1.0) -> float:
    """The cores this process keeps busy while every rank sleeps (Horovod's background loop,
    the transports' threads): what an exchange's CPU is counted beyond (collective)."""
    barrier()
    before = process_cpu_s()
    time.sleep(seconds)
    return (process_cpu_s() - before) / seconds


def cpu_snapshot() -> tuple[float, float, float]:
    """(wall, busy CPU seconds of the whole machine, CPU seconds of this process)."""
    return time.perf_counter(), machine_busy_s(), process_cpu_s()


def ranks_cpu_s(before, after) -> float:
    """CPU seconds of every rank together between two :func:`cpu_snapshot` (collective)."""
    return sum(gather_rows(after[2] - before[2]))


def foreign_load(before, after) -> float:
    """Cores busy with anything but the ranks during an item (other jobs, kernel threads)."""
    own = ranks_cpu_s(before, after)
    return max(0.0, (after[1] - before[1] - own) / (after[0] - before[0]))


OVERLAP_MODES = ("idle", "sleep", "compute")
#: what the overlap probe posts: Horovod's fp32 allreduce (config ids ``idle`` ...), four
#: concurrent torch.distributed gloo all_gathers of a uint8 payload of the same size on a group
#: beside Horovod (``torch-idle`` ...), and the package's transport="gloo" allgather of it
#: (``hq-idle`` ...)
OVERLAP_TRANSPORTS = {"": "hvd_allreduce", "torch-": "torch_dist_all_gather_concurrent",
                      "hq-": "hq_gloo_group"}


def _post(transport: str, buf: torch.Tensor, payload: torch.Tensor, name: str, item: dict):
    """Start one transfer; returns the function that waits for it."""
    if transport == "hvd_allreduce":
        handle = hvd.allreduce_async_(buf, name=name, op=hvd.Average)
        return lambda: hvd.synchronize(handle)
    if transport == "hq_gloo_group":  # one name: its bound is known from the warm-up round on
        handle = _peers().allgather_async(payload.numpy(), "hqcl.o.hq")
        return handle.wait
    dist = _torch_group(item)
    works = []
    for piece in torch.chunk(payload, TRANSPORT_PIECES):
        out = [torch.empty_like(piece) for _ in range(hvd.size())]
        works.append(dist.all_gather(out, piece, async_op=True))
    return lambda: [w.wait() for w in works]


def run_overlap(item: dict, emit) -> None:
    """Does a transfer progress while the thread that posted it works? A transfer of
    ``size_mb`` MB per rank (:data:`OVERLAP_TRANSPORTS`) is posted; the posting thread then
    waits at once (``idle``), sleeps ``busy_s`` (``sleep``) or computes for ``busy_s``
    (``compute``: an elementwise NumPy loop, as an encode kernel or a backward pass would), then
    waits. Wall time ~ max(transfer, busy_s) means the transfer went on meanwhile (overlap);
    ~ transfer + busy_s means it stalled. Pipelining encode/decode with the wire, and
    overlapping communication with backward, can only pay in the first case."""
    n = int(item["size_mb"] * MB) // 4
    buf = torch.from_numpy(gradient(n).copy())
    payload = buf.view(torch.uint8).clone()
    work = np.ones(8 << 20, np.float32)
    busy = float(item["busy_s"])
    configs = [(prefix, mode) for prefix in item.get("transports", [""])
               for mode in OVERLAP_MODES]
    walls: dict[str, list[float]] = {p + m: [] for p, m in configs}
    rounds = item["warmup"] + item["repeats"]
    for r in range(rounds):  # modes interleaved, so drifts of the link hit all alike
        for prefix, mode in configs:
            barrier()
            t = time.perf_counter()
            wait = _post(OVERLAP_TRANSPORTS[prefix], buf, payload,
                         f"hqcl.o.{prefix}{mode}.{r}", item)
            if mode == "sleep":
                time.sleep(busy)
            elif mode == "compute":
                while time.perf_counter() - t < busy:
                    work *= np.float32(1.0000001)
            wait()
            if r >= item["warmup"]:
                walls[prefix + mode].append(time.perf_counter() - t)
        emit({"type": "progress", "id": item["id"], "round": r})
    for prefix, mode in configs:
        slowest = [max(w) for w in zip(*gather_rows(walls[prefix + mode]))]
        emit({"type": "result", "id": f"{item['id']}-{prefix}{mode}",
              "wall_s": statistics.median(slowest), "wall_min_s": min(slowest),
              "walls_s": slowest, "busy_s": busy if mode != "idle" else 0.0})


TRANSPORT_PIECES = 4


def _torch_group(item: dict):
    """A torch.distributed gloo group beside Horovod, on this rank's veth (named in
    GLOO_SOCKET_IFNAME, as a user of torch.distributed sets it to the cluster network's
    interface), rendezvous at rank 0's address from the plan. The package's own transport
    needs no such setting."""
    import torch.distributed as dist

    if not dist.is_initialized():
        ifaces = [i for i in os.listdir("/sys/class/net") if i != "lo"]
        if len(ifaces) == 1:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", ifaces[0])
        dist.init_process_group("gloo", init_method=f"tcp://{item['rendezvous']}",
                                rank=hvd.rank(), world_size=hvd.size())
    return dist


def _peers():
    """The package's gloo group beside Horovod (``transport="gloo"``; built once)."""
    return transport_collectives(transport="gloo")


def _mpi_comm():
    """A duplicate of MPI_COMM_WORLD for mpi4py (None under the gloo controller)."""
    if os.environ.get("HOROVOD_CONTROLLER", "mpi") != "mpi" or not hvd.mpi_enabled():
        return None
    from mpi4py import MPI

    global _MPI_DUP
    if _MPI_DUP is None:
        _MPI_DUP = MPI.COMM_WORLD.Dup()
    return _MPI_DUP


_MPI_DUP = None


def transports(item: dict) -> dict:
    """Ways to move one uint8 payload of every rank to every rank (what an allgather of
    compressed gradients needs), each a function(payload tensor, name) run to completion."""
    k = TRANSPORT_PIECES

    def pieces(t):
        return list(torch.chunk(t, k))

    def hvd_allgather(t, name):
        hvd.allgather(t, name=name)

    def hvd_allgather_concurrent(t, name):
        hs = [hvd.allgather_async(p, name=f"{name}.{i}") for i, p in enumerate(pieces(t))]
        for h in hs:
            hvd.synchronize(h)

    def hvd_grouped_allgather(t, name):
        hvd.grouped_allgather(pieces(t), name=name)

    def hvd_alltoall(t, name):  # every rank sends its whole payload to each rank
        n = hvd.size()
        hvd.alltoall(t.repeat(n), splits=torch.tensor([t.numel()] * n, dtype=torch.int32),
                     name=name)

    def hvd_allreduce_int32(t, name):  # the integer sum of linear Global-QSGD, same bytes
        hvd.allreduce(t.view(torch.int32), name=name, op=hvd.Sum)

    def hvd_allreduce_fp32_same_bytes(t, name):
        hvd.allreduce(t.view(torch.float32), name=name, op=hvd.Sum)

    def torch_dist_all_gather(t, name):
        dist = _torch_group(item)
        out = [torch.empty_like(t) for _ in range(hvd.size())]
        dist.all_gather(out, t)

    def torch_dist_all_gather_concurrent(t, name):
        dist = _torch_group(item)
        works = []
        for p in pieces(t):
            out = [torch.empty_like(p) for _ in range(hvd.size())]
            works.append(dist.all_gather(out, p, async_op=True))
        for w in works:
            w.wait()

    def hq_gloo_group(t, name):  # the package's transport="gloo" (StandaloneGroupCollectives)
        peers = _peers()
        peers.allgather_async(t.numpy(), name.rsplit(".", 1)[0]).wait()

    def hq_gloo_group_concurrent(t, name):
        peers = _peers()
        handles = [peers.allgather_async(p.numpy(), f"{name.rsplit('.', 1)[0]}.{i}")
                   for i, p in enumerate(pieces(t))]
        for h in handles:
            h.wait()

    def hq_gloo_group_allreduce_int32(t, name):  # the same bytes summed, as transport="gloo"
        peers = _peers()
        peers.allreduce_async(t.numpy().view(np.int32), name.rsplit(".", 1)[0]).wait()

    def mpi4py_iallgather(t, name):
        comm = _mpi_comm()
        a = t.numpy()
        out = np.empty(a.size * comm.Get_size(), np.uint8)
        req = comm.Iallgather(a, out)
        while not req.Test():  # polled as a pipelined exchange would, between its work
            time.sleep(0.0005)

    table = {f.__name__: f for f in (
        hvd_allgather, hvd_allgather_concurrent, hvd_grouped_allgather, hvd_alltoall,
        hvd_allreduce_int32, hvd_allreduce_fp32_same_bytes, torch_dist_all_gather,
        torch_dist_all_gather_concurrent, hq_gloo_group, hq_gloo_group_concurrent,
        hq_gloo_group_allreduce_int32, mpi4py_iallgather)}
    if _mpi_comm() is None:
        table.pop("mpi4py_iallgather")
    return table


def run_transport(item: dict, emit) -> None:
    """The time to move ``size_mb`` MB of uint8 payload per rank to every other rank by each
    transport of :func:`transports`, interleaved over rounds, after a barrier each (median and
    min of the slower rank). A ``result`` row per transport with the payload rate: the bytes
    a rank receives from its peers, times 8, over the wall time."""
    n = int(item["size_mb"] * MB)
    payload = torch.from_numpy(np.random.default_rng(hvd.rank()).integers(
        0, 256, n, dtype=np.uint8))
    table = transports(item)
    walls: dict[str, list[float]] = {name: [] for name in table}
    rounds = item["warmup"] + item["repeats"]
    for r in range(rounds):
        for name, move in table.items():
            barrier()
            t = time.perf_counter()
            move(payload, f"hqcl.t.{name}.{r}")
            if r >= item["warmup"]:
                walls[name].append(time.perf_counter() - t)
        emit({"type": "progress", "id": item["id"], "round": r})
    received_bits = 8 * n * (hvd.size() - 1)
    for name in table:
        slowest = [max(w) for w in zip(*gather_rows(walls[name]))]
        med = statistics.median(slowest)
        emit({"type": "result", "id": f"{item['id']}-{name}", "wall_s": med,
              "wall_min_s": min(slowest), "walls_s": slowest,
              "gbit_s": received_bits / med / 1e9})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    with open(args.plan) as f:
        plan = json.load(f)
    def emit(row: dict) -> None:
        if hvd.rank() == 0:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    for item in plan["items"]:
        t = time.perf_counter()
        barrier()
        before = cpu_snapshot()
        if item["kind"] == "overlap":
            run_overlap(item, emit)
        elif item["kind"] == "transport":
            run_transport(item, emit)
        elif item["kind"] == "exchange":
            rows = []
            run_exchange(item, lambda row: rows.append(row) if row["type"] == "result"
                         else emit(row))
            load = foreign_load(before, cpu_snapshot())
            for row in rows:
                row["other_load_cores"] = load
                emit(row)
        else:
            try:
                res = run_train(item)
                res["error"] = None
            except Exception as exc:  # recorded; ranks fail alike (same codecs, same sizes)
                res = {"error": f"{type(exc).__name__}: {exc}"}
                traceback.print_exc()
            res["other_load_cores"] = foreign_load(before, cpu_snapshot())
            emit({"type": "result", "id": item["id"], **res})
        emit({"type": "done", "id": item["id"], "item_s": time.perf_counter() - t})
    barrier()


if __name__ == "__main__":
    main()
