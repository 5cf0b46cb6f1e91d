"""``hq.tensorflow.Compression.<codec>(**params)``: Horovod ``Compressor`` objects for TensorFlow.

They plug into ``hvd.DistributedGradientTape(tape, compression=...)``, the Keras
``horovod.tensorflow.keras.DistributedOptimizer(opt, compression=...)``, the legacy
``hvd.DistributedOptimizer`` and ``hvd.allreduce``/``hvd.grouped_allreduce(...,
compression=...)``, eagerly and inside ``tf.function`` (Horovod itself wraps the gradient
allreduce of an eagerly built tape/optimizer in a ``tf.function``, so ``compress`` is normally
called while a graph is traced).

Horovod allreduces whatever ``compress`` returns with the user's ``op``, which would destroy
quantized codes, so ``compress`` builds the codec's own exchange out of graph ops:
``tf.numpy_function`` callbacks into the framework-neutral steps of
:mod:`horovod_quant.comm.steps` (the same core code as every other adapter) around Horovod's TF
collectives on the encoded bytes (``hvd.allgather`` of uint8 frames for gather and custom
codecs, ``hvd.allreduce(op=hvd.Sum)`` of int64 words for summable ones, ``hvd.alltoall`` +
``hvd.allgather`` for the scatter-reduce-allgather schedule, and first an allgather of the
per-rank norm statistics for global-norm codecs; NDQSG ends with an int64 allreduce of the
ranks' wrong-coarse-bin counts). The gathered/reduced tensor stays in ``ctx`` and
Horovod reduces a one-element float32 placeholder holding 1.0, whose reduced value is the
factor the user's op and pre/postscale factors imply (1 for Average, n for Sum); ``decompress``
decodes, applies that factor, reshapes and casts back to the gradient's dtype.

Seeds. Each compressor owns an int64 ``tf.Variable`` call counter. Every compressed tensor
takes the counter's value k and increments it (``assign_add`` inside the graph, so the count
advances each time the graph runs, not once per trace) and is exchanged with seed
``derive_key(seed, k)``. The ops of one compressor all use that variable, so TensorFlow's
automatic control dependencies run them in program order: k follows the order in which Horovod
calls ``compress``, which is the order of the gradient list (``sources`` of the tape,
``model.trainable_variables`` for Keras; group by group for ``groups``/``num_groups``), the
same on every rank. Tensors the policy leaves uncompressed take no k.
"""
from __future__ import annotations

import itertools
import threading
import time
from typing import Any, NamedTuple

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from horovod.tensorflow.compression import Compressor

from ..comm import steps
from ..core.base import Codec
from ..core.rng import derive_key
from ..adapters import CompressionNamespace, CompressorSettings, check_same_config
from ..policy import LayerPolicy
from ._fenv import ieee_denormals
from .collectives import HorovodTFCollectives

_IDS = itertools.count()
_NORM_WIRE_BYTES = 8  # the rank's norm statistic, one float64
_PLACEHOLDER_BYTES = 4


class _Ctx(NamedTuple):
    """What ``decompress`` needs: the exchanged tensor and the call index, as graph tensors."""

    result: tf.Tensor
    k: tf.Tensor
    flat: tf.Tensor  # this rank's input: NDQSG senders count their own wrong coarse bins
    shape: Any
    dtype: tf.DType


class QuantizedCompressor(CompressorSettings, Compressor):
    """A ``horovod.tensorflow.compression.Compressor`` running a horovod_quant codec.

    Args: see :class:`~horovod_quant.adapters.CompressorSettings`. Here the k-th tensor
    compressed (from 0) uses seed ``derive_key(seed, k)``, and tensors whose static shape is not
    fully known travel uncompressed too.

    Attributes:
        stats: :class:`~horovod_quant.stats.StepStats` of the compressed exchanges since the
            last ``stats.reset()``, accumulated when they run (not when graphs are traced).
            Tensors left to Horovod (policy, ``none``, ``fp16``) are not counted: that would
            take a Python callback per tensor and step, which TensorFlow orders like any
            stateful op and so would serialize Horovod's allreduces of those tensors.
    """

    def __init__(self, codec: Codec, seed: int = 0, gather: str = "auto",
                 policy: LayerPolicy | None = None, process_set: Any = None) -> None:
        super().__init__(codec, seed, gather, policy, process_set)
        self._id = next(_IDS)
        self._counter: tf.Variable | None = None
        self._checked = False
        self._inflight: dict[int, dict] = {}
        self._lock = threading.Lock()

    # -- bookkeeping ---------------------------------------------------------------------------
    @property
    def calls(self) -> int:
        """How many tensors this compressor has exchanged so far: the next one uses
        ``derive_key(seed, calls)``."""
        return 0 if self._counter is None else int(self._counter.numpy())

    def _ps(self) -> Any:
        return self.process_set if self.process_set is not None else hvd.global_process_set

    def _start(self) -> None:
        """Create the call counter and check the configuration across ranks (once, eagerly,
        even while a ``tf.function`` is traced: every rank traces its first step)."""
        with tf.init_scope():
            if self._counter is None:
                with tf.device("/cpu:0"):
                    self._counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                                name=f"hq_calls_{self._id}")
            if not self._checked:
                ps = self._ps()
                if ps.size() > 1:
                    check_same_config(HorovodTFCollectives(ps), self.shared_config(),
                                      f"hq.tf.config.{self._id}")
                self._checked = True

    # -- numpy callbacks (run when the graph runs) --------------------------------------------
    def _norm_wire(self, flat: np.ndarray) -> np.ndarray:
        with ieee_denormals():
            return steps.norm_wire(self.codec, [flat])

    def _norm_from_gathered(self, gathered: np.ndarray) -> np.ndarray:
        with ieee_denormals():
            return np.float32(steps.norm_from_gathered(self.codec, gathered))

    def _begin(self, k: int, size: int, meta: dict, t0: float, nbytes: int) -> None:
        t1 = time.perf_counter()
        with self._lock:
            self._inflight[k] = {"size": size, "meta": meta, "t": t1}
            self.stats.encode_s += t1 - t0
            self.stats.bytes_sent += nbytes
            self.stats.bytes_raw += 4 * size
            self.stats.tensors += 1

    def _finish(self, k: int) -> dict:
        with self._lock:
            rec = self._inflight.pop(k)
            self.stats.exchange_s += time.perf_counter() - rec["t"]
        return rec

    def _end(self, mean: np.ndarray, factor: np.ndarray, t0: float) -> np.ndarray:
        f = np.float32(np.asarray(factor).reshape(-1)[0])
        if f != np.float32(1.0):
            mean = mean * f
        with self._lock:
            self.stats.decode_s += time.perf_counter() - t0
            self.stats.bytes_sent += _PLACEHOLDER_BYTES
        return np.ascontiguousarray(mean, np.float32)

    def _encode(self, kind: str, rank: int, flat: np.ndarray, k: np.ndarray,
                norm: np.ndarray | None = None) -> np.ndarray:
        with ieee_denormals():
            t0 = time.perf_counter()
            k = int(k)
            wire, meta = steps.encode_wire(self.codec, flat, derive_key(self.seed, k), rank,
                                           kind, None if norm is None else np.float32(norm))
            extra = _NORM_WIRE_BYTES if norm is not None else 0
            self._begin(k, flat.size, meta, t0, wire.nbytes + extra)
            return wire

    def _decode(self, kind: str, n: int, result: np.ndarray, k: np.ndarray,
                factor: np.ndarray, flat: np.ndarray | None = None):
        with ieee_denormals():
            k = int(k)
            rec = self._finish(k)
            t0 = time.perf_counter()
            seed = derive_key(self.seed, k)
            if kind == "sum":
                mean = steps.decode_sum_wire(self.codec, result, rec["size"], n, rec["meta"])
            elif kind == "allgather":
                own = (self._ps().rank(), flat) if flat is not None else None
                mean = steps.combine_wire(self.codec, result, rec["size"], seed, n, rec["meta"],
                                          own)
            else:
                mean = steps.sra_decode_wire(self.codec, result, rec["size"], seed, n)
            mean = self._end(mean, factor, t0)
            return mean if flat is None else (mean, steps.outage_wire(self.codec))

    def _outage_total(self, total: np.ndarray) -> np.ndarray:
        steps.outage_from_wire(self.codec, total)
        return np.zeros([], np.int64)

    def _sra_encode(self, rank: int, n: int, flat: np.ndarray, k: np.ndarray):
        with ieee_denormals():
            t0 = time.perf_counter()
            k = int(k)
            send, splits = steps.sra_encode_wire(self.codec, flat, derive_key(self.seed, k),
                                                 rank, n)
            self._begin(k, flat.size, {}, t0, send.nbytes)
            return send, splits

    def _sra_reduce(self, rank: int, n: int, received: np.ndarray, k: np.ndarray) -> np.ndarray:
        with ieee_denormals():
            k = int(k)
            t0 = time.perf_counter()
            with self._lock:
                size = self._inflight[k]["size"]
            again = steps.sra_reduce_wire(self.codec, received, size, derive_key(self.seed, k),
                                          rank, n)
            with self._lock:
                self.stats.decode_s += time.perf_counter() - t0
                self.stats.bytes_sent += again.nbytes
            return again

    # -- Compressor ---------------------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor: Any) -> tuple[Any, Any]:
        if isinstance(tensor, tf.IndexedSlices):  # Horovod gathers these itself
            return tensor, None
        tensor = tf.convert_to_tensor(tensor)
        self._start()
        shape = tensor.shape
        name = self.codec.name
        codec = None
        if name != "none" and shape.is_fully_defined() and tensor.dtype.is_floating:
            codec = self.policy.codec_for(self.codec, shape.as_list())
        if codec is None:
            return tensor, None
        if name == "fp16":
            return tf.cast(tensor, tf.float16), tensor.dtype
        ps = self._ps()
        n, rank = ps.size(), ps.rank()
        kind = steps.plan(self.codec, n, self.gather)
        with tf.device("/cpu:0"):
            flat = tf.reshape(tf.cast(tensor, tf.float32), [-1])
            k = self._counter.assign_add(1) - 1
            if kind == "sra":
                send, splits = tf.numpy_function(
                    lambda x, kk: self._sra_encode(rank, n, x, kk), [flat, k],
                    [tf.uint8, tf.int32], stateful=True, name="hq_sra_encode")
                send.set_shape([None])
                splits.set_shape([n])
                received, _ = hvd.alltoall(send, splits=splits, process_set=ps)
                again = tf.numpy_function(lambda r, kk: self._sra_reduce(rank, n, r, kk),
                                          [received, k], tf.uint8, stateful=True,
                                          name="hq_sra_reduce")
                again.set_shape([None])
                result = hvd.allgather(again, process_set=ps)
            else:
                inputs = [flat, k]
                if steps.needs_norm(self.codec):
                    stat = tf.numpy_function(self._norm_wire, [flat], tf.float64,
                                             stateful=True, name="hq_norm_stat")
                    stat.set_shape([1])
                    gathered = hvd.allgather(stat, process_set=ps)
                    norm = tf.numpy_function(self._norm_from_gathered, [gathered], tf.float32,
                                             stateful=True, name="hq_norm")
                    norm.set_shape([])
                    inputs.append(norm)
                dtype = tf.as_dtype(steps.wire_dtype(self.codec, kind))
                wire = tf.numpy_function(lambda *a: self._encode(kind, rank, *a), inputs, dtype,
                                         stateful=True, name="hq_encode")
                wire.set_shape([None])
                if kind == "sum":
                    result = hvd.allreduce(wire, op=hvd.Sum, process_set=ps)
                else:
                    result = hvd.allgather(wire, process_set=ps)
            placeholder = tf.ones([1], tf.float32)
        return placeholder, _Ctx(result, k, flat, shape, tensor.dtype)

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor: Any, ctx: Any) -> Any:
        if ctx is None:
            return tensor
        if isinstance(ctx, tf.DType):
            return tf.cast(tensor, ctx)
        n = self._ps().size()
        kind = steps.plan(self.codec, n, self.gather)
        with tf.device("/cpu:0"):
            args = [ctx.result, ctx.k, tf.cast(tensor, tf.float32)]
            if kind == "allgather" and steps.counts_outage(self.codec):
                mean, count = tf.numpy_function(
                    lambda r, kk, f, x: self._decode(kind, n, r, kk, f, x), args + [ctx.flat],
                    [tf.float32, tf.int64], stateful=True, name="hq_decode")
                count.set_shape([1])
                total = hvd.allreduce(count, op=hvd.Sum, process_set=self._ps())
                done = tf.numpy_function(self._outage_total, [total], tf.int64, stateful=True,
                                         name="hq_outage")
                with tf.control_dependencies([done]):
                    mean = tf.identity(mean)
            else:
                mean = tf.numpy_function(lambda r, kk, f: self._decode(kind, n, r, kk, f), args,
                                         tf.float32, stateful=True, name="hq_decode")
            mean.set_shape([ctx.shape.num_elements()])
            out = tf.reshape(mean, ctx.shape)
        return tf.cast(out, ctx.dtype) if ctx.dtype != tf.float32 else out


Compression = CompressionNamespace(QuantizedCompressor, hvd.global_process_set, "TensorFlow")
