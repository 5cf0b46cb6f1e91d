"""scripts/gpu_check.sh's GPU_CHECK_STEPS (the GPU image sets it: no Nsight Compute there): the
steps it names run without --steps, and the preflight notes only the tools of the steps that
run; a missing tool fails its own step, not the run before it starts. The stubs (a GPU, an
interpreter, the tools) are those of test_gpu_check.py."""
import os
from pathlib import Path

from test_gpu_check import _run, stubs  # noqa: F401  (stubs is a fixture)


def _without_tools(env, *names):
    """env with the stub folder's copy of each named tool removed."""
    bin_dir = Path(env["PATH"].split(":", 1)[0])
    for name in names:
        (bin_dir / name).unlink()
    return env


def test_the_environments_steps_run_and_need_only_their_tools(stubs, tmp_path):  # noqa: F811
    env = dict(_without_tools(stubs, "ncu", "compute-sanitizer"),
               GPU_CHECK_STEPS="throughput,tests")
    out = tmp_path / "out"
    res = _run(env, out=out)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = (out / "gpu_check_summary.md").read_text()
    assert "| throughput | ok |" in summary and "| tests | ok |" in summary
    table = summary.split("| step |")[1]
    assert "| ncu |" not in table and "| sanitizer |" not in table
    assert not os.path.exists(stubs["STUB_LOG"] + ".tools")  # neither tool was called


def test_a_step_asked_for_without_its_tool_fails_only_that_step(stubs, tmp_path):  # noqa: F811
    env = dict(_without_tools(stubs, "ncu"), GPU_CHECK_STEPS="throughput,tests")
    out = tmp_path / "out"
    res = _run(env, "--steps", "ncu,tests", out=out)
    assert res.returncode == 1, res.stdout + res.stderr
    summary = (out / "gpu_check_summary.md").read_text()
    assert "ncu is not on PATH: its step will fail" in summary
    table = summary.split("| step |")[1]
    assert "| tests | ok |" in table
    assert "| ncu | ok |" not in table and "| ncu |" in table
