"""IEEE subnormals inside ``tf.numpy_function`` callbacks.

TensorFlow's graph executor runs every kernel, the Python callback of ``tf.numpy_function``
included, with flush-to-zero and denormals-are-zero set in the thread's floating-point control
register. NumPy and numba code called from there would flush subnormal intermediates to zero
and stop matching the same code run anywhere else (``mean_estimate`` in a test, the PyTorch
adapter, another rank running eagerly). :func:`ieee_denormals` clears those bits for the
duration of a callback and restores them afterwards (x86-64 MXCSR FTZ/DAZ, AArch64 FPCR FZ);
elsewhere it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform
from collections.abc import Iterator
from contextlib import contextmanager

_MACHINE = platform.machine().lower()


class _FenvX86(ctypes.Structure):  # glibc fenv_t on x86-64: x87 environment, then MXCSR
    _fields_ = [("x87", ctypes.c_uint8 * 28), ("mxcsr", ctypes.c_uint32)]


class _FenvArm(ctypes.Structure):  # glibc fenv_t on AArch64
    _fields_ = [("fpcr", ctypes.c_uint32), ("fpsr", ctypes.c_uint32)]


if _MACHINE in ("x86_64", "amd64"):
    _ENV, _FIELD, _BITS = _FenvX86, "mxcsr", 0x8040  # FTZ (bit 15) | DAZ (bit 6)
elif _MACHINE in ("aarch64", "arm64"):
    _ENV, _FIELD, _BITS = _FenvArm, "fpcr", 1 << 24  # FZ
else:
    _ENV = None

_libm = None
if _ENV is not None:
    try:
        _libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
        _libm.fegetenv.argtypes = [ctypes.c_void_p]
        _libm.fesetenv.argtypes = [ctypes.c_void_p]
    except (OSError, AttributeError):
        _libm = None


def flush_bits() -> int:
    """The flush-to-zero bits set in this thread (0 when none, or on other platforms)."""
    if _libm is None:
        return 0
    env = _ENV()
    _libm.fegetenv(ctypes.byref(env))
    return getattr(env, _FIELD) & _BITS


@contextmanager
def ieee_denormals() -> Iterator[None]:
    """Run the body with gradual underflow (subnormals kept), then restore the thread's mode."""
    if _libm is None:
        yield
        return
    env = _ENV()
    _libm.fegetenv(ctypes.byref(env))
    saved = getattr(env, _FIELD)
    if not saved & _BITS:
        yield
        return
    setattr(env, _FIELD, saved & ~_BITS)
    _libm.fesetenv(ctypes.byref(env))
    try:
        yield
    finally:
        _libm.fegetenv(ctypes.byref(env))
        setattr(env, _FIELD, (getattr(env, _FIELD) & ~_BITS) | (saved & _BITS))
        _libm.fesetenv(ctypes.byref(env))
