#!/usr/bin/env python3
"""Check the shell commands shown in the documentation (`make test` runs it).

Reads every fenced code block of README.md, DEVELOPERS.md, docs/*.md and docker/README.md,
plus inline code spans that run one of this repository's scripts, and:

1. **Flags.** For every command that runs a script of this repository (`python3 benchmarks/...`,
   `examples/...`, `scripts/...`, `tests/...`, `python3 -m horovod_quant...`, also behind
   `horovodrun`, `mpirun`, `sudo`, `taskset`, `docker run`), checks that the script exists and
   that every flag the command passes is one that the script's `--help` lists (argparse). Flags
   are compared exactly: an abbreviation that argparse would accept still fails, so the docs
   keep the full names. The flags given to `horovodrun` are checked against
   `horovodrun --help` the same way (`torchrun`'s against `torchrun --help`, and the script it
   runs against the script's), and `make <target>` against the Makefile's targets.
   `bash <file>` needs the file to exist. A script whose `--help` fails on a missing module
   (e.g. TensorFlow, with `HQ_WITH_TENSORFLOW=0`) is named and skipped, not failed. Each
   script's `--help` runs in a process forked from a server that imported torch once.
2. **Quick commands.** A fenced block whose previous non-blank line is the HTML comment
   `<!-- check-docs: run -->` (invisible on GitHub) is run as it stands, from the repository
   root: `bash` blocks by `bash -euo pipefail`, `python` blocks by `python3 -`. It must exit 0
   within 120 s (or `<!-- check-docs: run timeout=S -->`). Mark only commands that finish in
   well under 20 s on a 2-core machine and change no tracked file.
3. **Links.** Every relative Markdown link (and its ``#anchor``), every repository path quoted
   in a code span and every ``docs/...`` file named in prose (outside fenced blocks) must exist.
4. **Results.** Every file of docs/results is named by a page or read by a test or script
   (or is an image a kept results page shows, or the JSON beside a kept file of its stem), and
   docs/results/README.md says which command makes it; a table after
   ``<!-- results: NAME -->`` and a figure written ``<!-- figure: NAME -->VALUE<!-- /figure -->``
   must equal what
   scripts/render_results.py renders from the JSON.
5. **API signatures.** Each ``### `module.object(parameters)` `` heading of docs/api.md must
   match ``inspect.signature`` of that object (names, kinds, order, defaults), and every
   public callable of the package's modules (their ``__all__``) must have such a heading.
6. **GPU claims.** A paragraph or table row that says something is on or with a GPU model, or
   that something ran on a GPU (``GPU_CLAIM``), links the list of docs/dev/gpu.md, "What has
   run on a GPU", and names only GPU models and ``gpu_*`` results files that the list holds;
   each row of the list has a date, a commit git knows and an existing results file
   (docs/dev/gpu.md states the rule).
7. **Length.** The user docs (README.md and docs/*.md, counted as ``wc -w`` does) stay within
   ``MAX_USER_WORDS``: what does not fit belongs in docs/dev/.

Usage:
    python3 scripts/check_docs.py            # everything; exit status 1 on any problem
    python3 scripts/check_docs.py --no-run   # flags only (no marked block is run)
    python3 scripts/check_docs.py -v         # also list every command whose flags were checked
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import fnmatch
import glob
import importlib
import importlib.util
import inspect
import multiprocessing
import os
import re
import runpy
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", "DEVELOPERS.md", "docs/*.md", "docs/dev/*.md", "docs/results/README.md",
        "docker/README.md"]
SCRIPT_DIRS = ("benchmarks/", "examples/", "scripts/", "tests/")
RUN_MARK = re.compile(r"^\s*<!--\s*check-docs:\s*run(?:\s+timeout=(\d+))?\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh"}
PYTHON = re.compile(r"^(python[0-9.]*|\$\(PYTHON\)|\$PYTHON|\$\{PYTHON\})$")
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", ";;", "|&"}
# python3's own options that take a value (the script comes after them)
PY_OPTS_WITH_VALUE = {"-W", "-X", "-Q"}
SKIPPED = frozenset({"<skipped>"})  # help_flags: the program could not run here (optional deps)


@dataclass
class Block:
    path: str
    line: int  # 1-based line of the opening fence (or of the inline span)
    lang: str
    text: str
    run: bool = False
    timeout: int = 120
    inline: bool = False


@dataclass
class Invocation:
    where: str
    command: str
    kind: str  # "script", "module", "horovodrun", "torchrun", "make", "file"
    target: str  # script path, module, Makefile target or file
    flags: list = field(default_factory=list)
    env: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------ extraction ---
def doc_files() -> list[str]:
    out = []
    for pattern in DOCS:
        out += sorted(glob.glob(os.path.join(ROOT, pattern)))
    return [os.path.relpath(p, ROOT) for p in out]


def read_blocks(path: str) -> list[Block]:
    """Fenced blocks of a Markdown file, with their run marker, and inline code spans that
    mention a repository script (for the flag check only)."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    blocks, prose = [], []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        start = i
        body = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1  # closing fence
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = RUN_MARK.match(prev)
        blocks.append(Block(path, start + 1, lang, "\n".join(body), run=bool(mark),
                            timeout=int(mark.group(1)) if mark and mark.group(1) else 120))
        prose.append((start + 1, ""))
    # inline spans (may wrap over lines): only those that run something of ours
    text = "\n".join(line for _, line in prose)
    line_of = [n for n, line in prose for _ in range(len(line) + 1)]
    for m in re.finditer(r"`([^`]+)`", text):
        span = m.group(1).replace("\n", " ")
        if re.search(r"(^|\s)(python[0-9.]*|horovodrun|torchrun|make)\s", span) and \
                re.search(r"\.py\b|horovod_quant|horovodrun|^make\s", span):
            blocks.append(Block(path, line_of[min(m.start(), len(line_of) - 1)], "bash", span,
                                inline=True))
    return blocks


def shell_commands(text: str) -> list[str]:
    """The commands of a shell block: heredoc bodies dropped, continuations joined, comments
    and prompts stripped."""
    out, buf, heredoc = [], "", None
    for raw in text.split("\n"):
        if heredoc is not None:
            if raw.strip() == heredoc:
                heredoc = None
            continue
        line = raw.rstrip()
        if line.lstrip().startswith("$ "):
            line = line.lstrip()[2:]
        m = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
        if m:
            heredoc = m.group(1)
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        if buf.strip() and not buf.lstrip().startswith("#"):
            out.append(buf.strip())
        buf = ""
    if buf.strip():
        out.append(buf.strip())
    return out


def tokens(command: str) -> list[str]:
    lex = shlex.shlex(command, posix=True, punctuation_chars=";&|()")
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        return list(lex)
    except ValueError:  # unbalanced quotes in a doc fragment: split on blanks
        return command.split()


def simple_commands(toks: list[str]) -> list[list[str]]:
    out, cur = [], []
    for t in toks:
        if t in SEPARATORS:
            if cur:
                out.append(cur)
            cur = []
        else:
            cur.append(t)
    if cur:
        out.append(cur)
    return out


def is_flag(tok: str) -> bool:
    return tok.startswith("-") and tok != "-" and not re.match(r"^-[0-9.]", tok)


def flag_name(tok: str) -> str:
    return tok.split("=", 1)[0]


def invocations(block: Block) -> list[Invocation]:
    where = f"{block.path}:{block.line}"
    out = []
    for command in shell_commands(block.text):
        for cmd in simple_commands(tokens(command)):
            env = {}
            for t in cmd:
                if re.match(r"^[A-Z_][A-Z0-9_]*=", t):
                    k, v = t.split("=", 1)
                    env[k] = v
            out += _invocations_of(where, command, cmd, env)
    return out


#: launchers whose own flags are checked against their --help (torchrun also runs the script)
LAUNCHERS = ("horovodrun", "torchrun")


def _invocations_of(where: str, command: str, cmd: list[str], env: dict) -> list[Invocation]:
    out = []
    names = [os.path.basename(t) for t in cmd]
    for launcher in LAUNCHERS:
        if launcher not in names:
            continue
        i = names.index(launcher)
        flags = []
        for j, t in enumerate(cmd[i + 1:], i + 1):
            if t.endswith(".py") and launcher == "torchrun":  # torchrun runs the script itself
                script = t.removeprefix("./")
                if script.startswith(SCRIPT_DIRS):
                    out.append(Invocation(where, command, "script", script,
                                          [flag_name(a) for a in _flags_until_end(cmd[j + 1:])],
                                          env))
                break
            if PYTHON.match(os.path.basename(t)) or t.endswith(".py") or t in ("bash", "sh"):
                break
            if is_flag(t):
                flags.append(flag_name(t))
        out.append(Invocation(where, command, launcher, launcher, flags, env))
    if names and names[0] == "make":
        for t in cmd[1:]:
            if not is_flag(t) and "=" not in t:
                out.append(Invocation(where, command, "make", t))
    if "bash" in names:
        i = names.index("bash")
        rest = [t for t in cmd[i + 1:] if not is_flag(t)]
        if rest and rest[0].startswith(SCRIPT_DIRS):
            out.append(Invocation(where, command, "file", rest[0]))
    for i, t in enumerate(cmd):
        if not PYTHON.match(os.path.basename(t)):
            continue
        j = i + 1
        while j < len(cmd) and is_flag(cmd[j]) and cmd[j] not in ("-m", "-c"):
            j += 2 if cmd[j] in PY_OPTS_WITH_VALUE else 1
        if j >= len(cmd) or cmd[j] == "-c":
            break
        if cmd[j] == "-m":
            if j + 1 < len(cmd) and cmd[j + 1].startswith("horovod_quant"):
                args = cmd[j + 2:]
                out.append(Invocation(where, command, "module", cmd[j + 1],
                                      [flag_name(a) for a in _flags_until_end(args)], env))
            break
        script = cmd[j].removeprefix("./")
        if script.startswith(SCRIPT_DIRS) and script.endswith(".py"):
            out.append(Invocation(where, command, "script", script,
                                  [flag_name(a) for a in _flags_until_end(cmd[j + 1:])], env))
        break
    return out


def _flags_until_end(args: list[str]) -> list[str]:
    out = []
    for a in args:
        if a == "--":
            break
        if a.startswith((">", "<")):
            break
        if is_flag(a):
            out.append(a)
    return out


# ----------------------------------------------------------------------------------- links ---
LINK = re.compile(r"\]\(([^)\s]+)\)")
#: a repository path quoted in a code span (checked from the repository root)
REPO_PATH = re.compile(r"^(?:docs|examples|benchmarks|scripts|tests|horovod_quant|docker|kernels)/"
                       r"[\w./-]+\.(?:md|py|sh|json|png|cu|cuh)$")
#: a page or results file named in prose
DOCS_MENTION = re.compile(r"(?<![\w/.-])(docs/[\w/.-]*\w\.(?:md|json|png))(?![\w/-])")


def heading_anchors(path: str) -> set:
    """The anchors GitHub gives the headings of a Markdown file (lower case, punctuation
    dropped, spaces as hyphens)."""
    with open(path, encoding="utf-8") as fh:
        heads = [m.group(1) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*$", fh.read(), re.M)]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def prose_lines(text: str):
    """(line number, line) of each line of Markdown ``text`` outside fenced blocks."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if m and (fence is None or m.group(2).startswith(fence)):
            fence = m.group(2) if fence is None else None
        elif fence is None:
            yield n, line


def check_links(path: str) -> list[str]:
    """Problems with the relative Markdown links of ``path`` (resolved from its folder), the
    repository paths it quotes in code spans and the ``docs/...`` files it names (resolved
    from the root), outside fenced blocks: each must exist."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        text = fh.read()
    problems = []
    for n, line in prose_lines(text):
        for m in LINK.finditer(line):
            target = m.group(1).split("#", 1)[0]
            if not target or re.match(r"^[a-z]+:", target):
                continue
            full = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), target))
            anchor = m.group(1).partition("#")[2]
            if not os.path.exists(full):
                problems.append(f"{path}:{n}: link to {m.group(1)}: no such file")
            elif anchor and full.endswith(".md") and anchor not in heading_anchors(full):
                problems.append(f"{path}:{n}: link to {m.group(1)}: no heading with that anchor")
        named = {m.group(1) for m in re.finditer(r"`([^`\s]+)`", line)
                 if REPO_PATH.match(m.group(1))}
        named |= {m.group(1) for m in DOCS_MENTION.finditer(re.sub(r"\]\([^)]*\)", "]", line))}
        for name in sorted(named):
            if not os.path.exists(os.path.join(ROOT, name)):
                problems.append(f"{path}:{n}: {name}: no such file in the repository")
    return problems


# --------------------------------------------------------------------------------- results ---
RESULTS = "docs/results"


#: where the code that reads results files lives (a file it names is read by a test or script)
RESULT_READERS = ["scripts/*.py", "scripts/*.sh", "tests/**/*.py", "benchmarks/*.py",
                  "horovod_quant/**/*.py", "Makefile"]


def check_results(root: str | None = None) -> list[str]:
    """Problems with docs/results. A file stays when a page names it (README.md,
    DEVELOPERS.md, docs/**/*.md outside docs/results), when a test or script reads it (named
    in ``RESULT_READERS``), when a kept ``.md`` shows it as an image, or as the JSON beside a
    kept file of its stem (``x.json`` of a named ``x.md``: the data its table is made from); a file
    that only the index or another results file names is a problem (the index says how to
    regenerate it). So is a file that docs/results/README.md (which maps each file to its
    command) does not name, by its name or by a quoted pattern such as ``scaling_*``."""
    root = ROOT if root is None else root
    folder = os.path.join(root, RESULTS)
    files = sorted(f for f in os.listdir(folder) if f != "README.md"
                   and os.path.isfile(os.path.join(folder, f)))
    pages = [os.path.join(root, "README.md"), os.path.join(root, "DEVELOPERS.md")]
    pages += [p for p in glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True)
              if not os.path.abspath(p).startswith(os.path.abspath(folder) + os.sep)]
    readers = [p for pattern in RESULT_READERS
               for p in glob.glob(os.path.join(root, pattern), recursive=True)]
    text = "\n".join(open(p, encoding="utf-8").read() for p in pages + readers
                     if os.path.isfile(p))

    def named_in(body: str) -> set:
        return {f for f in files if re.search(r"(?<![\w-])" + re.escape(f) + r"(?![\w-])", body)}

    used, todo = set(), named_in(text)
    while todo:
        f = todo.pop()
        used.add(f)
        stem = os.path.splitext(f)[0]
        todo |= {g for g in files if g == stem + ".json"} - used
        if f.endswith(".md"):
            with open(os.path.join(folder, f), encoding="utf-8") as fh:
                shown = " ".join(re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", fh.read()))
            todo |= named_in(shown) - used
    problems = [f"{RESULTS}/{f}: no page names it and no test or script reads it (delete it "
                "and say in docs/results/README.md how to make it again)"
                for f in files if f not in used]
    readme = os.path.join(folder, "README.md")
    listing = open(readme, encoding="utf-8").read() if os.path.exists(readme) else ""
    patterns = re.findall(r"`([\w.-]*\*[\w.*-]*)`", listing)
    listed = named_in(listing) | {f for f in files if any(fnmatch.fnmatch(f, p) for p in patterns)}
    problems += [f"{RESULTS}/README.md does not say which command made {f}"
                 for f in files if f not in listed]
    return problems


def rendered_tables(path: str) -> list[str]:
    """Problems of the tables and figures of ``path`` that scripts/render_results.py renders
    from JSON."""
    with open(os.path.join(ROOT, path), encoding="utf-8") as fh:
        text = fh.read()
    if "<!-- results:" not in text and "<!-- figure:" not in text:
        return []
    spec = importlib.util.spec_from_file_location(
        "render_results", os.path.join(ROOT, "scripts", "render_results.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.check_page(path, ROOT)


# ------------------------------------------------------------------------------ GPU claims ---
GPU_PAGE = "docs/dev/gpu.md"
GPU_ANCHOR = "what-has-run-on-a-gpu"
GPU_LIST = re.compile(r"<!-- gpu-runs -->\n(.*?)<!-- /gpu-runs -->", re.S)
#: the list's section of docs/dev/gpu.md, which the claim check leaves out
GPU_SECTION = re.compile(r"^## What has run on a GPU\n.*?(?=^## )", re.S | re.M)
#: a GPU model named as a word (NVIDIA's data-centre names; case-sensitive)
GPU_MODEL = re.compile(r"\b(?:[ABH]100|[AH]800|H200|A10G?|A30|A40|L4|L40S?|V100|T4|B200|GH200|"
                       r"GB200)\b(?![-\w])")
#: a GPU claim: something on or with a GPU model ("passed on one H100"; a model named otherwise,
#: such as the hardware of another system's published figures, claims nothing of this
#: project), or a run on a GPU / with CUDA data in the past tense
GPU_CLAIM = re.compile(
    r"\b(?:on|with) (?:a |an |one |the |two |\d+ )?(?:" + GPU_MODEL.pattern + r")"
    r"|(?i:\b(?:ran|(?:has|have|had|been|never|not) (?:yet )?run|passed|"
    r"tested|measured|timed|verified)\b"
    r"[^.;:()]{0,25}?\b(?:on|with) (?:a |an |one |the |two |\w+ )?"
    r"(?:GPUs?|CUDA (?:parameters|tensors|gradients|buckets))\b)")
GPU_CLAIM_PAGES = ["README.md", "DEVELOPERS.md", "docker/README.md", "docs/*.md", "docs/dev/*.md"]


def _git_ok(root: str, *args: str) -> bool:
    try:
        return subprocess.run(["git", "-C", root, *args], capture_output=True).returncode == 0
    except OSError:
        return False


def gpu_runs(root: str) -> tuple[list[dict], list[str]]:
    """The rows of the list in docs/dev/gpu.md (what ran, result, GPU, date, commit, file) and
    the problems of the rows themselves."""
    path = os.path.join(root, GPU_PAGE)
    found = GPU_LIST.search(open(path, encoding="utf-8").read()) if os.path.exists(path) else None
    if not found:
        return [], [f"{GPU_PAGE}: no list of GPU runs (<!-- gpu-runs --> ... <!-- /gpu-runs -->)"]
    rows, problems = [], []
    for line in found.group(1).strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 6:
            problems.append(f"{GPU_PAGE}: a row of the GPU list without 6 cells: {line}")
            continue
        what, result, gpu, date, commit, link = cells
        target = re.fullmatch(r"\[([\w.-]+)\]\(\.\./results/\1\)", link)
        row = dict(what=what, gpu=gpu, date=date, commit=commit,
                   file=target.group(1) if target else link)
        rows.append(row)
        where = f"{GPU_PAGE}: GPU list row '{what[:40]}'"
        if not GPU_MODEL.fullmatch(gpu):
            problems.append(f"{where}: '{gpu}' is not a GPU model")
        if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
            problems.append(f"{where}: date '{date}' is not YYYY-MM-DD")
        if not target or not os.path.isfile(os.path.join(root, RESULTS, row["file"])):
            problems.append(f"{where}: '{link}' is not a link to a file of {RESULTS}")
            continue
        text = open(os.path.join(root, RESULTS, row["file"]), encoding="utf-8",
                    errors="replace").read(4000)
        recorded = re.search(r"^- date: (\d{4}-\d{2}-\d{2})", text, re.M)
        if recorded and recorded.group(1) != date:
            problems.append(f"{where}: date {date}, the file says {recorded.group(1)}")
        if not re.fullmatch(r"[0-9a-f]{7,40}", commit):
            problems.append(f"{where}: commit '{commit}' is not a commit hash")
        elif _git_ok(root, "rev-parse", "--git-dir") and \
                not _git_ok(root, "cat-file", "-e", commit + "^{commit}"):
            problems.append(f"{where}: git knows no commit {commit}")  # without git: unchecked
    return rows, problems


def _paragraphs(path: str):
    """(first line, text) of each paragraph and each table row of a Markdown file, outside
    fenced blocks; the GPU list's own section left out."""
    with open(path, encoding="utf-8") as fh:
        text = GPU_SECTION.sub(lambda m: "\n" * m.group(0).count("\n"), fh.read())
    para, start = [], 0
    for n, line in prose_lines(text + "\n"):
        if not line.strip() or line.lstrip().startswith(("|", "#")):
            if para:
                yield start, " ".join(para)
            para = []
            if line.lstrip().startswith("|"):
                yield n, line
            continue
        if not para:
            start = n
        para.append(line.strip())


def check_gpu_claims(root: str | None = None) -> list[str]:
    """Problems of the GPU claims of the pages against the list in docs/dev/gpu.md."""
    root = ROOT if root is None else root
    rows, problems = gpu_runs(root)
    models = {r["gpu"] for r in rows}
    stems = {os.path.splitext(r["file"])[0] for r in rows}  # a run's file or its renditions
    pages = sorted({os.path.relpath(p, root) for pattern in GPU_CLAIM_PAGES
                    for p in glob.glob(os.path.join(root, pattern))})
    for page in pages:
        for line, text in _paragraphs(os.path.join(root, page)):
            claims = GPU_CLAIM.findall(text)
            if not claims:
                continue
            where = f"{page}:{line}: GPU claim '{claims[0]}'"
            own = page == GPU_PAGE
            if f"{'' if own else 'gpu.md'}#{GPU_ANCHOR}" not in text:
                problems.append(f"{where}: link the list ({GPU_PAGE}#{GPU_ANCHOR}) instead "
                                "of restating it")
            problems += [f"{where}: no run on a {m} in the list of {GPU_PAGE}"
                         for m in sorted(set(GPU_MODEL.findall(text)) - models)]
            problems += [f"{where}: {f} is no file of the list of {GPU_PAGE}"
                         for f in sorted(set(re.findall(r"\bgpu_[\w-]+\.\w+", text)))
                         if os.path.splitext(f)[0] not in stems]
    return problems


# ---------------------------------------------------------------------------------- length ---
#: the most words README.md and docs/*.md may hold together (``cat README.md docs/*.md | wc -w``)
MAX_USER_WORDS = 18_000


def check_length(root: str | None = None, limit: int = MAX_USER_WORDS) -> list[str]:
    """A problem when README.md and docs/*.md hold more than ``limit`` words (whitespace-
    separated, as ``wc -w`` counts), naming the longest pages."""
    root = ROOT if root is None else root
    pages = [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs",
                                                                              "*.md")))
    counts = {os.path.relpath(p, root): len(open(p, encoding="utf-8").read().split())
              for p in pages if os.path.exists(p)}
    total = sum(counts.values())
    if total <= limit:
        return []
    longest = ", ".join(f"{p} {n}" for p, n in sorted(counts.items(), key=lambda i: -i[1])[:3])
    return [f"the user docs hold {total} words, over {limit} (longest: {longest}): move what "
            "users need not read first into docs/dev/"]


# ------------------------------------------------------------------------------------- api ---
API_PAGE = "docs/api.md"
#: a documented signature: a heading ``### `module.object(parameters)` ``
API_HEADING = re.compile(r"^#{2,4}\s+`([\w.]+)\((.*)\)`\s*$")
#: modules whose ``__all__`` the API page must document (each public callable, by heading)
API_MODULES = ("horovod_quant", "horovod_quant.torch", "horovod_quant.torch.ddp",
               "horovod_quant.tensorflow")
_EMPTY = inspect.Parameter.empty


def split_parameters(text: str) -> list[str]:
    """``"a, b=(1, 2), *, c=f(x, y)"`` -> ``["a", "b=(1, 2)", "*", "c=f(x, y)"]``."""
    out, depth, quote, cur = [], 0, None, ""
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def resolve(path: str):
    """The object named by a dotted path: the longest importable module, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name and not ".".join(parts[:i]).startswith(exc.name):
                raise  # a dependency is missing, not this module
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def _documented_parameters(text: str) -> list[tuple[str, str, str | None]]:
    """(kind, name, default text) of each documented parameter; kind is "", "*" or "**"."""
    out = []
    for p in split_parameters(text):
        name, _, default = p.partition("=")
        stars = re.match(r"^\*{0,2}", name.strip()).group(0)
        out.append((stars, name.strip()[len(stars):], default.strip() if default else None))
    return out


def _real_parameters(obj) -> list[tuple[str, str, object]]:
    out, star = [], False
    for p in inspect.signature(obj).parameters.values():
        if p.kind is p.VAR_POSITIONAL:
            out.append(("*", p.name, p.empty))
            star = True
        elif p.kind is p.VAR_KEYWORD:
            out.append(("**", p.name, p.empty))
        else:
            if p.kind is p.KEYWORD_ONLY and not star:
                out.append(("*", "", p.empty))
                star = True
            out.append(("", p.name, p.default))
    if out and out[0][1] == "self":
        out = out[1:]
    return out


def _default_matches(text: str, value, namespace: dict) -> bool:
    if text == repr(value):
        return True
    try:
        got = eval(text, dict(namespace))  # noqa: S307 (the repository's own page)
    except Exception:  # noqa: BLE001 (any text that does not evaluate does not match)
        return False
    return got is value or (type(got) is type(value) and got == value)


def check_api_signatures(text: str, path: str = API_PAGE, namespace: dict | None = None,
                         modules: tuple = API_MODULES) -> tuple[list[str], list[str]]:
    """(problems, skipped) for the API page's text: each heading's signature against
    ``inspect.signature`` of the object it names (parameter names, kinds and order, defaults
    compared by ``repr`` or by value; annotations not compared), and every public callable
    of ``modules`` (their ``__all__``) documented, under its own name or another name of
    the same object. A module or object that cannot be imported
    for a missing optional dependency is skipped, and named in ``skipped``."""
    namespace = {} if namespace is None else namespace
    problems, skipped, documented = [], [], set()  # documented: names and ids of objects
    for n, line in enumerate(text.split("\n"), 1):
        m = API_HEADING.match(line)
        if not m:
            continue
        where, name = f"{path}:{n}", m.group(1)
        documented.add(name)
        try:
            obj = resolve(name)
        except ModuleNotFoundError as exc:
            skipped.append(f"{name} (missing module {exc.name})")
            continue
        except (ImportError, AttributeError) as exc:
            problems.append(f"{where}: {name}: no such object ({exc})")
            continue
        documented.add(id(obj))
        doc, real = _documented_parameters(m.group(2)), _real_parameters(obj)
        shown = ", ".join((k + nm) + ("" if d is None else "=" + d) for k, nm, d in doc)
        want = ", ".join(k + nm + ("" if v is _EMPTY else f"={v!r}") for k, nm, v in real)
        if [(k, nm) for k, nm, _ in doc] != [(k, nm) for k, nm, _ in real]:
            problems.append(f"{where}: {name}({shown}): the code has {name}({want})")
            continue
        for (_, nm, d), (_, _, v) in zip(doc, real):
            if (d is None) != (v is _EMPTY) or (d is not None and
                                                 not _default_matches(d, v, namespace)):
                problems.append(f"{where}: {name}: parameter {nm} documented with default "
                                f"{d!r}, the code has {'none' if v is _EMPTY else repr(v)}")
    for module in modules:
        try:
            mod = resolve(module)
        except ModuleNotFoundError as exc:
            skipped.append(f"{module} (missing module {exc.name})")
            continue
        for public in getattr(mod, "__all__", []):
            obj = getattr(mod, public)
            if callable(obj) and not {f"{module}.{public}", id(obj)} & documented:
                problems.append(f"{path}: {module}.{public} is public but has no "
                                f"`### `{module}.{public}(...)`` heading")
    return problems, skipped



def check_api() -> tuple[list[str], list[str]]:
    """:func:`check_api_signatures` on docs/api.md, the frameworks' names importable."""
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    namespace = {}
    try:
        import horovod.torch as hvd
        namespace["hvd"] = hvd
    except ImportError:
        pass
    with open(os.path.join(ROOT, API_PAGE), encoding="utf-8") as fh:
        return check_api_signatures(fh.read(), API_PAGE, namespace)


# ---------------------------------------------------------------------------------- checks ---
#: a command module that runs another module's ``main`` (``from .tools.predict import main``)
RUNS_MAIN_OF = re.compile(r"^from\s+(\.+|horovod_quant\.)([\w.]*)\s+import\s+main\b", re.M)


def _uses_argparse(path: str) -> bool:
    """Whether the script parses its flags with argparse, or runs the ``main`` of a package
    module that does (``python -m horovod_quant.predict`` runs horovod_quant/tools/predict.py's)."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if "argparse" in text:
        return True
    m = RUNS_MAIN_OF.search(text)
    if not m:
        return False
    dots, rest = m.groups()
    base = os.path.join(ROOT, "horovod_quant") if not dots.startswith(".") else \
        os.path.dirname(path) if len(dots) == 1 else \
        os.path.normpath(os.path.join(os.path.dirname(path), *[".."] * (len(dots) - 1)))
    target = os.path.join(base, *rest.split(".")) if rest else base
    for candidate in (target + ".py", os.path.join(target, "__init__.py")):
        if os.path.exists(candidate):
            return _uses_argparse(candidate)
    return False


def help_flags(inv: Invocation) -> tuple[set | None, str]:
    """The flags the script's --help lists; None when the script does not use argparse."""
    if inv.kind in LAUNCHERS:
        argv = [inv.kind, "--help"]
    elif inv.kind == "module":
        path = os.path.join(ROOT, *inv.target.split(".")) + ".py"
        if not os.path.exists(path):
            path = os.path.join(ROOT, *inv.target.split("."), "__main__.py")
        if not os.path.exists(path):
            return None, f"no module {inv.target} in this repository"
        if not _uses_argparse(path):
            return None, ""
        argv = [sys.executable, "-m", inv.target, "--help"]
    else:
        path = os.path.join(ROOT, inv.target)
        if not os.path.exists(path):
            return None, f"{inv.target} does not exist"
        if not _uses_argparse(path):
            return None, ""
        argv = [sys.executable, inv.target, "--help"]
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1", TF_CPP_MIN_LOG_LEVEL="3")
    try:
        if inv.kind in LAUNCHERS:
            res = subprocess.run(argv, check=False, cwd=ROOT, env=env, capture_output=True,
                                 text=True, timeout=180)
            returncode, stdout, stderr = res.returncode, res.stdout, res.stderr
        else:
            returncode, stdout, stderr = _forked_help(argv[1:], env, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return set(), f"`{' '.join(argv)}` failed: {exc}"
    missing = re.search(r"ModuleNotFoundError: No module named '([\w.]+)'", stderr)
    if returncode != 0 and missing:  # an optional framework (e.g. TensorFlow) not installed
        return SKIPPED, f"not checked: --help needs the missing module {missing.group(1)}"
    if returncode != 0:
        return set(), f"`{' '.join(argv)}` exited {returncode}: {stderr.strip()[-300:]}"
    return parse_help(stdout), ""


#: what this repository's scripts import before they parse their arguments: a fork server loads
#: them once, and each --help runs in a process forked from it, since importing torch is most of
#: what a fresh interpreter's --help costs
HELP_PRELOAD = ["numpy", "torch", "horovod_quant"]
_HELP_CONTEXT = multiprocessing.get_context("forkserver")
_HELP_CONTEXT.set_forkserver_preload(HELP_PRELOAD)


def _forked_help(args: list[str], env: dict, timeout: float) -> tuple[int, str, str]:
    """``python3 ARGS`` (``SCRIPT --help`` or ``-m MODULE --help``) in a process forked from the
    fork server; returns its exit status, standard output and standard error."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        proc = _HELP_CONTEXT.Process(target=_run_as_main, args=(args, env, out, err))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(["python3", *args], timeout)
        if not os.path.exists(err):
            return proc.exitcode or 1, "", "its process ended before it ran (see above)"
        with open(out, encoding="utf-8", errors="replace") as fo, \
                open(err, encoding="utf-8", errors="replace") as fe:
            return proc.exitcode, fo.read(), fe.read()


def _run_as_main(args: list[str], env: dict, out: str, err: str) -> None:
    """In the forked process: runs ``python3 ARGS`` as the interpreter would (``__main__``, the
    script's folder or the working folder first on sys.path), its output into OUT and ERR."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    code = 0
    try:
        if args[0] == "-m":
            sys.argv, sys.path[0] = [args[1], *args[2:]], ROOT
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv, sys.path[0] = list(args), os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # sys.exit(message): the interpreter prints the message and exits 1
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  (reported as the interpreter reports it)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def parse_help(text: str) -> set:
    """Option strings of an argparse help text: the usage block and the option lines."""
    flags = set()
    lines = text.split("\n")
    in_usage = False
    for line in lines:
        if line.startswith("usage:"):
            in_usage = True
        elif in_usage and not line.strip():
            in_usage = False
        if in_usage:
            flags |= set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", line))
        elif re.match(r"^\s+-", line):
            opts = re.split(r"\s{2,}", line.strip())[0]
            flags |= set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", opts))
    return flags


def make_targets() -> set:
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as fh:
        return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", fh.read(), re.MULTILINE))


def run_block(block: Block) -> tuple[bool, float, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if block.lang in SHELL_LANGS or block.lang == "":
        argv, stdin = ["bash", "-euo", "pipefail", "-c", block.text], None
    elif block.lang in ("python", "py"):
        argv, stdin = [sys.executable, "-"], block.text
    else:
        return False, 0.0, f"cannot run a `{block.lang}` block"
    t = time.perf_counter()
    try:
        res = subprocess.run(argv, check=False, cwd=ROOT, env=env, input=stdin,
                             capture_output=True, text=True, timeout=block.timeout)
    except subprocess.TimeoutExpired:
        return False, time.perf_counter() - t, f"timed out after {block.timeout} s"
    dt = time.perf_counter() - t
    tail = (res.stdout + res.stderr).strip().split("\n")
    tail = "\n".join(line for line in tail if line.strip())[-800:]
    return res.returncode == 0, dt, tail if res.returncode else ""


def check_flags(invs: list, helps: dict, targets: set, verbose: bool = False):
    """Problems found in ``invs`` given each program's ``help_flags`` result (``helps``, keyed
    by (kind, target)) and the Makefile's targets; also the number of flags checked."""
    problems, checked = [], 0
    for inv in invs:
        short = inv.command if len(inv.command) <= 100 else inv.command[:97] + "..."
        if inv.kind == "make":
            if inv.target not in targets:
                problems.append(f"{inv.where}: `make {inv.target}`: no such Makefile target")
            continue
        if inv.kind == "file":
            if not os.path.exists(os.path.join(ROOT, inv.target)):
                problems.append(f"{inv.where}: `{short}`: {inv.target} does not exist")
            continue
        known, err = helps[(inv.kind, inv.target)]
        if known is SKIPPED:
            if verbose:
                print(f"  --  {inv.where}: {inv.target}: {err}")
            continue
        if err:
            problems.append(f"{inv.where}: `{short}`: {err}")
            continue
        if known is None:
            if inv.flags:
                problems.append(f"{inv.where}: `{short}`: {inv.target} takes no flags "
                                f"(no argparse) but gets {' '.join(inv.flags)}")
            continue
        bad = [f for f in inv.flags if f not in known]
        checked += len(inv.flags)
        if bad:
            problems.append(f"{inv.where}: `{short}`: {inv.target} has no "
                            f"{' '.join(bad)} (its --help lists {' '.join(sorted(known))})")
        elif verbose:
            print(f"  ok  {inv.where}: {inv.target} {' '.join(inv.flags)}")
    return problems, checked


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-run", action="store_true", help="check flags only, run nothing")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="list every command whose flags were checked")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    files = doc_files()
    blocks = [b for f in files for b in read_blocks(f)]
    invs = [inv for b in blocks if b.inline or b.lang in SHELL_LANGS or b.lang == ""
            for inv in invocations(b)]

    marked = [b for b in blocks if b.run and not args.no_run]
    # --help runs and marked blocks are independent: run them side by side
    keys = sorted({(i.kind, i.target) for i in invs if i.kind in ("script", "module",
                                                                   *LAUNCHERS)})
    with cf.ThreadPoolExecutor(max_workers=4) as pool:
        ran = [pool.submit(run_block, b) for b in marked]
        futs = {k: pool.submit(help_flags, next(i for i in invs if (i.kind, i.target) == k))
                for k in keys}
        helps = {k: f.result() for k, f in futs.items()}

        # 1. flags and links -----------------------------------------------------------------
        problems, checked_flags = check_flags(invs, helps, make_targets(), args.verbose)
        problems += [p for f in files for p in check_links(f)]
        problems += check_results()
        problems += check_gpu_claims()
        problems += check_length()
        problems += [p for f in files for p in rendered_tables(f)]
        api_problems, api_skipped = check_api()
        problems += api_problems
        for name in api_skipped:
            print(f"check_docs: {API_PAGE}: not checked: {name}")
        checked = [k[1] for k in keys if helps[k][0] not in (None, SKIPPED)]
        for k in keys:
            if helps[k][0] is SKIPPED:
                print(f"check_docs: {k[1]}: {helps[k][1]}")
        print(f"check_docs: {len(files)} files, {len(blocks)} code blocks/spans, "
              f"{len(invs)} commands of this repository or horovodrun/make; "
              f"{checked_flags} flags checked against the --help of {len(checked)} programs "
              f"({', '.join(checked)}) in {time.perf_counter() - t0:.1f} s", flush=True)

        # 2. quick commands ------------------------------------------------------------------
        if args.no_run:
            print(f"check_docs: {len([b for b in blocks if b.run])} marked blocks not run "
                  "(--no-run)")
        for b, fut in zip(marked, ran):
            ok, dt, tail = fut.result()
            first = b.text.strip().split("\n")[0]
            first = first if len(first) <= 90 else first[:87] + "..."
            print(f"  {'ran' if ok else 'FAILED'} {b.path}:{b.line} ({b.lang}, {dt:.1f} s): "
                  f"{first}")
            if not ok:
                problems.append(f"{b.path}:{b.line}: marked block failed:\n{tail}")

    for p in problems:
        print(f"check_docs: ERROR {p}")
    print(f"check_docs: {'FAILED, ' + str(len(problems)) + ' problems' if problems else 'ok'} "
          f"in {time.perf_counter() - t0:.1f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
