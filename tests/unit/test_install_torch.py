"""scripts/install.sh's torch step (`make` runs it) against a stand-in torch: a CUDA build
already installed is kept, and said so; a CPU build of another version is replaced by the pinned
CPU torch, as is a CUDA build when the caller names the torch to install. pip itself is a stub
that records what it was asked to install."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The interpreter the script is given: `-m pip` is recorded and answered, everything else runs
# in the real Python (with the stand-in torch first on its path).
PYTHON_STUB = textwrap.dedent('''\
    #!{real}
    import json, os, sys
    args = sys.argv[1:]
    if args == ["-c", "import sys; print(sys.executable)"]:  # the script keeps this interpreter
        print(os.path.abspath(sys.argv[0]))
        sys.exit(0)
    if args[:2] == ["-m", "pip"]:
        with open(os.environ["STUB_LOG"], "a") as f:
            f.write(json.dumps(args[2:]) + "\\n")
        sys.exit(0)
    os.execv("{real}", ["{real}", *args])
    ''')


def _stand_in_torch(folder: Path, version: str, cuda: str | None) -> None:
    """A package `torch` (its version.py only) with the distribution metadata pip reads."""
    pkg = folder / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('a stand-in: read, never imported')\n")
    (pkg / "version.py").write_text(f"__version__ = {version!r}\ncuda = {cuda!r}\n")
    info = folder / f"torch-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")


def _install_python_step(tmp_path: Path, version: str, cuda: str | None, **env):
    site = tmp_path / "site"
    _stand_in_torch(site, version, cuda)
    python = tmp_path / "python-stub"
    python.write_text(PYTHON_STUB.format(real=sys.executable))
    python.chmod(0o755)
    log = tmp_path / "pip.jsonl"
    run_env = dict(os.environ, PYTHON=str(python), PYTHONPATH=str(site), STUB_LOG=str(log),
                   HQ_INSTALL_STEPS="python", HQ_WITH_TENSORFLOW="0", **env)
    if "HQ_TORCH_SPEC" not in env:
        run_env.pop("HQ_TORCH_SPEC", None)
    res = subprocess.run(["bash", str(REPO / "scripts" / "install.sh")], env=run_env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"({python})" in res.stdout  # the stub ran every pip call, not the real Python
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    torch_installs = [c for c in calls if c[0] == "install" and
                      any(a.startswith("torch") for a in c)]
    return res.stdout, torch_installs


def test_a_cuda_torch_already_installed_is_kept(tmp_path):
    out, torch_installs = _install_python_step(tmp_path, "2.11.0+cu130", "13.0")
    assert torch_installs == []
    assert "keeping the installed CUDA build 2.11.0+cu130 (CUDA 13.0)" in out


def test_a_cpu_torch_of_another_version_is_replaced_by_the_pinned_one(tmp_path):
    out, torch_installs = _install_python_step(tmp_path, "2.11.0+cpu", None)
    assert len(torch_installs) == 1 and "torch==2.13.0" in torch_installs[0], torch_installs
    assert "keeping" not in out


@pytest.mark.parametrize("env", [{"HQ_KEEP_CUDA_TORCH": "0"},
                                 {"HQ_TORCH_SPEC": "torch==2.13.0"}])
def test_a_cuda_torch_is_replaced_when_asked(tmp_path, env):
    out, torch_installs = _install_python_step(tmp_path, "2.11.0+cu130", "13.0", **env)
    assert len(torch_installs) == 1 and "torch==2.13.0" in torch_installs[0], torch_installs
    assert "keeping" not in out


def test_an_unknown_step_is_refused(tmp_path):
    res = subprocess.run(["bash", str(REPO / "scripts" / "install.sh")],
                         env=dict(os.environ, HQ_INSTALL_STEPS="python warp"),
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "unknown step 'warp'" in res.stderr
