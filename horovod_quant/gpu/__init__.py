"""GPU execution of the codecs: CUDA kernels (``kernels/*.cu``) through CuPy.

One dispatch point. ``codec.encode(x)``, ``codec.decode(payload)``, ... look at where their
arrays live (hook in :mod:`horovod_quant.core.base`): NumPy arrays run the CPU (numba) code,
CuPy arrays and CUDA torch tensors come here. The two produce identical payload bytes and
decoded values for the same seed (``tests/kernels``, ``tests/gpu``).

Public API (all take CuPy arrays or CUDA torch tensors; torch tensors are viewed zero-copy with
``cupy.from_dlpack`` and the kernels run on ``torch.cuda.current_stream()``):

* :func:`encode` ``(codec, x, seed=0, **kw) -> Payload`` (payload data on the device)
* :func:`decode` ``(codec, payload, out=None)``, :func:`decode_add` ``(codec, payload, out)``
* :func:`combine_gathered` ``(codec, payloads, seed)``: a gather exchange's mean, all peers
  decoded in one pass
* :func:`exp_combine`: :func:`horovod_quant.core.exp_reduce.exp_combine` (same signature) on
  device buffers; :func:`reduce_packed` likewise
* :func:`torch_reference_encode` / :func:`torch_reference_decode`: plain PyTorch versions of the
  level quantizers (``torch.rand_like`` + elementwise ops), the baseline of the speed benchmark
* :func:`cuda_aware_mpi`: whether MPI can take device buffers (``HQ_CUDA_AWARE_MPI`` overrides);
  :func:`horovod_device_collectives`: whether Horovod's collectives can (else exchanges stage
  their payloads through host memory, :class:`horovod_quant.exchange.staging.HostStaged`)
* :func:`to_host` / :func:`to_device`: the staging copies
* :func:`available`, :func:`compile_kernels`

CuPy is imported lazily: ``import horovod_quant.gpu`` works without it (``available()`` is
then False).
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any, Callable, Iterator, Sequence

from ..core.payload import Payload
from ._ops import Ops, Unsupported
from .mpi import cuda_aware_mpi, horovod_device_collectives
from .torch_ref import torch_reference_decode, torch_reference_encode

__all__ = [
    "available", "combine_gathered", "compile_kernels", "cuda_aware_mpi", "decode", "decode_add",
    "device_scope", "dispatch", "encode", "exp_combine", "horovod_device_collectives",
    "is_device_array", "ops", "reduce_packed", "to_device", "to_host", "torch_reference_decode",
    "torch_reference_encode",
]

_OPS: Ops | None = None


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """True when CuPy imports and sees at least one CUDA device (asked once per process)."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # ImportError, CUDARuntimeError without a driver, ...
        return False


def ops() -> Ops:
    """The :class:`~._ops.Ops` on the CuPy backend (created on first use)."""
    global _OPS
    if _OPS is None:
        try:
            from ._cupy import CupyBackend
            backend = CupyBackend()
        except ImportError as exc:
            raise ImportError("horovod_quant.gpu needs CuPy for device arrays: pip install "
                              "cupy-cuda12x (or cupy-cuda13x), matching your CUDA driver") from exc
        _OPS = Ops(backend)
    return _OPS


def compile_kernels() -> list[str]:
    """Compile every kernel file for the current device now (instead of at first use)."""
    from ._cupy import compile_all

    return compile_all()


# -- arrays and streams ----------------------------------------------------------------------
def is_device_array(obj: Any) -> bool:
    """A CuPy array or a CUDA torch tensor (checked without importing either)."""
    mod = type(obj).__module__
    if mod.startswith("cupy"):
        return True
    if mod.startswith("torch"):
        return bool(getattr(obj, "is_cuda", False))
    return False


def _is_torch(obj: Any) -> bool:
    return type(obj).__module__.startswith("torch")


def as_cupy(obj: Any) -> Any:
    """A CuPy view of a CUDA torch tensor (``cupy.from_dlpack``, zero-copy); CuPy arrays and
    everything else pass through. bfloat16 tensors are widened to float32 first (CuPy has no
    bfloat16)."""
    if not _is_torch(obj):
        return obj
    import cupy
    import torch

    t = obj.detach()
    if t.dtype not in (torch.float16, torch.float32, torch.float64) and t.is_floating_point():
        t = t.float()
    return cupy.from_dlpack(t)


def to_host(a: Any) -> Any:
    """A NumPy copy of a device array (after the work queued on the current stream), in pinned
    memory from CuPy's pool (copied by DMA, without the driver's staging buffer); other
    arrays as they are."""
    if not is_device_array(a):
        return a
    import cupyx

    src = as_cupy(a)
    return src.get(out=cupyx.empty_pinned(src.shape, src.dtype))


def to_device(a: Any, like: Any) -> Any:
    """A CuPy copy of the host array ``a`` on the device of ``like`` (queued on the current
    stream)."""
    import cupy

    with as_cupy(like).device:
        return cupy.asarray(a)


@contextlib.contextmanager
def device_scope(*objs: Any) -> Iterator[None]:
    """Run the enclosed kernels on the right device and stream: torch's current stream
    (``cupy.cuda.ExternalStream``) when any argument is a torch tensor, else CuPy's current
    stream on the arrays' device."""
    import cupy

    tensor = next((o for o in _flatten(objs) if _is_torch(o) and getattr(o, "is_cuda", False)),
                  None)
    if tensor is not None:
        import torch

        dev = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
        with cupy.cuda.Device(dev):
            stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(dev).cuda_stream, dev)
            with stream:
                yield
        return
    arr = next((o for o in _flatten(objs) if type(o).__module__.startswith("cupy")), None)
    if arr is not None:
        with arr.device:
            yield
        return
    yield


def _flatten(objs: Any) -> Iterator[Any]:
    for o in objs:
        if isinstance(o, Payload):
            yield o.data
        elif isinstance(o, (list, tuple)):
            yield from _flatten(o)
        else:
            yield o


def _convert(obj: Any, fn: Callable[[Any], Any]) -> Any:
    """Apply fn to every array in obj (payloads, lists and tuples of them)."""
    if isinstance(obj, Payload):
        return Payload(fn(obj.data), obj.size, dict(obj.meta))
    if isinstance(obj, list):
        return [_convert(o, fn) for o in obj]
    if isinstance(obj, tuple):
        return tuple(_convert(o, fn) for o in obj)
    if type(obj).__module__.split(".")[0] in ("cupy", "torch", "numpy"):
        return fn(obj)
    return obj


# -- dispatch --------------------------------------------------------------------------------
def _handler(codec: Any, method: str) -> Callable[..., Any] | None:
    """The GPU implementation of ``codec.method`` (None: none, use the CPU fallback)."""
    from ..core.baselines import BF16, FP16, NoCompression
    from ..core.dithered import DitheredQuantizer, NestedDitheredQuantizer
    from ..core.global_qsgd import GlobalQSGD
    from ..core.quantizers import LevelQuantizer

    o = ops()
    table: dict[str, Callable[..., Any]] = {}
    if isinstance(codec, LevelQuantizer):
        table = {"encode": o.levels_encode, "decode": o.levels_decode,
                 "decode_add": o.levels_decode_add, "combine_gathered": o.gather_combine}
    elif isinstance(codec, GlobalQSGD):
        table = {"encode": o.gq_encode, "decode": o.gq_decode, "decode_add": o.gq_decode_add,
                 "decode_sum": o.gq_decode_sum, "reduce": o.gq_reduce,
                 "combine_gathered": o.gq_combine_gathered,
                 "norm_statistic": o.gq_norm_statistic}
    elif isinstance(codec, NestedDitheredQuantizer):
        table = {"encode": o.nd_encode, "decode": o.dq_decode, "decode_add": o.dq_decode_add,
                 "decode_side_info": o.nd_decode_side_info,
                 "combine_gathered": _nd_combine_gathered}
    elif isinstance(codec, DitheredQuantizer):
        table = {"encode": o.dq_encode, "decode": o.dq_decode, "decode_add": o.dq_decode_add,
                 "combine_gathered": o.dq_combine_gathered}
    elif isinstance(codec, (NoCompression, FP16, BF16)):
        table = {"encode": o.baseline_encode, "decode": o.baseline_decode}
    h = table.get(method)
    if h is None and method == "combine_gathered":
        return _generic_combine_gathered
    if h is None and method == "payload_from_wire":
        return _payload_from_wire
    return h


def _payload_from_wire(codec: Any, data: Any, size: int, **meta: Any) -> Payload:
    """``Codec.payload_from_wire`` for device buffers (a view, no copy), checked as on the CPU
    (:meth:`~horovod_quant.core.base.Codec.check_payload`)."""
    from ..core.base import check_payload_size

    raw = Payload(ops().xp.asarray(data).reshape(-1).view("uint8"),
                  check_payload_size(codec.name, size), dict(meta))
    codec.check_payload(raw)  # before the view: a damaged length may not be whole words
    return Payload(raw.data.view(codec.wire_dtype), raw.size, raw.meta)


def _nd_combine_gathered(codec: Any, payloads: Sequence[Payload], seed: int) -> Any:
    from ..core.base import worker_seed

    return ops().nd_decode_side_info(codec, payloads,
                                     [worker_seed(seed, r) for r in range(len(payloads))])


def _generic_combine_gathered(codec: Any, payloads: Sequence[Payload], seed: int) -> Any:
    """``Codec.combine_gathered`` on device arrays: decode_add in rank order, then the mean."""
    o = ops()
    est = o.xp.zeros(codec.check_payloads(payloads)[0].size, o.xp.float32)
    for p in payloads:
        codec.decode_add(p, est)
    return o.scale_into(est, 1.0 / len(payloads), est)


#: methods whose CPU implementation is array-agnostic (only calls other dispatched methods)
_PASSTHROUGH = {"Codec.decode_add", "_FloatBaseline.decode_sum"}
_warned: set[str] = set()


def dispatch(method: str, codec: Any, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run ``codec.<method>(*args, **kwargs)`` on the GPU (called by the core hook when an
    argument is a device array). ``fn`` is the CPU implementation: used directly when it is
    array-agnostic, and as a fallback (arrays copied to the host and back, with a one-time
    warning) when no kernel path exists, e.g. Elias-coded QSGD."""
    with device_scope(args, tuple(kwargs.values())):
        if fn.__qualname__ in _PASSTHROUGH:
            return fn(codec, *args, **kwargs)
        views: dict[int, Any] = {}  # CuPy view data pointer -> the torch tensor it views

        def to_cupy(o: Any) -> Any:
            c = as_cupy(o)
            if c is not o and _is_torch(o):
                views[c.data.ptr] = o
            return c

        cargs = _convert(args, to_cupy)
        ckw = {k: _convert(v, to_cupy) for k, v in kwargs.items()}
        if method in ("combine_gathered", "decode_side_info") and ckw.get("out") is not None:
            # the kernels build their estimate themselves; copy it into the caller's buffer
            out = ckw.pop("out")
            out[...] = dispatch(method, codec, fn, cargs, ckw)
            return views.get(out.data.ptr, out)
        handler = _handler(codec, method)
        result = None
        if handler is not None:
            try:
                result = handler(codec, *cargs, **ckw)
            except Unsupported:
                handler = None
        if handler is None:
            result = _host_fallback(method, codec, fn, cargs, ckw)
        # decode(payload, out=<torch tensor>) returns that tensor, not its CuPy view
        ptr = getattr(getattr(result, "data", None), "ptr", None)
        if ptr is not None and ptr in views and views[ptr].numel() == result.size:
            return views[ptr]
        return result


def _host_fallback(method: str, codec: Any, fn: Callable[..., Any], args: tuple,
                   kwargs: dict) -> Any:
    import cupy

    name = f"{type(codec).__name__}.{method}"
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"horovod_quant.gpu: no kernel for {name} with these parameters; it runs "
                      f"on the CPU with host copies", RuntimeWarning, stacklevel=4)
    devs: list[tuple[Any, Any]] = []

    def to_host(a: Any) -> Any:
        if type(a).__module__.startswith("cupy"):
            h = cupy.asnumpy(a)
            devs.append((a, h))
            return h
        return a

    hargs = _convert(args, to_host)
    hkw = {k: _convert(v, to_host) for k, v in kwargs.items()}
    result = fn(codec, *hargs, **hkw)
    for dev, host in devs:  # arguments the CPU code may have written into (out=...)
        dev[...] = cupy.asarray(host)
    import numpy as np

    by_host = {id(h): d for d, h in devs}

    def back(a: Any) -> Any:
        if id(a) in by_host:
            return by_host[id(a)]
        return cupy.asarray(a) if isinstance(a, np.ndarray) else a

    return _convert(result, back)


# -- convenience API -------------------------------------------------------------------------
def encode(codec: Any, x: Any, seed: int = 0, **kw: Any) -> Payload:
    """``codec.encode(x, seed, **kw)`` on the GPU; x a CuPy array or CUDA torch tensor."""
    return codec.encode(x, seed, **kw)


def decode(codec: Any, payload: Payload, out: Any | None = None) -> Any:
    """``codec.decode(payload, out)`` on the GPU (payload data on the device)."""
    return codec.decode(payload, out)


def decode_add(codec: Any, payload: Payload, out: Any) -> Any:
    """``out += decode(payload)`` in one kernel pass."""
    return codec.decode_add(payload, out)


def combine_gathered(codec: Any, payloads: Sequence[Payload], seed: int) -> Any:
    """A gather exchange's mean from every rank's payload (rank order), on the GPU: the level
    quantizers and DQSG decode all payloads in one kernel pass."""
    return codec.combine_gathered(list(payloads), seed)


def exp_combine(a_codes_packed: Any, b_codes_packed: Any, out_packed: Any, n_elements: int,
                first_element_index: int, bits: int, k0: int, k1: int) -> int:
    """:func:`horovod_quant.core.exp_reduce.exp_combine` with the same arguments; device
    buffers run the ``hq_exp_combine`` kernel (randomness drawn in the kernel), host buffers
    the CPU code. Returns the number of bytes written."""
    if not is_device_array(a_codes_packed):
        from ..core.exp_reduce import exp_combine as cpu

        return int(cpu(a_codes_packed, b_codes_packed, out_packed, n_elements,
                       first_element_index, bits, k0, k1))
    with device_scope(a_codes_packed, b_codes_packed, out_packed):
        a, b, o = (as_cupy(v).reshape(-1).view("uint8") for v in
                   (a_codes_packed, b_codes_packed, out_packed))
        return ops().exp_combine(a, b, o, int(n_elements), int(first_element_index), int(bits),
                                 int(k0), int(k1))


def reduce_packed(buffers: Sequence[Any], size: int, bits: int, seed: int, reduction: str) -> Any:
    """:func:`horovod_quant.core.exp_reduce.reduce_packed` on device buffers."""
    with device_scope(*buffers):
        return ops().reduce_packed([as_cupy(b) for b in buffers], size, bits, seed, reduction)
