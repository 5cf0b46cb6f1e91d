"""Every test suite that ``make test`` runs fails when it collects no test.

pytest exits with status 5 when it collects nothing; no pytest run of the Makefile or of the
suites' scripts may accept that status, and each runs one suite folder, so that a folder that
collects nothing cannot hide behind another. A suite whose tests all skip still passes (tests/gpu
on a machine without a GPU). The rule reads the Makefile and the scripts; the Makefile's unit
recipe also runs on an empty folder, and fails.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: where suites are run: the Makefile's recipes and the scripts that launch pytest
RUNNERS = [ROOT / "Makefile", *sorted(ROOT.glob("tests/*/*.sh")),
           *sorted(ROOT.glob("scripts/*.sh"))]
#: ways a command accepts pytest's "no tests collected" status
ACCEPTS_NOTHING = re.compile(r"\$+\?\s*-eq\s*5|--suppress-no-test-exit-code|\|\|\s*(true|:)(\s|$)")
SUITE = re.compile(r"\btests/[\w.]+")


def pytest_commands(path: Path) -> list[tuple[int, str]]:
    """The commands of ``path`` that run pytest, continuation lines joined, as (line, text)."""
    commands, start, parts = [], 0, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not parts:
            start = number
        parts.append(line.rstrip("\\").strip())
        if line.endswith("\\"):
            continue
        text = " ".join(parts)
        parts = []
        if re.search(r"-m pytest\b|\bpytest\s+-", text) and not text.lstrip().startswith("#"):
            commands.append((start, text))
    return commands


def suite_rule_breaches(path: Path) -> list[str]:
    """The pytest commands of ``path`` that accept "no tests collected" or run several
    suite folders, as ``file:line: text``."""
    found = []
    for line, text in pytest_commands(path):
        suites = {m.split("/")[1] for m in SUITE.findall(text.split("pytest", 1)[1])}
        if ACCEPTS_NOTHING.search(text) or len(suites) > 1:
            found.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:"
                         f"{line}: {text}")
    return found


def test_no_suite_passes_when_it_collects_nothing() -> None:
    found = [hit for path in RUNNERS for hit in suite_rule_breaches(path)]
    assert not found, ("pytest runs that pass with no test collected, or that run several suite "
                       "folders at once (run one folder per pytest, and let status 5 fail):\n"
                       + "\n".join(found))


def test_the_rule_sees_the_suites_runs() -> None:
    makefile = [text for _, text in pytest_commands(ROOT / "Makefile")]
    assert any("tests/unit" in t for t in makefile) and any("tests/gpu" in t for t in makefile)
    assert pytest_commands(ROOT / "tests/parallel/run.sh")


def test_the_rule_fails_on_made_up_runners(tmp_path: Path) -> None:
    runner = tmp_path / "Makefile"
    runner.write_text("test:\n"
                      "\t$(PYTHON) -m pytest -q tests/unit || [ $$? -eq 5 ]\n"
                      "\t$(PYTHON) -m pytest -q tests/cuda_parity tests/gpu\n"
                      "\tpython3 -m pytest -q -x \\\n"
                      "\t  tests/parallel || true\n"
                      "\t$(PYTHON) -m pytest -q tests/gpu/test_gpu_parity.py tests/gpu\n")
    assert [hit.split(":")[1] for hit in suite_rule_breaches(runner)] == ["2", "3", "4"]


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_unit_fails_on_a_folder_without_tests(tmp_path: Path) -> None:
    """The Makefile's own unit recipe, run where tests/unit holds no test."""
    (tmp_path / "tests" / "unit").mkdir(parents=True)
    run = subprocess.run(["make", "-s", "-f", str(ROOT / "Makefile"), "-C", str(tmp_path), "unit",
                          f"PYTHON={sys.executable}"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0, run.stdout + run.stderr
    assert "no tests ran" in run.stdout, run.stdout + run.stderr
