"""examples/: every script takes --device cpu|cuda and shows a CUDA launch line in its header;
examples/ddp_train.py trains under torchrun (the torchrun-only user's path), its ranks ending
with status 0 and without OutOfStep (they ran the same steps), and leaves its warm-up steps out
of the step time; asking for CUDA where torch sees none is an error that
says so. What the scripts do on a GPU is the GPU runs' to show (docs/dev/gpu.md)."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.py"))


def _device_choices(path: Path):
    """The choices of the script's --device option, or None when it has none."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
                and node.args and getattr(node.args[0], "value", None) == "--device"):
            choices = next(k.value for k in node.keywords if k.arg == "choices")
            return tuple(ast.literal_eval(choices))
    return None


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_runs_on_cpu_or_cuda_from_its_flags(path):
    assert _device_choices(path) == ("cpu", "cuda"), path.name
    header = ast.get_docstring(ast.parse(path.read_text()))
    launches = [line.strip() for line in header.splitlines()
                if "examples/" + path.name in line and ("horovodrun" in line or
                                                        "torchrun" in line or "mpirun" in line)]
    assert launches and any("--device cuda" in line for line in launches), header


def _torchrun(*args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", str(REPO / "examples" / "ddp_train.py"),
                           *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_ddp_train_trains_under_torchrun_and_times_after_its_warmup(tmp_path):
    out = tmp_path / "rows.json"
    res = _torchrun("--codecs", "allreduce qsgd:8", "--steps", "12", "--warmup", "4",
                    "--json", str(out))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    # ranks that ran the same steps agree at the job's end (tests/unit/test_uneven_steps.py
    # checks the uneven case): status 0 above, and no OutOfStep on any rank
    assert "OutOfStep" not in res.stdout + res.stderr, res.stdout[-2000:] + res.stderr[-2000:]
    table = json.loads(out.read_text())
    assert table["warmup"] == 4 and table["device"] == "cpu" and table["world"] == 2
    rows = {r["codec"]: r for r in table["rows"]}
    assert rows["qsgd:8"]["ratio"] > 3.5 and rows["allreduce"]["ratio"] == 1.0
    assert all(r["step_ms"] > 0 and r["test_accuracy"] > 0.2 for r in rows.values())
    assert "step ms: the steps after the first 4" in res.stdout


def test_ddp_train_says_when_torch_sees_no_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the refusal is for machines without one")
    res = subprocess.run([sys.executable, str(REPO / "examples" / "ddp_train.py"), "--device",
                          "cuda"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert res.returncode == 2 and "this torch sees no GPU" in res.stderr
