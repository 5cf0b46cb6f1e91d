"""GPU time of enqueued work, measured with CUDA events and free of Python's launch overhead.

A codec call enqueues one or two kernels after tens of microseconds of Python; timed as it
comes, a 1M-element kernel would measure the interpreter. :class:`CudaTimer` first enqueues a
kernel that spins for longer than the host needs to enqueue the timed calls, records the start
event behind it, enqueues the calls and the end event: the device then runs the calls back to
back, and the events bracket device time only (a start event already passed when the host
finished enqueuing means the spin was too short, and the run is repeated with a longer one).
A call that waits for the device itself (a host synchronization, e.g. reading a norm back)
cannot be hidden that way: after a few tries it is timed by the events without the spin, its
host time included. Figures are medians over runs, after a warm-up call (kernel compilation,
memory pool growth).
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Any, Callable

_SPIN = r"""
extern "C" __global__ void bench_spin(long long cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}
"""


def _clock_hz(cupy: Any) -> float:
    """The SM clock (for the spin kernel's length; a wrong value only makes spins longer or
    retried)."""
    rt = cupy.cuda.runtime
    try:
        return rt.deviceGetAttribute(rt.cudaDevAttrClockRate, rt.getDevice()) * 1e3  # kHz
    except Exception:  # attribute missing in this CUDA / CuPy
        return 2e9


class CudaTimer:
    """Seconds per call of ``fn`` on CuPy's current stream (which must be the stream the
    timed work runs on)."""

    def __init__(self, cupy: Any, min_batch_seconds: float = 2e-3) -> None:
        self.cp = cupy
        self.min_batch = min_batch_seconds
        self._spin = cupy.RawKernel(_SPIN, "bench_spin")
        self.hz = _clock_hz(cupy)

    def _spin_for(self, seconds: float) -> None:
        self._spin((1,), (1,), (self.cp.int64(int(seconds * self.hz)),))

    def _batch(self, fn: Callable[[], Any], inner: int, host_seconds: float | None) -> float | None:
        """Device seconds of ``inner`` calls, or None when the spin ended before the host had
        enqueued them (no spin when ``host_seconds`` is None)."""
        cp = self.cp
        start, end = cp.cuda.Event(), cp.cuda.Event()
        if host_seconds is not None:
            self._spin_for(2 * inner * host_seconds + 1e-4)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        late = host_seconds is not None and start.done
        end.synchronize()
        return None if late else cp.cuda.get_elapsed_time(start, end) * 1e-3

    def seconds(self, fn: Callable[[], Any], repeat: int = 7) -> float:
        """Median device seconds of one call of ``fn`` over ``repeat`` batches (a batch lasts
        at least ``min_batch_seconds``: many calls of a short kernel)."""
        cp = self.cp
        fn()  # warm-up: compilation, memory pool
        cp.cuda.get_current_stream().synchronize()
        t0 = time.perf_counter()
        fn()
        host = time.perf_counter() - t0  # enqueue time (an upper bound while nothing waits)
        cp.cuda.get_current_stream().synchronize()
        one = self._batch(fn, 1, host) or host
        inner = max(1, min(10000, math.ceil(self.min_batch / max(one, 1e-7))))
        runs: list[float] = []
        tries = 0
        while len(runs) < repeat:
            t = self._batch(fn, inner, host)
            if t is None:  # spin too short: longer, or give up on hiding the host's time
                tries += 1
                host = None if tries >= 4 else host * 4
                continue
            runs.append(t / inner)
        return statistics.median(runs)

    def copy_seconds(self, src: Any, dst: Any, repeat: int = 7) -> float:
        """Median device seconds of a device-to-device copy of ``src`` into ``dst``
        (cudaMemcpyAsync on the current stream)."""
        rt = self.cp.cuda.runtime
        stream = self.cp.cuda.get_current_stream().ptr
        return self.seconds(lambda: rt.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes,
                                                   rt.memcpyDeviceToDevice, stream), repeat)
