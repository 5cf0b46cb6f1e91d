"""Device arrays and streams: CuPy views of CUDA torch tensors, host <-> device copies, the
stream the kernels are queued on, and that stream carried to another thread
(:class:`StreamScope`). Nothing here imports CuPy or torch until a device array is seen."""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator

from ..protocol import is_device_array


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


def _flatten(objs: Any) -> Iterator[Any]:
    for o in objs:
        if isinstance(o, (list, tuple)):
            yield from _flatten(o)
        else:
            yield getattr(o, "data", o) if not is_device_array(o) else o


@contextlib.contextmanager
def device_scope(*objs: Any) -> Iterator[None]:
    """Run the enclosed kernels on the right device and stream: torch's current stream
    (``cupy.cuda.ExternalStream``) when any argument is a CUDA torch tensor, else CuPy's
    current stream on the arrays' device (arguments: arrays, payloads, lists of them)."""
    arrays = [o for o in _flatten(objs) if is_device_array(o)]
    tensor = next((o for o in arrays if _is_torch(o)), None)
    if tensor is not None:
        import cupy
        import torch

        dev = tensor.device.index
        if dev is None:
            dev = torch.cuda.current_device()
        with cupy.cuda.Device(dev):
            stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(dev).cuda_stream, dev)
            with stream:
                yield
        return
    if arrays:
        with arrays[0].device:
            yield
        return
    yield


class StreamScope:
    """The CUDA device and stream current on the thread that builds it (CuPy's, which
    :func:`device_scope` sets to torch's), to queue work on from another thread.

    :meth:`entered` makes them current on the calling thread, for CuPy and, where torch has
    initialized CUDA, for torch too (its collectives, NCCL's included, then order with the
    stream: NCCL's stream waits for it at issue, and ``work.wait()`` makes it wait for NCCL).
    Work queued there runs after what the building thread queued before (one stream, in
    order). :meth:`fence` marks the end of that work for a consumer on another stream.
    """

    def __init__(self) -> None:
        import cupy

        self.device = cupy.cuda.Device()
        self.stream = cupy.cuda.get_current_stream()
        if self.stream.ptr == cupy.cuda.runtime.streamPerThread:
            self.stream.synchronize()  # a per-thread stream is another on another thread
        self._torch_stream = None
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            current = torch.cuda.current_stream(self.device.id)
            if current.cuda_stream == self.stream.ptr:
                self._torch_stream = current
            elif self.stream.ptr in (0, cupy.cuda.runtime.streamPerThread):
                self._torch_stream = torch.cuda.default_stream(self.device.id)
            else:
                self._torch_stream = torch.cuda.ExternalStream(self.stream.ptr,
                                                               device=current.device)

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """The device and stream current on the calling thread inside the block."""
        with self.device, self.stream:
            if self._torch_stream is None:
                yield
                return
            import torch

            with torch.cuda.stream(self._torch_stream):
                yield

    def fence(self) -> "Fence":
        """An event after everything queued on the stream so far."""
        import cupy

        event = cupy.cuda.Event(block=False, disable_timing=True)
        event.record(self.stream)
        return Fence(event)


class Fence:
    """The end of some device work (:meth:`StreamScope.fence`)."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def wait(self) -> None:
        """Make the calling thread's current stream (CuPy's, torch's inside
        :func:`device_scope`) wait for that work, without blocking the host."""
        import cupy

        cupy.cuda.get_current_stream().wait_event(self._event)
