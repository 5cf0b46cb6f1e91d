"""The CUDA path of an exchange on the CPU: arrays that every layer takes for device arrays,
a backend that runs the numba kernels on them, and the stream and staging hooks of
``horovod_quant.gpu``, so exchanges of "device" vectors run end to end without a GPU.

* :class:`DeviceArray`: a NumPy array whose type's module says CuPy, so ``backend_of`` and
  ``gpu.is_device_array`` take it for a device array. Float arithmetic on it (NumPy's ``+``,
  ``-``, ``*``, ``/``, and ``xp.multiply`` and its kin) raises, as a reminder that CuPy's own
  elementwise kernels flush subnormals: the GPU path must leave that arithmetic to the backends'
  kernels.
* :class:`EmulatedDeviceBackend`: every ``Backend`` entry point of the numba backend, run on
  plain views of its arguments (a kernel reading device memory); arrays it returns, and the
  arrays its ``xp`` makes, are :class:`DeviceArray`. It records its calls.
* :class:`EmulatedStream`: stands in for ``gpu.capture_stream()``; records the threads it is
  entered on and the threads that wait for its fence.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np

import horovod_quant.backends.cuda as backends_cuda
import horovod_quant.gpu as gpu
from horovod_quant.backends import numba_backend

_FLOAT_ARITHMETIC = {np.add, np.subtract, np.multiply, np.true_divide, np.divide, np.power,
                     np.floor_divide}


def _refuse_float_arithmetic(func: Any, inputs: tuple, kwargs: dict) -> None:
    """Raise where ``func`` is float arithmetic with a float device array among its operands
    (``out=`` included)."""
    out = kwargs.get("out", ())
    operands = inputs + (out if isinstance(out, tuple) else (out,))
    if func in _FLOAT_ARITHMETIC and any(
            isinstance(o, DeviceArray) and o.dtype.kind in "fc" for o in operands):
        raise AssertionError(f"np.{func.__name__} on a device array outside a kernel: "
                             "CuPy's elementwise kernels flush subnormals")


def _plain(obj: Any) -> Any:
    """``obj`` with every DeviceArray in it viewed as a plain ndarray (same memory)."""
    if isinstance(obj, DeviceArray):
        return obj.view(np.ndarray)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(o) for o in obj)
    return obj


def _device(obj: Any) -> Any:
    """``obj`` with every ndarray in it viewed as a DeviceArray (same memory)."""
    if isinstance(obj, np.ndarray):
        return obj.view(DeviceArray)
    if isinstance(obj, tuple):
        return tuple(_device(o) for o in obj)
    if isinstance(obj, list):
        return [_device(o) for o in obj]
    return obj


class DeviceArray(np.ndarray):
    """Stands in for a CuPy array (module doc)."""

    __module__ = "cupy.emulated"

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        _refuse_float_arithmetic(ufunc, inputs, kwargs)
        if "out" in kwargs:
            kwargs["out"] = tuple(_plain(o) for o in kwargs["out"])
        return getattr(ufunc, method)(*_plain(inputs), **kwargs)


class _DeviceNumpy:
    """NumPy whose functions return DeviceArrays: the ``xp`` of the emulated backend."""

    def __getattr__(self, name: str) -> Any:
        attr = getattr(np, name)
        if not callable(attr) or isinstance(attr, type):
            return attr

        def call(*args, **kwargs):
            _refuse_float_arithmetic(attr, args, kwargs)  # cupy.multiply(...) is such a kernel
            kwargs = {k: _plain(v) for k, v in kwargs.items()}
            return _device(attr(*_plain(args), **kwargs))
        return call


class EmulatedDeviceBackend:
    """The numba backend behind device arrays (module doc); ``calls`` counts entry points."""

    name = "emulated CUDA"
    xp = _DeviceNumpy()

    def __init__(self) -> None:
        self._numba = numba_backend()
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._numba, name)
        if not callable(attr):
            return attr

        def entry(*args, **kwargs):
            with self._lock:
                self.calls[name] = self.calls.get(name, 0) + 1
            kwargs = {k: _plain(v) for k, v in kwargs.items()}
            return _device(attr(*_plain(args), **kwargs))
        return entry


_ENTERED = threading.local()  # whether an EmulatedStream is entered on this thread


def stream_entered() -> bool:
    """Whether the calling thread runs inside an :class:`EmulatedStream` (its work is
    queued on the captured stream)."""
    return getattr(_ENTERED, "on", False)


class EmulatedStream:
    """Stands in for :func:`horovod_quant.gpu.capture_stream` (module doc): ``log`` gets
    ``(event, thread name)`` for its capture, each entry and fence, and each wait."""

    def __init__(self, log: list) -> None:
        self._log = log
        log.append(("captured", threading.current_thread().name))

    @contextlib.contextmanager
    def entered(self):
        self._log.append(("entered", threading.current_thread().name))
        _ENTERED.on = True
        try:
            yield
        finally:
            _ENTERED.on = False

    def fence(self):
        log = self._log
        log.append(("fenced", threading.current_thread().name))

        class _Fence:
            def wait(self):
                log.append(("waited", threading.current_thread().name))
        return _Fence()


def emulate_device(monkeypatch) -> dict:
    """Patch the package so DeviceArrays take the CUDA path (module doc); returns what it
    records: ``backend`` (the :class:`EmulatedDeviceBackend`), ``streams`` (the events of
    every :class:`EmulatedStream`), ``copies`` (staging copies each way)."""
    backend, streams = EmulatedDeviceBackend(), []
    copies = {"to_host": 0, "to_device": 0}
    lock = threading.Lock()

    def to_host(a):
        if not isinstance(a, DeviceArray):
            return a
        with lock:
            copies["to_host"] += 1
        return np.array(a.view(np.ndarray), copy=True)

    def to_device(a, like):
        assert isinstance(like, DeviceArray), "to_device needs a device array to copy next to"
        with lock:
            copies["to_device"] += 1
        return np.array(_plain(a), copy=True).view(DeviceArray)

    monkeypatch.setattr(backends_cuda, "cuda_backend", lambda: backend)
    monkeypatch.setattr(gpu, "to_host", to_host)
    monkeypatch.setattr(gpu, "to_device", to_device)
    monkeypatch.setattr(gpu, "capture_stream", lambda: EmulatedStream(streams))
    return {"backend": backend, "streams": streams, "copies": copies}
