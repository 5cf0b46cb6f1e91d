"""``hq.tensorflow.Compression.<codec>(**params)``: Horovod ``Compressor`` objects for TensorFlow.

They plug into ``hvd.DistributedGradientTape``, the Keras and legacy ``DistributedOptimizer``
and ``hvd.allreduce``/``grouped_allreduce(..., compression=...)``, eagerly and inside
``tf.function``. ``compress`` runs the codec's exchange plan (:mod:`horovod_quant.exchange.plans`,
the generators ``Exchange`` and ``mean_estimate`` run too) as graph ops: ``tf.numpy_function``
callbacks around Horovod TF collectives. Horovod reduces a one-element placeholder holding 1.0,
whose reduced value is the factor of the user's op, which ``decompress`` applies.

Seeds: each compressor's int64 call counter is the step of the k-th compressed tensor (in the order
Horovod calls ``compress``, the same on every rank), named after Horovod's own call
(:func:`payload_key`), seeded ``payload_seed(seed, k, key)`` as in every door
(:mod:`~horovod_quant.exchange.runtime`). Every exchange carries a tag of name, k and shape, so
ranks whose tensors differ raise the same ValueError. A cross-rank configuration check runs before
the first exchange. The counter and the adaptive codecs' states (NDQSG's) are a job's state:
``tf.train.Checkpoint(..., hq=compressor.checkpointable)`` saves and restores them, so a resumed
job continues with the same seeds. docs/tensorflow.md tells the whole story.
"""
from __future__ import annotations

import functools
import itertools
import json
import sys
import threading
import time
from typing import Any, NamedTuple

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf
from horovod.tensorflow.compression import Compressor

from ..core.base import Codec
from ..core.contract import HorovodWire
from ..doors import (
    TF_DOOR,
    CompressionNamespace,
    CompressorSettings,
    DoorOptions,
    RequestedCodec,
    door_options,
    load_codec_states,
    mpi_exchange_config,
)
from ..exchange import plans, wire
from ..exchange.codec_states import CodecStates
from ..exchange.job_end import LEDGER
from ..rendezvous import horovod_end_of_job
from ._fenv import ieee_denormals
from .collectives import HorovodTFCollectives

_IDS = itertools.count()
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


def payload_key(name: str | None) -> str:
    """The key of a tensor Horovod names ``name`` in the seeds: the name without a variable's
    output index ``:0`` (``dense/kernel:0`` is ``dense/kernel``, as the torch doors name a
    parameter), ``#`` for an unnamed one."""
    return "#" if name is None else name.removesuffix(":0")


class _Spec(NamedTuple):
    """One tensor's exchange as traced: what the numpy callbacks close over."""

    codec: Codec
    kind: str  # plans.plan_kind
    key: str | None  # horovod_name, or None (the tag's step, the call index, tells them apart)
    shape: tuple
    rank: int
    n: int
    prefix: str  # the configuration check's ``hq.<group>.<n>``
    custom: Any  # the codec's custom collective (plans.Custom), or None

    def tag(self, k: int) -> wire.Tag:
        return wire.exchange_tag(self.key or "#", self.shape, k)

    def label(self, k: int) -> str:
        """The exchange's name in error messages."""
        return f"{self.prefix}.{self.key if self.key else ''}#{k}"


class _Ctx(NamedTuple):
    """What ``decompress`` needs: the mean estimate as a graph tensor."""

    mean: tf.Tensor
    spec: _Spec
    dtype: tf.DType


class _SavedCodecStates(tf.train.experimental.PythonState):
    """A compressor's :class:`~horovod_quant.exchange.codec_states.CodecStates` in a
    ``tf.train.Checkpoint`` (as JSON), with the world size they were saved at (adapted with one
    warning at another, :func:`~horovod_quant.doors.load_codec_states`)."""

    def __init__(self, states: CodecStates, world_size: Any) -> None:
        self._states, self._world_size = states, world_size

    def serialize(self) -> str:
        return json.dumps({"world_size": self._world_size(),
                           "codec_states": self._states.state_dict()})

    def deserialize(self, string_value: Any) -> None:
        text = string_value.decode() if isinstance(string_value, bytes) else string_value
        saved = json.loads(text)
        if "codec_states" not in saved:  # saved without its world size
            saved = {"world_size": None, "codec_states": saved}
        load_codec_states(self._states, saved["codec_states"], saved["world_size"],
                          self._world_size(), "TensorFlow compressor")


class _CompressorCheckpoint(tf.Module):
    """What a checkpoint of a compressor holds: its call counter (``calls``) and its codec
    states."""

    def __init__(self, counter: tf.Variable, states: CodecStates, world_size: Any) -> None:
        super().__init__(name="horovod_quant")
        self.calls = counter
        self.codec_states = _SavedCodecStates(states, world_size)


class QuantizedCompressor(CompressorSettings, Compressor):
    """A ``horovod.tensorflow.compression.Compressor`` running a horovod_quant codec.

    Args: the codec, ``process_set``, and the settings of :class:`~horovod_quant.doors.DoorOptions`
    as ``options=`` or as keywords (seed, gather, policy, pipeline_elems; the others raise
    ValueError; ``HQ_MPI_EXCHANGE`` is read here, once,
    :class:`~horovod_quant.doors.DoorEnvironment`). Here the k-th tensor compressed (from 0) uses
    seed ``payload_seed(seed, k, name)`` (module doc), the policy's name rules see the variable
    names (``dense/kernel:0``) or the ``name=`` of ``hvd.allreduce``, tensors whose static shape is
    not fully known travel uncompressed too, and integer and boolean tensors always pass to Horovod
    unchanged (exact). Tensors longer than ``pipeline_elems`` are exchanged in pieces, as
    :class:`~horovod_quant.exchange.Exchange` does (same pieces, seeds and bits).

    Attributes:
        codec_states: the adaptive codecs' states its exchanges carry (NDQSG's,
            :class:`~horovod_quant.exchange.codec_states.CodecStates`).
        checkpointable: the compressor's state for ``tf.train.Checkpoint`` (module doc).
        stats: :class:`~horovod_quant.stats.StepStats` of the compressed exchanges since the
            last ``stats.reset()``, accumulated when they run (not when graphs are traced).
            Tensors left to Horovod (policy, ``none``, ``fp16``) are not counted: that would
            take a Python callback per tensor and step, which TensorFlow orders like any
            stateful op and so would serialize Horovod's allreduces of those tensors.
    """

    def __init__(self, codec: Codec | RequestedCodec, process_set: Any = None,
                 options: DoorOptions | None = None, **settings: Any) -> None:
        super().__init__(codec, door_options(settings, options, door=TF_DOOR), TF_DOOR,
                         process_set)
        self.runtime.use_fabric(self.environment.fabric(False))  # the plans run on the host
        self._id = next(_IDS)
        # Created eagerly with the compressor, not by the first compress: a tf.function whose
        # first trace creates a variable and then raises (a configuration mismatch) is not
        # traced again at its next call.
        with tf.init_scope(), tf.device("/cpu:0"):
            self._counter = tf.Variable(0, dtype=tf.int64, trainable=False,
                                        name=f"hq_calls_{self._id}")
        self.checkpointable = _CompressorCheckpoint(self._counter, self.codec_states,
                                                    lambda: self._ps().size())
        self._prefix: str | None = None  # the check's prefix, once it passed
        self._flights: dict[tuple[int, str], tuple] = {}  # plans between callbacks, and when
        # their last callback ended
        self._lock = threading.Lock()

    def shared_config(self) -> dict:
        return {**super().shared_config(), "fabric": list(self.runtime.fabric),
                **mpi_exchange_config(self.policy.codecs(self.codec),
                                      self.environment.mpi_exchange)}

    # -- bookkeeping ---------------------------------------------------------------------------
    @property
    def calls(self) -> int:
        """How many tensors this compressor has exchanged so far: the next one's step (its
        seed ``payload_seed(seed, calls, name)``)."""
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
                horovod = HorovodTFCollectives(self._ps())
                self.runtime.check(horovod, self.shared_config())
                self._prefix = self.runtime.wait_check()
                # the job's end is agreed in a store of horovod_quant.store (no torch)
                self._steps = LEDGER.register("TensorFlow compressor", self.calls,
                                              horovod_end_of_job(horovod, hvd.shutdown))
        return self._prefix

    def _custom_for(self, codec: Codec) -> Any:
        """The codec's custom collective (set up once per codec, at the same trace point on
        every rank), or None: the allgather plan then reduces on every rank."""
        with tf.init_scope():
            return self.runtime.custom_for(codec, HorovodTFCollectives(self._ps(),
                                                                       self.environment))

    # -- the graph runner of a plan --------------------------------------------------------------
    def _resume(self, spec: _Spec, key: tuple[int, str], plan: plans.Plan, value: Any,
                expected: tuple | None, first: bool) -> Any:
        """Send ``value`` into ``plan`` and return what the next graph op needs: the next
        request's array (an alltoall's with its splits), or the plan's result. A custom
        collective runs here, inside the callback (it pairs ranks by call order, which the
        compressor's ordered callbacks keep)."""
        label, sent = spec.label(key[0]), 0
        with ieee_denormals():
            t0 = time.perf_counter()
            try:
                request = plan.send(value)
                while isinstance(request, plans.Custom):
                    sent += request.array.nbytes
                    request = plan.send(spec.custom(request.payload, request.seed, label).wait())
            except StopIteration as stop:
                request, result = None, stop.value
            except Exception:
                self._steps.failed = True  # (the job's end then leaves this door to its error)
                raise
            plans.check_request(request, expected, label)
            t1 = time.perf_counter()
        with self._lock:
            if request is None:  # the call's exchange ended (its steps: calls, as its tags')
                self._steps.end(max(self._steps.steps, key[0] + 1))
            if first or self._flights:
                self._steps.begin()
            field = "encode_s" if first else "decode_s"
            setattr(self.stats, field, getattr(self.stats, field) + t1 - t0)
            self.stats.bytes_sent += sent + (0 if request is None else request.array.nbytes)
            if request is None:
                return result
            self._flights[key] = plan, t1
        if isinstance(request, plans.Alltoall):
            return request.array, np.asarray(request.splits, np.int32)
        return request.array

    def _callback(self, spec: _Spec, key: str, expected: tuple | None, k: np.ndarray,
                  *result: np.ndarray) -> Any:
        """Callback after a collective: resume the plan ``key`` of call ``k`` with its result."""
        k = int(k)
        with self._lock:
            plan, t = self._flights.pop((k, key))
            self.stats.exchange_s += time.perf_counter() - t
        value = result[0] if len(result) == 1 else (result[0], result[1].tolist())
        return self._resume(spec, (k, key), plan, value, expected, False)

    def _run_plans(self, spec: _Spec, k: tf.Tensor, starts: list, signature: list,
                   shapes: list) -> list[tf.Tensor]:
        """Lay out plans as graph ops: per plan ``(key, make, inputs)`` a callback that starts
        it (``make(k, *inputs)`` returns the generator), then per request of the ``signature``
        its Horovod op and a callback that resumes the plan with the op's result; the last
        returns the plan's float32 result of shape ``shapes[j]``. Stage by stage, so every
        plan (piece) is started before any collective, as :class:`Exchange` does."""
        ps = self._ps()
        signature = [s for s in signature if s[0] is not plans.Custom]  # run in callbacks

        def dtypes(i: int) -> Any:
            if i == len(signature):
                return tf.float32
            kind, dtype = signature[i]
            return [tf.uint8, tf.int32] if kind is plans.Alltoall else tf.as_dtype(dtype)

        def start(key: str, make: Any, kk: np.ndarray, *xs: np.ndarray) -> Any:
            return self._resume(spec, (int(kk), key), make(int(kk), *xs), None,
                                signature[0] if signature else None, True)

        values = [tf.numpy_function(functools.partial(start, key, make), [k] + inputs,
                                    dtypes(0), stateful=True, name="hq_plan")
                  for key, make, inputs in starts]
        for i, (kind, _) in enumerate(signature):
            nxt = signature[i + 1] if i + 1 < len(signature) else None
            for j, (key, _, _) in enumerate(starts):
                if kind is plans.Alltoall:
                    send, splits = values[j]
                    send.set_shape([None])
                    splits.set_shape([spec.n])
                    result = list(hvd.alltoall(send, splits=splits, process_set=ps))
                else:
                    values[j].set_shape([None])
                    op = hvd.allgather if kind is plans.Allgather else functools.partial(
                        hvd.allreduce, op=hvd.Sum)
                    result = [op(values[j], process_set=ps)]
                values[j] = tf.numpy_function(functools.partial(self._callback, spec, key, nxt),
                                              [k] + result, dtypes(i + 1), stateful=True,
                                              name="hq_plan")
        for value, shape in zip(values, shapes):
            value.set_shape(shape)
        return values

    def _end(self, mean: np.ndarray, factor: np.ndarray) -> np.ndarray:
        """The mean times the factor Horovod's reduction of the placeholder gave (module doc)."""
        t0 = time.perf_counter()
        f = np.float32(np.asarray(factor).reshape(-1)[0])
        if f != np.float32(1.0):
            with ieee_denormals():
                mean = mean * f
        with self._lock:
            self.stats.decode_s += time.perf_counter() - t0
            self.stats.bytes_sent += _PLACEHOLDER_BYTES
        return np.ascontiguousarray(mean, np.float32)

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
        wire = None if codec is None else codec.traits.horovod_wire
        if codec is None or wire is HorovodWire.KEEP:
            return tensor, None
        if wire is not None:  # Horovod's own allreduce carries it, cast (as Compression.fp16)
            return tf.cast(tensor, tf.as_dtype(wire.cast)), tensor.dtype
        ps = self._ps()
        n = ps.size()
        custom = self._custom_for(codec)
        size = int(np.prod(shape.as_list(), dtype=np.int64))
        kind = plans.plan_kind(codec, n, size, self.gather, fabric=self.runtime.fabric)
        spec = _Spec(codec, plans.runnable(kind, custom is not None),
                     key, tuple(shape.as_list()), ps.rank(), n, prefix, custom)
        bounds = plans.pipeline_bounds(size, self.pipeline_elems)
        with tf.device("/cpu:0"):
            flat = tf.reshape(tf.cast(tensor, tf.float32), [-1])
            k = self._counter.assign_add(1) - 1
            norm = []
            if codec.traits.needs_norm:
                norm = self._run_plans(spec, k, [(
                    "norm", lambda kk, x: plans.norm_plan(codec, [x], spec.tag(kk),
                                                          spec.label(kk)), [flat])],
                    plans.signature("norm", codec), [[]])
            means = self._run_plans(
                spec, k, [(f"p{i}", functools.partial(self._piece, spec, i, len(bounds)),
                           [flat[lo:hi]] + norm) for i, (lo, hi) in enumerate(bounds)],
                plans.signature(spec.kind, codec), [[hi - lo] for lo, hi in bounds])
            mean = means[0] if len(means) == 1 else tf.concat(means, 0)
            placeholder = tf.ones([1], tf.float32)
        return placeholder, _Ctx(mean, spec, tensor.dtype)

    def _piece(self, spec: _Spec, i: int, pieces: int, k: int, x: np.ndarray,
               norm: np.ndarray | None = None) -> plans.Plan:
        """The plan of piece ``i`` of call ``k`` (numpy, in the first callback)."""
        if i == 0:
            with self._lock:
                self.stats.tensors += 1
                self.stats.bytes_raw += 4 * int(np.prod(spec.shape, dtype=np.int64))
        # read after this callback: TF may reuse its buffer
        if spec.codec.traits.side_information:
            x = np.array(x, copy=True)
        return self.runtime.piece_plan(spec.kind, spec.codec, x, k, payload_key(spec.key), i,
                                       pieces,
                                       spec.rank, spec.n,
                                       None if norm is None else np.float32(norm), spec.tag(k),
                                       spec.label(k))

    @tf.autograph.experimental.do_not_convert
    def decompress(self, tensor: Any, ctx: Any) -> Any:
        if ctx is None:
            return tensor
        if isinstance(ctx, tf.DType):
            return tf.cast(tensor, ctx)
        with tf.device("/cpu:0"):
            mean = tf.numpy_function(self._end, [ctx.mean, tf.cast(tensor, tf.float32)],
                                     tf.float32, stateful=True, name="hq_scale")
            out = tf.reshape(mean, ctx.spec.shape)
        return tf.cast(out, ctx.dtype) if ctx.dtype != tf.float32 else out


Compression = CompressionNamespace(QuantizedCompressor, hvd.global_process_set, "TensorFlow")
