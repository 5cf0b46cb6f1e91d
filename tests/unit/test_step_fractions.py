"""benchmarks/step_fractions.py: a row's limit is max(compute-only step, float32's communication
x b/32) and its fraction limit / step; the targets take each width's fastest codec row (never
the baselines) and compare 8 with 4 bits by half the wire time 4 bits remove."""
from __future__ import annotations

import pytest
from benchmark_module import load_benchmark

sf = load_benchmark("step_fractions")


def test_limits_fractions_and_targets():
    # compute 100 ms, float32 740 ms: 640 ms of communication; 8 bits 160 ms, 4 bits 80
    door = sf.door_rows({"fp32": 740.0, "fp16": 500.0, "qsgd:8": 200.0, "natural:8": 170.0,
                         "qsgd:4": 125.0, "natural:4": 150.0}, 100.0)
    rows = {r["config"]: r for r in door["rows"]}
    assert rows["fp16"]["limit_ms"] == pytest.approx(320.0)
    assert rows["natural:8"]["fraction"] == pytest.approx(160.0 / 170.0)
    assert rows["qsgd:4"]["limit_ms"] == pytest.approx(100.0)  # the compute floor
    targets = door["targets"]
    assert targets["best 8-bit >= 0.85"] == {"row": "natural:8",
                                             "value": round(160 / 170, 3), "met": True}
    assert targets["best 4-bit >= 0.85"]["row"] == "qsgd:4"
    assert targets["best 4-bit >= 0.85"]["met"] is False  # 100 / 125 = 0.8
    saved = targets["4-bit saves >= half the wire time it removes"]
    assert saved["value"] == "45 of 80 ms" and saved["met"] is True


def test_a_door_without_4_bit_rows_has_no_comparison():
    door = sf.door_rows({"fp32": 740.0, "qsgd:8": 200.0}, 100.0)
    assert door["targets"]["best 4-bit >= 0.85"] is None
    assert "4-bit saves >= half the wire time it removes" not in door["targets"]
