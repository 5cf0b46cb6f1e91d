"""``hq.torch.DistributedOptimizer``: Horovod's signature, plus fusion, grouped norms, policy.

What it adds over ``hvd.DistributedOptimizer(compression=...)``:

* Fusion: compressed gradients are packed into fixed buckets of about ``fusion_bytes`` (formed
  once, in reverse parameter order, so early-ready gradients of the last layers go first); a
  bucket's exchange starts from the backward hook of its last gradient, so communication
  overlaps the rest of backward, and many small tensors cost one collective. Over a transport
  that pairs collectives by call order (``transport="gloo"``, the default for CPU gradients)
  buckets start in bucket order, each once the ones before it have; over Horovod's, a bucket
  whose own collective pairs by call order (Global-QSGD's exponent allreduce) starts at
  ``synchronize()``, in bucket order.
* Per-bucket norm: codecs that normalize by a global norm (Global-QSGD) take each bucket's own,
  over that bucket's vector on every rank. Its small allgather starts from the bucket's
  backward hook without waiting for peers, and the bucket's pieces are encoded and sent from
  the first later hook that finds the norm arrived, so neither waits for the end of backward.
* Per-layer policy: small, 1-D and sparse gradients travel uncompressed through Horovod's own
  allreduce (fused by Horovod); name rules choose another codec (or none) per parameter
  (:class:`LayerPolicy`), and buckets hold the parameters of one codec.

Bucket ``i`` of step ``t`` is exchanged with seed ``derive_key(seed, t, i)``; its flat vector is
the concatenation of its gradients in bucket order, so ``mean_estimate(codec, [that vector on
each rank], derive_key(seed, t, i), pipeline_elems=opt.pipeline_elems)`` reproduces the result
exactly, for every bucket (global-norm codecs included: the norm is the bucket's).

As in Horovod, every parameter gets the averaged gradient on every rank, also where a rank did
not use it (its gradient counts as zeros), so the ranks' weights stay identical. The ranks check
at construction that they agree on the codecs, the policy and the bucket layout (parameter
names and shapes), before anything else waits for a peer. A sparse gradient travels on
Horovod's sparse path (``sparse_as_dense=True``: its dense form is compressed); its parameter
leaves its bucket from the next step on.

Fallback (``fallback="auto"``, the default; :mod:`horovod_quant.exchange.fallback`): at the
end of step :data:`~horovod_quant.exchange.fallback.FALLBACK_STEP` each bucket's codec exchange
and Horovod's float32 allreduce of the same vector are timed in isolation; the ranks agree on
the slowest rank's times, and a bucket whose codec was slower than the allreduce has its
parameters carried by Horovod's allreduce (float32, the configured ``op``) from the next step
on, like a sparse parameter, with one warning in the ``horovod_quant`` log (rank 0). When a kept
codec won by less than 2x, the next steps check the choice inside training (2 x
:data:`~horovod_quant.exchange.fallback.STEP_CHECK_ROUNDS` steps alternating between that
layout and every bucket on the allreduce; each step is timed from its first gradient ready to
the end of ``synchronize()``, and the ranks take the shortest of their times:
:meth:`~horovod_quant.exchange.fallback.StepChecker.decide`) and every bucket falls back when
the allreduce's steps were the faster. ``opt.fallback_decisions`` holds every
bucket's trial, ``opt.fallback_step_check`` the step check (None when none ran), and
``opt.fallback_settled`` says whether the layout is final.

CUDA parameters: buckets hold parameters of one device, their buffers live on that device, and
the codec runs there (see :mod:`horovod_quant.torch.compression`).
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Callable, Iterable

import horovod.torch as hvd
import numpy as np
import torch

from ..doors import check_same_config, check_seed, mpi_exchange_config
from ..exchange.driver import Exchange
from ..exchange.fallback import (FALLBACK_STEP, BucketTrial, FallbackDecision, StepCheck,
                                 StepChecker, check_fallback, measure_and_decide,
                                 needs_step_check)
from ..core.registry import get_codec, horovod_equivalent
from ..core.base import Codec
from ..core.rng import derive_key
from ..exchange.plans import DEFAULT_PIPELINE_ELEMS, check_pipeline_elems
from ..policy import LayerPolicy, describe
from ..stats import StepStats
from .collectives import HorovodTorchCollectives, as_array, as_tensor
from .compression import QuantizedCompressor, flat_array, horovod_dtype, on_gpu, stream_of
from .transport import collectives_for, resolve_transport, transport_of

DEFAULT_FUSION_BYTES = 32 << 20

log = logging.getLogger("horovod_quant")


def _resolve_codec(compression: Any) -> tuple[Codec, dict]:
    """(codec, compressor settings) from what a user may pass as ``compression``."""
    if isinstance(compression, QuantizedCompressor):
        return compression.codec, {"seed": compression.seed, "gather": compression.gather,
                                   "policy": compression.policy}
    if isinstance(compression, Codec):
        return compression, {}
    if isinstance(compression, str):
        return get_codec(compression), {}
    if compression is None or compression is hvd.Compression.none:
        return horovod_equivalent("keep"), {}
    if compression is hvd.Compression.fp16:
        return horovod_equivalent("float16"), {}
    raise ValueError(f"compression={compression!r} is not understood: pass "
                     "hq.torch.Compression.<codec>(...), a codec, a codec name, or "
                     "hvd.Compression.none/fp16")


class _Bucket:
    """Parameters of one device and one codec exchanged together, with the bucket's flat input
    and output buffers (kept across steps: fresh multi-MB arrays would page-fault on every
    step), on the device the codec runs on."""

    __slots__ = ("index", "params", "codec", "numel", "ready", "pending", "flat", "mean")

    def __init__(self, index: int, params: list[torch.nn.Parameter], codec: Codec) -> None:
        devices = {p.device for p in params}
        if len(devices) > 1:
            raise ValueError(f"a fusion group mixes devices {sorted(map(str, devices))}: put "
                             f"the parameters of each device in groups of their own")
        self.index = index
        self.params = params
        self.codec = codec
        self.numel = sum(p.numel() for p in params)
        self.ready = 0
        self.pending = None
        self.flat: np.ndarray | None = None
        self.mean = self.buffer()

    def buffer(self) -> Any:
        """A float32 array of ``numel`` where the codec runs for these parameters."""
        p = self.params[0]
        device = p.device if on_gpu(p) else torch.device("cpu")
        return as_array(torch.empty(self.numel, dtype=torch.float32, device=device))


class _QuantDistributedOptimizer(torch.optim.Optimizer):
    def __init__(self, params, named_parameters, codec: Codec, backward_passes_per_step: int,
                 op, gradient_predivide_factor: float, groups, sparse_as_dense: bool,
                 process_set, fusion_bytes: int, policy: LayerPolicy, seed: int, gather: str,
                 pipeline_elems: int | None, transport: str,
                 on_step: Callable[[StepStats], None] | None, fallback: str) -> None:
        super(self.__class__, self).__init__(params)
        if op not in (hvd.Average, hvd.Sum):
            raise ValueError("horovod_quant optimizers support op=hvd.Average or hvd.Sum; "
                             "Adasum combines models, not gradient means")
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be >= 1")
        if fusion_bytes < 1:
            raise ValueError(f"fusion_bytes={fusion_bytes} must be >= 1")
        self.codec = codec
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.backward_passes_per_step = backward_passes_per_step
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self.policy = policy
        self.seed = check_seed(seed)
        self.gather = gather
        self.pipeline_elems = check_pipeline_elems(pipeline_elems)
        self.on_step = on_step
        self.fallback = check_fallback(fallback)
        self.fallback_decisions: list[FallbackDecision] = []
        self.fallback_step_check: StepCheck | None = None
        self._step_checker: StepChecker | None = None
        self.stats = StepStats()
        self.last_stats: StepStats | None = None
        self._step = 0

        all_params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not isinstance(t, tuple) or len(t) != 2 for t in named):
                raise ValueError("named_parameters should be a sequence of (name, parameter) "
                                 "tuples, usually model.named_parameters()")
            names = {id(p): n for n, p in named}
            dups = {n for n in names.values() if list(names.values()).count(n) > 1}
            if dups:
                raise ValueError(f"parameter names must be unique; duplicates: {sorted(dups)}")
            missing = [p for p in all_params if id(p) not in names]
            if missing:
                raise ValueError(f"{len(missing)} optimizer parameters are missing from "
                                 "named_parameters")
        else:
            names = {id(p): f"param.{i}" for i, p in enumerate(all_params)}
        self._names = names
        self._all_params = all_params
        self._groups, self._fusion_bytes = groups, fusion_bytes
        self._sparse: set[int] = set()  # parameters whose gradients came sparse
        self._densified: set[int] = set()  # sparse this step, exchanged dense (sparse_as_dense)
        self._fallen_back: set[int] = set()  # parameters of buckets whose codec did not pay
        self._bucket_cache: dict[tuple, _Bucket] = {}  # buckets (and buffers) a layout reuses
        self._delay = {id(p): backward_passes_per_step for p in all_params}
        self._raw_handles: dict[int, Any] = {}
        self._hooked: set[int] = set()
        self._synchronized = False
        self._should_synchronize = True
        self._comm = HorovodTorchCollectives(process_set)
        self._layout()
        # the check comes before anything that can wait for a peer (the transport's and the
        # exchanges' set-up), over Horovod's collectives
        self._transport = transport
        self._prefix = self._check_layout()
        self._comm = collectives_for(process_set, transport)
        #: what carries the payloads: "gloo" (a group beside Horovod) or "horovod"
        self.transport = transport_of(self._comm)
        #: which ranks share hosts, where the transport runs hierarchical exchanges (else None):
        #: what :func:`~horovod_quant.mean_estimate` needs to reproduce a bucket
        self.topology = getattr(self._comm.hierarchy, "topology", None)
        self._exchanges = {c.config_key(): Exchange(c, self._comm, gather=gather,
                                                        pipeline_elems=pipeline_elems)
                           for c in policy.codecs(codec)}
        self._grad_accs = []
        if self._comm.size > 1:
            for p in all_params:
                acc = p.expand_as(p).grad_fn.next_functions[0][0]
                acc.register_hook(self._make_hook(p))
                self._grad_accs.append(acc)

    def _layout(self) -> None:
        """Which parameters Horovod's allreduce carries (and in which dtype: ``_cast``) and the
        buckets of the others, one codec per bucket."""
        self._raw, self._cast, by_codec = [], {}, {}
        for p in self._all_params:
            c = (None if id(p) in self._sparse or id(p) in self._fallen_back else
                 self.policy.codec_for(self.codec, p.shape, self._names[id(p)]))
            wire = horovod_dtype(c, p)
            if wire is not None:
                self._raw.append(p)
                self._cast[id(p)] = wire
            else:
                by_codec.setdefault(c.config_key(), (c, []))[1].append(p)
        self._buckets = []
        for c in self.policy.codecs(self.codec):
            _, params = by_codec.get(c.config_key(), (c, []))
            self._buckets += self._make_buckets(params, c, self._groups, self._fusion_bytes,
                                                len(self._buckets))
        # a bucket formed again (the step check switches layouts) keeps its buffers: fresh
        # multi-MB ones would page-fault in the step being timed
        cache = self._bucket_cache
        self._buckets = [cache.setdefault(self._bucket_key(b), b) for b in self._buckets]
        if self._step_checker is None:
            self._bucket_cache = {self._bucket_key(b): b for b in self._buckets}
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._next_bucket = 0  # the gloo transport starts buckets in order from this one

    @staticmethod
    def _bucket_key(bucket: _Bucket) -> tuple:
        return (bucket.index, bucket.codec.config_key(), tuple(id(p) for p in bucket.params))

    def _check_layout(self) -> str:
        """Every rank must agree on everything that changes what goes on the wire (the codecs,
        policy, seed, transport, pipeline, op and factors, sparse handling, fallback and the
        buckets, which ``fusion_bytes`` and ``num_groups``/``groups`` form); returns the
        check's prefix, which names this optimizer's collectives. ``backward_passes_per_step``
        is not checked: it changes when a rank starts its exchanges, not which."""
        codecs = self.policy.codecs(self.codec)
        mpi = {} if self._transport == "gloo" else mpi_exchange_config(codecs)
        return check_same_config(self._comm, {
            "door": "optimizer", **self.codec.config(), "seed": self.seed,
            "transport": self._transport, **mpi, "pipeline_elems": self.pipeline_elems,
            "op": self.op, "gradient_predivide_factor": self.gradient_predivide_factor,
            "sparse_as_dense": self.sparse_as_dense,
            "gather": self.gather, "policy": describe(self.policy),
            "fusion_bytes": self._fusion_bytes, "sparse": sorted(self._names[k] for k in self._sparse),
            "fallback": [self.fallback, sorted(self._names[k] for k in self._fallen_back)],
            "buckets": [[b.codec.config(), [[self._names[id(p)], list(p.shape)] for p in b.params]]
                        for b in self._buckets]})

    @staticmethod
    def _make_buckets(params: list, codec: Codec, groups, fusion_bytes: int,
                      first: int) -> list[_Bucket]:
        if groups is not None and not isinstance(groups, int):
            chosen = {id(p) for g in groups for p in g}
            lists = [[p for p in g if any(p is q for q in params)] for g in groups]
            lists += [[p] for p in params if id(p) not in chosen]
        else:
            lists, cur, size = [], [], 0
            limit = fusion_bytes
            if isinstance(groups, int) and groups > 0:
                total = sum(p.numel() * 4 for p in params)
                limit = max(1, -(-total // groups))
            for p in reversed(params):
                if cur and p.device != cur[-1].device:
                    lists.append(cur)
                    cur, size = [], 0
                cur.append(p)
                size += p.numel() * 4
                if size >= limit:
                    lists.append(cur)
                    cur, size = [], 0
            if cur:
                lists.append(cur)
        return [_Bucket(first + i, ps, codec) for i, ps in enumerate(l for l in lists if l)]

    # -- hooks --------------------------------------------------------------------------
    def _make_hook(self, p: torch.nn.Parameter):
        def hook(*_):
            key = id(p)
            if self._delay[key] <= 0:
                raise AssertionError("Gradients were computed more than backward_passes_per_step "
                                     "times before step(); raise backward_passes_per_step to "
                                     "accumulate gradients locally.")
            self._delay[key] -= 1
            if self._delay[key] == 0:
                if self._step_checker is not None:  # the step's exchange starts here
                    self._step_checker.start()
                self._hooked.add(key)
                self._ready(p)
                self._advance_buckets()
        return hook

    def _ready(self, p: torch.nn.Parameter) -> None:
        if p.grad is not None and p.grad.is_sparse and self.sparse_as_dense:
            p.grad = p.grad.to_dense()
            self._densified.add(id(p))
        bucket = self._bucket_of.get(id(p))
        if bucket is None or (p.grad is not None and p.grad.is_sparse):
            if bucket is not None:  # found sparse now: its bucket slot is zeros this step
                self._sparse.add(id(p))
            self._start_raw(p)
            if bucket is None:
                return
        bucket.ready += 1
        if self._comm.pairs_by_order:
            self._start_buckets_in_order()
        elif bucket.ready == len(bucket.params) and not self._exchange_of(bucket).blocks_on_peers:
            self._start_bucket(bucket)

    def _start_buckets_in_order(self) -> None:
        """Over collectives that pair by call order (the gloo transport): start each bucket
        whose gradients are all here once the buckets before it have started, and put its
        pieces on the wire at once (waiting for its norm), so that every rank issues the same
        collectives in the same order whatever order its hooks ran in, as DDP's reducer does.
        Buckets fill in bucket order in the common case (they are formed in reverse parameter
        order, backward's order), so this rarely holds one back."""
        while self._next_bucket < len(self._buckets):
            bucket = self._buckets[self._next_bucket]
            if bucket.ready < len(bucket.params):
                return
            self._start_bucket(bucket)
            with stream_of(bucket.params[0]):
                bucket.pending.advance(block=True)
            self._next_bucket += 1

    def _advance_buckets(self) -> None:
        """Start the pieces of the started buckets whose global norm has arrived, so that they
        are encoded and sent during the rest of backward (for the others, a check that their
        norm's collective is not done yet). Called from the hooks, when a rank's progress
        decides what it finds; over a transport that pairs by call order every started bucket
        is already on the wire (:meth:`_start_buckets_in_order`)."""
        for b in self._buckets:
            if b.pending is not None and not b.pending.issued:
                with stream_of(b.params[0]):
                    b.pending.advance()

    def _exchange_of(self, bucket: _Bucket) -> Exchange:
        return self._exchanges[bucket.codec.config_key()]

    def _start_raw(self, p: torch.nn.Parameter) -> None:
        """Horovod's own allreduce of ``p``'s gradient (sparse: Horovod's sparse path; a cast
        dtype: a cast copy, as Horovod's ``Compression.fp16``)."""
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        name = f"{self._prefix}.raw.{self._names[id(p)]}"
        wire = p.grad
        if wire.is_sparse:
            handle = hvd.sparse_allreduce_async(wire, name=name, op=self.op,
                                                process_set=self.process_set)
        else:
            wire = wire.to(self._cast.get(id(p), wire.dtype))
            handle = self._allreduce_async_(wire, name)
        self.stats.add_raw(wire.numel() * wire.element_size(),
                           p.grad.numel() * p.grad.element_size())
        self._raw_handles[id(p)] = (p, handle)

    def _allreduce_async_(self, tensor: torch.Tensor, name: str) -> Any:
        """Horovod's in-place allreduce of ``tensor`` with the configured op and factors."""
        scale = self.gradient_predivide_factor if self.op == hvd.Average else 1.0
        return hvd.allreduce_async_(tensor, name=name, op=self.op, prescale_factor=1.0 / scale,
                                    postscale_factor=scale, process_set=self.process_set)

    def _travels_in_bucket(self, p: torch.nn.Parameter) -> bool:
        return id(p) not in self._raw_handles

    def _flat(self, bucket: _Bucket) -> Any:
        """The bucket's gradients as one float32 vector: the gradient itself (a view) for a
        one-parameter float32 bucket, else copied into the bucket's buffer (zeros for a
        parameter without a gradient this step, or one on the sparse path). Gradients do not
        change between the start of their exchange and ``synchronize()``."""
        parts = [flat_array(p.grad) if p.grad is not None and self._travels_in_bucket(p)
                 else None for p in bucket.params]
        if len(parts) == 1 and parts[0] is not None:
            return parts[0]
        if bucket.flat is None:
            bucket.flat = bucket.buffer()
        offset = 0
        for p, part in zip(bucket.params, parts):
            dst = bucket.flat[offset:offset + p.numel()]
            if part is None:
                dst.fill(0)
            else:
                dst[:] = part
            offset += p.numel()
        return bucket.flat

    def _start_bucket(self, bucket: _Bucket) -> None:
        seed = derive_key(self.seed, self._step, bucket.index)
        name = f"{self._prefix}.b{bucket.index}"  # the same every step: Horovod caches it
        with stream_of(bucket.params[0]):
            bucket.pending = self._exchange_of(bucket).start(
                self._flat(bucket), seed, name, out=bucket.mean)

    def _start_waiting_buckets(self) -> None:
        """Start, in bucket order, the buckets not started yet (those whose exchanges pair by
        call order, and those a rank did not use), then put every bucket's pieces on the wire
        in bucket order (waiting for the global norms that have not arrived), so that no
        bucket's transfer waits for the bucket before it to finish."""
        for b in self._buckets:
            if b.pending is None:
                self._start_bucket(b)
        for b in self._buckets:
            with stream_of(b.params[0]):
                b.pending.advance(block=True)

    # -- synchronize / step -------------------------------------------------------------
    def synchronize(self) -> None:
        if self._comm.size == 1:
            self._finish_step()
            return
        if self._step_checker is not None:  # a step without gradients: its exchange starts now
            self._step_checker.start()
        for p in [p for b in self._buckets for p in b.params] + self._raw:
            if id(p) not in self._hooked:  # no gradient this step (unused parameter)
                self._hooked.add(id(p))
                self._ready(p)
        self._start_waiting_buckets()
        factor = float(self._comm.size) if self.op == hvd.Sum else 1.0
        for b in self._buckets:
            with stream_of(b.params[0]):
                mean = as_tensor(b.pending.wait())
            self.stats.add(b.pending.stats)
            if factor != 1.0:
                mean.mul_(factor)
            offset = 0
            for p in b.params:
                n = p.numel()
                if self._travels_in_bucket(p):
                    if p.grad is None:  # unused here, used elsewhere: Horovod's zeros
                        p.grad = torch.zeros_like(p)
                    p.grad.copy_(mean[offset:offset + n].view_as(p.grad))
                offset += n
            b.pending = None
            b.ready = 0
        self._next_bucket = 0
        for p, handle in self._raw_handles.values():
            out = handle() if callable(handle) else hvd.synchronize(handle)  # sparse: callable
            if p.grad.is_sparse:
                p.grad = out
            elif out.data_ptr() != p.grad.data_ptr():  # a cast copy travelled
                p.grad.copy_(out)
        self._raw_handles.clear()
        for p in self._all_params:  # as Horovod: the optimizer gets the sparse form back
            if id(p) in self._densified:
                p.grad = p.grad.to_sparse()
        self._densified.clear()
        relayout = any(id(p) in self._bucket_of for p in self._all_params if id(p) in self._sparse)
        if self.fallback == "auto":
            relayout |= self._fallback_at_step_end()
        if relayout:  # sparse and fallen-back parameters leave their buckets; the ranks check again
            self._layout()
            self._check_layout()
        self._finish_step()

    @property
    def fallback_settled(self) -> bool:
        """Whether the fallback has decided for good (always with ``fallback="never"``): from
        the next step on the layout no longer changes for the fallback's sake."""
        return self.fallback == "never" or (self._step > FALLBACK_STEP
                                            and self._step_checker is None)

    def _fallback_at_step_end(self) -> bool:
        """The fallback's work at the end of a step: the isolated trial at step
        :data:`~horovod_quant.exchange.fallback.FALLBACK_STEP`, then, when a kept codec won it
        narrowly, the step check: end the timing of this step's exchange, set the next step's
        layout, decide once every step of the check ran. Returns whether the layout changes."""
        checker = self._step_checker
        if checker is not None:
            checker.stop()
            if not checker.complete:
                self._fallen_back = set(checker.next_layout())
                return True
            self._step_checker = None
            check = checker.decide(self._comm, f"{self._prefix}.fallback.steps")
            self.fallback_step_check = check
            self._fallen_back = set(checker.layouts[check.fallback])
            if self._comm.rank == 0:
                (log.warning if check.fallback else log.info)(check.message())
            return True
        if self._step != FALLBACK_STEP:
            return False
        relayout = self._measure_fallbacks()
        if needs_step_check(self.fallback_decisions):
            kept = frozenset(self._fallen_back)
            everything = kept | {id(p) for b in self._buckets for p in b.params}
            self._step_checker = StepChecker(self._step + 1, kept, everything)
            self._fallen_back = set(self._step_checker.next_layout())
        return relayout

    def _measure_fallbacks(self) -> bool:
        """Time each bucket's codec exchange and Horovod's float32 allreduce of the same vector
        (:func:`~horovod_quant.exchange.fallback.measure_and_decide`), record the decisions in
        :attr:`fallback_decisions`, log each fallback once (rank 0: every rank decides the same)
        and mark the fallen-back buckets' parameters for Horovod's allreduce.

        The trials read the step's means (``bucket.mean``, already copied into the gradients)
        and write into scratch buffers, so they change no gradient.

        Returns:
            Whether any bucket falls back (the layout must be formed again).
        """
        largest: dict[torch.device, _Bucket] = {}
        for b in self._buckets:
            device = b.params[0].device
            if device not in largest or b.numel > largest[device].numel:
                largest[device] = b
        scratch = {device: b.buffer() for device, b in largest.items()}
        trials = [self._trial(b, scratch[b.params[0].device][:b.numel]) for b in self._buckets]
        self.fallback_decisions = measure_and_decide(self._comm, trials, self._step,
                                                     f"{self._prefix}.fallback")
        for b, decision in zip(self._buckets, self.fallback_decisions):
            if decision.fallback:
                self._fallen_back.update(id(p) for p in b.params)
                if self._comm.rank == 0:
                    log.warning(decision.message())
        return any(d.fallback for d in self.fallback_decisions)

    def _trial(self, bucket: _Bucket, out: Any) -> BucketTrial:
        """The two blocking runs that measure ``bucket``, both writing into ``out``."""
        first = bucket.params[0]
        exchange = self._exchange_of(bucket)
        seed = derive_key(self.seed, self._step, bucket.index)  # its estimate is discarded
        name = f"{self._prefix}.fallback.b{bucket.index}"

        def settle() -> None:  # device work is queued: the time must include it
            if on_gpu(first):
                torch.cuda.synchronize(first.device)

        def run_codec() -> None:
            with stream_of(first):
                exchange.start(bucket.mean, seed, name, out=out).wait()
                settle()

        def run_fp32() -> None:
            with stream_of(first):
                hvd.synchronize(self._allreduce_async_(as_tensor(out), f"{name}.fp32"))
                settle()

        return BucketTrial(bucket.index, repr(bucket.codec), bucket.numel * 4, run_codec,
                           run_fp32)

    def _finish_step(self) -> None:
        self._hooked.clear()
        for key in self._delay:
            self._delay[key] = self.backward_passes_per_step
        self._step += 1
        self.last_stats = self.stats.reset()
        if self.on_step is not None:
            self.on_step(self.last_stats)
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """Use after an explicit ``synchronize()`` (e.g. for gradient clipping) around step()."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, *args, **kwargs):
        if self._raw_handles or any(b.pending is not None for b in self._buckets):
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but "
                                 "before optimizer.step() or optimizer.synchronize()")
        return super(self.__class__, self).zero_grad(*args, **kwargs)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                         compression: Any = None, backward_passes_per_step: int = 1,
                         op: Any = hvd.Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = hvd.global_process_set, *,
                         fusion_bytes: int = DEFAULT_FUSION_BYTES,
                         policy: LayerPolicy | None = None, seed: int | None = None,
                         gather: str | None = None,
                         pipeline_elems: int | None = DEFAULT_PIPELINE_ELEMS,
                         transport: str | None = None,
                         on_step: Callable[[StepStats], None] | None = None,
                         fallback: str = "auto"):
    """Wrap ``optimizer`` so gradients are averaged across ranks through a horovod_quant codec.

    Same arguments as ``horovod.torch.DistributedOptimizer`` (``num_groups``/``groups`` define
    the fusion buckets when given), plus:

    Args:
        fusion_bytes: float32 bytes per fused bucket of compressed gradients.
        policy: per-layer policy (default :class:`LayerPolicy`, or the compressor's).
        seed: base seed (default: the compressor's, else 0).
        gather: schedule for gather codecs (default: the compressor's, else "auto").
        pipeline_elems: buckets longer than this are exchanged in pieces of this many elements,
            each piece on the wire while the next is encoded and the previous decoded (see
            :class:`horovod_quant.exchange.Exchange`; default ``1 << 21``); None sends every bucket
            whole.
        transport: what carries the payloads (:mod:`horovod_quant.torch.transport`): "auto"
            (default, or the ``HQ_TRANSPORT`` environment variable: the collectives of a gloo
            group beside Horovod for CPU gradients, buckets started in bucket order, else
            Horovod's collectives), "gloo" or "horovod". The choice is logged once and kept
            in ``opt.transport``.
        on_step: called with each step's :class:`StepStats` (also at ``.last_stats``).
        fallback: "auto" (default): at the end of the second step (index
            :data:`~horovod_quant.exchange.fallback.FALLBACK_STEP`), time each bucket's codec
            exchange against Horovod's float32 allreduce of the same vector (the slowest rank's
            median of 3-15 runs each) and let Horovod's allreduce carry, from the next step
            on, the buckets whose codec did not save 5% and 2 ms, with one warning per bucket
            in the ``horovod_quant`` log; when a kept codec won by less than 2x, check in the
            next 10 training steps (alternating: the codec, then every bucket on the allreduce;
            each step's exchange timed from its first gradient ready to the end of
            ``synchronize()``) and let the allreduce carry every bucket if its exchanges were
            the faster (one warning).
            "never": always the codec (no measurement). A one-rank world never measures.

    Returns:
        An optimizer of a subclass of ``type(optimizer)``; its ``fallback_decisions`` lists
        the :class:`~horovod_quant.exchange.fallback.FallbackDecision` of every bucket once
        measured (empty before, and with ``fallback="never"``), ``fallback_step_check`` the
        :class:`~horovod_quant.exchange.fallback.StepCheck` once one ran, and
        ``fallback_settled`` whether the fallback has decided for good.

    Raises:
        ValueError: an argument is invalid (``fallback`` not "auto" or "never", ...).
    """
    codec, settings = _resolve_codec(compression)
    if num_groups and groups is None:
        groups = num_groups
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,),
               dict(_QuantDistributedOptimizer.__dict__))
    opt = cls(optimizer.param_groups, named_parameters, codec, backward_passes_per_step, op,
              gradient_predivide_factor, groups, sparse_as_dense, process_set, fusion_bytes,
              policy if policy is not None else settings.get("policy", LayerPolicy()),
              seed if seed is not None else settings.get("seed", 0),
              gather if gather is not None else settings.get("gather", "auto"), pipeline_elems,
              resolve_transport(transport), on_step, fallback)
    opt.load_state_dict(optimizer.state_dict())
    return opt
