#!/usr/bin/env python3
"""Which commit the working tree's files are, read from the files themselves.

A copy of a working tree often travels without its .git, or with a stale one (`make gpu-check`
on a lent GPU machine): its HEAD names another commit than the files. This reads the source
files (``SOURCES``: the package, the kernels, the scripts, tests, benchmarks and examples, the
build files) and hashes each as git hashes a blob; the fingerprint is the SHA-1 of the sorted
"path blob" lines. A commit's fingerprint comes from ``git ls-tree`` alone (no checkout), so the
commits of a repository can be searched for the one whose files these are.

Prints one line: ``<commit> (the working tree's files are this commit's)`` when a commit of the
reachable history (``--depth`` commits from HEAD) has the same fingerprint; else ``none of the
last N commits (files changed; fingerprint F)``; without git or a repository, ``unknown (no git
repository; fingerprint F)``.

Usage:
    python3 scripts/source_commit.py                     # the line above
    python3 scripts/source_commit.py --fingerprint       # the fingerprint only
    python3 scripts/source_commit.py --find F            # the commit whose files have fingerprint F
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the folders and files whose content the fingerprint covers
SOURCES = ("horovod_quant", "kernels", "scripts", "tests", "benchmarks", "examples",
           "setup.py", "pyproject.toml", "Makefile")
SUFFIXES = (".py", ".sh", ".cu", ".cuh", ".toml")
NAMES = ("Makefile",)


def _is_source(path: str) -> bool:
    name = os.path.basename(path)
    return (name.endswith(SUFFIXES) or name in NAMES) and "__pycache__" not in path.split("/")


def _blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _fingerprint(entries: dict[str, str]) -> str:
    lines = "".join(f"{path} {blob}\n" for path, blob in sorted(entries.items()))
    return hashlib.sha1(lines.encode()).hexdigest()


def tree_fingerprint(root: str = ROOT) -> str:
    """The fingerprint of the source files under ``root`` as they are on disk."""
    entries = {}
    for top in SOURCES:
        full = os.path.join(root, top)
        if os.path.isfile(full):
            paths = [top]
        else:
            paths = [os.path.relpath(os.path.join(d, f), root)
                     for d, dirs, files in os.walk(full) for f in files]
        for path in paths:
            if _is_source(path):
                with open(os.path.join(root, path), "rb") as fh:
                    entries[path] = _blob_sha1(fh.read())
    return _fingerprint(entries)


def _git(root: str, *args: str) -> str:
    return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True,
                          check=True).stdout


def commit_fingerprint(root: str, commit: str) -> str:
    """The fingerprint of the source files of ``commit`` (from git's tree, no checkout)."""
    listing = _git(root, "ls-tree", "-r", commit, "--", *SOURCES)
    entries = {}
    for line in listing.splitlines():
        meta, path = line.split("\t", 1)
        mode, kind, blob = meta.split()
        if kind == "blob" and not mode.startswith("12") and _is_source(path):
            entries[path] = blob
    return _fingerprint(entries)


def find_commit(root: str, fingerprint: str, depth: int) -> str | None:
    """The newest of the last ``depth`` commits whose fingerprint is ``fingerprint`` (or starts
    with it)."""
    for commit in _git(root, "rev-list", f"--max-count={depth}", "HEAD").split():
        if commit_fingerprint(root, commit).startswith(fingerprint):
            return commit
    return None


def describe(root: str = ROOT, depth: int = 200) -> str:
    fingerprint = tree_fingerprint(root)
    try:
        commit = find_commit(root, fingerprint, depth)
    except (OSError, subprocess.CalledProcessError):
        return f"unknown (no git repository; fingerprint {fingerprint[:12]})"
    if commit is None:
        return (f"none of the last {depth} commits (files changed; fingerprint "
                f"{fingerprint[:12]})")
    return f"{commit[:12]} (the working tree's files are this commit's)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fingerprint", action="store_true", help="print the fingerprint only")
    ap.add_argument("--find", metavar="FINGERPRINT",
                    help="print the commit whose source files have this fingerprint (or its "
                         "first characters)")
    ap.add_argument("--depth", type=int, default=200, help="commits from HEAD to search")
    ap.add_argument("--root", default=ROOT, help="the working tree (default: this checkout)")
    args = ap.parse_args(argv)
    if args.fingerprint:
        print(tree_fingerprint(args.root))
        return 0
    if args.find:
        commit = find_commit(args.root, args.find, args.depth)
        if commit:
            print(commit)
            return 0
        print(f"no commit of the last {args.depth} has fingerprint {args.find}", file=sys.stderr)
        return 1
    print(describe(args.root, args.depth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
