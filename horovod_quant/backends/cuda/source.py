"""Where the CUDA sources are, and how they become one self-contained source string.

Sources are looked up, in order:

1. ``$HQ_KERNEL_DIR`` (a folder holding ``*.cu`` / ``*.cuh``), for development;
2. ``<repo>/kernels`` next to the ``horovod_quant`` folder that was imported, in a source
   checkout: the sources that match the Python code, also when another checkout is installed
   in editable mode (whose ``horovod_quant.kernels`` would win otherwise);
3. the installed package ``horovod_quant.kernels`` (setup.py ships ``kernels/`` there),
   through :mod:`importlib.resources`.

``#include "hq_*.cuh"`` lines are inlined here (each header once, like its include guard), so
NVRTC needs no include path and the compile cache, keyed by the source text, sees every header
change.

Compilation goes through NVRTC with exactly :data:`NVRTC_OPTIONS` (see ``kernels.py``), not
through ``cupy.RawModule(code=...)``: CuPy appends ``-ftz=true`` to every option list it compiles
and NVRTC honours the last occurrence, which would flush subnormal floats to zero in products,
comparisons, ``fabsf`` and ``floorf`` and break bit parity with the CPU.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

#: CUDA source files, one CuPy RawModule each
KERNEL_FILES = ("levels.cu", "global_qsgd.cu", "dithered.cu", "reduce.cu")

#: NVRTC options: no FMA contraction, no flush-to-zero, IEEE division / square root, so that
#: every float operation rounds exactly as on the CPU (the sources also use the _rn
#: intrinsics, which are never contracted). tests/cuda_parity checks the PTX for .ftz and f32 fma.
NVRTC_OPTIONS = ("-std=c++17", "-fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true")


def nvrtc_options(arch: str) -> tuple[str, ...]:
    """The full NVRTC option list for a virtual architecture such as ``"compute_90"``."""
    return NVRTC_OPTIONS + (f"-arch={arch}",)

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


def _candidates() -> list[Path]:
    out = []
    env = os.environ.get("HQ_KERNEL_DIR")
    if env:
        out.append(Path(env))
    out.append(Path(__file__).resolve().parents[3] / "kernels")
    try:
        from importlib.resources import files

        out.append(Path(str(files("horovod_quant.kernels"))))
    except (ImportError, ModuleNotFoundError, TypeError):
        pass
    return out


def kernel_dir() -> Path:
    """The folder holding the CUDA sources (see module doc)."""
    tried = []
    for d in _candidates():
        if (d / "hq_common.cuh").is_file():
            return d
        tried.append(str(d))
    raise FileNotFoundError(
        "horovod_quant CUDA sources not found (looked in: " + ", ".join(tried) + "). Install the "
        "package with its kernels (pip install .) or set HQ_KERNEL_DIR to the repository's "
        "kernels/ folder.")


def load_source(name: str, folder: Path | None = None) -> str:
    """``name`` (e.g. ``"levels.cu"``) with its local headers inlined."""
    folder = kernel_dir() if folder is None else Path(folder)
    seen: set[str] = set()

    def expand(fname: str) -> str:
        text = (folder / fname).read_text(encoding="utf-8")

        def repl(m: re.Match) -> str:
            inc = m.group(1)
            inc_name = os.path.basename(inc)
            if not (folder / inc_name).is_file():
                return m.group(0)
            if inc_name in seen:
                return f"// (already included: {inc_name})"
            seen.add(inc_name)
            return f"// ---- begin {inc_name}\n{expand(inc_name)}\n// ---- end {inc_name}"

        return _INCLUDE.sub(repl, text)

    return expand(name)
