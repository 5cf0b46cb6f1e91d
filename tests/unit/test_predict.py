"""The predictor (horovod_quant.tools.predict, ``python -m horovod_quant.predict``): its plans
are the optimizer's, its tables are the committed measurements, its model table is the
architectures' own counts, its inputs are checked, and the codecs' limits are said before a
user meets them."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import warnings

import numpy as np
import pytest

import horovod_quant as hq
from horovod_quant.core.limits import CodecLimitWarning
from horovod_quant.doors import CodecRequest
from horovod_quant.exchange import plans, reference
from horovod_quant.exchange.cost import (
    NET_EFFICIENCY,
    Fabric,
    float32_ring,
    hierarchical_allreduce,
    plan_cost,
    ring_allreduce,
)
from horovod_quant.exchange.topology import Topology
from horovod_quant.tools import predict as pr

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "docs", "results")


def _rows(prediction: pr.Prediction) -> dict[str, pr.Row]:
    return {r.name: r for r in prediction.rows}


def test_the_command_runs_the_tool():
    """``python -m horovod_quant.predict`` is a plain module that runs the tool's ``main``."""
    import types

    import horovod_quant.predict as command

    assert type(command) is types.ModuleType and command.main is pr.main
    assert pr.predict(2, 1, 1, 10, params=1000, codecs=[]).rows[0].name == "fp32"


def test_the_acceptance_command_prints_every_row_as_json():
    """``python -m horovod_quant.predict ... --json``: fp32, fp16 and the default codecs, each
    with its plan, bytes, step and both ratios."""
    out = subprocess.run(
        [sys.executable, "-m", "horovod_quant.predict", "--hosts", "8", "--ranks-per-host", "8",
         "--link-gbit", "25", "--model", "resnet50", "--compute-ms", "120", "--device", "cuda",
         "--json"], capture_output=True, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)["rows"]
    assert [r["name"] for r in rows] == ["fp32", "fp16", *pr.DEFAULT_CODECS]
    for r in rows:
        assert {"name", "plan", "host_bytes", "step_ms", "vs_fp32", "vs_fp16"} <= set(r)
        assert r["step_ms"] >= 120 and r["host_bytes"] > 0
    fp32, fp16 = rows[0], rows[1]
    assert fp16["host_bytes"] == pytest.approx(fp32["host_bytes"] / 2)
    assert fp32["vs_fp32"] == 1 and fp16["vs_fp16"] == 1
    assert fp32["vs_fp16"] == pytest.approx(fp16["step_ms"] / fp32["step_ms"])


@pytest.mark.parametrize("hosts,local", [(2, 4), (4, 8)])
@pytest.mark.parametrize("bits,most", [(8, 0.30), (4, 0.17)])
def test_gpu_hosts_qsgd_is_hierarchical_and_sends_a_fraction(hosts, local, bits, most):
    """2 x 4 and 4 x 8 GPU hosts: the predicted qsgd plan is hierarchical, its bytes across
    the busiest host's interface at most 0.30 of the float32 ring's at 8 bits, 0.17 at 4."""
    prediction = pr.predict(hosts, local, 25, 120, model="resnet50", device="cuda",
                            codecs=[f"qsgd:{bits}"])
    rows = _rows(prediction)
    row = rows[f"qsgd:{bits}"]
    assert row.plan.startswith(plans.HIERARCHICAL) and "," not in row.plan, row.plan
    assert row.host_bytes <= most * rows["fp32"].host_bytes, row.host_bytes / rows[
        "fp32"].host_bytes


def test_the_plans_and_bytes_are_the_optimizers():
    """Each bucket takes plan_choice's plan on the predictor's fabric (one cost model): the
    bytes of a one-bucket model are that plan's over the pipelined pieces, the float32 row's
    the ring's; a plan_choice that picked another plan changes the prediction."""
    topology, numel = Topology.grid(4, 2), 5_000_000
    fabric = Fabric(10.0, 16.0, 50.0)
    prediction = pr.predict(4, 2, 10, 50, params=numel, device="cuda", codecs=["qsgd:8"])
    assert prediction.fabric == fabric
    codec = hq.get_codec("qsgd", bits=8)
    choice = plans.plan_choice(codec, topology, numel, "auto", True, fabric)
    rows = _rows(prediction)
    assert rows["qsgd:8"].plan == choice.kind
    pieces = plans.pipeline_bounds(numel, plans.DEFAULT_PIPELINE_ELEMS)
    want = sum(plan_cost(choice.kind, topology, hi - lo, codec).host_bytes for lo, hi in pieces)
    assert rows["qsgd:8"].host_bytes == pytest.approx(want)
    fp32 = {pr.RING: float32_ring(topology, numel),
            pr.HIERARCHICAL_ALLREDUCE: hierarchical_allreduce(topology, numel, 4.0)}
    assert rows["fp32"].host_bytes == pytest.approx(fp32[rows["fp32"].plan].host_bytes)


def test_a_different_plan_choice_changes_the_prediction(monkeypatch):
    """The predictor has no plan choice of its own: forcing plan_choice to the flat allgather
    shows up in its plan and bytes."""
    before = _rows(pr.predict(4, 2, 10, 50, params=5_000_000, codecs=["qsgd:8"]))["qsgd:8"]
    real = plans.plan_choice

    def flat(codec, topology, numel, gather="auto", hierarchy=False, fabric=None):
        return real(codec, topology, numel, "allgather", False, fabric)

    monkeypatch.setattr(plans, "plan_choice", flat)
    after = _rows(pr.predict(4, 2, 10, 50, params=5_000_000, codecs=["qsgd:8"]))["qsgd:8"]
    assert before.plan != after.plan == "allgather"
    assert after.host_bytes > before.host_bytes


def test_the_step_overlaps_communication_with_backward():
    """One bucket is ready only when backward ends: its wire adds to the compute. Many
    buckets: all but the last hide behind backward. Device work (encode, decode) never
    hides."""
    one, exposed = pr.step_seconds(0.3, [pr.BucketTime(0.0, 0.1, 0.0)], [100])
    assert one == pytest.approx(0.4) and exposed == pytest.approx(0.1)
    many, exposed = pr.step_seconds(0.3, [pr.BucketTime(0.0, 0.01, 0.0)] * 10, [10] * 10)
    assert many == pytest.approx(0.31) and exposed == pytest.approx(0.01)
    coded, _ = pr.step_seconds(0.3, [pr.BucketTime(0.02, 0.01, 0.03)] * 10, [10] * 10)
    assert coded == pytest.approx(0.3 + 10 * 0.05)
    # a slow link: the first bucket is ready after forward and a tenth of backward, then the
    # wire carries the ten buckets one after the other
    slow_link, _ = pr.step_seconds(0.3, [pr.BucketTime(0.0, 0.2, 0.0)] * 10, [10] * 10)
    assert slow_link == pytest.approx(0.1 + 0.02 + 10 * 0.2)


def test_cpu_codecs_share_the_cores():
    """CPU codecs run on a rank's share of its host's cores: half the cores, twice the codec
    time; the GPU rows have no cast cost in the 16-bit baseline, the CPU rows do; every row
    copies its buckets in and out (float32's only work beside compute)."""
    full = _rows(pr.predict(2, 2, 1, 100, params=8_000_000, device="cpu", codecs=["qsgd:8"],
                            cores_per_host=2))
    half = _rows(pr.predict(2, 2, 1, 100, params=8_000_000, device="cpu", codecs=["qsgd:8"],
                            cores_per_host=1))
    assert half["qsgd:8"].codec_ms == pytest.approx(2 * full["qsgd:8"].codec_ms)
    copies_ms = 2 * 8_000_000 * 4 / (pr.CPU_THROUGHPUT["copy"].encode * 1e9) * 1e3
    # each rank of the float32 ring sends 2 (n - 1) / n of the vector: the host's CPU per byte
    sent = 2 * 3 / 4 * 8_000_000 * 4
    assert full["fp32"].codec_ms == pytest.approx(
        copies_ms + sent * pr.CPU_TRANSPORT_NS * 1e-6)
    no_network_cpu = _rows(pr.predict(2, 2, 1, 100, params=8_000_000, device="cpu",
                                      codecs=["qsgd:8"], cores_per_host=2, transport_ns=0))
    assert no_network_cpu["fp32"].codec_ms == pytest.approx(copies_ms)
    assert no_network_cpu["qsgd:8"].codec_ms < full["qsgd:8"].codec_ms
    assert full["fp16"].codec_ms > full["fp32"].codec_ms - sent / 2 * pr.CPU_TRANSPORT_NS * 1e-6
    gpu = _rows(pr.predict(2, 2, 1, 100, params=8_000_000, device="cuda", codecs=["qsgd:8"]))
    assert gpu["fp16"].codec_ms == gpu["fp32"].codec_ms  # the copies: no cast on GPUs
    assert gpu["fp32"].codec_ms == pytest.approx(copies_ms * pr.CPU_THROUGHPUT["copy"].encode
                                                 / pr.GPU_THROUGHPUT["copy"].encode)
    with pytest.raises(ValueError, match="GPU ranks"):
        pr.predict(2, 2, 1, 100, params=8_000_000, device="cuda", transport_ns=0.5)


def test_a_cpu_codec_step_costs_its_overhead_beyond_its_exchanges():
    """``step_overhead_ns`` adds its CPU per gradient element to each codec row (on the rank's
    share of the cores), not to float32's or 16-bit's."""
    rows = {ns: _rows(pr.predict(2, 2, 1, 100, params=8_000_000, device="cpu",
                                 codecs=["qsgd:8"], cores_per_host=1, step_overhead_ns=ns))
            for ns in (0.0, 3.0)}
    assert rows[3.0]["qsgd:8"].codec_ms == pytest.approx(
        rows[0.0]["qsgd:8"].codec_ms + 8_000_000 * 3.0 * 1e-6 / 0.5)
    assert rows[3.0]["qsgd:8"].step_ms > rows[0.0]["qsgd:8"].step_ms
    for name in ("fp32", "fp16"):
        assert rows[3.0][name].codec_ms == rows[0.0][name].codec_ms
        assert rows[3.0][name].step_ms == rows[0.0][name].step_ms
    default = _rows(pr.predict(2, 2, 1, 100, params=8_000_000, device="cpu",
                               codecs=["qsgd:8"], cores_per_host=1))
    assert default["qsgd:8"].codec_ms == pytest.approx(
        rows[0.0]["qsgd:8"].codec_ms + 8_000_000 * pr.CPU_STEP_OVERHEAD_NS * 1e-6 / 0.5)


def test_the_builtin_throughput_tables_are_the_committed_measurements():
    """CPU: the predictor's own ``--measure`` on the development machine
    (docs/results/predict_throughput_cpu.json); GPU: qsgd's encode and decode and the copy from
    gpu_check_throughput.json at 256M, the rest from gpu_h100_256m.json, and Global-QSGD,
    standard dithering and NDQSG from gpu_h100_throughput.json at 64M (the built-in copies keep
    three or four significant figures)."""
    def table(name, elements):
        with open(os.path.join(RESULTS, name)) as f:
            results = json.load(f)["results"]
        return {(f"{r['codec']}:{r['bits']}" if r["bits"] else r["codec"]):
                (r["encode_gbps"], r["decode_gbps"], r["combine_gbps"])
                for r in results if r["elements"] == elements}

    with open(os.path.join(RESULTS, "predict_throughput_cpu.json")) as f:
        cpu = json.load(f)["assumptions"]["throughput_gbps"]
    gpu = {**table("gpu_h100_throughput.json", 1 << 26), **table("gpu_h100_256m.json", 1 << 28)}
    with open(os.path.join(RESULTS, "gpu_check_throughput.json")) as f:
        check = json.load(f)
    current = {(f"{r['codec']}:{r['bits']}", r["direction"]): r["input_gbps"]
               for r in check["results"] if r["elements"] == 1 << 28}
    for key in ("qsgd:4", "qsgd:8"):
        gpu[key] = (current[key, "encode"], current[key, "decode"], gpu[key][2])
    copy = next(c for c in check["env"]["copy"] if c["elements"] == 1 << 28)
    gpu["copy"] = (4 * copy["elements"] / copy["seconds"] / 1e9,) * 2 + (None,)
    for built_in, measured in ((pr.CPU_THROUGHPUT, cpu), (pr.GPU_THROUGHPUT, gpu)):
        assert "copy" in built_in
        for key, rate in built_in.items():
            enc, dec, comb = measured[key]
            assert rate.encode == pytest.approx(enc, rel=2e-3), key
            assert rate.decode == pytest.approx(dec, rel=2e-3), key
            assert (rate.combine is None) == (comb is None), key
            if rate.combine is not None:
                assert rate.combine == pytest.approx(comb, rel=2e-3), key
    # the CPU per byte sent: the median of the calibration runs' link calibrations
    ns = [link["calibration"]["tcp_cpu_ns_per_byte"]
          for name in ("predictor_recalibration_runs.json", "predictor_recalibration_runs_4x2.json")
          for link in json.load(open(os.path.join(RESULTS, name)))["links"]]
    assert pr.CPU_TRANSPORT_NS == pytest.approx(statistics.median(ns), abs=0.005)


def _resnet50_params() -> int:
    import torch.nn as nn

    def bottleneck(cin, mid, stride):
        out = mid * 4
        layers = [nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid),
                  nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid),
                  nn.Conv2d(mid, out, 1, bias=False), nn.BatchNorm2d(out)]
        if stride != 1 or cin != out:
            layers += [nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out)]
        return layers

    layers, cin = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)], 64
    for mid, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for b in range(blocks):
            layers += bottleneck(cin, mid, stride if b == 0 else 1)
            cin = mid * 4
    layers.append(nn.Linear(2048, 1000))
    return sum(p.numel() for p in nn.ModuleList(layers).parameters())


def _transformer_layer(d: int, ff: int, norms: int = 2, bias: bool = True) -> int:
    b = 1 if bias else 0
    return 4 * (d * d + b * d) + (d * ff + b * ff) + (ff * d + b * d) + norms * 2 * d


def test_the_model_table_matches_the_architectures():
    """Every count of the table, from the architecture (layer by layer)."""
    def gpt2(d, layers):
        return (50257 * d + 1024 * d + layers * _transformer_layer(d, 4 * d)
                + 2 * d)

    def bert(d, layers):
        return (30522 * d + 512 * d + 2 * d + 2 * d
                + layers * _transformer_layer(d, 4 * d) + d * d + d)
    vit = (3 * 768 * 16 * 16 + 768 + 768 + 197 * 768 + 12 * _transformer_layer(768, 3072)
           + 2 * 768 + 768 * 1000 + 1000)
    head = 64  # Llama 3.2 1B: 32 query heads, 8 key/value heads of 64
    llama_layer = (2 * 2048 * 2048 + 2 * 2048 * 8 * head + 3 * 2048 * 8192 + 2 * 2048)
    llama = 128256 * 2048 + 16 * llama_layer + 2048
    want = {"resnet50": _resnet50_params(), "vit-b16": vit, "bert-base": bert(768, 12),
            "bert-large": bert(1024, 24), "gpt2": gpt2(768, 12), "gpt2-medium": gpt2(1024, 24),
            "llama-1b": llama}
    assert pr.MODELS == want


@pytest.mark.parametrize("kwargs,match", [
    ({"hosts": 0}, "hosts=0 must be a positive integer"),
    ({"ranks_per_host": 1.5}, "ranks_per_host=1.5 must be a positive integer"),
    ({"link_gbit": -1}, "link_gbit=-1 must be a positive number"),
    ({"compute_ms": float("nan")}, "compute_ms=nan"),
    ({"device": "tpu"}, "device='tpu'"),
    ({"model": "alexnet"}, "unknown model 'alexnet'"),
    ({"model": "gpt2", "params": 10}, "one of the two"),
    ({"codecs": ["qsgd:x"]}, "bits 'x' is not an integer"),
    ({"codecs": ["zip:8"]}, "unknown codec 'zip'"),
    ({"codecs": ["qsgd-lin:8"]}, "qsgd takes no suffix -lin"),
    ({"intra_gbyte": 0}, "intra_gbyte=0"),
    ({"cores_per_host": 0, "device": "cpu"}, "cores_per_host=0"),
    ({"transport_ns": -1, "device": "cpu"}, "transport_ns=-1 must be 0 or a positive number"),
    ({"transport_ns": 0.5, "device": "cuda"}, "GPU ranks"),
    ({"step_overhead_ns": -1, "device": "cpu"},
     "step_overhead_ns=-1 must be 0 or a positive number"),
    ({"step_overhead_ns": 2, "device": "cuda"}, "GPU ranks' codecs run on the GPU"),
])
def test_bad_inputs_are_refused_by_name(kwargs, match):
    args = {"hosts": 2, "ranks_per_host": 2, "link_gbit": 10, "compute_ms": 100,
            "model": "resnet50" if "params" not in kwargs else None}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace("[", r"\[")):
        pr.predict(args.pop("hosts"), args.pop("ranks_per_host"), args.pop("link_gbit"),
                   args.pop("compute_ms"), **args)


def test_the_command_line_takes_the_cpu_ranks_costs():
    """``--transport-ns`` and ``--step-overhead-ns`` reach the prediction and its JSON."""
    out = subprocess.run([sys.executable, "-m", "horovod_quant.predict", "--hosts", "2",
                          "--ranks-per-host", "2", "--link-gbit", "10", "--params", "8000000",
                          "--compute-ms", "100", "--device", "cpu", "--codecs", "qsgd:8",
                          "--transport-ns", "0.25", "--step-overhead-ns", "4", "--json"],
                         capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert printed["assumptions"]["step_overhead_ns"] == 4.0
    assert printed["assumptions"]["transport_ns"] == 0.25
    expected = pr.predict(2, 2, 10, 100, params=8_000_000, device="cpu", codecs=["qsgd:8"],
                          transport_ns=0.25, step_overhead_ns=4.0)
    assert [r["step_ms"] for r in printed["rows"]] == pytest.approx(
        [r.step_ms for r in expected.rows])


def test_the_command_line_says_what_is_wrong():
    out = subprocess.run([sys.executable, "-m", "horovod_quant.predict", "--hosts", "0",
                          "--ranks-per-host", "2", "--link-gbit", "10", "--params", "100",
                          "--compute-ms", "10"], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert out.returncode == 2 and "hosts=0 must be a positive integer" in out.stderr


def test_linear_global_qsgd_limits_are_said_with_the_alternative():
    """At 64 ranks of one host each, linear 8-bit Global-QSGD has 1 level: the codec warns at
    build and the predictor says so; at 8 x 8 the hierarchical plan sums 8 host payloads (15
    levels); at 128 ranks it cannot be built, and the message names exponential levels."""
    with pytest.warns(CodecLimitWarning, match="64 workers' sum leaves 1 level"):
        hq.get_codec("global_qsgd", world_size=64, bits=8, levels="linear")
    flat = _rows(pr.predict(64, 1, 25, 100, model="gpt2", codecs=["global_qsgd-lin:8"]))
    assert "leaves 1 level" in flat["global_qsgd-lin:8"].note
    assert "levels='exponential' (115 levels" in flat["global_qsgd-lin:8"].note
    nested = _rows(pr.predict(8, 8, 25, 100, model="gpt2", codecs=["global_qsgd-lin:8"]))
    row = nested["global_qsgd-lin:8"]
    assert row.plan == "hierarchical-sum" and "host (8): 15 levels" in row.note
    big = _rows(pr.predict(128, 1, 25, 100, model="gpt2", codecs=["global_qsgd-lin:8"]))
    assert big["global_qsgd-lin:8"].plan == "cannot be built"
    assert "levels='exponential' (113 levels" in big["global_qsgd-lin:8"].note
    with warnings.catch_warnings():
        warnings.simplefilter("error", CodecLimitWarning)
        hq.get_codec("global_qsgd", world_size=8, bits=8, levels="linear")  # 15 levels: quiet
        hq.get_codec("global_qsgd", world_size=64, bits=8)  # exponential: 115 levels


def test_a_world_too_large_for_the_codec_runs_hierarchically_between_its_hosts():
    """128 ranks as 16 hosts x 8: linear 8-bit Global-QSGD cannot sum 128 payloads, so the
    door builds it for the 16 hosts, the plan choice keeps to the hierarchical plans (which
    sum one payload per host) and refuses a flat exchange, naming the hierarchy."""
    request = CodecRequest("global_qsgd", {"bits": 8, "levels": "linear"})
    codec = request.build(lambda: 128, lambda: 16)
    assert codec.world_size == 16 and codec.s == 7
    with pytest.raises(ValueError, match="needs fields of"):
        request.build(lambda: 128)  # no hosts known: the codec's own error
    topology = Topology.grid(16, 8)
    choice = plans.plan_choice(codec, topology, 1 << 20, hierarchy=True)
    assert choice.kind == "hierarchical-sum"
    with pytest.raises(ValueError, match="a flat exchange of 128 ranks combines 128"):
        plans.plan_choice(codec, topology, 1 << 20, hierarchy=False)
    with pytest.raises(ValueError, match="exchange hierarchically"):
        plans.plan_choice(codec, Topology.grid(128, 1), 1 << 20, hierarchy=True)
    row = _rows(pr.predict(16, 8, 25, 100, model="gpt2", codecs=["global_qsgd-lin:8"]))
    assert row["global_qsgd-lin:8"].plan == "hierarchical-sum"


def test_measure_times_the_codecs_here():
    """``--measure`` (CPU): positive rates for the codec and the float16 cast, which the
    prediction then uses."""
    rates = pr.measure_throughput(["qsgd:4", "global_qsgd-lin:8"], "cpu", elements=1 << 16,
                                  repeat=1)
    assert set(rates) == {"copy", "fp16", "qsgd:4", "global_qsgd-lin:8"}
    assert all(r.encode > 0 and r.decode > 0 for r in rates.values())
    assert rates["qsgd:4"].combine > 0 and rates["global_qsgd-lin:8"].combine is None
    prediction = pr.predict(2, 1, 1, 10, params=1 << 20, device="cpu", codecs=["qsgd:4"],
                            throughput=rates)
    assert prediction.throughput_source.startswith("measured here")
    assert prediction.as_json()["assumptions"]["throughput_gbps"]["copy"][0] == rates["copy"][0]


def test_measure_times_one_rank_in_the_plan_of_the_shape():
    """With a topology, ``--measure`` runs one bucket through the shape's plan as one rank
    does: a hierarchical plan's float32 shards inside the host (framed, summed in order,
    gathered) cost a rank more than its codec's kernels on one shard, so the rates fall."""
    kernels = pr.measure_throughput(["qsgd:8"], "cpu", elements=1 << 20, repeat=3)["qsgd:8"]
    hosts = pr.measure_throughput(["qsgd:8"], "cpu", elements=1 << 20, repeat=3,
                                  topology=Topology.grid(2, 4), fabric=Fabric(1.0))["qsgd:8"]
    assert hosts.encode < kernels.encode / 1.5 and hosts.combine < kernels.combine / 1.5


@pytest.mark.parametrize("hosts, local", [(2, 2), (3, 1), (2, 3), (4, 2)])
def test_the_rates_scale_by_one_rank_s_time_in_the_plan(hosts, local):
    """The rates scale by the measured time over the kernels' time of the plan (a fixed
    measurement here: the arithmetic, on shapes whose ranks do not divide the bucket
    evenly too); NDQSG, whose ranks cannot all send one rank's payload, and a codec the
    shape cannot build keep their rates."""
    topology = Topology.grid(hosts, local)
    rate = pr.Throughput(2.0, 4.0, 3.0)
    vector = np.random.default_rng(0).standard_normal(1 << 21).astype(np.float32)
    timed = []

    def one_second(fn):
        timed.append(fn())
        return 1.0

    scaled = pr._as_the_plan_runs("qsgd:8", rate, topology, Fabric(1.0), 1 << 18, vector,
                                  one_second)
    assert timed and timed[0].shape == vector[:timed[0].size].shape
    kind = pr._plan_kind(pr.build_codec("qsgd:8", topology), topology, timed[0].size,
                         Fabric(1.0))
    encode, decode = pr._codec_seconds(kind, topology, timed[0].size, rate, 1.0)
    assert scaled.encode == pytest.approx(rate.encode * (encode + decode))
    assert scaled.combine / scaled.decode == pytest.approx(rate.combine / rate.decode)
    assert pr._as_the_plan_runs("nested_dithered:8", rate, topology, Fabric(1.0), 1 << 18,
                                vector, one_second) is rate
    assert pr._as_the_plan_runs("global_qsgd-lin:4", rate, Topology.grid(16, 1), Fabric(1.0),
                                1 << 18, vector, one_second) is rate


@pytest.mark.parametrize("hosts, local", [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_calibrate_recovers_the_rates_of_timed_exchanges(hosts, local):
    """Exchanges timed as a cluster whose codecs run three times slower than their kernels
    would take them (their collectives' CPU per byte known): calibrate gives those rates
    back; a codec not timed, one the shape cannot build, one without kernels' rates, or one
    whose collectives alone take more than its CPU keeps its rates; a CPU time below zero
    and a misspelt spec are refused."""
    topology, fabric, numel, ns = Topology.grid(hosts, local), Fabric(10.0), 1 << 23, 1.7
    kernels = dict(pr.CPU_THROUGHPUT)
    timed, truth = {}, {}
    for spec in ("qsgd:8", "global_qsgd-lin:8"):
        codec = pr.build_codec(spec, topology)
        key = pr.rate_keys(spec, codec)[0]
        truth[key] = pr.Throughput(*(None if v is None else v / 3
                                     for v in pr._rate(kernels, pr.rate_keys(spec, codec),
                                                       "cpu")))
        kind = pr._plan_kind(codec, topology, numel, fabric)
        encode, decode = pr._codec_seconds(kind, topology, numel, truth[key], 1.0)
        sent = pr._pieces_cost(kind, topology, numel, codec, plans.DEFAULT_PIPELINE_ELEMS)
        timed[spec] = encode + decode + sent.rank_bytes * ns * 1e-9
    rates = pr.calibrate(kernels, timed, numel, topology, fabric, ns)
    for key, rate in truth.items():
        assert rates[key].encode == pytest.approx(rate.encode)
        assert rates[key].decode == pytest.approx(rate.decode)
    assert rates["qsgd:4"] == kernels["qsgd:4"] and rates["copy"] == kernels["copy"]
    assert pr.calibrate(kernels, {"global_qsgd-lin:4": 1.0}, numel, Topology.grid(32, 1),
                        fabric, ns) == kernels
    # the collectives alone would take more than the CPU measured: the rates stay
    assert pr.calibrate(kernels, {"qsgd:8": 1e-9}, numel, topology, fabric, ns) == kernels
    assert pr.calibrate({"copy": kernels["copy"]}, timed, numel, topology, fabric, ns) == {
        "copy": kernels["copy"]}
    with pytest.raises(ValueError, match="qsgd:8"):
        pr.calibrate(kernels, {"qsgd:8": -1.0}, numel, topology, fabric, ns)
    with pytest.raises(ValueError, match="unknown codec"):
        pr.calibrate(kernels, {"qsdg:8": 1.0}, numel, topology, fabric, ns)


def test_one_rank_of_a_plan_is_the_mean_of_equal_vectors():
    """reference.one_rank: rank 0's plan, every rank sending rank 0's payload, estimates x
    itself in the allgather and sum plans; the other plans run to the end; NDQSG's groups
    refuse it."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(1 << 16).astype(np.float32)
    topology = Topology.grid(2, 2)
    for spec, kind in (("qsgd:8", "allgather"), ("global_qsgd-lin:8", "sum")):
        out = reference.one_rank(pr.build_codec(spec, topology), x, kind, topology, 1 << 14)
        assert np.linalg.norm(out - x) < 0.1 * np.linalg.norm(x)
    for kind in ("sra", "hierarchical-allgather", "hierarchical-sra"):
        out = reference.one_rank(pr.build_codec("qsgd:8", topology), x, kind, topology)
        assert out.shape == x.shape and np.isfinite(out).all()
    with pytest.raises(ValueError):
        reference.one_rank(pr.build_codec("nested_dithered:8", topology), x, "allgather",
                           topology)


def test_the_cpu_of_a_tcp_stream_is_measured_here():
    """``--measure``'s CPU per byte of a loopback TCP stream: a fraction of a nanosecond to
    a few (every core's busy time, both ends)."""
    assert 0.01 < pr.measure_transport_ns(1 << 27) < 20


def test_the_copy_rate_and_each_suffix_s_own_speed_are_used():
    """The rows take the table's copy rate (twice as fast: float32's copies take half as long)
    and a suffixed spec's own entry before its codec's (linear Global-QSGD measured apart
    from the exponential levels)."""
    def predict(table):
        return _rows(pr.predict(2, 1, 10, 100, params=1 << 22, device="cpu",
                                codecs=["global_qsgd-lin:8", "global_qsgd:8"], throughput=table,
                                transport_ns=0))

    table = dict(pr.CPU_THROUGHPUT)
    base = predict(table)
    table["copy"] = pr.Throughput(2 * table["copy"].encode, 2 * table["copy"].decode)
    assert predict(table)["fp32"].codec_ms == pytest.approx(base["fp32"].codec_ms / 2)
    table["global_qsgd-lin:8"] = pr.Throughput(1e-3, 1e-3)
    slow = predict(table)
    assert slow["global_qsgd-lin:8"].codec_ms > 100 * slow["global_qsgd:8"].codec_ms


def test_the_committed_example_is_what_the_code_predicts():
    """docs/will-it-pay.md renders docs/results/predict_resnet50_8x8_25g.json: the predictor
    must still give it (rerun its command, docs/results/README.md, after changing the model)."""
    with open(os.path.join(RESULTS, "predict_resnet50_8x8_25g.json")) as f:
        committed = json.load(f)
    now = pr.predict(8, 8, 25, 120, model="resnet50", device="cuda").as_json()
    assert [r["name"] for r in now["rows"]] == [r["name"] for r in committed["rows"]]
    for got, want in zip(now["rows"], committed["rows"]):
        assert got["plan"] == want["plan"]
        for key in ("host_bytes", "step_ms", "vs_fp32", "vs_fp16"):
            assert got[key] == pytest.approx(want[key], rel=1e-9), (got["name"], key)


# -- the baselines' plans and --measured-ms ----------------------------------------------------
def test_each_baseline_takes_the_faster_of_its_plans():
    """4 hosts x 8 GPUs: the flat ring puts 2 x 31/32 of the gradients on each host link, the
    hierarchical allreduce 2 x 3/4; each baseline's row is its faster plan, named, and keeps
    both plans' steps. One rank per host has no hierarchy: the ring."""
    numel = 50_000_000
    prediction = pr.predict(4, 8, 25, 150, params=numel, codecs=[])
    topology = Topology.grid(4, 8)
    for row, element_bytes in zip(prediction.rows, (4.0, 2.0)):
        assert set(row.plans_ms) == {pr.RING, pr.HIERARCHICAL_ALLREDUCE}
        assert row.step_ms == min(row.plans_ms.values())
        assert row.plan == min(row.plans_ms, key=row.plans_ms.get)
        costs = {pr.RING: [ring_allreduce(topology, n, element_bytes)
                           for n in prediction.buckets],
                 pr.HIERARCHICAL_ALLREDUCE: [hierarchical_allreduce(topology, n, element_bytes)
                                             for n in prediction.buckets]}
        assert row.host_bytes == pytest.approx(sum(c.host_bytes for c in costs[row.plan]))
        ring, nested = (sum(c.host_bytes for c in costs[k]) for k in costs)
        assert ring / nested == pytest.approx((31 / 32) / (3 / 4))
        # inside the host the baseline's own elements: reduce-scatter and allgather of 7/8
        inside = costs[pr.HIERARCHICAL_ALLREDUCE][0]
        assert inside.local_bytes == pytest.approx(2 * 7 / 8 * element_bytes
                                                   * prediction.buckets[0])
    assert _rows(prediction)["fp16"].plan == pr.HIERARCHICAL_ALLREDUCE
    flat = pr.predict(4, 1, 25, 150, params=numel, codecs=[])
    assert [(r.plan, list(r.plans_ms)) for r in flat.rows] == [(pr.RING, [pr.RING])] * 2


def test_the_best_baseline_and_each_rows_gain_over_it():
    prediction = pr.predict(4, 8, 25, 150, model="gpt2-medium", codecs=["qsgd:8", "qsgd:4"])
    out = prediction.as_json()
    rows = _rows(prediction)
    best = min(("fp32", "fp16"), key=lambda n: rows[n].step_ms)
    assert out["best_baseline"] == {"name": best, "plan": rows[best].plan,
                                    "step_ms": rows[best].step_ms}
    for row in out["rows"]:
        assert row["vs_best"] == pytest.approx(rows[best].step_ms / row["step_ms"])
    assert rows[best].vs_best == 1.0 and out["calibration"] is None


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_one_host_does_not_depend_on_the_link(device):
    """No byte crosses a host: the link rate, given or not, changes nothing."""
    def rows(link):
        out = pr.predict(1, 4, link, 100, model="gpt2", device=device,
                         codecs=["global_qsgd-lin:8", "qsgd:8"]).as_json()
        return out["rows"], out["best_baseline"]

    alone = rows(None)
    assert all(rows(link) == alone for link in (1, 25, 400))
    assert pr.predict(2, 2, 1, 100, model="gpt2", device=device).rows[0].step_ms != \
        pr.predict(2, 2, 400, 100, model="gpt2", device=device).rows[0].step_ms


def test_several_hosts_need_the_link():
    with pytest.raises(ValueError, match="link_gbit: give the network's rate between the 2"):
        pr.predict(2, 2, None, 100, model="gpt2")


@pytest.mark.parametrize("baseline", ["fp32", "fp16"])
@pytest.mark.parametrize("shape", [(4, 8), (1, 8), (8, 1)])
def test_a_measured_baseline_step_scales_the_links(baseline, shape):
    """The named baseline's row is the step measured; the other rows are those of links scaled
    by the factor reported: the a priori prediction at that factor's link rate."""
    hosts, local = shape
    prior = pr.predict(hosts, local, 25, 150, model="gpt2-medium", codecs=["qsgd:8"])
    measured = 1.3 * _rows(prior)[baseline].step_ms
    fitted = pr.predict(hosts, local, 25, 150, model="gpt2-medium", codecs=["qsgd:8"],
                        measured_ms=(baseline, measured))
    assert _rows(fitted)[baseline].step_ms == pytest.approx(measured, rel=1e-6)
    calibration = fitted.as_json()["calibration"]
    scale = calibration["rate_scale"]
    assert calibration["baseline"] == baseline and 0 < scale < 1
    assert calibration["predicted_ms"] == pytest.approx(_rows(prior)[baseline].step_ms)
    assert fitted.times == prior.times.scaled(scale)
    assert any(f"--measured-ms {baseline}=" in note for note in fitted.notes)
    slower = {r.name: r.step_ms for r in fitted.rows}
    assert all(slower[r.name] >= r.step_ms for r in prior.rows)
    if hosts > 1:  # the same links given a priori: the fitted rate, NCCL's share undone
        gbit = calibration["link_gbit_reached"] / NET_EFFICIENCY
        again = pr.predict(hosts, local, gbit, 150, model="gpt2-medium", codecs=["qsgd:8"],
                           intra_gbyte=calibration["intra_gbyte_reached"])
        assert _rows(again)["qsgd:8"].step_ms == pytest.approx(slower["qsgd:8"], rel=1e-6)


@pytest.mark.parametrize("measured,match", [
    (("fp64", 300.0), "unknown baseline 'fp64'"),
    (("fp32", 0.0), r"measured_ms\['fp32'\]=0.0 must be a positive number"),
    (("fp32", -5.0), "must be a positive number"),
    (("fp32", float("nan")), "must be a positive number"),
    (("fp32", float("inf")), "must be a positive number"),
    (("fp32", 149.0), "below the compute time 150 ms"),
    (("fp16", 150.0), "below what fp16 takes on links a million times faster"),
    (("fp32", 1e12), "more than a million times slower"),
    ("fp32=300", r"give \(baseline, ms\)"),
])
def test_measured_steps_out_of_range_are_refused(measured, match):
    with pytest.raises(ValueError, match=match):
        pr.predict(4, 8, 25, 150, model="gpt2-medium", codecs=[], measured_ms=measured)


def test_one_rank_has_no_links_to_scale():
    with pytest.raises(ValueError, match="one rank exchanges nothing"):
        pr.predict(1, 1, None, 150, model="gpt2", codecs=[], measured_ms=("fp32", 200.0))


@pytest.mark.parametrize("flag,match", [("fp32", "give BASELINE=MS"),
                                        ("fp32=fast", "give BASELINE=MS"),
                                        ("bf16=200", "unknown baseline 'bf16'"),
                                        ("fp32=100", "below the compute time")])
def test_the_command_line_refuses_bad_measured_steps(flag, match):
    out = subprocess.run([sys.executable, "-m", "horovod_quant.predict", "--hosts", "2",
                          "--ranks-per-host", "2", "--link-gbit", "10", "--model", "gpt2",
                          "--compute-ms", "150", "--codecs", "qsgd:8", "--measured-ms", flag],
                         capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert out.returncode == 2 and match in out.stderr, out.stderr


def test_the_command_line_prints_what_it_scaled():
    out = subprocess.run([sys.executable, "-m", "horovod_quant.predict", "--hosts", "2",
                          "--ranks-per-host", "2", "--link-gbit", "10", "--model", "gpt2",
                          "--compute-ms", "150", "--codecs", "qsgd:8", "--measured-ms",
                          "fp32=400", "--json"],
                         capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert printed["calibration"]["measured_ms"] == 400.0
    fp32 = next(r for r in printed["rows"] if r["name"] == "fp32")
    assert fp32["step_ms"] == pytest.approx(400.0, rel=1e-6)


def test_the_command_line_needs_no_link_on_one_host():
    """One host: --link-gbit may be left out, and given changes nothing; several: required."""
    def run(*extra):
        return subprocess.run([sys.executable, "-m", "horovod_quant.predict", "--hosts", "1",
                               "--ranks-per-host", "4", "--model", "gpt2", "--compute-ms",
                               "100", "--codecs", "qsgd:8", "--json", *extra],
                              capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    alone, linked = run(), run("--link-gbit", "400")
    assert alone.returncode == 0 and linked.returncode == 0, alone.stderr + linked.stderr
    assert json.loads(alone.stdout)["rows"] == json.loads(linked.stdout)["rows"]
    several = subprocess.run([sys.executable, "-m", "horovod_quant.predict", "--hosts", "2",
                              "--ranks-per-host", "4", "--model", "gpt2", "--compute-ms", "100"],
                             capture_output=True, text=True, cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)
    assert several.returncode == 2 and "--link-gbit" in several.stderr
