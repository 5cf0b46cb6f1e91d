"""benchmarks/validate_predictor.py: the comparison of predicted and measured steps passes on
runs that agree with the predictor and fails when one term of the model is broken on purpose."""
from __future__ import annotations

import json
import os

import pytest
from benchmark_module import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
vp = load_benchmark("validate_predictor")

SHAPES = [(2, 1), (2, 2), (4, 1), (4, 2)]
CODECS = ["qsgd:8", "qsgd:4", "global_qsgd-lin:8"]


def _run(rate_gbit: float, wobble: float = 0.05, throughput: dict | None = None,
         transport_ns: float | None = None, in_plans: dict | None = None,
         step_overhead_ns: float | None = None) -> dict:
    """A cluster.py JSON whose training rows measured what the predictor says (Horovod's rows:
    its default plan, the flat ring), give or take
    ``wobble`` (alternating signs: a measurement's scatter), on 2 cores; with ``throughput``
    (spec -> :class:`Throughput`), the codec speed the run measured and records; with
    ``transport_ns``, the CPU per byte its links' calibration measured; with ``in_plans``,
    the codec speed measured per link in its shape's plans (which the steps then follow);
    with ``step_overhead_ns`` (default: the predictor's), the codecs' CPU beyond their
    exchanges, which the rows' recorded CPU (the ranks' per step) holds beside the predicted
    exchanges'."""
    links = []
    for k, (hosts, per_host) in enumerate(SHAPES):
        results, sign = [], 1
        for model, params, compute_s in (("resnet18", 11_173_962, 0.4),
                                         ("gpt25", 25_239_552, 0.3)):
            inputs = dict(params=params, device="cpu", codecs=CODECS,
                          cores_per_host=2 / hosts, throughput=in_plans or throughput,
                          transport_ns=transport_ns)
            prediction = vp.predictor.predict(hosts, per_host, rate_gbit, compute_s * 1e3,
                                              step_overhead_ns=step_overhead_ns, **inputs)
            exchanges = vp.predictor.predict(hosts, per_host, rate_gbit, compute_s * 1e3,
                                             step_overhead_ns=0.0, **inputs)
            results.append({"kind": "train", "model": model, "config_id": "compute",
                            "door": "compute", "step_median_s": compute_s,
                            "model_params": params, "other_load_cores": 0.01,
                            "ranks_cpu_s_per_step": 2 * compute_s})
            for row, alone in zip(prediction.rows, exchanges.rows):
                sign = -sign
                beyond = (0.0 if row.name in ("fp32", "fp16")
                          else prediction.step_overhead_ns)
                rank_cpu_s = alone.codec_ms * prediction.core_share / 1e3 + params * beyond / 1e9
                results.append({"kind": "train", "model": model, "config_id": row.name,
                                "door": "horovod" if row.name in ("fp32", "fp16") else "hq",
                                "step_median_s": row.plans_ms.get(vp.predictor.RING,
                                                                  row.step_ms)
                                / 1e3 * (1 + sign * wobble),
                                "model_params": params, "other_load_cores": 0.01,
                                "ranks_cpu_s_per_step": 2 * compute_s
                                + hosts * per_host * rank_cpu_s})
        calibration = {"tcp_gbit_s": rate_gbit}
        if transport_ns is not None:
            calibration["tcp_cpu_ns_per_byte"] = transport_ns
        links.append({"hosts": hosts, "ranks_per_host": per_host, "rate_bps": rate_gbit * 1e9,
                      "calibration": calibration, "results": results,
                      "codec_throughput": in_plans and {k: list(v) for k, v in
                                                        in_plans.items()}})
    machine = {"cpus": 2, "loadavg_before": "0.10 0.20 0.30", "loadavg_after": "0.90 0.80 0.50"}
    if throughput is not None:
        machine["codec_throughput"] = {k: list(v) for k, v in throughput.items()}
    return {"machine": machine, "links": links}


RUNS = [_run(1.0), _run(10.0)]


def test_runs_that_agree_with_the_predictor_pass():
    rows = vp.compare(RUNS)
    summary = vp.summarize(rows)
    assert summary["passed"] and summary["median_abs_error"] == pytest.approx(0.05, rel=0.01)
    # every shape, both links, both models, fp32 and every codec counted; fp16 listed apart
    assert summary["rows"] == 2 * len(SHAPES) * 2 * (1 + len(CODECS))
    assert {r["config"] for r in rows if not r["counted"]} == {"fp16"}
    assert all(r["loadavg_before_after"] == ("0.10 0.20 0.30", "0.90 0.80 0.50") for r in rows)


def test_a_doubled_link_term_fails_the_comparison():
    """The link's bytes taking twice their time (the link rate halved, nothing else) moves
    the communication-bound rows by far more than the limits."""
    def doubled_link(hosts, per_host, gbit, compute_ms, **kwargs):
        return vp.predictor.predict(hosts, per_host, gbit / 2, compute_ms, **kwargs)

    summary = vp.summarize(vp.compare(RUNS, predict=doubled_link))
    assert not summary["passed"] and summary["max_abs_error"] > vp.MAX_ERROR


def test_a_forgotten_codec_term_fails_the_comparison():
    """Codecs that cost nothing (the encode and decode term dropped) fail too."""
    free = {k: vp.predictor.Throughput(1e9, 1e9, 1e9) for k in vp.predictor.CPU_THROUGHPUT}

    def no_codec_time(*args, **kwargs):
        return vp.predictor.predict(*args, **dict(kwargs, throughput=free))

    assert not vp.summarize(vp.compare(RUNS, predict=no_codec_time))["passed"]


def test_the_codec_speed_is_the_one_measured_with_the_runs():
    """A run on a machine whose codecs are five times slower than the built-in table records
    their speed (cluster.py's ``machine.codec_throughput``): compared with it, the rows pass;
    with the built-in table in its place they would not."""
    slow = {k: vp.predictor.Throughput(*(None if v is None else v / 5 for v in rate))
            for k, rate in vp.predictor.CPU_THROUGHPUT.items()}
    run = _run(1.0, throughput=slow)
    assert vp.summarize(vp.compare([run]))["passed"]
    del run["machine"]["codec_throughput"]
    assert not vp.summarize(vp.compare([run]))["passed"]


def test_each_link_s_own_measurements_are_used():
    """The CPU per byte a link's calibration measured, and the codec speed measured in a
    link's plans, are the ones its rows are predicted with: without them (the default CPU
    per byte; the machine's kernel speed) the same rows fail."""
    run = _run(1.0, transport_ns=6.0)
    assert vp.summarize(vp.compare([run]))["passed"]
    for link in run["links"]:
        del link["calibration"]["tcp_cpu_ns_per_byte"]
    assert not vp.summarize(vp.compare([run]))["passed"]
    slow = {k: vp.predictor.Throughput(*(None if v is None else v / 5 for v in rate))
            for k, rate in vp.predictor.CPU_THROUGHPUT.items()}
    run = _run(1.0, throughput=dict(vp.predictor.CPU_THROUGHPUT), in_plans=slow)
    assert vp.summarize(vp.compare([run]))["passed"]
    for link in run["links"]:
        link["codec_throughput"] = None
    assert not vp.summarize(vp.compare([run]))["passed"]


def _exchange_rows(hosts: int, per_host: int, gbit: float, rates: dict,
                   transport_ns: float, size_mb: float = 32.0) -> list[dict]:
    """cluster.py's exchange rows of a cluster whose codecs run at ``rates`` in their plans
    and whose collectives cost ``transport_ns`` of CPU per byte a rank sends; beside them
    rows that must not calibrate anything: the baselines', a codec's handed to float32 by
    the fallback, one whose CPU came out below zero, and another size's."""
    pr, topology = vp.predictor, vp.Topology.grid(hosts, per_host)
    numel, fabric = int(size_mb * vp.MB) // 4, vp.predictor.cluster_fabric("cpu", gbit)
    rows = [{"kind": "exchange", "config_id": "fp32", "size_mb": size_mb, "cpu_s": 9.0},
            {"kind": "exchange", "config_id": "fp16", "size_mb": size_mb, "cpu_s": 9.0},
            {"kind": "exchange", "config_id": "qsgd:4", "size_mb": size_mb, "cpu_s": 9.0,
             "fallback": True},
            {"kind": "exchange", "config_id": "qsgd:4", "size_mb": size_mb, "cpu_s": -0.01},
            {"kind": "exchange", "config_id": "qsgd:8", "size_mb": 4 * size_mb, "cpu_s": 9.0}]
    for spec in CODECS:
        codec = pr.build_codec(spec, topology)
        kind = pr._plan_kind(codec, topology, numel, fabric)
        encode, decode = pr._codec_seconds(kind, topology, numel,
                                           pr._rate(rates, pr.rate_keys(spec, codec), "cpu"),
                                           1.0)
        sent = pr._pieces_cost(kind, topology, numel, codec, pr.plans.DEFAULT_PIPELINE_ELEMS)
        rows.append({"kind": "exchange", "config_id": spec, "size_mb": size_mb,
                     "cpu_s": encode + decode + sent.rank_bytes * transport_ns * 1e-9})
    return rows


def test_exchanges_timed_by_the_ranks_calibrate_the_codec_speed():
    """Where the run's ranks timed one bucket's exchange per codec, the codec rows are
    predicted with the speed those exchanges give (the link's per-plan speed left out
    here): they pass; without the exchange rows the same rows fail."""
    slow = {k: vp.predictor.Throughput(*(None if v is None else v / 5 for v in rate))
            for k, rate in vp.predictor.CPU_THROUGHPUT.items()}
    run = _run(1.0, throughput=dict(vp.predictor.CPU_THROUGHPUT), in_plans=slow,
               transport_ns=4.0)
    for link in run["links"]:
        link["codec_throughput"] = None
        link["results"] += _exchange_rows(link["hosts"], link["ranks_per_host"], 1.0, slow,
                                          4.0)
    rows = vp.compare([run])
    assert vp.summarize(rows)["passed"]
    assert {r["codec_speed"] for r in rows if r["config"] not in vp.BASELINES} == {"exchanges"}
    assert vp.exchange_cpu(run["links"][0])[1].keys() == set(CODECS)
    for link in run["links"]:
        link["results"] = [r for r in link["results"] if r["kind"] != "exchange"]
    assert not vp.summarize(vp.compare([run]))["passed"]


def test_the_cpu_beyond_the_exchanges_is_what_the_rows_recorded():
    """Runs whose codec rows each burned 6 ns per gradient element beyond their exchanges
    give 6 (:func:`step_overhead_ns`), whatever CPU the baselines burned beyond their model;
    predicted without the term (forgotten) the same rows fail. The rows keep the predictor's
    term and both CPU figures."""
    runs = [_run(1.0, step_overhead_ns=6.0), _run(10.0, step_overhead_ns=6.0)]
    assert vp.step_overhead_ns(runs) == pytest.approx(6.0)
    assert vp.step_overhead_ns([_run(1.0)]) == pytest.approx(vp.predictor.CPU_STEP_OVERHEAD_NS)
    rows = vp.compare(runs)
    assert {r["step_overhead_ns"] for r in rows} == {vp.predictor.CPU_STEP_OVERHEAD_NS}
    assert all(r["cpu_over_compute_ms"] > r["predicted_cpu_ms"] > 0 for r in rows
               if r["config"] in CODECS)
    forgotten = vp.compare(runs, predict=lambda *a, **k: vp.predictor.predict(
        *a, **dict(k, step_overhead_ns=0.0)))
    assert not vp.summarize(forgotten)["passed"]
    for link in runs[1]["links"]:  # baselines outnumber the codecs, with CPU of their own
        link["results"] = [r for r in link["results"]
                           if r["config_id"] in ("compute", "fp32", "fp16", "qsgd:8")]
        for row in link["results"]:
            if row["config_id"] in ("fp32", "fp16"):
                row["ranks_cpu_s_per_step"] += 1.0
    assert vp.step_overhead_ns(runs[1:]) == pytest.approx(6.0)
    for link in runs[0]["links"]:  # runs without the ranks' CPU give no figure
        for row in link["results"]:
            del row["ranks_cpu_s_per_step"]
    assert vp.step_overhead_ns(runs[:1]) is None


def test_the_predictor_s_step_overhead_is_the_calibration_runs_figure():
    """The predictor's default ``step_overhead_ns`` is what the committed calibration runs give;
    the validation table is made of other runs."""
    runs = []
    for name in ("predictor_recalibration_runs.json", "predictor_recalibration_runs_4x2.json"):
        with open(os.path.join(ROOT, "docs", "results", name)) as f:
            runs.append(json.load(f))
    assert vp.predictor.CPU_STEP_OVERHEAD_NS == pytest.approx(vp.step_overhead_ns(runs),
                                                              abs=0.005)
    with open(os.path.join(ROOT, "docs", "results", "predictor_validation.json")) as f:
        assert not {os.path.basename(p) for p in json.load(f)["inputs"]} & {
            "predictor_recalibration_runs.json", "predictor_recalibration_runs_4x2.json"}


def test_the_command_writes_its_table_and_fails_on_large_errors(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(_run(1.0, wobble=0.5)))
    assert vp.main([str(path), "--out", str(tmp_path / "v")]) == 1
    assert "failed" in (tmp_path / "v.md").read_text()
    assert json.loads((tmp_path / "v.json").read_text())["summary"]["passed"] is False
    path.write_text(json.dumps(_run(1.0)))
    assert vp.main([str(path)]) == 0


def test_rows_whose_rounds_disagree_are_counted_among_the_misses():
    """A miss whose own rounds (or its compute row's) differ by more than the limit is
    counted apart; a miss measured the same in every round is not."""
    run = _run(1.0)
    link = run["links"][0]
    compute = next(r for r in link["results"] if r["config_id"] == "compute")
    compute["rounds"] = [{"step_s": 0.4}, {"step_s": 0.44}]
    misses = [r for r in link["results"] if r["config_id"] in ("fp32", "qsgd:8")
              and r["model"] == compute["model"]]
    for row, rounds in zip(misses, ([1.0, 1.5], [1.0, 1.1])):
        row["step_median_s"] *= 2  # predicted -50%
        row["rounds"] = [{"step_s": s} for s in rounds]
    rows = vp.compare([run])
    by_config = {r["config"]: r for r in rows if r["shape"] == "2x1"
                 and r["model"] == compute["model"]}
    assert by_config["fp32"]["rounds_spread"] == pytest.approx(0.5)
    assert by_config["qsgd:8"]["compute_rounds_spread"] == pytest.approx(0.1)
    assert by_config["qsgd:4"]["rounds_spread"] is None
    summary = vp.summarize(rows)
    assert summary["over_max_error"] == 2 and summary["over_max_error_unrepeatable"] == 1
    assert "2 rows over 30%; in 1 of them" in vp.table(rows, summary)
