"""Will compression pay on my cluster? The step of float32, a 16-bit allreduce and each codec,
predicted from the model, the link and the step's compute (docs/will-it-pay.md: the model in
full, and its error against measurements).

    python -m horovod_quant.predict --hosts 8 --ranks-per-host 8 --link-gbit 25 \\
        --model resnet50 --compute-ms 120 --device cuda

One cost model (:mod:`horovod_quant.exchange.cost`): each bucket (``fusion_bytes``,
pipelined pieces) takes the plan ``plans.plan_choice`` picks on the same ``Fabric``, its wire
time is its ``Cost`` at ``LinkTimes`` (NCCL's or gloo's rates and latencies), its codec time
``codec_work`` at measured ``Throughput`` (built-in tables, or ``--measure``; CPU ranks: their
share of the host's cores). float32 and 16-bit take the faster of a flat ring and the
hierarchical allreduce. Every row copies each bucket into one vector at the device's copy
rate, the baselines their sums back too (a codec's mean is handed over as the gradients); CPU
ranks also pay ``transport_ns`` of CPU per byte they send (TCP, both ends), and a codec's step
``step_overhead_ns`` per gradient element beyond its exchanges timed alone. Overlap, the
same for every row: the device runs forward, backward (the last
:data:`BACKWARD_SHARE` of the compute) and the codecs one after the other; the wire carries the
buckets one after the other, each once backward produced it and it is encoded; the step ends
when both are done: ``max(compute + encode + decode, last wire end + its decode)``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from ..core.base import Codec
from ..core.baselines import BASELINE_CODECS, HOROVOD_SIXTEEN_BIT, baseline_element_bytes
from ..core.contract import Combine
from ..core.limits import CodecLimitWarning
from ..doors import (
    DEFAULT_FUSION_BYTES,
    INTRA_ENV,
    LINK_ENV,
    OPTIMIZER_DOOR,
    ROUND_ENV,
    CodecRequest,
    DoorEnvironment,
)
from ..exchange import plans, reference
from ..exchange.cost import (
    NCCL_NET_STEP_US,
    CodecWork,
    Cost,
    Fabric,
    LinkTimes,
    Throughput,
    codec_work,
    hierarchical_allreduce,
    plan_cost,
    ring_allreduce,
)
from ..exchange.topology import Topology

#: parameter counts of common models (float32 gradients of every parameter): checked against
#: the architectures in tests/unit/test_predict.py
MODELS: dict[str, int] = {
    "resnet50": 25_557_032,  # torchvision resnet50, 1000 classes
    "vit-b16": 86_567_656,  # torchvision vit_b_16, 1000 classes
    "bert-base": 109_482_240,  # BertModel, uncased vocabulary, with the pooler
    "bert-large": 335_141_888,  # BertModel large (often quoted as 340M)
    "gpt2": 124_439_808,  # GPT-2 small, tied embeddings
    "gpt2-medium": 354_823_168,
    "llama-1b": 1_235_814_400,  # Llama 3.2 1B, tied embeddings
}
#: the codecs predicted when none are named: those docs/choosing.md recommends
DEFAULT_CODECS = ("qsgd:8", "qsgd:4", "global_qsgd:8")
#: the share of a step's compute that is backward (forward ~ 1/3 of forward + backward)
BACKWARD_SHARE = 2.0 / 3.0
DEVICES = ("cpu", "cuda")
#: a row's plan where one rank has nothing to exchange
NO_EXCHANGE = "no exchange"


#: one numba thread of the 2-core development machine, as ``--measure`` times it (128 MB
#: vectors; docs/results/predict_throughput_cpu.json; tests/unit/test_predict.py checks the
#: copy). Keys are "<codec>:<bits>": linear Global-QSGD takes the exponential levels' figures
CPU_THROUGHPUT: dict[str, Throughput] = {
    HOROVOD_SIXTEEN_BIT: Throughput(1.205, 2.869), "copy": Throughput(6.825, 6.825),
    "qsgd:4": Throughput(2.883, 4.828, 2.742), "nuqsgd:4": Throughput(2.08, 4.473, 2.755),
    "natural:4": Throughput(2.57, 4.248, 2.733),
    "natural_dithering:4": Throughput(2.117, 4.562, 2.847),
    "standard_dithering:4": Throughput(2.235, 4.34, 2.721),
    "global_qsgd:4": Throughput(1.749, 5.607), "dithered:4": Throughput(3.106, 3.748, 2.034),
    "nested_dithered:4": Throughput(2.929, 3.67), "qsgd:8": Throughput(2.616, 3.674, 2.289),
    "nuqsgd:8": Throughput(1.947, 3.646, 2.216), "natural:8": Throughput(2.439, 3.576, 2.271),
    "natural_dithering:8": Throughput(1.98, 3.615, 2.218),
    "standard_dithering:8": Throughput(2.091, 3.556, 2.268),
    "global_qsgd:8": Throughput(1.641, 4.088), "dithered:8": Throughput(2.303, 2.741, 1.629),
    "nested_dithered:8": Throughput(2.291, 2.842),
}
#: one H100: qsgd from the current kernels (docs/results/gpu_check_throughput.json, 256M
#: elements, ``make gpu-check``; its combine from gpu_h100_256m.json), the other codecs from
#: the previous kernels (gpu_h100_256m.json; Global-QSGD, standard dithering and NDQSG at 64M
#: from gpu_h100_throughput.json): for them the figures are slower than the current kernels
GPU_THROUGHPUT: dict[str, Throughput] = {
    "qsgd:4": Throughput(2162.0, 2526.0, 826.8), "qsgd:8": Throughput(2089.3, 2282.1, 1048.1),
    "natural:4": Throughput(774.3, 751.5, 833.6), "natural:8": Throughput(843.5, 1027.9, 1049.2),
    "natural_dithering:4": Throughput(778.6, 761.6, 838.7),
    "natural_dithering:8": Throughput(840.5, 1033.4, 1050.6),
    "nuqsgd:4": Throughput(776.6, 759.3, 835.1), "nuqsgd:8": Throughput(826.5, 1004.5, 1043.9),
    "dithered:4": Throughput(816.9, 563.1, 613.7), "dithered:8": Throughput(889.5, 619.2, 738.6),
    "standard_dithering:4": Throughput(721.3, 559.0, 742.3),
    "standard_dithering:8": Throughput(768.7, 741.0, 909.2),
    "global_qsgd:4": Throughput(321.8, 698.7), "global_qsgd:8": Throughput(333.2, 952.0),
    "nested_dithered:4": Throughput(650.6, 449.8),
    "nested_dithered:8": Throughput(691.7, 480.3),
    "copy": Throughput(1506.6, 1506.6),
}
#: the CPU (ns, both ends) one byte a CPU rank sends through TCP costs the host: the median of
#: the emulated links' calibrations of docs/results/predictor_recalibration_runs.json and
#: predictor_recalibration_runs_4x2.json (0.70-1.22 ns); ``--measure`` times a stream over
#: loopback instead
CPU_TRANSPORT_NS = 1.10
#: the CPU (ns per gradient element, per rank and step) a CPU rank's codec step costs beyond
#: its buckets' exchanges timed alone, where they run beside backward on the same cores.
#: The median over the codec rows of the same runs (each row's CPU over its compute row's,
#: less its exchanges' and its copy into the bucket: benchmarks/validate_predictor.py's
#: step_overhead_ns); other runs validate it
CPU_STEP_OVERHEAD_NS = 2.35
#: the baselines a measured step (``--measured-ms``) can name
BASELINES = ("fp32", HOROVOD_SIXTEEN_BIT)
#: the baselines' plans: a flat ring over every rank (Horovod's and NCCL's default), or
#: reduce-scatter inside the host, allreduce across the hosts, allgather inside
RING, HIERARCHICAL_ALLREDUCE = "ring allreduce", "hierarchical allreduce"
#: the range of the factor ``--measured-ms`` scales the links' rates by
SCALE_RANGE = (1e-6, 1e6)
#: where each built-in table comes from, for the printout
TABLE_SOURCES = {"cpu": "docs/results/predict_throughput_cpu.json (one numba thread)",
                 "cuda": "docs/results/gpu_check_throughput.json (one H100, qsgd), "
                         "gpu_h100_256m.json and gpu_h100_throughput.json (the others)"}


@dataclass
class Row:
    """One predicted configuration.

    Attributes:
        name: "fp32", "fp16" (the 16-bit allreduce) or the codec spec ("qsgd:8").
        plan: the plan of its buckets (several: each with its bucket count); a baseline's is
            the faster of "ring allreduce" and "hierarchical allreduce".
        host_bytes: bytes out of the busiest host's interface per step.
        step_ms: the predicted step.
        vs_fp32, vs_fp16: float32's (16-bit's) step over this one (> 1: faster).
        vs_best: the faster baseline's step over this one.
        plans_ms: a baseline's step by each plan it could take (the row takes the least).
        wire_ms: the buckets' wire time, all together.
        codec_ms: the device's work per step beside compute: the buckets' copies in and out,
            the codec's encode and decode (the CPU's float16 cast).
        exposed_ms: how much of the step is communication the compute did not hide.
        note: the codec's limits at this shape, or why it could not be built.
    """

    name: str
    plan: str
    host_bytes: float
    step_ms: float
    vs_fp32: float = 1.0
    vs_fp16: float = 1.0
    vs_best: float = 1.0
    wire_ms: float = 0.0
    codec_ms: float = 0.0
    exposed_ms: float = 0.0
    note: str = ""
    plans_ms: dict[str, float] = field(default_factory=dict)


@dataclass
class Prediction:
    """What :func:`predict` returns: the rows and what they assumed."""

    rows: list[Row]
    hosts: int
    ranks_per_host: int
    params: int
    compute_ms: float
    device: str
    fabric: Fabric
    buckets: list[int]
    throughput_source: str
    throughput: dict[str, Throughput]
    core_share: float
    transport_ns: float
    step_overhead_ns: float
    times: LinkTimes
    notes: list[str] = field(default_factory=list)
    calibration: dict | None = None

    @property
    def best_baseline(self) -> Row:
        """The faster of the fp32 and fp16 rows (the first on a tie)."""
        return min((r for r in self.rows if r.name in BASELINES), key=lambda r: r.step_ms)

    def as_json(self) -> dict:
        """``{"rows": [...], "best_baseline": {...}, "calibration": {...} or None,
        "assumptions": {...}}`` (every row's fields, the faster baseline, what
        ``measured_ms`` scaled, the inputs)."""
        best = self.best_baseline
        return {"rows": [asdict(r) for r in self.rows],
                "best_baseline": {"name": best.name, "plan": best.plan,
                                  "step_ms": best.step_ms},
                "calibration": self.calibration, "assumptions": {
            "hosts": self.hosts, "ranks_per_host": self.ranks_per_host, "params": self.params,
            "compute_ms": self.compute_ms, "device": self.device,
            "fabric": self.fabric._asdict(), "link_times": self.times._asdict(),
            "buckets": self.buckets,
            "throughput": self.throughput_source,
            "throughput_gbps": {k: list(v) for k, v in self.throughput.items()},
            "core_share": self.core_share, "transport_ns": self.transport_ns,
            "step_overhead_ns": self.step_overhead_ns,
            "backward_share": BACKWARD_SHARE, "notes": self.notes}}


# -- inputs ------------------------------------------------------------------------------------
def _positive(name: str, value: float, integer: bool = False, zero: bool = False) -> float:
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
    if (not ok or not math.isfinite(value) or (value < 0 if zero else value <= 0)
            or (integer and value != int(value))):
        kind = "a positive integer" if integer else "a positive number"
        raise ValueError(f"{name}={value!r} must be {'0 or ' if zero else ''}{kind}")
    return int(value) if integer else float(value)


def _cpu_ns(name: str, value: float | None, cpu_default: float, on_gpu: bool,
            gpu_reason: str) -> float:
    """A CPU rank's cost in ns (0 allowed): ``cpu_default`` when None; 0 on GPUs, where any
    other value is refused with ``gpu_reason``."""
    if value is None:
        return 0.0 if on_gpu else cpu_default
    value = _positive(name, value, zero=True)
    if on_gpu and value:
        raise ValueError(f"{name}={value:g} is {gpu_reason}: leave it unset")
    return value


def model_params(model: str | None = None, params: int | None = None) -> int:
    """The parameter count of ``model`` (a name of :data:`MODELS`) or ``params``.

    Raises:
        ValueError: neither or both given, an unknown name, or a count that is not positive.
    """
    if (model is None) == (params is None):
        raise ValueError("give the model as params (a parameter count) or model (one of "
                         f"{', '.join(MODELS)}), one of the two")
    if model is not None:
        if model not in MODELS:
            raise ValueError(f"unknown model {model!r}: choose one of {', '.join(MODELS)}, "
                             "or give its parameter count as params")
        return MODELS[model]
    return int(_positive("params", params, integer=True))


def build_codec(spec: str, topology: Topology) -> Codec:
    """The codec of ``spec`` as the doors build it for ``topology``: a codec that needs a world
    size for every rank, or, where that many payloads cannot be combined and the ranks share
    hosts, for the hosts (only the hierarchical exchange can then run it). Its warnings about
    its limits are left to :func:`limit_note`, which knows the plan.

    Raises:
        ValueError: it cannot be built (invalid parameters, or too many payloads to sum).
    """
    request = CodecRequest.from_spec(spec)
    hosts = (lambda: topology.host_count) if topology.hierarchical else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CodecLimitWarning)
        return request.build(lambda: topology.size, hosts)


def limit_note(codec: Codec, kind: str, topology: Topology) -> str:
    """What limits ``codec`` in the plan ``kind`` (the payloads that plan combines: one per
    rank, or one per host in a hierarchical plan); "" when nothing does."""
    if not kind.startswith(plans.HIERARCHICAL):
        return codec.limit_note() or ""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CodecLimitWarning)
        used = codec.for_world_size(topology.host_count)
    note = used.limit_note()
    if note:
        return note
    flat = codec.limit_note() if codec.world_size == topology.size else None
    if not flat:
        return ""
    return (f"a flat exchange of {topology.size} ranks would leave "
            f"{codec.params.get('num_levels')} level(s); the hierarchical plan combines one "
            f"payload per host ({topology.host_count}): {used.params.get('num_levels')} levels.")


def optimizer_fabric(on_gpu: bool) -> Fabric:
    """The fabric ``hq.torch.DistributedOptimizer`` starts from here: GPU or CPU ranks'
    defaults with the fields this environment sets (``HQ_LINK_GBIT``, ``HQ_INTRA_GBYTE``,
    ``HQ_ROUND_US``), read as the optimizer's door reads them (``doors.DoorEnvironment``)."""
    return DoorEnvironment.read(OPTIMIZER_DOOR).fabric(on_gpu)


def cluster_fabric(device: str, link_gbit: float | None, intra_gbyte: float | None = None,
                   round_us: float | None = None) -> Fabric:
    """The links the optimizer weighs on this cluster: ``link_gbit`` between hosts, the
    optimizer's fabric (:func:`optimizer_fabric`) where ``link_gbit``, ``intra_gbyte`` or
    ``round_us`` is None."""
    base = optimizer_fabric(device == "cuda")
    return Fabric(base.link_gbit if link_gbit is None else _positive("link_gbit", link_gbit),
                  base.intra_gbyte if intra_gbyte is None
                  else _positive("intra_gbyte", intra_gbyte),
                  base.round_us if round_us is None else _positive("round_us", round_us))


def bucket_sizes(params: int, fusion_bytes: int = DEFAULT_FUSION_BYTES) -> list[int]:
    """The model's float32 gradients in buckets of ``fusion_bytes`` (elements each; the
    optimizer closes a bucket at the parameter that fills it, so its buckets are as large or
    slightly larger)."""
    per = max(1, fusion_bytes // 4)
    full, rest = divmod(params, per)
    return [per] * full + ([rest] if rest else [])


# -- the step ------------------------------------------------------------------------------------
class BucketTime(NamedTuple):
    """One bucket's times, seconds: ``encode`` and ``decode`` on the device, ``wire`` on the
    links."""

    encode: float
    wire: float
    decode: float


def step_seconds(compute_s: float, buckets: Sequence[BucketTime],
                 elements: Sequence[int]) -> tuple[float, float]:
    """The step of the module docstring's overlap rule, and its exposed communication.

    Args:
        compute_s: forward, backward and update without communication.
        buckets: each bucket's times, in the order backward produces them.
        elements: each bucket's elements (when backward has produced it).

    Returns:
        ``(step, exposed)`` seconds: exposed is the step minus the device's own work.
    """
    total = float(sum(elements))
    forward = compute_s * (1.0 - BACKWARD_SHARE)
    device_work = compute_s + sum(b.encode + b.decode for b in buckets)
    done, encoded, wire_free, last_end = 0.0, 0.0, 0.0, 0.0
    for bucket, numel in zip(buckets, elements):
        done += numel
        encoded += bucket.encode  # encodes delay the rest of backward
        ready = forward + compute_s * BACKWARD_SHARE * done / total + encoded
        wire_free = max(ready, wire_free) + bucket.wire
        last_end = wire_free + bucket.decode
    step = max(device_work, last_end)
    return step, step - device_work


def _codec_seconds(kind: str, topology: Topology, numel: int, rate: Throughput,
                   share: float) -> tuple[float, float]:
    """(encode, decode) seconds of one exchange of ``numel`` elements by plan ``kind``."""
    return rate.seconds(codec_work(kind, topology, numel), share)


def _pieces_cost(kind: str, topology: Topology, numel: int, codec: Codec,
                 pipeline_elems: int | None) -> Cost:
    """The plan's cost over every piece of a pipelined bucket (each piece its own plan)."""
    total = Cost(0.0, 0)
    cross = codec.for_world_size(topology.host_count) if topology.hierarchical else None
    for lo, hi in plans.pipeline_bounds(numel, pipeline_elems):
        total = total + plan_cost(kind, topology, hi - lo, codec, cross)
    return total


def _plan_label(kinds: list[str]) -> str:
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    if len(counts) == 1:
        return kinds[0]
    return ", ".join(f"{k} ({c} bucket{'s' if c > 1 else ''})" for k, c in counts.items())


def predict(hosts: int, ranks_per_host: int, link_gbit: float | None, compute_ms: float, *,
            params: int | None = None, model: str | None = None, device: str = "cuda",
            codecs: Sequence[str] | None = None, intra_gbyte: float | None = None,
            round_us: float | None = None, cores_per_host: float | None = None,
            throughput: Mapping[str, Throughput] | None = None,
            fusion_bytes: int = DEFAULT_FUSION_BYTES,
            pipeline_elems: int | None = plans.DEFAULT_PIPELINE_ELEMS,
            transport_ns: float | None = None,
            step_overhead_ns: float | None = None,
            measured_ms: tuple[str, float] | None = None) -> Prediction:
    """Predict the step of float32, the 16-bit allreduce and each codec (module docstring).

    Args:
        hosts: hosts (at least 1).
        ranks_per_host: ranks on each host (GPUs, or CPU processes).
        link_gbit: the network between hosts, Gbit/s per host interface (its line rate; GPU
            ranks reach ``cost.NET_EFFICIENCY`` of it). One host: None allowed; without effect.
        compute_ms: the step without communication (forward, backward, update), ms.
        params: the model's parameter count; or ``model``, a name of :data:`MODELS`.
        device: "cuda" (GPU ranks, NCCL baselines) or "cpu" (CPU ranks, numba codecs).
        codecs: codec specs ("qsgd:8", "global_qsgd-lin:8"); default :data:`DEFAULT_CODECS`.
        intra_gbyte: GB/s a rank moves inside its host (default: the ranks' fabric default,
            :func:`optimizer_fabric`, which ``HQ_INTRA_GBYTE`` overrides).
        round_us: a round's latency across hosts, microseconds (default: GPU ranks
            :data:`NCCL_NET_STEP_US`; CPU ranks the fabric's, ``HQ_ROUND_US``). The plans are
            chosen on the optimizer's fabric (:func:`cluster_fabric`).
        cores_per_host: CPU cores the ranks of a host share (device "cpu"; default one per
            rank; fractions allowed: hosts emulated on fewer cores).
        throughput: codec spec -> :class:`Throughput` (``"fp16"``: the CPU cast; ``"copy"``:
            a plain copy, required), in place of the built-in table (``--measure``).
        fusion_bytes: float32 bytes per bucket.
        pipeline_elems: elements per pipelined piece (None: whole buckets).
        transport_ns: CPU ranks: ns of the host's CPU per byte a rank sends, both ends of the
            TCP stream (default :data:`CPU_TRANSPORT_NS`; 0 allowed). GPU ranks' network
            runs beside their device: None or 0 only.
        step_overhead_ns: CPU ranks: ns of CPU per gradient element a codec's step costs a rank
            beyond its exchanges (default :data:`CPU_STEP_OVERHEAD_NS`; 0 allowed). GPU ranks:
            None or 0 only.
        measured_ms: ``(baseline, ms)``: the step measured with that baseline ("fp32" or
            "fp16") on this cluster. Both link rates are scaled by one factor so that the
            baseline's predicted step equals it (:attr:`Prediction.calibration` says by how
            much); the codecs are predicted on the scaled links.

    Returns:
        The :class:`Prediction`: fp32, fp16, then the codecs in the order given.

    Raises:
        ValueError: an input out of range, an unknown model, device or codec, a link rate
            missing for several hosts, a measured step that no link rate explains.
    """
    hosts = int(_positive("hosts", hosts, integer=True))
    ranks_per_host = int(_positive("ranks_per_host", ranks_per_host, integer=True))
    if link_gbit is not None:
        _positive("link_gbit", link_gbit)
    elif hosts > 1:
        raise ValueError(f"link_gbit: give the network's rate between the {hosts} hosts "
                         "(Gbit/s per host interface, --link-gbit)")
    if hosts == 1:  # no byte crosses a host: the link neither times nor chooses a plan
        link_gbit = None
    compute_s = _positive("compute_ms", compute_ms) / 1e3
    if device not in DEVICES:
        raise ValueError(f"device={device!r}: choose one of {', '.join(DEVICES)}")
    numel_total = model_params(model, params)
    on_gpu = device == "cuda"
    base = optimizer_fabric(on_gpu)
    fabric = cluster_fabric(device, link_gbit, intra_gbyte, round_us)
    times = LinkTimes.of(fabric, on_gpu, round_us)
    share = 1.0
    if not on_gpu:
        cores = ranks_per_host if cores_per_host is None else _positive("cores_per_host",
                                                                        cores_per_host)
        share = min(1.0, cores / ranks_per_host)
    elif cores_per_host is not None:
        _positive("cores_per_host", cores_per_host)  # validated, unused: GPU codecs
    transport_ns = _cpu_ns("transport_ns", transport_ns, CPU_TRANSPORT_NS, on_gpu,
                           "the CPU that CPU ranks give their network; GPU ranks' runs "
                           "beside the GPU")
    step_overhead_ns = _cpu_ns("step_overhead_ns", step_overhead_ns, CPU_STEP_OVERHEAD_NS,
                               on_gpu, "the CPU a CPU rank's codec step costs beyond its "
                               "exchanges; GPU ranks' codecs run on the GPU")
    table = dict(throughput) if throughput is not None else (
        GPU_THROUGHPUT if on_gpu else CPU_THROUGHPUT)
    source = "measured here (--measure)" if throughput is not None else TABLE_SOURCES[device]
    topology = Topology.grid(hosts, ranks_per_host)
    sizes = bucket_sizes(numel_total, _positive("fusion_bytes", fusion_bytes, integer=True))
    plans.check_pipeline_elems(pipeline_elems)
    specs = list(DEFAULT_CODECS if codecs is None else codecs)
    for spec in specs:  # a misspelt spec is the caller's error; a codec the shape cannot
        CodecRequest.from_spec(spec)  # serve is a row that says why
    work = DeviceWork(_rate(table, "copy", device), share, transport_ns, step_overhead_ns)
    baselines = {name: Baseline(name, baseline_element_bytes(name), topology, sizes, compute_s,
                                work,
                                None if on_gpu or name == "fp32" else _rate(table, name, device))
                 for name in BASELINES}
    calibration = None
    if measured_ms is not None:
        times, calibration = _calibrated(measured_ms, baselines, times, compute_s, fabric)
    rows = [baseline.row(times) for baseline in baselines.values()]
    for spec in specs:
        rows.append(_codec_row(spec, topology, sizes, compute_s, fabric, times, table, device,
                               work, pipeline_elems))
    fp32, fp16 = rows[0].step_ms, rows[1].step_ms
    best = min(fp32, fp16)
    for row in rows:
        if row.step_ms > 0:
            row.vs_fp32, row.vs_fp16 = fp32 / row.step_ms, fp16 / row.step_ms
            row.vs_best = best / row.step_ms
    notes = []
    if calibration is not None:
        notes.append(calibration["note"])
    settings = [f"{env}={mine:g}" for env, mine, default in zip(
        (LINK_ENV, INTRA_ENV, ROUND_ENV), fabric, base) if mine != default]
    if settings:
        notes.append(f"the optimizer and the DDP hook choose these plans for the links their "
                     f"fallback's trial measures, or with {' '.join(settings)} on every rank "
                     f"(their defaults until the trial: {base.describe()})")
    if not on_gpu:
        notes.append("16-bit on CPUs: the cast is timed, gloo's float16 sum is taken as fast "
                     "as its float32 sum (it is slower: docs/will-it-pay.md)")
    return Prediction(rows, hosts, ranks_per_host, numel_total, compute_s * 1e3, device, fabric,
                      sizes, source, table, share, transport_ns, step_overhead_ns, times, notes,
                      calibration)


def rate_keys(spec: str, codec: Codec) -> list[str]:
    """The throughput table's keys for ``spec``, most specific first: with its suffix
    (``"global_qsgd-lin:8"``), then the codec's (``"global_qsgd:8"``, which the built-in
    tables measure for every suffix)."""
    bits = codec.params.get("bits")
    return list(dict.fromkeys([f"{spec.strip().partition(':')[0]}:{bits}",
                               f"{codec.name}:{bits}"]))


def _rate(table: Mapping[str, Throughput], keys: str | Sequence[str],
          device: str) -> Throughput:
    """The entry of the first of ``keys`` (one key, or :func:`rate_keys`) that ``table`` has."""
    keys = [keys] if isinstance(keys, str) else list(keys)
    for key in keys:
        if key in table:
            return table[key]
    raise ValueError(f"no {device} throughput for {keys[0]!r}: its kernels were not measured "
                     "(use --measure, or one of " + ", ".join(sorted(table)) + ")")


class DeviceWork(NamedTuple):
    """The rank's device beside its codec: ``copy``, its copy rate; ``share``, the rank's
    share of a core (CPU ranks; 1 on GPUs); ``transport_ns``, the CPU per byte it sends;
    ``step_overhead_ns``, a codec's CPU per gradient element beyond its exchanges."""

    copy: Throughput
    share: float
    transport_ns: float
    step_overhead_ns: float

    def bucket(self, encode: float, cost: Cost, times: LinkTimes, decode: float,
               numel: int, copy_back: bool) -> BucketTime:
        """A bucket's times with its copies added (its gradients into one vector before the
        encode; with ``copy_back`` the mean back into them after the decode: an allreduce's
        fusion buffer, where ``hq.torch.DistributedOptimizer`` hands its mean over as the
        gradients) and, after the decode, the CPU of the bytes the rank sends
        (``Cost.rank_bytes``)."""
        copy_in, copy_out = self.copy.seconds(CodecWork(numel, numel, 0.0), self.share)
        return BucketTime(encode + copy_in, times.seconds(cost),
                          decode + (copy_out if copy_back else 0.0)
                          + cost.rank_bytes * self.transport_ns * 1e-9 / self.share)


class Baseline:
    """An allreduce of ``element_bytes`` per element (``cast``: the CPU's float16 cast) on
    every bucket, by a flat ring or, where the ranks share hosts, hierarchically; its row
    takes the faster on the links it is timed on."""

    def __init__(self, name: str, element_bytes: float, topology: Topology, sizes: list[int],
                 compute_s: float, work: DeviceWork, cast: Throughput | None):
        self.name, self.sizes, self.compute_s, self.work = name, sizes, compute_s, work
        self.cast = cast
        self.plans: dict[str, list[Cost]] = {NO_EXCHANGE: [Cost(0.0, 0)] * len(sizes)}
        if topology.size > 1:
            self.plans = {RING: [ring_allreduce(topology, n, element_bytes) for n in sizes]}
            if topology.hierarchical:
                self.plans[HIERARCHICAL_ALLREDUCE] = [
                    hierarchical_allreduce(topology, n, element_bytes) for n in sizes]

    def row(self, times: LinkTimes) -> Row:
        """The row of the faster plan on ``times`` (the flat ring on a tie)."""
        best, steps = None, {}
        for plan, costs in self.plans.items():
            buckets = [self._bucket(numel, cost, times, plan)
                       for numel, cost in zip(self.sizes, costs)]
            row = _row(self.name, plan, sum(c.host_bytes for c in costs), buckets, self.sizes,
                       self.compute_s)
            steps[plan] = row.step_ms
            if best is None or row.step_ms < best.step_ms:
                best = row
        best.plans_ms = steps
        return best

    def _bucket(self, numel: int, cost: Cost, times: LinkTimes, plan: str) -> BucketTime:
        if plan == NO_EXCHANGE:
            return BucketTime(0.0, 0.0, 0.0)
        encode = decode = 0.0
        if self.cast is not None:  # the CPU's float16 cast of every element, and back
            encode, decode = self.cast.seconds(CodecWork(numel, numel, 0.0), self.work.share)
        return self.work.bucket(encode, cost, times, decode, numel, copy_back=True)


def _calibrated(measured_ms: tuple[str, float], baselines: Mapping[str, Baseline],
                times: LinkTimes, compute_s: float, fabric: Fabric) -> tuple[LinkTimes, dict]:
    """``times`` with both rates scaled by the factor that makes the named baseline's step
    the measured one (the least such factor: a step the compute hides is reached by every
    faster link), and what was scaled.

    Raises:
        ValueError: an unknown baseline, a step that is not a positive number, one below the
            compute or below what the baseline takes on links a million times faster, one
            rank (nothing crosses a link), or a step no slower link reaches.
    """
    try:
        name, ms = measured_ms
    except (TypeError, ValueError):
        raise ValueError(f"measured_ms={measured_ms!r}: give (baseline, ms), e.g. "
                         "('fp32', 180.0); on the command line --measured-ms fp32=180") from None
    if name not in baselines:
        raise ValueError(f"measured_ms: unknown baseline {name!r}; name one of "
                         f"{', '.join(baselines)} (--measured-ms fp32=MS)")
    ms = _positive(f"measured_ms[{name!r}]", ms)
    baseline = baselines[name]
    if NO_EXCHANGE in baseline.plans:
        raise ValueError("measured_ms: one rank exchanges nothing, so its step says nothing "
                         "of the links; leave it out")
    if ms < compute_s * 1e3:
        raise ValueError(f"measured_ms: the measured {name} step {ms:g} ms is below the "
                         f"compute time {compute_s * 1e3:g} ms; a step includes its compute: "
                         "check --compute-ms and the measured step")

    def step(factor: float) -> float:
        return baseline.row(times.scaled(factor)).step_ms

    low, high = SCALE_RANGE
    if ms < step(high):
        raise ValueError(f"measured_ms: the measured {name} step {ms:g} ms is below what "
                         f"{name} takes on links a million times faster ({step(high):.4g} ms: "
                         "compute, copies, rounds' latency); check --compute-ms, --round-us "
                         "and the baseline's name")
    if ms > step(low):
        raise ValueError(f"measured_ms: the measured {name} step {ms:g} ms needs links more "
                         f"than a million times slower than those given; check --link-gbit, "
                         "--intra-gbyte and the measured step")
    for _ in range(200):  # bisection on log(factor): step() does not grow with the factor
        middle = math.sqrt(low * high)
        if step(middle) <= ms:
            high = middle
        else:
            low = middle
        if high / low < 1 + 1e-9:
            break
    scaled, before = times.scaled(high), baseline.row(times).step_ms
    plan = baseline.row(scaled).plan
    note = (f"--measured-ms {name}={ms:g}: the links' rates scaled by {high:.3g} so that "
            f"{name}'s step ({plan}) is the measured one (predicted {before:.1f} ms on the "
            f"rates given): {scaled.link_bytes_per_s * 8 / 1e9:.3g} Gbit/s reached between "
            f"hosts, {scaled.intra_bytes_per_s / 1e9:.3g} GB/s inside a host; the rounds' "
            "latency unchanged")
    return scaled, {"baseline": name, "measured_ms": ms, "predicted_ms": before,
                    "rate_scale": high, "plan": plan,
                    "link_gbit_reached": scaled.link_bytes_per_s * 8 / 1e9,
                    "intra_gbyte_reached": scaled.intra_bytes_per_s / 1e9,
                    "link_gbit_given": fabric.link_gbit, "note": note}


def _codec_row(spec: str, topology: Topology, sizes: list[int], compute_s: float,
               fabric: Fabric, times: LinkTimes, table: Mapping[str, Throughput], device: str,
               work: DeviceWork, pipeline_elems: int | None) -> Row:
    try:
        codec = build_codec(spec, topology)
    except ValueError as exc:
        return Row(spec.strip(), "cannot be built", 0.0, 0.0, 0.0, 0.0, note=str(exc))
    rate = _rate(table, rate_keys(spec, codec), device)
    buckets, kinds, host_bytes = [], [], 0.0
    for numel in sizes:
        if topology.size == 1:
            kinds.append(NO_EXCHANGE)
            buckets.append(BucketTime(0.0, 0.0, 0.0))
            continue
        kind = _plan_kind(codec, topology, numel, fabric)
        cost = _pieces_cost(kind, topology, numel, codec, pipeline_elems)
        encode, decode = _codec_seconds(kind, topology, numel, rate, work.share)
        # the step's CPU beyond the exchange delays backward, as an encode does
        encode += numel * work.step_overhead_ns * 1e-9 / work.share
        buckets.append(work.bucket(encode, cost, times, decode, numel, copy_back=False))
        kinds.append(kind)
        host_bytes += cost.host_bytes
    row = _row(spec.strip(), _plan_label(kinds), host_bytes, buckets, sizes, compute_s)
    row.note = " ".join(dict.fromkeys(limit_note(codec, k, topology) for k in kinds if k))
    return row


def _plan_kind(codec: Codec, topology: Topology, numel: int, fabric: Fabric) -> str:
    """The plan the optimizer takes for a bucket of ``numel`` elements: no custom collective
    on the transports that carry GPU and gloo payloads."""
    choice = plans.plan_choice(codec, topology, numel, "auto", topology.hierarchical, fabric)
    return plans.runnable(choice.kind, custom=False)


def _row(name: str, plan: str, host_bytes: float, times: list[BucketTime], sizes: list[int],
         compute_s: float) -> Row:
    step, exposed = step_seconds(compute_s, times, sizes)
    return Row(name, plan, host_bytes, step * 1e3, wire_ms=sum(t.wire for t in times) * 1e3,
               codec_ms=sum(t.encode + t.decode for t in times) * 1e3, exposed_ms=exposed * 1e3)


# -- --measure ----------------------------------------------------------------------------------
def measure_throughput(specs: Sequence[str], device: str, elements: int = 1 << 25,
                       repeat: int = 3, topology: Topology | None = None,
                       fabric: Fabric | None = None,
                       pipeline_elems: int | None = plans.DEFAULT_PIPELINE_ELEMS
                       ) -> dict[str, Throughput]:
    """Time each codec's encode, decode and combine on this machine (best of ``repeat``,
    after a first call that compiles the kernels), a copy of the vector (``"copy"``) and on
    CPUs the float16 cast (``"fp16"``).

    Args:
        specs: codec specs (:meth:`~horovod_quant.doors.CodecRequest.from_spec`).
        device: "cpu" (numba, one thread) or "cuda" (CuPy kernels; needs CuPy and a GPU).
        elements: float32 elements of the timed vector: by default 128 MB, more than a
            CPU's last-level cache or a GPU's L2 holds, as a model's gradients are (a vector
            that stays in cache runs a CPU's kernels up to three times as fast).
        topology: CPU ranks: also time one bucket (``DEFAULT_FUSION_BYTES``) through the
            plan the predictor gives this shape, as one of its ranks runs it
            (:func:`~.exchange.reference.one_rank`: its pieces, frames and the copies and sums
            of its collectives), and scale the codec's rates by that time over its kernels'.
        fabric, pipeline_elems: the links the plan is chosen for, and its pieces.

    Returns:
        spec -> :class:`Throughput` (GB/s of float32 input).
    """
    if device == "cuda":
        import cupy as xp

        def sync() -> None:
            xp.cuda.Device().synchronize()
    else:
        xp = np

        def sync() -> None:
            pass

    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal(elements, dtype=np.float32))
    out = xp.empty(elements, np.float32)
    gigabytes = elements * 4 / 1e9

    def best_seconds(fn) -> float:
        fn()
        sync()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return min(times)

    def best(fn) -> float:
        return gigabytes / best_seconds(fn)

    copy = best(lambda: xp.copyto(out, x))  # a bucket's gradients in, or its mean out
    rates: dict[str, Throughput] = {"copy": Throughput(copy, copy)}
    if device == "cpu":  # the 16-bit baseline's cast and back, as the built-in table times it
        half = BASELINE_CODECS[HOROVOD_SIXTEEN_BIT]()
        payload = half.encode(x, seed=1)
        rates[HOROVOD_SIXTEEN_BIT] = Throughput(best(lambda: half.encode(x, seed=1)),
                                   best(lambda: half.decode(payload, out)))
    in_plan = device == "cpu" and topology is not None and topology.size > 1
    for spec in specs:
        codec = CodecRequest.from_spec(spec).build(lambda: 2)  # world-sized: for two ranks
        key = rate_keys(spec, codec)[0]
        if key in rates:
            continue
        payload = codec.encode(x, seed=1)
        combine = None
        if codec.traits.combine is Combine.GATHER:
            combine = best(lambda: codec.decode_add(payload, out))
        rate = Throughput(best(lambda: codec.encode(x, seed=1)),
                          best(lambda: codec.decode(payload, out)), combine)
        if in_plan:
            rate = _as_the_plan_runs(spec, rate, topology, fabric, pipeline_elems, x,
                                     best_seconds)
        rates[key] = rate
    return rates


def _as_the_plan_runs(spec: str, rate: Throughput, topology: Topology, fabric: Fabric | None,
                      pipeline_elems: int | None, vector, best_seconds) -> Throughput:
    """``rate`` scaled by the ratio of one rank's measured time in the plan of a full bucket
    (of ``vector``, its pieces cut to split evenly into the plan's chunks and shards) to the
    time the kernels' rates give that plan, for every bucket; unchanged where ``spec`` cannot
    be built for ``topology`` or one rank's payload cannot stand for every rank's (NDQSG)."""
    try:
        codec = build_codec(spec, topology)
    except ValueError:
        return rate
    if codec.traits.side_information:
        return rate
    even = topology.size * topology.local_size
    piece = max(even, (pipeline_elems or vector.size) // even * even)
    bucket = vector[:max(piece, min(vector.size, DEFAULT_FUSION_BYTES // 4) // piece * piece)]
    kind = _plan_kind(codec, topology, bucket.size, fabric or optimizer_fabric(False))
    measured = best_seconds(lambda: reference.one_rank(codec, bucket, kind, topology, piece))
    return _scaled(rate, measured, kind, topology, bucket.size)


def _scaled(rate: Throughput, seconds: float, kind: str, topology: Topology,
            numel: int) -> Throughput:
    """``rate`` scaled so that one exchange of ``numel`` elements by plan ``kind`` takes its
    codec ``seconds`` at a whole core."""
    encode, decode = _codec_seconds(kind, topology, numel, rate, 1.0)
    slower = seconds / (encode + decode)
    return Throughput(rate.encode / slower, rate.decode / slower,
                      None if rate.combine is None else rate.combine / slower)


def calibrate(kernels: Mapping[str, Throughput], exchange_cpu_s: Mapping[str, float],
              numel: int, topology: Topology, fabric: Fabric, transport_ns: float,
              pipeline_elems: int | None = plans.DEFAULT_PIPELINE_ELEMS
              ) -> dict[str, Throughput]:
    """CPU ranks' codec rates from exchanges timed by the ranks of a cluster.

    ``exchange_cpu_s`` holds, per codec spec, the CPU one rank's process spent (every
    thread, beyond its idle load) in one exchange of ``numel`` elements by the plan
    :func:`predict` gives it. Each codec's rates are scaled so that its kernels take that
    CPU less its collectives' (the bytes the rank sends at ``transport_ns``). A codec keeps
    its rates where the shape cannot build it, ``kernels`` has no entry for it, or its
    collectives alone would take the CPU measured.

    Args:
        kernels: the codecs' rates on the machine (:func:`measure_throughput`; only the
            ratio of each codec's encode, decode and combine matters for the codecs timed);
            kept for the specs not in ``exchange_cpu_s``.
        exchange_cpu_s: codec spec -> CPU seconds of one exchange.
        numel, topology, fabric, pipeline_elems: the exchanges' elements, the cluster's
            shape, the links the ranks' plans were chosen for, and their pieces.
        transport_ns: the CPU per byte a rank sends (:func:`predict`'s).

    Returns:
        The table :func:`predict` takes as ``throughput``.

    Raises:
        ValueError: a misspelt spec, or a CPU time that is not positive.
    """
    rates = dict(kernels)
    for spec, seconds in exchange_cpu_s.items():
        CodecRequest.from_spec(spec)
        _positive(f"exchange_cpu_s[{spec!r}]", seconds)
        try:
            codec = build_codec(spec, topology)
            rate = _rate(kernels, rate_keys(spec, codec), "cpu")
        except ValueError:
            continue
        kind = _plan_kind(codec, topology, numel, fabric)
        sent = _pieces_cost(kind, topology, numel, codec, pipeline_elems).rank_bytes
        own = seconds - sent * transport_ns * 1e-9
        if own > 0:
            rates[rate_keys(spec, codec)[0]] = _scaled(rate, own, kind, topology, numel)
    return rates


def machine_busy_s() -> float:
    """Seconds every core of this machine has been busy since boot (Linux ``/proc/stat``:
    user, nice, system, irq and softirq; not idle, iowait or a hypervisor's steal)."""
    with open("/proc/stat") as f:  # user nice system idle iowait irq softirq
        ticks = [int(v) for v in f.readline().split()[1:8]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def measure_transport_ns(nbytes: int = 1 << 30, timeout_s: float = 60.0) -> float:
    """The CPU (ns, every core's busy time: both ends) one byte sent over a TCP stream on
    loopback costs this machine (an otherwise idle machine).

    Args:
        nbytes: bytes streamed to a child process.
        timeout_s: how long the child may take to connect, and each send.

    Raises:
        ValueError: no ``/proc/stat`` (not Linux): give the figure (``--transport-ns``).
    """
    if not os.path.exists("/proc/stat"):
        raise ValueError("timing the network's CPU reads /proc/stat (Linux): give "
                         "--transport-ns (ns of CPU per byte sent) instead")
    receiver = ("import socket, sys; s = socket.create_connection(('127.0.0.1', "
                "int(sys.argv[1]))); b = bytearray(1 << 20)\n"
                "while s.recv_into(b): pass")
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(timeout_s)
        child = subprocess.Popen([sys.executable, "-c", receiver,
                                  str(server.getsockname()[1])])
        try:
            conn, _ = server.accept()
            conn.settimeout(timeout_s)
            block, sent = bytes(1 << 20), 0
            start = machine_busy_s()
            with conn:
                while sent < nbytes:
                    conn.sendall(block)
                    sent += len(block)
            child.wait(timeout_s)
            return (machine_busy_s() - start) / sent * 1e9
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()


# -- command line -------------------------------------------------------------------------------
def format_table(prediction: Prediction) -> str:
    """The prediction as text: what was assumed, then one line per row."""
    p, f, t = prediction, prediction.fabric, prediction.times
    mb = p.params * 4 / 1e6
    between = (f"{f.link_gbit:g} Gbit/s between hosts ({t.link_bytes_per_s * 8e-9:.3g} "
               f"reached), {t.round_s * 1e6:.3g} us per round across hosts, "
               if p.hosts > 1 else "")
    lines = [f"{p.hosts} host(s) x {p.ranks_per_host} ranks ({p.device}); {between}"
             f"{t.intra_bytes_per_s / 1e9:.3g} GB/s inside a host, "
             f"{t.local_round_s * 1e6:.3g} us per round inside",
             f"{p.params / 1e6:.1f}M parameters = {mb:.1f} MB of float32 gradients in "
             f"{len(p.buckets)} bucket(s); compute {p.compute_ms:g} ms per step",
             f"codec throughput: {p.throughput_source}"
             + (f", x{p.core_share:.2f} (a rank's share of the cores)"
                if p.core_share != 1.0 else "")
             + (f"; {p.transport_ns:.2f} ns of CPU per byte a rank sends"
                if p.transport_ns else "")
             + (f"; a codec's step {p.step_overhead_ns:.2f} ns of CPU per element beyond its "
                f"exchanges" if p.step_overhead_ns else ""),
             "", f"{'config':<20} {'host MB/step':>12} {'step ms':>9} {'vs best':>8} "
                 f"{'vs 16-bit':>9} {'vs fp32':>8}  plan"]
    for r in p.rows:
        if r.plan == "cannot be built":
            lines.append(f"{r.name:<20} {'-':>12} {'-':>9} {'-':>8} {'-':>9} {'-':>8}  "
                         "cannot be built")
            continue
        name = {HOROVOD_SIXTEEN_BIT: "16-bit allreduce"}.get(r.name, r.name)
        lines.append(f"{name:<20} {r.host_bytes / 1e6:>12.1f} {r.step_ms:>9.1f} "
                     f"{r.vs_best:>7.2f}x {r.vs_fp16:>8.2f}x {r.vs_fp32:>7.2f}x  {r.plan}")
    best = p.best_baseline
    lines.append("")
    lines.append(f"best baseline: {best.name} by {best.plan}, {best.step_ms:.1f} ms ('vs best' "
                 "is its step over each row's; each baseline takes the faster of its plans)")
    lines.append("step = max(compute + encode + decode, the last bucket's wire end + its "
                 "decode); communication overlaps backward (the last 2/3 of compute).")
    for r in p.rows:
        if r.note:
            lines.append(f"{r.name}: {r.note}")
    lines += p.notes
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m horovod_quant.predict",
        description="Predict the training step of float32, a 16-bit allreduce and each codec "
                    "on your cluster (docs/will-it-pay.md).")
    ap.add_argument("--hosts", type=int, required=True, help="hosts")
    ap.add_argument("--ranks-per-host", type=int, required=True,
                    help="ranks per host (GPUs per host)")
    ap.add_argument("--link-gbit", type=float, default=None,
                    help="network between hosts, Gbit/s per host interface (its line rate; "
                         "required with several hosts, without effect on one)")
    ap.add_argument("--intra-gbyte", type=float, default=None,
                    help="GB/s a rank moves inside its host (default 16 for GPUs: PCIe; 1.25 "
                         "for CPU ranks; NVLink: 100 or more)")
    ap.add_argument("--round-us", type=float, default=None,
                    help="latency of one round of a collective across hosts, microseconds, "
                         "for the plans and their time (default: GPUs are timed at "
                         f"{NCCL_NET_STEP_US:g}, NCCL's step, and their plans chosen at the "
                         "optimizer's HQ_ROUND_US; CPU ranks the optimizer's for both)")
    ap.add_argument("--cores-per-host", type=float, default=None,
                    help="CPU cores the ranks of a host share (--device cpu; default one per "
                         "rank)")
    model = ap.add_mutually_exclusive_group(required=True)
    model.add_argument("--params", type=int, default=None, help="the model's parameter count")
    model.add_argument("--model", choices=sorted(MODELS), default=None,
                       help="a model of the built-in table")
    ap.add_argument("--compute-ms", type=float, required=True,
                    help="the step without communication (forward, backward, update), ms")
    ap.add_argument("--device", choices=DEVICES, default="cuda",
                    help="where the gradients and codecs are (default cuda)")
    ap.add_argument("--codecs", default=",".join(DEFAULT_CODECS),
                    help="comma-separated codec specs, e.g. qsgd:8,qsgd:4,global_qsgd-lin:8 "
                         f"(default {','.join(DEFAULT_CODECS)})")
    ap.add_argument("--transport-ns", type=float, default=None,
                    help="CPU ranks: ns of the host's CPU per byte a rank sends, both ends of "
                         f"TCP (default {CPU_TRANSPORT_NS:g}; --measure times it on loopback)")
    ap.add_argument("--step-overhead-ns", type=float, default=None,
                    help="CPU ranks: ns of CPU per gradient element a codec's step costs a "
                         "rank beyond its exchanges (default "
                         f"{CPU_STEP_OVERHEAD_NS:g}: fitted on the 2-core development machine's "
                         "emulated cluster, docs/will-it-pay.md; --measure does not time it)")
    ap.add_argument("--measure", action="store_true",
                    help="time the codecs on this machine first (CPU: also through the "
                         "plan of this shape as one rank runs it, and the CPU of a TCP "
                         "stream; the GPU with --device cuda) instead of the built-in tables")
    ap.add_argument("--measured-ms", default=None, metavar="BASELINE=MS",
                    help="your measured step with a baseline, fp32=MS or fp16=MS: the links' "
                         "rates are scaled so that its predicted step is this one, then the "
                         "codecs are predicted on them (the output says by how much)")
    ap.add_argument("--json", action="store_true", help="print JSON: {\"rows\": [...]}")
    return ap.parse_args(argv)


def parse_measured(text: str | None) -> tuple[str, float] | None:
    """``"fp32=180"`` -> ``("fp32", 180.0)``; None stays None.

    Raises:
        ValueError: not of the form BASELINE=MS, or MS not a number.
    """
    if text is None:
        return None
    name, sep, ms = text.partition("=")
    try:
        value = float(ms)
    except ValueError:
        value = None
    if not sep or value is None:
        raise ValueError(f"--measured-ms {text!r}: give BASELINE=MS, e.g. fp32=180 (the step "
                         f"you measured with {' or '.join(BASELINES)}, milliseconds)")
    return name.strip(), value


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (``python -m horovod_quant.predict --help``, which runs this)."""
    args = parse_args(argv)
    codecs = [c for c in args.codecs.split(",") if c.strip()]
    try:
        table, transport_ns = None, args.transport_ns
        inputs = dict(params=args.params, model=args.model, device=args.device, codecs=codecs,
                      intra_gbyte=args.intra_gbyte, round_us=args.round_us,
                      cores_per_host=args.cores_per_host, step_overhead_ns=args.step_overhead_ns,
                      measured_ms=parse_measured(args.measured_ms))
        predict(args.hosts, args.ranks_per_host, args.link_gbit, args.compute_ms,
                transport_ns=transport_ns, **inputs)  # bad inputs refused before timing
        if args.measure:
            table = measure_throughput(
                codecs, args.device, topology=Topology.grid(args.hosts, args.ranks_per_host),
                fabric=cluster_fabric(args.device, args.link_gbit, args.intra_gbyte,
                                      args.round_us))
            if args.device == "cpu" and transport_ns is None:
                transport_ns = measure_transport_ns()
        prediction = predict(args.hosts, args.ranks_per_host, args.link_gbit, args.compute_ms,
                             throughput=table, transport_ns=transport_ns, **inputs)
    except ValueError as exc:
        print(f"predict: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(prediction.as_json(), indent=1))
    else:
        print(format_table(prediction))
    return 0
