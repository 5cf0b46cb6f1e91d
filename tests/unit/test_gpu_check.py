"""scripts/gpu_check.sh (make gpu-check) on a machine without a GPU: its arguments, the Horovod
build recipe applied to the real sdist, the output folder's layout and the exit status, with the
GPU tools and the slow commands replaced by stubs that record how they were called. What the
steps themselves find on a GPU is what the script's own run there shows."""
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
SDIST = Path(os.environ.get("HQ_CACHE", Path.home() / ".cache" / "horovod_quant")) / "src" / \
    "horovod-0.28.1.tar.gz"
FILES = {"gpu_check_summary.md", "gpu_check_throughput.json", "gpu_check_throughput.txt",
         "gpu_check_ncu.txt", "gpu_check_sanitizer.log", "gpu_check_tests.log",
         "gpu_check_doors.log", "gpu_check_ddp.log"}

# The interpreter the script is given: answers the GPU-bound and slow invocations itself (and
# records each in calls.jsonl), hands every other one to the real Python.
PYTHON_STUB = textwrap.dedent('''\
    #!{real}
    import json, os, sys
    from pathlib import Path
    args = sys.argv[1:]
    log = Path(os.environ["STUB_LOG"])
    def record(kind):
        with log.open("a") as f:
            f.write(json.dumps({{"kind": kind, "args": args, "cwd": os.getcwd(),
                                "env": {{k: v for k, v in os.environ.items()
                                        if k.startswith(("HOROVOD_", "CMAKE_", "HQ_"))}}}}) + "\\n")
    def value(flag):
        return args[args.index(flag) + 1]
    fail = os.environ.get("STUB_FAIL", "")
    if args == ["-"]:  # the preflight's package report
        sys.stdin.read()
        print("- Python 3.12 (stub); torch 2.11 (stub); torch CUDA 13.0")
    elif args[:2] == ["-c", "import horovod.torch"]:
        sys.exit(1)  # no Horovod: the script builds one
    elif args[:1] == ["-c"] and "compile_kernels" in args[1]:
        print("- kernels compiled: (stub)")
    elif args[:3] == ["-m", "pip", "wheel"]:
        record("pip wheel")
        src = Path.cwd()
        assert "set(CMAKE_CXX_STANDARD 17)" in (src / "horovod/torch/CMakeLists.txt").read_text()
        out = Path(value("-w"))
        out.mkdir(parents=True, exist_ok=True)
        (out / "horovod-0.28.1-cp312-cp312-linux_x86_64.whl").write_bytes(b"stub")
        print("built (stub)")
    elif args[:3] == ["-m", "pip", "install"]:
        record("pip install")
        prefix = Path(value("--target"))
        (prefix / "horovod" / "torch").mkdir(parents=True)
        (prefix / "horovod" / "__init__.py").write_text("")
        (prefix / "horovod" / "torch" / "__init__.py").write_text(
            "def gloo_built(): return True\\n")
        (prefix / "bin").mkdir()
        run = prefix / "bin" / "horovodrun"
        run.write_text("#!/bin/sh\\n"
                       "echo $(date +%s.%N) horovodrun \\"$@\\" >> \\"$STUB_LOG.horovodrun\\"\\n"
                       "exit ${{STUB_HOROVODRUN_RC:-0}}\\n")
        run.chmod(0o755)
    elif args[:2] == ["-m", "pytest"]:
        record("pytest")
        print("1 passed (stub)")
        sys.exit(1 if fail == "pytest" else 0)
    elif args[:2] == ["-m", "torch.distributed.run"]:
        record("torchrun")
    elif args and args[0] == "benchmarks/codec_throughput.py":
        record("throughput")
        import time
        time.sleep(float(os.environ.get("STUB_THROUGHPUT_SLEEP", "0")))
        Path(value("--json")).write_text(json.dumps({{"rows": []}}))
        print("a table (stub)")
    elif args and args[0] == "benchmarks/kernel_launches.py":
        record("kernel_launches")
    else:
        os.execv("{real}", ["{real}", *args])
    ''')


def _tool(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


@pytest.fixture
def stubs(tmp_path):
    """A PATH with stub GPU tools, a stub interpreter and a private cache; returns the env."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python-stub"
    python.write_text(PYTHON_STUB.format(real=sys.executable))
    python.chmod(0o755)
    _tool(bin_dir / "nvidia-smi", 'case "$1" in -L) echo "GPU 0: Stub H100";; '
                                  '*) echo "Stub H100, 81559 MiB, 580.0";; esac')
    _tool(bin_dir / "nvcc", 'echo "Cuda compilation tools, release 13.0, V13.0.0"')
    _tool(bin_dir / "ncu", 'echo "$(date +%s.%N) ncu $*" >> "$STUB_LOG.tools"; '
                           'echo "NVIDIA (R) Nsight Compute 2025.3"')
    _tool(bin_dir / "compute-sanitizer",
          'echo "sanitizer $*" >> "$STUB_LOG.tools"; echo "Version 2025.3"; '
          'echo "ERROR SUMMARY: 0 errors"')
    cache = tmp_path / "cache"
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(python),
               HQ_CACHE=str(cache), STUB_LOG=str(tmp_path / "calls.jsonl"),
               HOROVOD_SDIST=str(SDIST))
    env.pop("PYTHONPATH", None)
    return env


def _run(env, *args, out=None):
    cmd = ["bash", str(SCRIPT), *args] + (["--out", str(out)] if out else [])
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def _calls(env):
    path = Path(env["STUB_LOG"])
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_help_list_and_bad_arguments(tmp_path):
    assert _run(os.environ, "--help").returncode == 0
    listed = _run(os.environ, "--list")
    assert listed.returncode == 0
    assert {line.split()[2] for line in listed.stdout.splitlines()} == FILES - {
        "gpu_check_throughput.json"}
    bad = _run(os.environ, "--steps", "tests,warp")
    assert bad.returncode == 2 and "unknown step 'warp'" in bad.stderr
    assert _run(os.environ, "--frobnicate").returncode == 2
    a_file = tmp_path / "f"
    a_file.write_text("")
    assert _run(os.environ, out=a_file).returncode == 2


def test_preflight_stops_before_anything_runs(stubs, tmp_path):
    env = dict(stubs, HOROVOD_SDIST=str(tmp_path / "missing.tar.gz"))
    env["PATH"] = env["PATH"].split(":", 1)[1]  # no stub GPU tools either
    res = _run(env, out=tmp_path / "out")
    assert res.returncode == 2
    assert "no GPU" in res.stderr
    assert os.listdir(tmp_path / "out") == ["gpu_check_summary.md"]
    summary = (tmp_path / "out" / "gpu_check_summary.md").read_text()
    assert "no Horovod and no sdist" in summary
    assert _calls(env) == []


def test_without_the_sdist_a_run_asking_for_horovod_stops_at_the_preflight(stubs, tmp_path):
    env = dict(stubs, HOROVOD_SDIST=str(tmp_path / "missing.tar.gz"))
    for steps in ("doors2", "horovod,tests", None):  # None: every step
        out = tmp_path / f"out-{steps}"
        res = _run(env, *(["--steps", steps] if steps else []), out=out)
        assert res.returncode == 2, (steps, res.stdout + res.stderr)
        assert "make gpu-check-inputs" in res.stderr
        assert os.listdir(out) == ["gpu_check_summary.md"]
        assert _calls(env) == []
    res = _run(env, "--steps", "tests,ddp", out=tmp_path / "out")  # no Horovod step: runs
    assert res.returncode == 0, res.stdout + res.stderr


def _events(stdout: str) -> list[tuple[str, str]]:
    """(step, "start" or "end") in the order the script printed them."""
    found = []
    for line in stdout.splitlines():
        m = re.match(r"\[gpu-check +\d+s\] (\w+): (.*)", line)
        if m and m.group(1) != "output":
            found.append((m.group(1), "start" if "(deadline" in m.group(2) else "end"))
    return found


@pytest.mark.skipif(not SDIST.is_file(), reason=f"no Horovod sdist at {SDIST} "
                    "(scripts/install.sh downloads it when it builds Horovod)")
def test_every_step_runs_and_the_folder_holds_its_eight_files(stubs, tmp_path):
    out = tmp_path / "out"
    res = _run(stubs, out=out)
    assert res.returncode == 0, res.stdout + res.stderr
    assert set(os.listdir(out)) == FILES
    assert json.loads((out / "gpu_check_throughput.json").read_text())  # the benchmark's alone
    summary = (out / "gpu_check_summary.md").read_text()
    for step in ("horovod", "kernels", "throughput", "ncu", "sanitizer", "tests", "doors2x2",
                 "doors2", "ddp"):
        assert f"| {step} | ok |" in summary, summary
    # the commit is the one whose files these are, read from them (not from .git's HEAD alone)
    commit = subprocess.run([sys.executable, str(REPO / "scripts" / "source_commit.py")],
                            capture_output=True, text=True).stdout.strip()
    assert f"commit: {commit}" in summary
    # what never ran on a GPU first: the DDP hook and tests/gpu while Horovod builds, the doors
    # at 2 x 2 then at 2 once it is built; the sanitizers, the timed steps and the profiler
    # last, after all of those have ended
    events = _events(res.stdout)
    starts = [step for step, kind in events if kind == "start"]
    # (Horovod's build starts in the background as the kernels compile: either prints first)
    assert starts[0] == "preflight" and set(starts[1:3]) == {"horovod", "kernels"}, starts
    assert starts.index("kernels") < starts.index("ddp") < starts.index("tests"), starts
    assert starts.index("doors2x2") < starts.index("doors2"), starts
    last_correctness_end = max(events.index((s, "end")) for s in ("ddp", "tests", "doors2"))
    assert [s for s in starts if events.index((s, "start")) > last_correctness_end] == [
        "sanitizer", "throughput", "ncu"], events
    calls = _calls(stubs)
    build = next(c for c in calls if c["kind"] == "pip wheel")
    # the recipe: gloo only, no MPI, no TensorFlow, against the patched sdist, offline
    for flag in ("HOROVOD_WITH_GLOO", "HOROVOD_WITHOUT_MPI", "HOROVOD_WITHOUT_TENSORFLOW",
                 "HOROVOD_WITH_PYTORCH"):
        assert build["env"].get(flag) == "1", flag
    assert "--no-index" in build["args"]
    pytest_runs = [c["args"][-1] for c in calls if c["kind"] == "pytest"]
    assert pytest_runs == ["tests/gpu"]  # the ranks' pytest runs go through the launchers
    launched = Path(stubs["STUB_LOG"] + ".horovodrun").read_text().splitlines()
    assert [line.split()[3] for line in launched] == ["4", "2"]
    assert "localhost:2,127.0.0.1:2" in launched[0]
    # nothing else runs on the GPU while the timed steps do: ncu after the last door
    profiled = [float(line.split()[0]) for line in
                Path(stubs["STUB_LOG"] + ".tools").read_text().splitlines()
                if "regex:" in line]
    assert len(profiled) == 1 and float(launched[-1].split()[0]) < profiled[0]
    assert len([c for c in calls if c["kind"] == "torchrun"]) == 3  # 1 node, then 2 nodes
    tools = Path(stubs["STUB_LOG"] + ".tools").read_text()
    assert "--tool memcheck" in tools and "--tool racecheck" in tools and "ncu " in tools
    # a second run finds the cached wheel: no build
    Path(stubs["STUB_LOG"]).unlink()
    assert _run(stubs, "--steps", "horovod", out=out).returncode == 0
    assert [c["kind"] for c in _calls(stubs)] == ["pip install"]
    assert set(os.listdir(out)) == {"gpu_check_summary.md", "gpu_check_doors.log",
                                    "gpu_check_tests.log"}  # the kernels' compile log


@pytest.mark.skipif(not SDIST.is_file(), reason=f"no Horovod sdist at {SDIST}")
def test_a_failing_step_fails_the_run_and_the_others_still_run(stubs, tmp_path):
    env = dict(stubs, STUB_FAIL="pytest", STUB_HOROVODRUN_RC="1")
    out = tmp_path / "out"
    res = _run(env, "--steps", "tests,throughput,doors2x2,doors2", out=out)
    assert res.returncode == 1
    summary = (out / "gpu_check_summary.md").read_text()
    assert "| tests | FAILED (rc 1) |" in summary and "| throughput | ok |" in summary
    assert "| doors2x2 | FAILED (rc 1) |" in summary and "| horovod | ok |" in summary
    assert "| doors2 | FAILED (rc 1) |" in summary  # the first door's failure stops nothing
    assert "ncu" not in summary.split("| step |")[1]  # steps not asked for are not listed


def test_steps_past_the_budget_are_skipped_and_fail_the_run(stubs, tmp_path):
    out = tmp_path / "out"
    res = _run(dict(stubs, GPU_CHECK_BUDGET="5"), "--steps", "tests,ncu", out=out)
    assert res.returncode == 1
    summary = (out / "gpu_check_summary.md").read_text()
    assert "| preflight | ok |" in summary
    assert "| tests | skipped (the 5s budget was spent) |" in summary
    assert "| ncu | skipped (the 5s budget was spent) |" in summary


def test_each_row_is_written_when_its_step_ends_and_a_stopped_run_keeps_them(stubs, tmp_path):
    out = tmp_path / "out"
    summary = out / "gpu_check_summary.md"
    cmd = ["bash", str(SCRIPT), "--steps", "ddp,tests,throughput", "--out", str(out)]
    proc = subprocess.Popen(cmd, env=dict(stubs, STUB_THROUGHPUT_SLEEP="60"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        calls = Path(stubs["STUB_LOG"])
        deadline = 60
        while deadline > 0 and not (calls.exists() and '"throughput"' in calls.read_text()):
            subprocess.run(["sleep", "0.5"])
            deadline -= 0.5
        assert deadline > 0, "the throughput step never started"
        text = summary.read_text()
        for step in ("preflight", "kernels", "ddp", "tests"):
            assert f"| {step} | ok |" in text, text
        assert "| throughput |" not in text  # still running
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # stopped from outside, as a lease's end stops it
        proc.wait()
    table = summary.read_text().split("| step |")[1].splitlines()
    assert [row.split("|")[1].strip() for row in table[2:] if row.startswith("|")] == [
        "preflight", "kernels", "ddp", "tests"]


def test_the_horovod_patches_apply_to_the_sdist(tmp_path):
    if not SDIST.is_file():
        pytest.skip(f"no Horovod sdist at {SDIST}")
    with tarfile.open(SDIST) as tar:
        tar.extractall(tmp_path, filter="data")
    src = tmp_path / "horovod-0.28.1"
    script = (f'say() {{ :; }}; die() {{ echo "$*" >&2; exit 1; }}; '
              f'source {REPO}/scripts/horovod_build.sh; horovod_patch_source {src}')
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "distutils" not in (src / "horovod/torch/CMakeLists.txt").read_text()
    assert "xla_mpi_ops" not in (src / "horovod/tensorflow/CMakeLists.txt").read_text()
    again = subprocess.run(["bash", "-c", script], capture_output=True, text=True)
    assert again.returncode != 0 and "expected one occurrence" in again.stderr
