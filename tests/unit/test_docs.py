"""scripts/check_docs.py: command extraction, flag parsing and the checks themselves."""
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# importable by its name, as the processes its --help runs fork from import it
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import check_docs as cd  # noqa: E402


def _invs(text, lang="bash"):
    return cd.invocations(cd.Block("x.md", 1, lang, text))


def test_shell_commands_join_continuations_and_drop_comments_and_heredocs():
    text = ("# a comment\n"
            "$ python3 benchmarks/variance.py --plot-only   # trailing\n"
            "horovodrun -np 2 \\\n    python3 examples/comm_bound.py --steps 3\n"
            "cat > /tmp/x.py <<'EOF'\nimport sys; python3 examples/nothing.py --bad\nEOF\n"
            "echo done")
    cmds = [" ".join(c.split()) for c in cd.shell_commands(text)]
    assert cmds == ["python3 benchmarks/variance.py --plot-only # trailing",
                    "horovodrun -np 2 python3 examples/comm_bound.py --steps 3",
                    "cat > /tmp/x.py <<'EOF'", "echo done"]


def test_invocations_find_scripts_behind_launchers():
    got = [(i.kind, i.target, i.flags) for i in _invs(
        "sudo python3 benchmarks/cluster.py --rates 1gbit --quick\n"
        "NUMBA_NUM_THREADS=1 taskset -c 1 python3 benchmarks/codec_throughput.py --sizes=1M\n"
        "horovodrun -np 2 -H localhost:2 --gloo python3 examples/pytorch_digits.py --codec qsgd:8\n"
        "mpirun -np 2 --allow-run-as-root python3 -m horovod_quant.demo --quick; make demo\n"
        "python3 -c \"import horovod_quant\" && bash tests/parallel/run.sh\n"
        "python3 -m pytest -q tests/unit\n")]
    assert got == [
        ("script", "benchmarks/cluster.py", ["--rates", "--quick"]),
        ("script", "benchmarks/codec_throughput.py", ["--sizes"]),
        ("horovodrun", "horovodrun", ["-np", "-H", "--gloo"]),
        ("script", "examples/pytorch_digits.py", ["--codec"]),
        ("module", "horovod_quant.demo", ["--quick"]),
        ("make", "demo", []),
        ("file", "tests/parallel/run.sh", []),
    ]


def test_torchrun_flags_and_its_script_are_checked():
    got = [(i.kind, i.target, i.flags) for i in _invs(
        "torchrun --standalone --nproc_per_node 2 examples/ddp_train.py --codec qsgd:8\n"
        "python3 -m torch.distributed.run --standalone examples/ddp_train.py --steps 3\n")]
    assert got == [
        ("script", "examples/ddp_train.py", ["--codec"]),
        ("torchrun", "torchrun", ["--standalone", "--nproc_per_node"]),
    ]


def test_a_command_module_that_runs_another_s_main_has_its_flags_checked(tmp_path):
    """``python -m horovod_quant.predict`` runs horovod_quant/tools/predict.py's argparse."""
    assert cd._uses_argparse(os.path.join(ROOT, "horovod_quant", "predict.py"))
    (tmp_path / "tool.py").write_text("def main():\n    return 0\n")
    (tmp_path / "command.py").write_text("from .tool import main\n")
    assert not cd._uses_argparse(str(tmp_path / "command.py"))
    (tmp_path / "tool.py").write_text("import argparse\n")
    assert cd._uses_argparse(str(tmp_path / "command.py"))


def test_parse_help_reads_usage_and_option_lines():
    text = ("usage: x.py [-h] [--worlds WORLDS] [--first-seed FIRST_SEED]\n"
            "            [--launcher {horovodrun,mpirun}]\n\n"
            "Runs --not-a-flag-of-x in its description.\n\n"
            "options:\n  -h, --help            show this help\n"
            "  -v, --verbose         more output, see --also-not\n")
    assert cd.parse_help(text) == {"-h", "--worlds", "--first-seed", "--launcher", "--help",
                                   "-v", "--verbose"}


def test_check_flags_reports_unknown_flags_targets_and_files():
    invs = _invs("python3 benchmarks/variance.py --plot-only --plot-onyl\n"
                 "make no-such-target\nbash scripts/no_such.sh\n")
    helps = {("script", "benchmarks/variance.py"): ({"-h", "--plot-only"}, "")}
    problems, checked = cd.check_flags(invs, helps, {"test"})
    assert checked == 2 and len(problems) == 3
    assert "has no --plot-onyl" in problems[0]
    assert "no such Makefile target" in problems[1]
    assert "scripts/no_such.sh does not exist" in problems[2]


def test_read_blocks_marker_and_inline_spans(tmp_path):
    doc = tmp_path / "d.md"
    doc.write_text("Text `python3 benchmarks/variance.py\n--plot-only` here.\n\n"
                   "<!-- check-docs: run timeout=30 -->\n```python\nprint(1)\n```\n\n"
                   "1. item\n\n   ```bash\n   make demo\n   ```\n")
    blocks = cd.read_blocks(str(doc))
    run = [b for b in blocks if b.run]
    assert len(run) == 1 and run[0].lang == "python" and run[0].timeout == 30
    assert [b.text for b in blocks if b.lang == "bash" and not b.inline] == ["make demo"]
    inline = [b for b in blocks if b.inline]
    assert [(i.target, i.flags) for b in inline for i in cd.invocations(b)] == [
        ("benchmarks/variance.py", ["--plot-only"])]
    ok, _, _ = cd.run_block(run[0])
    assert ok


def test_help_flags_of_a_real_script():
    inv = _invs("python3 benchmarks/convergence.py --worlds 2")[0]
    known, err = cd.help_flags(inv)
    assert not err and {"--worlds", "--seeds", "--plot-only"} <= known
    assert "--worker" not in known  # argparse.SUPPRESS: not a documented flag


def test_help_flags_skips_a_script_whose_optional_dependency_is_missing(tmp_path):
    script = tmp_path / "needs_tf.py"
    script.write_text("import argparse\nimport no_such_module_for_check_docs\n")
    inv = cd.Invocation("x.md:1", "python3 x.py --a", "script", str(script), ["--a"])
    known, note = cd.help_flags(inv)
    assert known is cd.SKIPPED and "no_such_module_for_check_docs" in note
    problems, checked = cd.check_flags([inv], {("script", str(script)): (known, note)}, set())
    assert problems == [] and checked == 0


def test_check_links_reports_missing_link_targets_and_quoted_paths(tmp_path, monkeypatch):
    (tmp_path / "docs" / "dev").mkdir(parents=True)
    (tmp_path / "docs" / "a.md").write_text("## The `part`: one\n")
    (tmp_path / "docs" / "dev" / "b.md").write_text(
        "[ok](../a.md#the-part-one) [web](https://x.org/y.md) [gone](../nope.md) "
        "[no](../a.md#other)\n"
        "`docs/a.md` `docs/missing.md` `bench_out/x.json`, see docs/gone.md.\n"
        "```bash\npython3 x.py --json docs/results/not_yet.json\n```\n")
    monkeypatch.setattr(cd, "ROOT", str(tmp_path))
    problems = cd.check_links("docs/dev/b.md")
    assert len(problems) == 4, problems
    assert "docs/dev/b.md:1: link to ../nope.md: no such file" in problems[0]
    assert "docs/dev/b.md:1: link to ../a.md#other: no heading with that anchor" in problems[1]
    assert "docs/dev/b.md:2: docs/gone.md" in problems[2]
    assert "docs/dev/b.md:2: docs/missing.md" in problems[3]


API_PAGE = ("# API\n"
            "### `horovod_quant.get_codec(name, **params)`\n"
            "### `horovod_quant.mean_estimate(codec, xs, seed=0, gather='allgather', "
            "pipeline_elems=None, topology=None, fabric=None, states=None)`\n"
            "### `horovod_quant.Codec.encode(x, seed=0)`\n"
            "### `horovod_quant.Payload(data, size, meta=<factory>)`\n")


def test_api_signatures_match_the_code():
    problems, skipped = cd.check_api_signatures(API_PAGE, modules=())
    assert problems == [] and skipped == []


def test_api_signature_check_fails_on_a_made_up_mismatch():
    page = (API_PAGE.replace("seed=0, gather='allgather'", "seed=1, gather='allgather'")
            .replace("get_codec(name, **params)", "get_codec(name, bits, **params)")
            .replace("Codec.encode(x, seed=0)", "Codec.encode(x, *, seed=0)")
            + "### `horovod_quant.no_such_function(x)`\n")
    problems, _ = cd.check_api_signatures(page, "api.md", modules=())
    assert len(problems) == 4, problems
    assert "api.md:2: horovod_quant.get_codec(name, bits, **params): the code has " \
           "horovod_quant.get_codec(name, **params)" in problems[0]
    assert "parameter seed documented with default '1', the code has 0" in problems[1]
    assert "Codec.encode(x, *, seed=0)" in problems[2]
    assert "no_such_function: no such object" in problems[3]


def test_api_check_names_public_objects_without_a_heading():
    problems, _ = cd.check_api_signatures(API_PAGE, "api.md", modules=("horovod_quant",))
    missing = sorted(p.split()[1] for p in problems)
    assert missing == ["horovod_quant.Codec", "horovod_quant.available_codecs",
                       "horovod_quant.derive_key", "horovod_quant.worker_seed"]


def test_api_defaults_compare_by_value_or_repr():
    assert cd._default_matches("1 << 21", 2097152, {})
    assert cd._default_matches("'auto'", "auto", {})
    assert not cd._default_matches("True", 1, {})  # same value, another type
    assert not cd._default_matches("None", 0, {})


def test_check_results_keeps_what_a_page_or_a_test_reads(tmp_path):
    results = tmp_path / "docs" / "results"
    results.mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / "README.md").write_text("see docs/results/run.md\n")
    (tmp_path / "tests" / "test_x.py").write_text("open('docs/results/raw_read.json')\n")
    # run.md names its raw run and a plot, and shows another plot
    (results / "run.md").write_text("from run_a.json; plot `run_a.png`; ![shown](shown.png)\n")
    for name in ("run.json", "run_a.json", "old.json", "raw_read.json", "raw_read.md",
                 "run_a.png", "shown.png"):
        (results / name).write_text("{}")
    (results / "README.md").write_text("| `run.md`, `run.json`, `old.json`, `run_a.png` | cmd |\n"
                                       "| `raw_*`, `shown.png` | cmd |\n")
    unread = "no page names it and no test or script reads it (delete it and say in " \
        "docs/results/README.md how to make it again)"
    problems = cd.check_results(str(tmp_path))
    # kept: run.md (a page), run.json (its data), raw_read.json (a test), shown.png (shown)
    assert problems == [
        f"docs/results/old.json: {unread}",
        f"docs/results/raw_read.md: {unread}",  # the rendition of a read run: not kept
        f"docs/results/run_a.json: {unread}",  # named by a results page only
        f"docs/results/run_a.png: {unread}",
        "docs/results/README.md does not say which command made run_a.json"], problems


def test_rendered_tables_fail_when_the_page_and_its_json_disagree(tmp_path):
    rr_spec = importlib.util.spec_from_file_location(
        "render_results", os.path.join(ROOT, "scripts", "render_results.py"))
    rr = importlib.util.module_from_spec(rr_spec)
    rr_spec.loader.exec_module(rr)
    tables = {"t": lambda: "| a | b |\n|---|---|\n| x | 1.00 |"}
    page = tmp_path / "p.md"
    page.write_text("intro\n<!-- results: t -->\n| a | b |\n|---|---|\n| x | 1.00 |\n\nend\n")
    assert rr.check_page("p.md", str(tmp_path), tables) == []
    page.write_text("<!-- results: t -->\n| a | b |\n|---|---|\n| x | 1.05 |\n"
                    "<!-- results: nope -->\n| a |\n")
    problems = rr.check_page("p.md", str(tmp_path), tables)
    assert len(problems) == 2
    assert "table 't' differs from its JSON" in problems[0] and "| x | 1.00 |" in problems[0]
    assert "no table named 'nope'" in problems[1]


def test_rendered_figures_fail_when_the_text_and_its_json_disagree(tmp_path):
    rr_spec = importlib.util.spec_from_file_location(
        "render_results", os.path.join(ROOT, "scripts", "render_results.py"))
    rr = importlib.util.module_from_spec(rr_spec)
    rr_spec.loader.exec_module(rr)
    figures = {"speed": lambda: "585-608 ms", "ratio": lambda: "1.7x"}
    page = tmp_path / "p.md"
    page.write_text("took <!-- figure: speed -->585-608 ms<!-- /figure --> and won by\n"
                    "<!-- figure: ratio -->1.7x<!-- /figure --> or more\n")
    assert rr.check_page("p.md", str(tmp_path), {}, figures) == []
    page.write_text("took <!-- figure: speed -->585-610 ms<!-- /figure --> and won by\n"
                    "<!-- figure: ratio -->1.7x<!-- /figure --> or "
                    "<!-- figure: nope -->2<!-- /figure -->\n")
    problems = rr.check_page("p.md", str(tmp_path), {}, figures)
    assert problems == [
        "p.md:1: figure 'speed' reads '585-610 ms', its JSON gives '585-608 ms' "
        "(python3 scripts/render_results.py --write)",
        "p.md:2: no figure named 'nope' in scripts/render_results.py"]


def test_every_figure_renderer_is_used_by_a_page():
    """Each FIGURES entry is used by a page, so none is rendered for nothing."""
    rr_spec = importlib.util.spec_from_file_location(
        "render_results", os.path.join(ROOT, "scripts", "render_results.py"))
    rr = importlib.util.module_from_spec(rr_spec)
    rr_spec.loader.exec_module(rr)
    used = set()
    for page in rr.PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as fh:
            used |= {m[1] for m in rr.FIGURE.finditer(fh.read())}
    assert used == set(rr.FIGURES)


def test_the_performance_page_matches_its_json():
    assert cd.rendered_tables("docs/performance.md") == []


def test_the_choosing_page_matches_its_json():
    assert cd.rendered_tables("docs/choosing.md") == []


def test_length_check_counts_the_user_docs_as_wc_does(tmp_path):
    (tmp_path / "docs" / "dev").mkdir(parents=True)
    (tmp_path / "README.md").write_text("one two\nthree")
    (tmp_path / "docs" / "a.md").write_text("four  five\n\nsix")
    (tmp_path / "docs" / "dev" / "long.md").write_text("word " * 100)  # not a user page
    assert cd.check_length(str(tmp_path), limit=6) == []
    problems = cd.check_length(str(tmp_path), limit=5)
    assert len(problems) == 1 and "6 words, over 5" in problems[0]
    assert cd.check_length() == []  # this checkout's pages


GPU_LIST_PAGE = """# GPU

## What has run on a GPU

The H100 rows (this section is the list: its prose is not a claim).

<!-- gpu-runs -->
| what ran | result | GPU | date | commit | file |
|---|---|---|---|---|---|
| tests/gpu | 200 passed | H100 | 2026-11-27 | abc1234 | [gpu_run.md](../results/gpu_run.md) |
{extra}<!-- /gpu-runs -->

## Testing

Measured on an H100 ([the list](#what-has-run-on-a-gpu)).
"""


def _gpu_tree(tmp_path, page: str, extra_row: str = "") -> str:
    (tmp_path / "docs" / "dev").mkdir(parents=True)
    (tmp_path / "docs" / "results").mkdir()
    (tmp_path / "docs" / "results" / "gpu_run.md").write_text("- date: 2026-11-27 16:27 UTC\n")
    (tmp_path / "docs" / "dev" / "gpu.md").write_text(GPU_LIST_PAGE.format(extra=extra_row))
    (tmp_path / "README.md").write_text(page)
    return str(tmp_path)


def test_gpu_claims_link_the_list_and_name_only_what_it_holds(tmp_path):
    root = _gpu_tree(tmp_path, """# x

The codecs run on the GPU through CUDA kernels (a capability, not a claim).

Another system's figures: 16 servers of 8 V100, a DGX-A100's adapters (no claim of ours).

```bash
echo "ran on an A100"   # fenced: not prose
```

Its tests passed on one H100 ([list](docs/dev/gpu.md#what-has-run-on-a-gpu)).

The doors have not run on a GPU.

| qsgd | ran on an A100, [list](docs/dev/gpu.md#what-has-run-on-a-gpu), gpu_run.json |

Measured on an H100: gpu_other.json ([list](docs/dev/gpu.md#what-has-run-on-a-gpu)).
""")
    problems = cd.check_gpu_claims(root)
    assert problems == [
        "README.md:13: GPU claim 'not run on a GPU': link the list "
        "(docs/dev/gpu.md#what-has-run-on-a-gpu) instead of restating it",
        "README.md:15: GPU claim 'on an A100': no run on a A100 in the list of docs/dev/gpu.md",
        "README.md:17: GPU claim 'on an H100': gpu_other.json is no file of the list of "
        "docs/dev/gpu.md"], problems


def test_gpu_list_rows_need_a_date_a_commit_and_a_file_that_agree(tmp_path):
    root = _gpu_tree(tmp_path, "nothing about GPUs\n", extra_row=(
        "| sanitizer | ok | H100 | 2026-11-28 | abc1234 | [gpu_run.md](../results/gpu_run.md) |\n"
        "| ncu | ok | RTX | 27 Nov | HEAD | [gone](../results/gpu_gone.txt) |\n"))
    problems = cd.check_gpu_claims(root)
    where = "docs/dev/gpu.md: GPU list row"
    assert problems == [
        f"{where} 'sanitizer': date 2026-11-28, the file says 2026-11-27",
        f"{where} 'ncu': 'RTX' is not a GPU model",
        f"{where} 'ncu': date '27 Nov' is not YYYY-MM-DD",
        f"{where} 'ncu': '[gone](../results/gpu_gone.txt)' is not a link to a file of "
        "docs/results"], problems


def test_the_gpu_list_and_the_pages_agree():
    assert cd.check_gpu_claims() == []
