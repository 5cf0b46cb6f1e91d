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
:mod:`horovod_quant.exchange.steps` (the same core code as every other adapter) around Horovod's TF
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
``derive_key(seed, k)``, whichever codec the policy chose for it. The ops of one compressor all
use that variable, so TensorFlow's automatic control dependencies run them in program order: k
follows the order in which Horovod calls ``compress``, which is the order of the gradient list
(``sources`` of the tape, ``model.trainable_variables`` for Keras; group by group for
``groups``/``num_groups``), the same on every rank. Tensors left uncompressed (policy, ``none``,
``fp16``, integer and boolean tensors) take no k.

Which tensor is which. The compressor reads the tensor's name from Horovod's own call
(:func:`horovod_name`: the variable's name in ``DistributedGradientTape`` and the optimizers,
the ``name=`` of ``hvd.allreduce``/``grouped_allreduce``; 0.28.1 is Horovod's final release,
so these call sites are fixed). The policy's name rules choose the codec by that name. Every
exchange carries a tag of the name (``#k`` for unnamed tensors), k and the static shape;
ranks whose tags differ (a variable of another shape or name on some rank, a call counter that
went apart) raise the same ValueError on every rank at the exchange's first collective, so
different tensors are never combined.

Before its first exchange a compressor checks that every rank built the same configuration
(:class:`~horovod_quant.adapters.ConfigCheck`, eagerly, even while a ``tf.function`` is
traced: every rank traces its first step); a rank whose peers never join gives up after
``HQ_CONFIG_TIMEOUT`` seconds with a RuntimeError.
"""
from __future__ import annotations

import itertools
import sys
import threading
import time
from typing import Any, NamedTuple

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from horovod.tensorflow.compression import Compressor

from ..adapters import CompressionNamespace, CompressorSettings, ConfigCheck
from ..exchange import steps
from ..core.base import Codec
from ..core.rng import derive_key
from ..policy import LayerPolicy
from ._fenv import ieee_denormals
from .collectives import HorovodTFCollectives

_IDS = itertools.count()
_NORM_WIRE_BYTES = 8 * steps.NORM_WIRE_WORDS  # the rank's norm statistic and the tag, float64
_PLACEHOLDER_BYTES = 4
_HOROVOD_TF = "horovod.tensorflow"
_MAX_FRAMES = 96  # autograph and tf.cond put ~40 frames between Horovod's allreduce_grads and us


def _variable_name(variables: Any, index: int) -> str | None:
    variables = _sequence(variables)
    if variables is None or not 0 <= index < len(variables):
        return None
    var = variables[index]
    return var.name if isinstance(var, tf.Variable) else None


def _sequence(value: Any) -> list | tuple | None:
    """``value`` if it is a list or tuple (autograph leaves placeholders for unset locals)."""
    return value if isinstance(value, (list, tuple)) else None


def horovod_name(tensor: Any) -> str | None:
    """The name Horovod's TensorFlow door is reducing ``tensor`` under, or None.

    Read from the calling frames of ``horovod.tensorflow`` (0.28.1, the final release; plain or
    converted by autograph, whose frames keep the module and the local names): in
    ``allreduce_grads`` (``DistributedGradientTape``, the Keras and legacy
    ``DistributedOptimizer``, grouped or not) the name of the variable whose gradient it is;
    else the ``name=`` of ``allreduce``, and ``name[i]`` for the i-th tensor of a named
    ``grouped_allreduce``. Call it from ``compress`` with the very object Horovod passed.
    """
    frame = sys._getframe(1)
    name: Any = None
    door = None  # "allreduce" or "grouped_allreduce": the Horovod function calling compress
    position = index = None  # the tensor's place in grouped_allreduce's list / in the grads
    for _ in range(_MAX_FRAMES):
        frame = frame.f_back
        if frame is None:
            break
        if frame.f_globals.get("__name__") != _HOROVOD_TF:
            continue
        code = frame.f_code.co_name.removeprefix("tf__")  # autograph's converted functions
        local = frame.f_locals
        if door is None:
            # grouped_allreduce: tensor_list[j] is compressed, tensor_list_idx[j] its position
            members = _sequence(local.get("tensor_list"))
            where = _sequence(local.get("tensor_list_idx"))
            if position is None and members is not None and where is not None:
                position = next((where[j] for j, t in enumerate(members[:len(where)])
                                 if t is tensor), None)
            if code == "allreduce":
                door, name = code, local.get("name")
            elif code == "grouped_allreduce":
                if position is None:
                    break
                door, name = code, local.get("name")
                name = f"{name}[{position}]" if isinstance(name, str) else None
            continue
        if door == "allreduce" and index is None:
            # the comprehension over enumerate(grads) in allreduce_grads
            i = local.get("i")
            if local.get("grad") is tensor and isinstance(i, int) and not isinstance(i, bool):
                index = i
        elif door == "grouped_allreduce" and index is None:
            # the loop over groups in allreduce_grads: grad_group[p] is vars[index_group[p]]'s
            group = _sequence(local.get("index_group"))
            members = _sequence(local.get("grad_group"))
            if (group is not None and members is not None
                    and position < min(len(group), len(members))
                    and members[position] is tensor):
                index = group[position]
        if code == "allreduce_grads":
            if isinstance(index, int):
                name = _variable_name(local.get("vars"), index) or name
            break
    return name if isinstance(name, str) else None


class _Spec(NamedTuple):
    """One tensor's exchange as traced: what the numpy callbacks close over."""

    codec: Codec
    kind: str  # steps.plan
    key: str | None  # horovod_name, or None: the tag then names the call index
    shape: tuple
    rank: int
    n: int
    prefix: str  # the configuration check's ``hq.<group>.<n>``

    def tag(self, k: int) -> steps.Tag:
        return steps.exchange_tag(f"{self.key}#{k}" if self.key else f"#{k}", self.shape)

    def label(self, k: int) -> str:
        """The exchange's name in error messages."""
        return f"{self.prefix}.{self.key if self.key else ''}#{k}"


class _Ctx(NamedTuple):
    """What ``decompress`` needs: the exchanged tensor and the call index, as graph tensors."""

    result: tf.Tensor
    k: tf.Tensor
    flat: tf.Tensor  # this rank's input: NDQSG senders count their own wrong coarse bins
    spec: _Spec
    dtype: tf.DType


class QuantizedCompressor(CompressorSettings, Compressor):
    """A ``horovod.tensorflow.compression.Compressor`` running a horovod_quant codec.

    Args: see :class:`~horovod_quant.adapters.CompressorSettings`. Here the k-th tensor
    compressed (from 0) uses seed ``derive_key(seed, k)`` (module doc), the policy's name rules
    see the variable names (``dense/kernel:0``) or the ``name=`` of ``hvd.allreduce``, tensors
    whose static shape is not fully known travel uncompressed too, and integer and boolean
    tensors always pass to Horovod unchanged (exact).

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
        # Created eagerly with the compressor, not by the first compress: a tf.function whose
        # first trace creates a variable and then raises (a configuration mismatch) is not
        # traced again at its next call.
        with tf.init_scope(), tf.device("/cpu:0"):
            self._counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                        name=f"hq_calls_{self._id}")
        self._check: ConfigCheck | None = None
        self._prefix: str | None = None  # the check's prefix, once it passed
        self._inflight: dict[int, dict] = {}
        self._lock = threading.Lock()

    # -- bookkeeping ---------------------------------------------------------------------------
    @property
    def calls(self) -> int:
        """How many tensors this compressor has exchanged so far: the next one uses
        ``derive_key(seed, calls)``."""
        return int(self._counter.numpy())

    def _ps(self) -> Any:
        return self.process_set if self.process_set is not None else hvd.global_process_set

    def _start(self) -> str:
        """Check the configuration across ranks (once, eagerly, even while a ``tf.function`` is
        traced: every rank traces its first step); returns the check's prefix.

        Raises:
            ValueError: the ranks' configurations differ (again at every later call).
            RuntimeError: a rank did not join the check within ``HQ_CONFIG_TIMEOUT`` seconds
                (a later call waits for the same check again).
        """
        if self._prefix is None:
            with tf.init_scope():
                if self._check is None:
                    self._check = ConfigCheck(HorovodTFCollectives(self._ps()),
                                              self.shared_config())
                self._prefix = self._check.wait()
        return self._prefix

    # -- numpy callbacks (run when the graph runs; ``spec`` chose the codec) --------------------
    def _norm_wire(self, spec: _Spec, flat: np.ndarray, k: np.ndarray) -> np.ndarray:
        with ieee_denormals():
            return steps.norm_wire(spec.codec, [flat], spec.tag(int(k)))

    def _norm_from_gathered(self, spec: _Spec, gathered: np.ndarray, k: np.ndarray) -> np.ndarray:
        with ieee_denormals():
            return np.float32(steps.norm_from_gathered(spec.codec, gathered, spec.label(int(k))))

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

    def _encode(self, spec: _Spec, flat: np.ndarray, k: np.ndarray,
                norm: np.ndarray | None = None) -> np.ndarray:
        with ieee_denormals():
            t0 = time.perf_counter()
            k = int(k)
            wire, meta = steps.encode_wire(spec.codec, flat, derive_key(self.seed, k), spec.rank,
                                           spec.kind, None if norm is None else np.float32(norm),
                                           spec.tag(k))
            extra = _NORM_WIRE_BYTES if norm is not None else 0
            self._begin(k, flat.size, meta, t0, wire.nbytes + extra)
            return wire

    def _decode(self, spec: _Spec, result: np.ndarray, k: np.ndarray, factor: np.ndarray,
                flat: np.ndarray | None = None):
        with ieee_denormals():
            k = int(k)
            rec = self._finish(k)
            t0 = time.perf_counter()
            seed, codec, n = derive_key(self.seed, k), spec.codec, spec.n
            if spec.kind == "sum":
                mean = steps.decode_sum_wire(codec, result, rec["size"], n, rec["meta"])
            elif spec.kind == "allgather":
                own = (spec.rank, flat) if flat is not None else None
                mean = steps.combine_wire(codec, result, rec["size"], seed, n, rec["meta"], own,
                                          name=spec.label(k))
            else:
                mean = steps.sra_decode_wire(codec, result, rec["size"], seed, n)
            mean = self._end(mean, factor, t0)
            return mean if flat is None else (mean, steps.outage_wire(codec))

    def _outage_total(self, spec: _Spec, total: np.ndarray) -> np.ndarray:
        steps.outage_from_wire(spec.codec, total)
        return np.zeros([], np.int64)

    def _sra_encode(self, spec: _Spec, flat: np.ndarray, k: np.ndarray):
        with ieee_denormals():
            t0 = time.perf_counter()
            k = int(k)
            send, splits = steps.sra_encode_wire(spec.codec, flat, derive_key(self.seed, k),
                                                 spec.rank, spec.n, spec.tag(k))
            self._begin(k, flat.size, {}, t0, send.nbytes)
            return send, splits

    def _sra_reduce(self, spec: _Spec, received: np.ndarray, k: np.ndarray) -> np.ndarray:
        with ieee_denormals():
            k = int(k)
            t0 = time.perf_counter()
            with self._lock:
                size = self._inflight[k]["size"]
            again = steps.sra_reduce_wire(spec.codec, received, size, derive_key(self.seed, k),
                                          spec.rank, spec.n, name=spec.label(k))
            with self._lock:
                self.stats.decode_s += time.perf_counter() - t0
                self.stats.bytes_sent += again.nbytes
            return again

    # -- Compressor ---------------------------------------------------------------------------
    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor: Any) -> tuple[Any, Any]:
        if isinstance(tensor, tf.IndexedSlices):  # Horovod gathers these itself
            return tensor, None
        key = horovod_name(tensor)  # before any conversion: found by identity
        tensor = tf.convert_to_tensor(tensor)
        prefix = self._start()
        shape = tensor.shape
        codec = None
        if shape.is_fully_defined() and tensor.dtype.is_floating:
            codec = self.policy.codec_for(self.codec, shape.as_list(), key)
        wire = None if codec is None else codec.horovod_allreduce
        if codec is None or wire == "keep":
            return tensor, None
        if wire is not None:  # Horovod's own allreduce carries it, cast (as Compression.fp16)
            return tf.cast(tensor, tf.as_dtype(wire)), tensor.dtype
        ps = self._ps()
        n = ps.size()
        spec = _Spec(codec, steps.plan(codec, n, self.gather), key, tuple(shape.as_list()),
                     ps.rank(), n, prefix)
        with tf.device("/cpu:0"):
            flat = tf.reshape(tf.cast(tensor, tf.float32), [-1])
            k = self._counter.assign_add(1) - 1
            if spec.kind == "sra":
                send, splits = tf.numpy_function(
                    lambda x, kk: self._sra_encode(spec, x, kk), [flat, k],
                    [tf.uint8, tf.int32], stateful=True, name="hq_sra_encode")
                send.set_shape([None])
                splits.set_shape([n])
                received, _ = hvd.alltoall(send, splits=splits, process_set=ps)
                again = tf.numpy_function(lambda r, kk: self._sra_reduce(spec, r, kk),
                                          [received, k], tf.uint8, stateful=True,
                                          name="hq_sra_reduce")
                again.set_shape([None])
                result = hvd.allgather(again, process_set=ps)
            else:
                inputs = [flat, k]
                if steps.needs_norm(codec):
                    stat = tf.numpy_function(lambda x, kk: self._norm_wire(spec, x, kk),
                                             [flat, k], tf.float64, stateful=True,
                                             name="hq_norm_stat")
                    stat.set_shape([steps.NORM_WIRE_WORDS])
                    gathered = hvd.allgather(stat, process_set=ps)
                    norm = tf.numpy_function(
                        lambda g, kk: self._norm_from_gathered(spec, g, kk), [gathered, k],
                        tf.float32, stateful=True, name="hq_norm")
                    norm.set_shape([])
                    inputs.append(norm)
                dtype = tf.as_dtype(steps.wire_dtype(codec, spec.kind))
                wire = tf.numpy_function(lambda *a: self._encode(spec, *a), inputs, dtype,
                                         stateful=True, name="hq_encode")
                wire.set_shape([None])
                if spec.kind == "sum":
                    result = hvd.allreduce(wire, op=hvd.Sum, process_set=ps)
                else:
                    result = hvd.allgather(wire, process_set=ps)
            placeholder = tf.ones([1], tf.float32)
        return placeholder, _Ctx(result, k, flat, spec, tensor.dtype)

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor: Any, ctx: Any) -> Any:
        if ctx is None:
            return tensor
        if isinstance(ctx, tf.DType):
            return tf.cast(tensor, ctx)
        spec = ctx.spec
        with tf.device("/cpu:0"):
            args = [ctx.result, ctx.k, tf.cast(tensor, tf.float32)]
            if spec.kind == "allgather" and steps.counts_outage(spec.codec):
                mean, count = tf.numpy_function(
                    lambda r, kk, f, x: self._decode(spec, r, kk, f, x), args + [ctx.flat],
                    [tf.float32, tf.int64], stateful=True, name="hq_decode")
                count.set_shape([1])
                total = hvd.allreduce(count, op=hvd.Sum, process_set=self._ps())
                done = tf.numpy_function(lambda t: self._outage_total(spec, t), [total],
                                         tf.int64, stateful=True, name="hq_outage")
                with tf.control_dependencies([done]):
                    mean = tf.identity(mean)
            else:
                mean = tf.numpy_function(lambda r, kk, f: self._decode(spec, r, kk, f), args,
                                         tf.float32, stateful=True, name="hq_decode")
            mean.set_shape([int(np.prod(spec.shape, dtype=np.int64))])
            out = tf.reshape(mean, spec.shape)
        return tf.cast(out, ctx.dtype) if ctx.dtype != tf.float32 else out


Compression = CompressionNamespace(QuantizedCompressor, hvd.global_process_set, "TensorFlow")
