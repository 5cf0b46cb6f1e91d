"""Kernel launcher on a GPU: CuPy RawModules over ``kernels/*.cu``.

Each source file is compiled with NVRTC (CuPy's bindings, our exact options: see ``source.py``
for why not ``RawModule(code=...)``) to a CUBIN for the device (PTX as a fallback) on first
use, once per device architecture,
cached on disk (``$HQ_KERNEL_CACHE`` or ``~/.cache/horovod_quant/kernels``, keyed by source,
options and NVRTC version) and loaded with ``cupy.RawModule(path=...)``. Every launch goes to
CuPy's current stream, which :func:`horovod_quant.backends.cuda.arrays.device_scope` sets to
the framework's stream.
"""
from __future__ import annotations

import hashlib
import os
import re
import tempfile
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..protocol import PACK_BLOCK
from .launch import MAX_PAYLOADS, DitherValues, log2_exact
from .source import load_source, nvrtc_options
from .specs import (
    DECODE_FILES,
    TILE_UNITS,
    block_encode_kernel,
    decode_kernel,
    exp_combine_kernel,
    tile_encode_kernel,
)

THREADS = 256  # HQ_THREADS of the .cu files
_MAX_GRID = 1 << 16  # grid-stride kernels: enough blocks to fill any current GPU

_lock = threading.Lock()
_modules: dict[tuple[int, str], Any] = {}
_functions: dict[tuple[int, str, str], Any] = {}

i32, i64, u32, f32, f64 = np.int32, np.int64, np.uint32, np.float32, np.float64


def _grid(n: int) -> tuple[int]:
    return (max(1, min(-(-n // THREADS), _MAX_GRID)),)


def _blocks(n: int) -> tuple[int]:
    return (-(-n // PACK_BLOCK),)


def cache_dir() -> Path:
    d = os.environ.get("HQ_KERNEL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "horovod_quant", "kernels")
    return Path(d)


def _nvrtc_compile(src: str, name: str, options: Sequence[str], kind: str) -> bytes:
    """PTX or CUBIN of ``src`` from NVRTC (through CuPy's bindings)."""
    from cupy.cuda import nvrtc

    prog = nvrtc.createProgram(src, name, (), ())
    try:
        try:
            nvrtc.compileProgram(prog, list(options))
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"NVRTC failed to compile {name} ({' '.join(options)}):\n"
                               f"{log}") from exc
        out = nvrtc.getCUBIN(prog) if kind == "cubin" else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return out.encode() if isinstance(out, str) else bytes(out)


def _targets() -> list[tuple[str, str]]:
    """(NVRTC -arch, output kind) to try: a CUBIN for the device's own architecture (no
    driver JIT, no PTX-version mismatch between NVRTC and driver), then PTX for it and for
    the newest architectures NVRTC supports below it."""
    import cupy
    from cupy.cuda import nvrtc

    cc = int(cupy.cuda.Device().compute_capability)
    out = []
    if hasattr(nvrtc, "getCUBIN"):
        out.append((f"sm_{cc}", "cubin"))
    out.append((f"compute_{cc}", "ptx"))
    try:
        out += [(f"compute_{a}", "ptx") for a in
                sorted((int(a) for a in nvrtc.getSupportedArchs() if int(a) < cc), reverse=True)]
    except Exception:
        pass
    return out


def module_path(fname: str, targets: Sequence[tuple[str, str]] | None = None) -> Path:
    """Compiled CUBIN / PTX of ``fname`` (from the cache if there) for the first of ``targets``
    (NVRTC -arch, output kind) that compiles; by default those of the current device."""
    from cupy.cuda import nvrtc

    src = load_source(fname)
    version = ".".join(map(str, nvrtc.getVersion()))
    errors = []
    for arch, kind in (_targets() if targets is None else targets):
        opts = nvrtc_options(arch)
        key = hashlib.sha256("\0".join([src, *opts, version]).encode()).hexdigest()[:32]
        path = cache_dir() / f"{Path(fname).stem}_{arch}_{key}.{kind}"
        if path.is_file():
            return path
        try:
            binary = _nvrtc_compile(src, fname, opts, kind)
        except RuntimeError as exc:  # e.g. an architecture this NVRTC does not know
            errors.append(str(exc))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(binary)
        os.replace(tmp, path)  # atomic: concurrent processes write the same bytes
        return path
    raise RuntimeError("\n".join(errors))


def get_module(fname: str) -> Any:
    """The loaded RawModule of ``fname`` on the current device (compiled once per device)."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    key = (dev, fname)
    mod = _modules.get(key)
    if mod is None:
        with _lock:
            mod = _modules.get(key)
            if mod is None:
                mod = cupy.RawModule(path=str(module_path(fname)))
                _modules[key] = mod
    return mod


def get_function(fname: str, kernel: str) -> Any:
    import cupy

    key = (cupy.cuda.runtime.getDevice(), fname, kernel)
    fn = _functions.get(key)
    if fn is None:
        fn = get_module(fname).get_function(kernel)
        _functions[key] = fn
    return fn


_ARCH = re.compile(r"(sm|compute)_\d+a?")


def compile_for(arch: str) -> list[Path]:
    """Compile every kernel file for ``arch`` without asking for a device: ``"sm_90"`` gives
    CUBINs, ``"compute_90"`` PTX, in the kernel cache (:func:`cache_dir`), where a process on
    such a device finds them. For machines without a GPU (image builds, build hosts), where
    :func:`compile_all` cannot ask the device for its architecture. Returns the files' paths;
    raises RuntimeError with NVRTC's log when a file does not compile."""
    from .source import KERNEL_FILES

    if not _ARCH.fullmatch(arch):
        raise ValueError(f"arch={arch!r}: give an NVRTC architecture such as 'sm_90' (a CUBIN) "
                         "or 'compute_90' (PTX)")
    kind = "cubin" if arch.startswith("sm_") else "ptx"
    return [module_path(f, targets=[(arch, kind)]) for f in KERNEL_FILES]


def compile_all() -> list[str]:
    """Compile every kernel file for the current device (raises on a compile error)."""
    from .source import KERNEL_FILES

    for f in KERNEL_FILES:
        get_module(f)
    return list(KERNEL_FILES)


class CupyKernels:
    """The kernel launcher of :class:`horovod_quant.backends.cuda.CudaBackend` on a GPU: one
    method per kernel, launched on CuPy's current stream."""

    def __init__(self) -> None:
        import cupy

        self.cp = cupy
        self.xp = cupy

    def address(self, a: Any) -> int:
        return int(a.data.ptr)

    def to_host(self, a: Any) -> np.ndarray:
        return self.cp.asnumpy(a)

    # -- levels.cu ---------------------------------------------------------------------------
    def encode_tiles(self, x, full_blocks, log2_bucket, mode, kind, bits, s, c, M, k, am, gnorm,
                     k0, k1, out, scales_off, codes_off) -> None:
        units = full_blocks * TILE_UNITS[bits]
        warps = THREADS // 32
        get_function("levels.cu", tile_encode_kernel(mode, kind, bits))(
            (min(-(-units // warps), _MAX_GRID),), (THREADS,),
            (x, i64(units), i32(log2_bucket), i32(s), i32(c), i32(M), i32(k), f32(am),
             f32(gnorm), u32(k0), u32(k1), out, i64(scales_off), i64(codes_off)))

    def encode_blocks(self, x, n, bucket, mode, bits, norm_kind, p, s, c, M, k, am, gnorm, k0,
                      k1, out, scales_off, codes_off, fused, first_block) -> None:
        get_function("levels.cu", block_encode_kernel(mode, bits))(
            (-(-n // PACK_BLOCK) - first_block,), (THREADS,),
            (x, i64(n), i64(bucket), i32(norm_kind), f64(p), i32(s), i32(c), i32(M), i32(k),
             f32(am), f32(gnorm), u32(k0), u32(k1), out, i64(scales_off), i64(codes_off),
             i32(1 if fused else 0), i64(first_block)))

    def scales(self, x, n, bucket, kind, p, scales) -> None:
        nb = -(-n // bucket)
        get_function("levels.cu", "hq_scales")(
            (-(-nb // (THREADS // 8)),), (THREADS,),
            (x, i64(n), i64(bucket), i32(kind), f64(p), scales))

    def max_scales(self, x, n, bucket, kind, scales) -> None:
        nb = -(-n // bucket)
        mbits = self.cp.zeros(nb, self.cp.int32)
        get_function("levels.cu", "hq_max_bits")(_blocks(n), (THREADS,),
                                                 (x, i64(n), i64(bucket), mbits))
        get_function("levels.cu", "hq_scales_from_bits")(
            (-(-nb // THREADS),), (THREADS,), (mbits, i64(nb), i32(kind), scales))

    def _decode(self, words, values, pays, scales_off, codes_off, gscale, n, bucket, bits, out,
                start, post, rng, threads_needed) -> None:
        """One decode launch; the payload pointers (and DQSG keys) are kernel arguments."""
        ptrs = [np.uint64(self.address(a)) for a in pays]
        ptrs += [np.uint64(0)] * (MAX_PAYLOADS - len(ptrs))
        args = (*ptrs, i32(len(pays)), i64(scales_off), i64(codes_off),
                f32(0.0 if gscale is None else gscale), i64(n), i64(bucket),
                i32(log2_exact(bucket) or 0), out, i32(start), i32(0 if post is None else 1),
                f32(0.0 if post is None else post))
        if isinstance(values, DitherValues):
            keys = [np.uint64(k0 | (k1 << 32)) for k0, k1 in values.keys]
            args += (*keys, *[np.uint64(0)] * (MAX_PAYLOADS - len(keys)), i32(values.M))
            kind = "dither"
        else:
            args += (values.table,)
            kind = "levels"
        get_function(DECODE_FILES[kind], decode_kernel(kind, words, bits))(
            _grid(threads_needed), (THREADS,), (*args, i64(rng)))

    def decode_words(self, values, pays, scales_off, codes_off, gscale, n, bucket, bits, out,
                     start, post, end) -> None:
        nwords = end // 32 * bits
        self._decode(True, values, pays, scales_off, codes_off, gscale, n, bucket, bits, out,
                     start, post, nwords, nwords)

    def decode_groups(self, values, pays, scales_off, codes_off, gscale, n, bucket, bits, out,
                      start, post, begin) -> None:
        self._decode(False, values, pays, scales_off, codes_off, gscale, n, bucket, bits, out,
                     start, post, begin, -(-(n - begin) // 4))

    def codes(self, x, n, mode, bits, s, c, gnorm, k0, k1, codes) -> None:
        get_function("levels.cu", "hq_codes")(
            _grid(n), (THREADS,),
            (x, i64(n), i32(mode), i32(bits), i32(s), i32(c), f32(gnorm), u32(k0), u32(k1), codes))

    def pack(self, codes, n, bits, out) -> None:
        get_function("levels.cu", "hq_pack")(
            _blocks(n), (THREADS,), (codes, i64(n), i32(bits), out))

    def scale(self, src, n, f, dst) -> None:
        get_function("levels.cu", "hq_scale")(_grid(n), (THREADS,), (src, i64(n), f32(f), dst))

    def to_f32(self, src, n, dst) -> None:
        get_function("levels.cu", "hq_to_f32")(_grid(n), (THREADS,), (src, i64(n), dst))

    def unpack(self, packed, n, bits, codes) -> None:
        get_function("levels.cu", "hq_unpack")(_grid(n), (THREADS,),
                                               (packed, i64(n), i32(bits), codes))

    # -- dithered.cu (its decodes of P1 payloads: decode_words / decode_groups) ---------------
    def decode_nested(self, d, scales_off, codes_off, n, bucket, M, k, bits, am, alpha, y, k0,
                      k1, out) -> tuple[float, int]:
        cp = self.cp
        resid = cp.empty(n, cp.float32)
        get_function("dithered.cu", "hq_decode_nested")(
            _grid(n), (THREADS,),
            (d, i64(scales_off), i64(codes_off), i64(n), i64(bucket), i32(M), i32(k), i32(bits),
             f32(am), f32(alpha), y, u32(k0), u32(k1), out, resid))
        total = cp.zeros(1, cp.float64)
        count = cp.zeros(1, cp.int64)
        get_function("dithered.cu", "hq_resid_sum")(
            (1,), (8,), (resid, d, i64(scales_off), i64(n), i64(bucket), total, count))
        return float(total.get()[0]), int(count.get()[0])

    # -- global_qsgd.cu ----------------------------------------------------------------------
    def linear_encode(self, x, n, bits, s, norm, k0, k1, words) -> None:
        get_function("global_qsgd.cu", "hq_linear_encode")(
            _grid(int(words.size)), (THREADS,),
            (x, i64(n), i32(bits), i32(s), f32(norm), u32(k0), u32(k1), words, i64(words.size)))

    def linear_decode(self, words, n, bits, offset, scale, out, accumulate) -> None:
        get_function("global_qsgd.cu", "hq_linear_decode")(
            _grid(n), (THREADS,),
            (words, i64(n), i32(bits), i32(offset), f32(scale), out, i32(1 if accumulate else 0)))

    def exp_combine(self, a, b, out, n, first, bits, k0, k1, first_block) -> None:
        get_function("global_qsgd.cu", exp_combine_kernel(False, bits))(
            (_blocks(n)[0] - first_block,), (THREADS,),
            (a, b, out, i64(n), i64(first), i32(bits), u32(k0), u32(k1), i64(first_block)))

    def exp_combine_words(self, a, b, out, end, first, bits, k0, k1) -> None:
        nwords = end // 32 * bits
        get_function("global_qsgd.cu", exp_combine_kernel(True, bits))(
            _grid(nwords), (THREADS,), (a, b, out, i64(first), u32(k0), u32(k1), i64(nwords)))

    def decode_sparse(self, data, cnt, bits, table, scale, out) -> None:
        get_function("global_qsgd.cu", "hq_decode_sparse")(
            _grid(cnt), (THREADS,), (data, i64(cnt), i32(bits), table, f32(scale), out))

    def max_abs_bits(self, x, n) -> int:
        res = self.cp.zeros(1, self.cp.int32)
        get_function("global_qsgd.cu", "hq_max_abs_bits")(_grid(n), (THREADS,), (x, i64(n), res))
        return int(res.get()[0])

    def sum_squares(self, x, n) -> float:
        res = self.cp.zeros(1, self.cp.float64)
        get_function("global_qsgd.cu", "hq_sum_squares")((1,), (8,), (x, i64(n), res))
        return float(res.get()[0])

    # -- reduce.cu ---------------------------------------------------------------------------
    def mean_parts(self, parts, nparts, n, divisor, out) -> None:
        # a host may hold more ranks than a launch takes pointer arguments: a device array
        ptrs = self.cp.asarray(np.array([self.address(a) for a in parts], np.uint64))
        get_function("reduce.cu", "hq_mean_parts")(
            _grid(n), (THREADS,), (ptrs, i32(nparts), i64(n), f32(divisor), out))
