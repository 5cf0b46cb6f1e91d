#!/usr/bin/env python3
"""The GPU image's build, checked where there is no GPU (`make image-test-gpu` runs it inside the
image): torch is a CUDA build, torch, CuPy and the CUDA compiler are of one CUDA major, Horovod
was built with NCCL, gloo and MPI, the tools of `make gpu-check` run, and CuPy's NVRTC compiles
the package's kernels for the given architectures (no device is asked:
``horovod_quant.backends.cuda.kernels.compile_for``).
What needs a GPU (the kernels and NCCL collectives running) is `make gpu-check`'s.

    python3 scripts/gpu_image_check.py                    # kernels for sm_80 and sm_90
    python3 scripts/gpu_image_check.py --arch sm_90

Prints one line per check; exits 1 when one fails, saying which and why.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile


def nvcc_release() -> tuple[str, str]:
    """(release, path) of the nvcc in $CUDA_HOME/bin, else on PATH."""
    home = os.environ.get("CUDA_HOME", "")
    nvcc = os.path.join(home, "bin", "nvcc") if home else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        raise RuntimeError("no nvcc in $CUDA_HOME/bin or on PATH")
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    if not m:
        raise RuntimeError(f"{nvcc} --version says no release: {out!r}")
    return m.group(1), nvcc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", metavar="ARCH",
                    help="NVRTC architecture to compile the kernels for, e.g. sm_90 (a CUBIN) or "
                    "compute_90 (PTX); repeatable (default: sm_80 and sm_90)")
    args = ap.parse_args(argv)
    archs = args.arch or ["sm_80", "sm_90"]
    failed: list[str] = []

    def check(name: str, fn) -> None:
        try:
            print(f"ok    {name}: {fn()}", flush=True)
        except Exception as exc:  # every check runs; the exit status sums them up
            print(f"FAIL  {name}: {type(exc).__name__}: {exc}", flush=True)
            failed.append(name)

    def cuda_majors() -> str:
        import cupy
        import torch

        if torch.version.cuda is None:
            raise RuntimeError(f"torch {torch.__version__} is a CPU build")
        cupy_cuda = cupy.cuda.runtime.runtimeGetVersion()  # the CUDA runtime CuPy runs on
        nvcc, path = nvcc_release()
        majors = {"torch": torch.version.cuda.split(".")[0], "CuPy": str(cupy_cuda // 1000),
                  "nvcc": nvcc.split(".")[0]}
        if len(set(majors.values())) != 1:
            raise RuntimeError(f"CUDA majors differ: {majors}")
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}), CuPy {cupy.__version__} "
                f"(its CUDA runtime {cupy_cuda // 1000}.{cupy_cuda % 1000 // 10}), nvcc {nvcc} "
                f"({path}): all CUDA {majors['torch']}")

    def horovod() -> str:
        import horovod
        import horovod.torch as hvd
        import torch

        built = {"nccl": hvd.nccl_built(), "gloo": hvd.gloo_built(), "mpi": hvd.mpi_built()}
        if not all(built.values()):
            raise RuntimeError(f"Horovod {horovod.__version__} built with {built}")
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        return (f"Horovod {horovod.__version__}: nccl_built() = {built['nccl']} (torch's NCCL "
                f"{nccl}), gloo_built() = {built['gloo']}, mpi_built() = {built['mpi']}")

    def gpu_check_tools() -> str:
        """the tools `make gpu-check` takes from PATH on a GPU host (ncu is not in the image)"""
        out = subprocess.run(["compute-sanitizer", "--version"], capture_output=True, text=True,
                             check=True).stdout
        version = re.search(r"Version (\S+)", out)
        if not version:
            raise RuntimeError(f"compute-sanitizer --version says no version: {out!r}")
        return (f"nvcc {nvcc_release()[0]}, compute-sanitizer {version.group(1)} "
                f"({shutil.which('compute-sanitizer')})")

    def kernels(arch: str):
        def compile_them() -> str:
            from horovod_quant.backends.cuda.kernels import compile_for

            paths = compile_for(arch)
            return ", ".join(f"{p.name.split('_' + arch)[0]} {p.stat().st_size} B" for p in paths)
        return compile_them

    check("CUDA", cuda_majors)
    check("Horovod", horovod)
    check("gpu-check tools", gpu_check_tools)
    with tempfile.TemporaryDirectory(prefix="hq-kernels-") as cache:
        os.environ["HQ_KERNEL_CACHE"] = cache  # a fresh cache: every file really compiles
        for arch in archs:
            check(f"kernels for {arch} (NVRTC, no device)", kernels(arch))
    if failed:
        print(f"gpu_image_check: {len(failed)} check(s) failed: {', '.join(failed)}")
        return 1
    print("gpu_image_check: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
