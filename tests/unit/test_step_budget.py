"""benchmarks/step_budget.py: a sample goes to the part of the step its innermost frame names;
rank 0's main thread only, the sampler's own attach left out; the parts split the measured
step, and the limit is max(compute-only step, float32's communication x b/32)."""
from __future__ import annotations

import pytest
from benchmark_module import load_benchmark

sb = load_benchmark("step_budget")


@pytest.mark.parametrize("frame, part", [
    ("wait (horovod_quant/exchange/job_end.py:275)", "wait"),
    ("wait_until_done (horovod_quant/torch/collectives.py:41)", "wait"),
    ("NumbaBackend.encode (horovod_quant/backends/numba/__init__.py:61)", "encode"),
    ("NumbaBackend.combine_levels (horovod_quant/backends/numba/__init__.py:76)",
     "decode and combine"),
    ("GradientExchanger._copy_means_back (horovod_quant/torch/exchanger.py:256)", "copies"),
    ("frames (horovod_quant/exchange/wire.py:57)", "framing"),
    ("ProcessGroupCollectives.allgather_async.<locals>.result (horovod_quant/torch/"
     "distributed.py:249)", "framing"),
    ("_engine_run_backward (torch/autograd/graph.py:979)", "compute"),
    ("_single_tensor_sgd (torch/optim/sgd.py:364)", "compute"),
    ("CodecStates.of (horovod_quant/exchange/codec_states.py:33)", "rest"),
])
def test_a_sample_goes_to_the_part_its_innermost_frame_names(frame, part):
    assert sb.classify(frame) == part


def test_the_parts_split_the_step_from_the_main_thread_only(tmp_path):
    stacks = tmp_path / "t-mlp48-qsgd:4.txt"
    stacks.write_text(
        "thread (1): MainThread;<module> (w.py:1);SampledSteps.__init__ (w.py:490) 40\n"
        "thread (1): MainThread;<module> (w.py:1);_engine_run_backward (torch/autograd/g.py:9) 30\n"
        "thread (1): MainThread;<module> (w.py:1);NumbaBackend.encode (hq/b.py:61) 10\n"
        "thread (1): MainThread;<module> (w.py:1);wait (hq/job_end.py:275) 60\n"
        "thread (2): horovod_quant-job-end;wait (threading.py:320) 500\n")
    parts, skipped = sb.main_thread_parts(str(stacks))
    assert skipped == 40 and parts == {"compute": 30, "encode": 10, "wait": 60}
    cpu = {"ranks_cpu_s_per_step": 0.3, "ranks_main_thread_cpu_s_per_step": 0.2,
           "other_load_cores": 0.1}
    rows = {"compute": {"step_s": 0.1, **cpu}, "fp32": {"step_s": 0.74, **cpu},
            "qsgd:4": {"step_s": 0.2, "encode_s": 0.01, **cpu}}
    for rid in ("compute", "fp32"):
        (tmp_path / f"t-mlp48-{rid}.txt").write_text("")
    (row,) = [b for b in sb.budget(rows, str(tmp_path)) if b["row"] == "qsgd:4"]
    assert row["parts_ms"]["wait"] == pytest.approx(120.0)
    assert sum(row["parts_ms"].values()) == pytest.approx(200.0)
    assert row["limit_ms"] == pytest.approx(100.0)  # the compute floor beats 640 ms x 4/32
    assert row["fraction_of_limit"] == pytest.approx(0.5)
    assert row["timers_ms"]["encode"] == pytest.approx(10.0)
    assert row["main_thread_cpu_ms"] == pytest.approx(100.0)  # per rank, of 2
    assert row["other_threads_cpu_ms"] == pytest.approx(50.0)
