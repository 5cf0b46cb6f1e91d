"""Can MPI take GPU buffers directly (CUDA-aware MPI)?

Order of evidence (first that answers wins):

1. The user's word: ``HQ_CUDA_AWARE_MPI=1`` / ``=0``, read by the door
   (``doors.DoorEnvironment``) and passed in as ``override``.
2. ``MPIX_Query_cuda_support()`` of the MPI library mpi4py is linked against (Open MPI >= 2.0
   and MPICH derivatives export it), called through ctypes on ``mpi4py.MPI``'s library; it
   reports run-time support.
3. ``ompi_info --parsable --all`` (Open MPI): ``mpi_built_with_cuda_support:value:true``.
4. Otherwise False: exchanges stage device buffers through host memory.

:func:`horovod_device_collectives` answers the same question for Horovod's own collectives,
which the codecs' sum and gather exchanges run on.
"""
from __future__ import annotations

import ctypes
import functools
import shutil
import subprocess
from typing import Any


def _from_mpix() -> bool | None:
    try:
        from mpi4py import MPI
    except Exception:
        return None
    candidates = []
    try:
        candidates.append(ctypes.CDLL(MPI.__file__, mode=ctypes.RTLD_GLOBAL))
    except OSError:
        pass
    try:
        candidates.append(ctypes.CDLL(None))
    except OSError:
        pass
    for lib in candidates:
        fn = getattr(lib, "MPIX_Query_cuda_support", None)
        if fn is not None:
            fn.restype = ctypes.c_int
            fn.argtypes = []
            try:
                return bool(fn())
            except Exception:
                return None
    return None


def _from_ompi_info() -> bool | None:
    exe = shutil.which("ompi_info")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--parsable", "--all"], capture_output=True, text=True,
                             timeout=30, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_ompi_info(out)


def parse_ompi_info(text: str) -> bool | None:
    """``mpi_built_with_cuda_support`` from ``ompi_info --parsable --all`` output."""
    for line in text.splitlines():
        if "mpi_built_with_cuda_support:value:" in line:
            return line.rsplit(":", 1)[-1].strip().lower() == "true"
    return None


@functools.lru_cache(maxsize=1)
def _detect() -> tuple[bool, str]:
    for source, probe in (("MPIX_Query_cuda_support", _from_mpix), ("ompi_info", _from_ompi_info)):
        ans = probe()
        if ans is not None:
            return ans, source
    return False, "default"


def cuda_aware_mpi(explain: bool = False, override: bool | None = None
                   ) -> bool | tuple[bool, str]:
    """Whether MPI can send/receive device buffers.

    Args:
        explain: also return where the answer came from ("HQ_CUDA_AWARE_MPI",
            "MPIX_Query_cuda_support", "ompi_info" or "default").
        override: the user's answer (a door's ``HQ_CUDA_AWARE_MPI``); None detects.
    """
    ans, source = (override, "HQ_CUDA_AWARE_MPI") if override is not None else _detect()
    return (ans, source) if explain else ans


def horovod_device_collectives(horovod_module: Any, override: bool | None = None,
                               cuda_aware: bool | None = None) -> tuple[bool, str]:
    """Whether Horovod's collectives can take CUDA tensors, and why.

    True when Horovod was built with NCCL (its GPU operations then move device buffers
    themselves), or built with CUDA and running on a CUDA-aware MPI (:func:`cuda_aware_mpi`).
    ``override`` (a door's ``HQ_DEVICE_COLLECTIVES=1``/``=0``) decides instead (e.g. ``0`` for
    a Horovod whose allgather or alltoall was built without GPU support). When False,
    exchanges of device gradients copy their compressed payloads to host memory and back
    (:class:`horovod_quant.exchange.staging.HostStaged`).

    Args:
        horovod_module: ``horovod.torch`` or ``horovod.tensorflow`` (initialized).
        override: the user's answer; None decides from Horovod's build.
        cuda_aware: the user's answer for the MPI (:func:`cuda_aware_mpi`'s ``override``).

    Returns:
        ``(answer, reason)``.
    """
    if override is not None:
        return override, "HQ_DEVICE_COLLECTIVES"
    if horovod_module.nccl_built():
        return True, "Horovod built with NCCL"
    if horovod_module.cuda_built() and horovod_module.mpi_enabled():
        aware, source = cuda_aware_mpi(explain=True, override=cuda_aware)
        return bool(aware), f"Horovod built with CUDA on MPI (CUDA-aware: {source})"
    return False, "Horovod built without GPU operations"
