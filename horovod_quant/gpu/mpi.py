"""Can MPI take GPU buffers directly (CUDA-aware MPI)?

Order of evidence (first that answers wins):

1. ``HQ_CUDA_AWARE_MPI=1`` / ``=0`` (also true/false, yes/no): the user's word.
2. ``MPIX_Query_cuda_support()`` of the MPI library mpi4py is linked against (Open MPI >= 2.0
   and MPICH derivatives export it), called through ctypes on ``mpi4py.MPI``'s library; it
   reports run-time support.
3. ``ompi_info --parsable --all`` (Open MPI): ``mpi_built_with_cuda_support:value:true``.
4. Otherwise False: exchanges stage device buffers through host memory.
"""
from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _from_env() -> bool | None:
    v = os.environ.get("HQ_CUDA_AWARE_MPI")
    if v is None or not v.strip():
        return None
    v = v.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"HQ_CUDA_AWARE_MPI={v!r}: use 1 or 0")


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


def cuda_aware_mpi(explain: bool = False) -> bool | tuple[bool, str]:
    """Whether MPI can send/receive device buffers.

    Args:
        explain: also return where the answer came from ("HQ_CUDA_AWARE_MPI",
            "MPIX_Query_cuda_support", "ompi_info" or "default").
    """
    env = _from_env()
    ans, source = (env, "HQ_CUDA_AWARE_MPI") if env is not None else _detect()
    return (ans, source) if explain else ans
