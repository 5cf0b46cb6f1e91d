"""benchmarks/validate_external.py: setups that measured what the predictor says pass; a
measured step the model does not explain fails the limits; the committed inputs cite a source
for every row and the committed output is what the code computes from them."""
from __future__ import annotations

import copy
import json
import os

import pytest
from benchmark_module import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ve = load_benchmark("validate_external")
RESULTS = os.path.join(ROOT, "docs", "results")


def _setup(setup_id: str, hosts: int, per_host: int, link: float | None, compute_ms: float | None,
           scale: float = 0.5, wobble: float = 0.0) -> dict:
    """A setup whose throughputs are those the predictor gives at links ``scale`` times the
    stated ones (the baseline measured there), the codec's off by ``wobble``."""
    at = 100.0 if compute_ms is None else compute_ms
    numel, one_gpu = 20_000_000, 400.0
    times = dict(params=numel, codecs=["qsgd:8"], intra_gbyte=20.0 * scale)
    truth = {r.name: r for r in ve.predictor.predict(
        hosts, per_host, None if link is None else link * scale, at, **times).rows}
    ideal = hosts * per_host * one_gpu
    return {"id": setup_id, "source": "s", "hosts": hosts, "ranks_per_host": per_host,
            "link_gbit": link, "intra_gbyte": 20.0, "params": numel, "one_gpu": one_gpu,
            "baseline": {"config": "fp32", "system": "allreduce",
                         "throughput": ideal * at / truth["fp32"].step_ms},
            "codecs": [{"config": "qsgd:8", "system": "a codec", "throughput":
                        ideal * at / (truth["qsgd:8"].step_ms * (1 + wobble))}],
            "compute_ms": compute_ms}


def _inputs(*setups: dict) -> dict:
    return {"sources": {"s": {"title": "S: a source", "counted": True}}, "setups": list(setups)}


def test_steps_follow_weak_scaling():
    setup = _setup("a", 2, 4, 10.0, 100.0)
    base, codecs = ve.measured_steps(setup, 50.0)
    ideal = 8 * setup["one_gpu"]
    assert base == pytest.approx(50.0 * ideal / setup["baseline"]["throughput"])
    assert codecs["qsgd:8"] == pytest.approx(50.0 * ideal / setup["codecs"][0]["throughput"])


def test_setups_that_measured_the_model_pass_and_a_slower_codec_fails(tmp_path):
    """Throughputs the predictor gives on links half as fast: told the baseline's step, the
    codec row comes back (the plans are still chosen on the stated links, and the compute
    grid's other times keep the device's fixed costs: within 1% and 5%), a priori it does not;
    a codec 60% slower fails."""
    good = _inputs(_setup("multi", 4, 2, 10.0, 120.0), _setup("one", 1, 4, None, None))
    rows = ve.compare(good)
    assert [r["id"] for r in rows] == ["multi", "one"]
    assert abs(rows[0]["error"]) < 0.01 and abs(rows[1]["error"]) < 0.05
    assert rows[0]["rate_scale"] == pytest.approx(0.5, rel=0.02)
    assert rows[0]["a_priori_error"] < -0.05
    assert rows[1]["compute_grid_ms"] == list(ve.COMPUTE_GRID_MS)
    assert ve.summarize(rows)["passed"]
    path = tmp_path / "in.json"
    path.write_text(json.dumps(good))
    assert ve.main([str(path), "--out", str(tmp_path / "v")]) == 0
    bad = _inputs(_setup("multi", 4, 2, 10.0, 120.0, wobble=0.6))
    path.write_text(json.dumps(bad))
    assert ve.main([str(path), "--out", str(tmp_path / "v")]) == 1
    written = json.loads((tmp_path / "v.json").read_text())
    assert written["summary"]["over_limit"] == ["multi qsgd:8"]
    assert "failed" in (tmp_path / "v.md").read_text()


def test_a_row_below_its_floor_stays_out_of_the_limits():
    """A counted source's row measured faster than its link can carry its bytes: reported,
    and the statistic with it, but not held to the limits."""
    setup = _setup("multi", 4, 2, 10.0, 120.0)
    fast = copy.deepcopy(setup)
    fast["id"] = "fast"
    fast["codecs"][0]["throughput"] *= 10
    summary = ve.summarize(ve.compare(_inputs(setup, fast)))
    assert summary["passed"] and summary["counted"]["rows"] == 1
    assert summary["with_below_floor"]["rows"] == 2
    assert summary["with_below_floor"]["max_abs_error"] > 0.35


def test_rows_not_counted_stay_out_of_the_limits():
    inputs = _inputs(_setup("multi", 4, 2, 10.0, 120.0))
    inputs["sources"]["t"] = {"title": "T: another", "counted": False}
    other = _setup("other", 4, 1, 10.0, 120.0, wobble=2.0)
    other["source"] = "t"
    inputs["setups"].append(other)
    summary = ve.summarize(ve.compare(inputs))
    assert summary["passed"] and summary["counted"]["rows"] == 1
    assert summary["all"]["max_abs_error"] > 0.6
    assert summary["rows_per_source"] == {"s": 1, "t": 1}


def test_a_step_below_what_its_link_carries_is_flagged():
    """The floor: forward, then the busiest host's bytes at the stated line rate."""
    setup = _setup("multi", 4, 2, 10.0, 120.0)
    row = ve.compare(_inputs(setup))[0]
    host_bytes = {r.name: r for r in ve.predictor.predict(
        4, 2, 10.0, 120.0, params=setup["params"], codecs=["qsgd:8"],
        intra_gbyte=20.0).rows}["qsgd:8"].host_bytes
    assert row["floor_ms"] == pytest.approx(
        120.0 * (1 - ve.predictor.BACKWARD_SHARE) + host_bytes * 8 / 10e9 * 1e3)
    assert not row["below_floor"]
    fast = copy.deepcopy(setup)
    fast["codecs"][0]["throughput"] *= 10
    assert ve.compare(_inputs(fast))[0]["below_floor"]
    assert ve.floor_ms(_setup("one", 1, 4, None, 100.0), 100.0, 0.0) is None


def test_the_committed_inputs_cite_every_row():
    with open(os.path.join(RESULTS, "external_measurements.json")) as f:
        inputs = json.load(f)
    sources = inputs["sources"]
    assert len(sources) >= 3
    for source in sources.values():
        assert source["title"] and source["url"] and source["setup"] and source["files"]
    codec_rows = 0
    for setup in inputs["setups"]:
        assert setup["source"] in sources and setup["where"] and setup["assumptions"]
        assert setup["baseline"]["throughput"] > 0 and setup["one_gpu"] > 0
        codec_rows += len(setup["codecs"])
    assert codec_rows >= 20


def test_the_committed_validation_is_what_the_code_computes():
    """docs/results/predictor_external.json: rerun its command (docs/results/README.md) after
    changing the model or the inputs."""
    with open(os.path.join(RESULTS, "external_measurements.json")) as f:
        rows = ve.compare(json.load(f))
    with open(os.path.join(RESULTS, "predictor_external.json")) as f:
        committed = json.load(f)
    assert [(r["id"], r["config"]) for r in rows] == [
        (r["id"], r["config"]) for r in committed["rows"]]
    for got, want in zip(rows, committed["rows"]):
        for key in ("error", "a_priori_error", "fitted_ms", "measured_ms"):
            assert got[key] == pytest.approx(want[key], rel=1e-9), (got["id"], key)
    assert ve.summarize(rows) == committed["summary"]
