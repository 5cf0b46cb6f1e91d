"""scripts/source_commit.py: the commit a working tree's files are, read from the files (as
`make gpu-check` records it on a copy whose .git is stale or missing)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import source_commit as sc  # noqa: E402


def _git(repo: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True, env=env).stdout.strip()


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "horovod_quant").mkdir(parents=True)
    (repo / "horovod_quant" / "a.py").write_text("A = 1\n")
    (repo / "kernels").mkdir()
    (repo / "kernels" / "k.cu").write_text("// kernel\n")
    (repo / "README.md").write_text("not a source file\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "first")
    return repo


def test_the_commit_is_found_from_the_files_even_behind_a_newer_head(tmp_path):
    repo = _repo(tmp_path)
    first = _git(repo, "rev-parse", "HEAD")
    assert sc.describe(str(repo)).startswith(first[:12])
    (repo / "horovod_quant" / "a.py").write_text("A = 2\n")
    _git(repo, "commit", "-qam", "second")
    second = _git(repo, "rev-parse", "HEAD")
    assert sc.describe(str(repo)).startswith(second[:12])
    _git(repo, "checkout", "-q", first, "--", "horovod_quant/a.py")  # files of the first commit
    assert sc.describe(str(repo)).startswith(first[:12])  # not HEAD's
    (repo / "README.md").write_text("prose changes do not count\n")
    (repo / "horovod_quant" / "__pycache__").mkdir()
    (repo / "horovod_quant" / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    assert sc.describe(str(repo)).startswith(first[:12])


def test_changed_sources_match_no_commit_and_without_git_the_fingerprint_finds_it(tmp_path):
    repo = _repo(tmp_path)
    head = _git(repo, "rev-parse", "HEAD")
    (repo / "kernels" / "new.cuh").write_text("// new\n")
    assert sc.describe(str(repo)).startswith("none of the last 200 commits")
    (repo / "kernels" / "new.cuh").unlink()
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".git"))
    fingerprint = sc.tree_fingerprint(str(copy))
    assert sc.describe(str(copy)) == f"unknown (no git repository; fingerprint {fingerprint[:12]})"
    assert sc.find_commit(str(repo), fingerprint[:12], depth=10) == head
