r"""Encode / decode throughput of every codec in one process.

examples:
  NUMBA_NUM_THREADS=1 python3 benchmarks/codec_throughput.py              # 1M and 64M elements
  python3 benchmarks/codec_throughput.py --sizes 1M --codecs qsgd,natural --bits 4,8 --repeat 7 \
      --json bench_out/cpu.json
  python3 benchmarks/codec_throughput.py --sizes 1M --json bench_out/cpu.json \
      --plot bench_out/cpu.png
  python3 benchmarks/codec_throughput.py --from-json bench_out/cpu.json --plot bench_out/cpu.png
  python3 benchmarks/codec_throughput.py --device cuda                      # the CUDA backend
  python3 benchmarks/codec_throughput.py --device cuda --torch-ref          # + plain PyTorch

On the CPU, throughput is GB/s of float32 input (4 bytes per element), best of --repeat runs
after one warm-up call (which also compiles the numba kernels). Columns:

  encode        codec.encode(x, seed) (it allocates its payload, as in training)
  decode        codec.decode(payload, out) into a preallocated float32 buffer
  dec+alloc     codec.decode(payload), allocating the output each time
  combine       gather codecs: --world-size payloads into one mean (what every rank runs
                after an allgather), GB/s of the float32 the payloads stand for
  torch enc/dec with --torch-ref, level quantizers: the same quantizer written in plain
                PyTorch (benchmarks/torch_ref.py) on a torch tensor of the same device

--device cuda measures what the kernels move: each encode and decode (into a buffer) is timed
with CUDA events behind a spin kernel (device time only, Python's launch overhead excluded;
benchmarks/cuda_timing.py), median of --repeat batches after a warm-up call that compiles the
kernels. A row per codec, bits, size and direction gives the seconds, the bytes moved (encode:
4 bytes of input per element + the payload; decode: the payload + 4 bytes of output), GB/s
moved, and copy_fraction: that rate over the rate of a device-to-device copy of the same
float32 vector measured in the same run (bytes read + written); with --torch-ref also the
plain-PyTorch time of the same work and the speedup over it. Sizes whose bytes fit in the L2
cache are flagged: their figures are inflated.

--clock cpu times with the process's CPU time instead of the wall clock: on a machine shared
with other jobs it leaves out the time the process waits for a core (it still pays for their
use of caches and memory bandwidth). Codecs that need world_size are built with --world-size.
Codecs without a bits parameter (the baselines) run once per size. --plot FILE.png draws the
table (a panel per measure, a row of panels per size); --from-json JSON draws an earlier --json
without measuring. Speed is measured here, never asserted in tests.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import horovod_quant as hq
from horovod_quant.core.contract import Combine


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def build(name: str, bits: int | None, world_size: int):
    params = {} if bits is None else {"bits": bits}
    try:
        return hq.get_codec(name, **params)
    except ValueError as exc:
        if "world_size" not in str(exc):
            raise
        return hq.get_codec(name, world_size=world_size, **params)


def takes_bits(name: str, world_size: int) -> bool:
    try:
        return "bits" in build(name, None, world_size).params
    except ValueError:
        return False


class CpuBackend:
    name = "cpu"

    def array(self, x):
        return x

    def empty(self, n):
        return np.empty(n, np.float32)

    def sync(self):
        pass


class CudaBackend:
    name = "cuda"

    def __init__(self):
        try:
            import horovod_quant.gpu as gpu
        except ImportError as exc:
            raise SystemExit(f"--device cuda needs horovod_quant.gpu, which failed to import: "
                             f"{exc}") from None
        if not gpu.available():
            raise SystemExit("--device cuda: CuPy is missing or sees no usable CUDA device "
                             "(horovod_quant.gpu.available() is False)")
        import cupy

        from cuda_timing import CudaTimer

        self.cp = cupy
        self.timer = CudaTimer(cupy)

    def array(self, x):
        return self.cp.asarray(x)

    def empty(self, n):
        return self.cp.empty(n, self.cp.float32)


CLOCK = time.perf_counter


def best_time(fn, repeat: int, sync) -> float:
    best = float("inf")
    for _ in range(repeat):
        sync()
        t0 = CLOCK()
        fn()
        sync()
        best = min(best, CLOCK() - t0)
    return best


def bench_torch_ref(codec, x, repeat: int, backend) -> tuple[float | None, float | None]:
    """GB/s of encode and decode of the plain-PyTorch version of a level quantizer
    (benchmarks/torch_ref.py) on a CPU tensor; (None, None) for other codecs."""
    import torch

    from torch_ref import torch_reference_decode, torch_reference_encode

    t = torch.from_numpy(x)
    try:
        enc = torch_reference_encode(codec, t)
    except NotImplementedError:
        return None, None
    torch_reference_decode(codec, enc)
    gb = x.size * 4 / 1e9
    return (gb / best_time(lambda: torch_reference_encode(codec, t), repeat, backend.sync),
            gb / best_time(lambda: torch_reference_decode(codec, enc), repeat, backend.sync))


def bench_one(codec, x, repeat: int, backend, world_size: int, threads: int = 1) -> dict:
    """Encode, decode (into a buffer / allocating) and, for gather codecs, the combine of
    ``world_size`` payloads into a buffer (what every rank runs after an allgather), as GB/s
    of the float32 the payloads stand for; with ``threads`` > 1 also the encode throughput of
    that many threads encoding at once (all of them together)."""
    gb = x.size * 4 / 1e9
    out = backend.empty(x.size)
    payload = codec.encode(x, seed=1)  # warm-up (compiles)
    codec.decode(payload, out)
    codec.decode(payload)
    seeds = iter(range(2, 2 + 10 * repeat))
    t_enc = best_time(lambda: codec.encode(x, seed=next(seeds)), repeat, backend.sync)
    t_dec = best_time(lambda: codec.decode(payload, out), repeat, backend.sync)
    t_dec_alloc = best_time(lambda: codec.decode(payload), repeat, backend.sync)
    combine = None
    if codec.traits.combine is Combine.GATHER:
        payloads = [codec.encode(x, seed=r) for r in range(world_size)]
        codec.combine_gathered(payloads, 0, out=out)
        combine = world_size * gb / best_time(lambda: codec.combine_gathered(payloads, 0, out=out),
                                              repeat, backend.sync)
    threaded = None
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            def together():
                list(pool.map(lambda s: codec.encode(x, seed=s), range(threads)))
            together()
            threaded = threads * gb / best_time(together, repeat, backend.sync)
    return {
        "encode_gbps": gb / t_enc,
        "encode_threads_gbps": threaded,
        "decode_gbps": gb / t_dec,
        "decode_alloc_gbps": gb / t_dec_alloc,
        "combine_gbps": combine,
        "bits_per_element": payload.nbytes * 8 / x.size,
    }


def bench_cuda(name: str, codec, x, backend, repeat: int, copy_seconds: float, l2_bytes: int,
               torch_ref: bool) -> list[dict]:
    """The encode and decode rows of ``codec`` (registered as ``name``) on the device vector
    x (module doc)."""
    n = int(x.size)
    out = backend.empty(n)
    payload = codec.encode(x, seed=1)
    seeds = iter(range(2, 1 << 30))
    timer = backend.timer
    times = {"encode": timer.seconds(lambda: codec.encode(x, seed=next(seeds)), repeat),
             "decode": timer.seconds(lambda: codec.decode(payload, out), repeat)}
    moved = {"encode": 4 * n + payload.nbytes, "decode": payload.nbytes + 4 * n}
    torch_times = {"encode": None, "decode": None}
    if torch_ref:
        import torch

        from torch_ref import torch_reference_decode, torch_reference_encode

        t = torch.from_dlpack(x)
        try:
            enc = torch_reference_encode(codec, t)
        except NotImplementedError:
            enc = None
        if enc is not None:
            torch_times = {
                "encode": timer.seconds(lambda: torch_reference_encode(codec, t), repeat),
                "decode": timer.seconds(lambda: torch_reference_decode(codec, enc), repeat)}
    copy_rate = 8 * n / copy_seconds
    rows = []
    for direction in ("encode", "decode"):
        sec, tsec = times[direction], torch_times[direction]
        rows.append({
            "codec": name, "bits": codec.params.get("bits"), "direction": direction,
            "elements": n, "seconds": sec, "bytes_moved": moved[direction],
            "gbps_moved": moved[direction] / sec / 1e9, "input_gbps": 4 * n / sec / 1e9,
            "copy_fraction": moved[direction] / sec / copy_rate,
            "torch_seconds": tsec, "speedup_vs_torch": None if tsec is None else tsec / sec,
            "bits_per_element": payload.nbytes * 8 / n, "l2_resident": moved[direction] <= l2_bytes,
            "params": codec.params})
    return rows


def run_cuda(args, names: list[str], sizes: list[int], bit_list: list[int], env: dict) -> list:
    """Every codec, bit width and size on the GPU: rows of bench_cuda, printed as they come."""
    backend = CudaBackend()
    cp = backend.cp
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.runtime.getDevice())
    name = props["name"]
    env.update({"gpu": name.decode() if isinstance(name, bytes) else str(name),
                "l2_bytes": int(props.get("l2CacheSize", 0)), "cupy": cp.__version__,
                "timing": "CUDA events behind a spin kernel, median of --repeat batches"})
    stream = contextlib.nullcontext()
    if args.torch_ref:
        import torch

        env["torch"] = torch.__version__
        # one stream for the codecs, torch and the events
        stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    print(f"{'codec':<20} {'bits':>4} {'dir':>6} {'elements':>10} {'MB moved':>9} "
          f"{'seconds':>10} {'GB/s moved':>10} {'of copy':>7}"
          + (f" {'torch s':>10} {'speedup':>7}" if args.torch_ref else ""))
    rows = []
    rng = np.random.default_rng(0)
    with stream:
        for n in sizes:
            x = backend.array(rng.standard_normal(n, dtype=np.float32))
            copy_s = backend.timer.copy_seconds(x, backend.empty(n), args.repeat)
            env.setdefault("copy", []).append(
                {"elements": n, "seconds": copy_s, "gbps_moved": 8 * n / copy_s / 1e9})
            print(f"# {n} elements: device-to-device copy {8 * n / copy_s / 1e9:.0f} GB/s "
                  f"(read + write)" + ("; fits in L2: figures inflated"
                                       if 8 * n <= env["l2_bytes"] else ""), flush=True)
            for cname in names:
                widths = bit_list if takes_bits(cname, args.world_size) else [None]
                for bits in widths:
                    try:
                        codec = build(cname, bits, args.world_size)
                        new = bench_cuda(cname, codec, x, backend, args.repeat, copy_s,
                                         env["l2_bytes"], args.torch_ref)
                    except Exception as exc:  # a codec without a GPU path: say so, go on
                        print(f"{cname:<20} {bits!s:>4} skipped on cuda: "
                              f"{type(exc).__name__}: {exc}")
                        continue
                    for r in new:
                        ts, sp = r["torch_seconds"], r["speedup_vs_torch"]
                        print(f"{cname:<20} {bits if bits else '-':>4} {r['direction']:>6} "
                              f"{n:>10} {r['bytes_moved'] / 1e6:>9.1f} {r['seconds']:>10.3e} "
                              f"{r['gbps_moved']:>10.1f} {r['copy_fraction']:>7.1%}"
                              + (f" {'-' if ts is None else f'{ts:.3e}':>10} "
                                 f"{'-' if sp is None else f'{sp:.1f}x':>7}"
                                 if args.torch_ref else ""), flush=True)
                    rows += new
            del x
    return rows


MEASURES = (("encode_gbps", "encode"), ("decode_gbps", "decode into a buffer"),
            ("decode_alloc_gbps", "decode + alloc"), ("combine_gbps", "combine of n payloads"),
            ("encode_threads_gbps", "encode, threads at once"))


def plot(blob: dict, path: str) -> None:
    """A row of panels per size, one panel per measure: a horizontal bar per codec and bit
    width with its GB/s written at the end (a linear axis; the labels keep the small bars
    readable next to ``none``'s memory copy)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = blob["results"]
    if results and "direction" in results[0]:
        return plot_cuda(blob, path)
    env = blob.get("env", {})
    sizes = list(dict.fromkeys(r["elements"] for r in results))
    measures = [(k, t) for k, t in MEASURES if any(r.get(k) is not None for r in results)]
    nrow = max(sum(r["elements"] == n for r in results) for n in sizes)
    fig, axes = plt.subplots(len(sizes), len(measures), squeeze=False, layout="constrained",
                             figsize=(3.3 * len(measures) + 1.5, (0.24 * nrow + 1.1) * len(sizes)))
    for row, n in zip(axes, sizes):
        sel = [r for r in results if r["elements"] == n]
        names = [r["codec"] + (f":{r['bits']}" if r.get("bits") else "") for r in sel]
        y = np.arange(len(sel))
        for ax, (key, title) in zip(row, measures):
            vals = [r.get(key) for r in sel]
            shown = [v if v is not None else 0.0 for v in vals]
            bars = ax.barh(y, shown, 0.7, color="#3b75af")
            ax.bar_label(bars, ["-" if v is None else f"{v:.2f}" for v in vals], fontsize=7,
                         padding=2)
            ax.set_xlim(0, max(shown + [1e-9]) * 1.22)
            ax.set_yticks(y)
            ax.set_yticklabels(names, fontsize=8)
            ax.invert_yaxis()
            ax.grid(alpha=0.3, axis="x")
            ax.set_xlabel("GB/s of float32")
            ax.set_title(f"{title}, {n:,} elements", fontsize=9)
        for ax in row[1:]:
            ax.tick_params(labelleft=False)
    clock = env.get("clock", "wall")
    fig.suptitle(f"codec throughput, one process ({env.get('device', 'cpu')}, {clock} clock, "
                 f"best of {blob.get('repeat', '?')}; load average {env.get('load_average', '?')})",
                 fontsize=10)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_cuda(blob: dict, path: str) -> None:
    """A panel per size: each kernel's fraction of the device-to-device copy rate, with its
    GB/s moved and the speedup over plain PyTorch; the targets (60 %, 75 %) as lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = blob["results"]
    env = blob.get("env", {})
    sizes = list(dict.fromkeys(r["elements"] for r in results))
    nrow = max(sum(r["elements"] == n for r in results) for n in sizes)
    fig, axes = plt.subplots(1, len(sizes), squeeze=False, layout="constrained",
                             figsize=(5.2 * len(sizes), 0.3 * nrow + 1.4))
    for ax, n in zip(axes[0], sizes):
        sel = [r for r in results if r["elements"] == n]
        y = np.arange(len(sel))
        frac = [r["copy_fraction"] for r in sel]
        colors = ["#3b75af" if r["direction"] == "encode" else "#e1812c" for r in sel]
        bars = ax.barh(y, frac, 0.7, color=colors)
        labels = [f"{r['gbps_moved']:.0f} GB/s"
                  + ("" if r.get("speedup_vs_torch") is None
                     else f", {r['speedup_vs_torch']:.1f}x torch") for r in sel]
        ax.bar_label(bars, labels, fontsize=7, padding=2)
        for target in (0.6, 0.75):
            ax.axvline(target, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xlim(0, max(frac + [1.0]) * 1.45)
        ax.set_yticks(y)
        ax.set_yticklabels([f"{r['codec']}:{r['bits']} {r['direction']}" for r in sel],
                           fontsize=8)
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
        ax.set_xlabel("bytes moved per second / device-to-device copy's")
        l2 = " (fits in L2)" if sel[0].get("l2_resident") else ""
        ax.set_title(f"{n:,} elements{l2}", fontsize=9)
    fig.suptitle(f"codec kernels on {env.get('gpu', 'cuda')}: fraction of a device-to-device "
                 f"copy, median of {blob.get('repeat', '?')}", fontsize=10)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help; the epilog's commands one per line."""


def main(argv=None) -> int:
    summary, _, rest = __doc__.partition("\n\n")
    ap = argparse.ArgumentParser(description=summary, epilog=rest, formatter_class=HelpFormatter)
    ap.add_argument("--sizes", default="1M,64M", help="comma-separated, e.g. 1M,64M,100000")
    ap.add_argument("--codecs", default=None, help="comma-separated (None: all registered)")
    ap.add_argument("--bits", default="4,8", help="bit widths for codecs that take bits")
    ap.add_argument("--repeat", type=int, default=5,
                    help="runs per measurement (cpu: best kept; cuda: median)")
    ap.add_argument("--world-size", type=int, default=2, help="for codecs that need one")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--plot", default=None, metavar="FILE.png", help="also draw the results here")
    ap.add_argument("--from-json", default=None, metavar="JSON",
                    help="measure nothing: draw --plot from an earlier --json")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: NumPy arrays (numba backend); cuda: CuPy arrays (CUDA backend)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall clock, or process CPU time (for shared machines; cpu device only)")
    ap.add_argument("--torch-ref", action="store_true",
                    help="also time the plain-PyTorch version of the level quantizers "
                         "(benchmarks/torch_ref.py) on the same device")
    ap.add_argument("--threads", type=int, default=1,
                    help="also encode on this many threads at once (cpu device, wall clock): "
                         "the kernels release the GIL")
    args = ap.parse_args(argv)
    if args.from_json:
        if not args.plot:
            ap.error("--from-json draws a plot: give --plot FILE.png")
        with open(args.from_json) as f:
            plot(json.load(f), args.plot)
        print(f"# wrote {args.plot}")
        return 0
    if args.threads > 1 and (args.device == "cuda" or args.clock == "cpu"):
        ap.error("--threads measures host threads by the wall clock: use --device cpu "
                 "--clock wall")
    global CLOCK
    if args.clock == "cpu":
        if args.device == "cuda":
            ap.error("--clock cpu measures host CPU time; use the wall clock with --device cuda")
        CLOCK = time.process_time

    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    names = [s for s in (args.codecs or "").split(",") if s] or hq.available_codecs()
    unknown = [n for n in names if n not in hq.available_codecs()]
    if unknown:
        ap.error(f"unknown codec(s) {unknown}; available: {', '.join(hq.available_codecs())}")
    bit_list = [int(b) for b in args.bits.split(",") if b]

    env = {
        "device": args.device,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "NUMBA_NUM_THREADS": os.environ.get("NUMBA_NUM_THREADS", ""),
        "clock": args.clock,
        "load_average": " ".join(f"{v:.2f}" for v in os.getloadavg()),
    }
    try:
        import numba

        env["numba"] = numba.__version__
    except ImportError:
        pass
    print("# " + ", ".join(f"{k}={v}" for k, v in env.items()))
    if args.device == "cuda":
        results = run_cuda(args, names, sizes, bit_list, env)
    else:
        results = run_cpu(args, names, sizes, bit_list)
    blob = {"env": env, "repeat": args.repeat, "results": results}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(blob, f, indent=1, default=str)
        print(f"# wrote {args.json}")
    if args.plot:
        plot(blob, args.plot)
        print(f"# wrote {args.plot}")
    return 0


def run_cpu(args, names: list[str], sizes: list[int], bit_list: list[int]) -> list:
    """Every codec, bit width and size on the CPU (bench_one), printed as they come."""
    backend = CpuBackend()
    header = f"{'codec':<20} {'bits':>4} {'elements':>10} {'wire b/el':>9} {'encode':>8} " \
             f"{'decode':>8} {'dec+alloc':>9} {'combine':>8}" \
             + (f" {'enc x' + str(args.threads):>8}" if args.threads > 1 else "") \
             + (f" {'torch enc':>9} {'torch dec':>9}" if args.torch_ref else "") \
             + "   (GB/s of float32 input; combine: --world-size payloads into one mean)"
    print(header)
    print("-" * len(header))
    results = []
    rng = np.random.default_rng(0)
    for n in sizes:
        x = backend.array(rng.standard_normal(n, dtype=np.float32))
        for name in names:
            widths = bit_list if takes_bits(name, args.world_size) else [None]
            for bits in widths:
                try:
                    codec = build(name, bits, args.world_size)
                except ValueError as exc:
                    print(f"{name:<20} {bits!s:>4} skipped: {exc}")
                    continue
                r = bench_one(codec, x, args.repeat, backend, args.world_size, args.threads)
                r.update({"codec": name, "bits": bits, "elements": n, "params": codec.params})
                if args.torch_ref:
                    r["torch_ref_encode_gbps"], r["torch_ref_decode_gbps"] = bench_torch_ref(
                        codec, x, args.repeat, backend)
                results.append(r)
                combine = "-" if r["combine_gbps"] is None else f"{r['combine_gbps']:.2f}"
                print(f"{name:<20} {bits if bits else '-':>4} {n:>10} "
                      f"{r['bits_per_element']:>9.3f} {r['encode_gbps']:>8.2f} "
                      f"{r['decode_gbps']:>8.2f} {r['decode_alloc_gbps']:>9.2f} {combine:>8}"
                      + (f" {r['encode_threads_gbps']:>8.2f}" if args.threads > 1 else "")
                      + ("".join(f" {'-' if v is None else f'{v:.2f}':>9}" for v in
                                 (r["torch_ref_encode_gbps"], r["torch_ref_decode_gbps"]))
                         if args.torch_ref else ""),
                      flush=True)
        del x
    return results


if __name__ == "__main__":
    sys.exit(main())
