"""The package's architecture rules (docs/architecture.md), checked on its source.

* No import cycles between the package's modules, lazy imports inside functions included: a
  lazy import hides a cycle from Python, not from a reader.
* Imports run one way through the layers (backends <- codecs <- exchange <- framework doors).
* No module outside the codec modules names a codec: neither a codec class nor a registered
  codec name as a string. Codecs declare what the other layers need (capability attributes).

The rules read the source with :mod:`ast`; nothing is imported but the registry (for the codec
names and the modules that define them).
"""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import horovod_quant
from horovod_quant.core import registry

PACKAGE_DIR = Path(horovod_quant.__file__).resolve().parent
PACKAGE = "horovod_quant"

#: Layers from the bottom: a module may import its own layer and the ones before it, never a
#: later one. The first prefix that matches a module decides its layer (the most specific
#: prefixes first); modules no prefix matches are unconstrained.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("environment", ("horovod_quant.env",)),
    ("backends", ("horovod_quant.backends",)),
    ("codecs", ("horovod_quant.core",)),
    ("gpu helpers", ("horovod_quant.gpu",)),
    ("exchange", ("horovod_quant.exchange",)),
    ("doors", ("horovod_quant.doors", "horovod_quant.policy", "horovod_quant.stats",
               "horovod_quant.torch", "horovod_quant.tensorflow")),
]

#: Modules that may name codecs besides the modules that define them: the registry and the
#: registration in the codecs' package, and the demo, which is an application of the package
#: (it picks codecs by name as a user's script does).
MAY_NAME_CODECS = {"horovod_quant.core", "horovod_quant.core.registry", "horovod_quant.demo"}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Package modules ``module`` imports anywhere in its source (function bodies included)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            # `from pkg import name`: a submodule when one is called so, else a name of pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (the cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def layer_of(module: str) -> int | None:
    for rank, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return rank
    return None


def codec_modules() -> set[str]:
    return {inspect.getmodule(registry.codec_class(n)).__name__
            for n in registry.available_codecs()}


def codec_mentions(path: Path) -> list[str]:
    """Codec class names and registered codec names (string constants other than docstrings)
    in a module's source, as ``line: text``."""
    names = set(registry.available_codecs())
    classes = {registry.codec_class(n).__name__ for n in names}
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    hits: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in names and id(node) not in docstrings:
                hits.append((node.lineno, f"string {node.value!r}"))
        elif isinstance(node, ast.Name) and node.id in classes:
            hits.append((node.lineno, f"class {node.id}"))
        elif isinstance(node, ast.Attribute) and node.attr in classes:
            hits.append((node.lineno, f"class {node.attr}"))
        elif isinstance(node, ast.alias) and node.name.split(".")[-1] in classes:
            hits.append((node.lineno, f"import of {node.name}"))
    return [f"{line}: {text}" for line, text in sorted(hits)]


def test_no_import_cycles() -> None:
    cycles = strongly_connected(import_graph())
    assert not cycles, ("import cycles between package modules (lazy imports included): "
                        + "; ".join(" <-> ".join(c) for c in cycles))


def test_imports_run_one_way_through_the_layers() -> None:
    wrong = []
    for module, targets in import_graph().items():
        mine = layer_of(module)
        if mine is None:
            continue
        for target in sorted(targets):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                wrong.append(f"{module} ({LAYERS[mine][0]}) imports {target} "
                             f"({LAYERS[theirs][0]})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_codecs_are_named_only_in_codec_modules() -> None:
    allowed = codec_modules() | MAY_NAME_CODECS
    found = {}
    for module, path in package_modules().items():
        if module not in allowed:
            hits = codec_mentions(path)
            if hits:
                found[module] = hits
    assert not found, ("modules outside the codecs name codecs (declare a capability on the "
                       "codec instead):\n" + "\n".join(f"{m}: {h}" for m, h in found.items()))


# -- the rules can fail: each one on a small made-up package graph or module ---------------------
def test_cycle_detection_finds_a_lazy_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [["a", "b", "c"]]


def test_codec_mentions_sees_names_and_classes(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    cls = registry.codec_class(registry.available_codecs()[-1]).__name__
    src.write_text(f'"""{registry.available_codecs()[-1]}"""\n'
                   f'def f(codec):\n    return codec.name == "{registry.available_codecs()[-1]}"\n'
                   f'def g(codec):\n    from x import {cls}\n    return isinstance(codec, {cls})\n')
    hits = codec_mentions(src)
    assert [h.split(":")[0] for h in hits] == ["3", "5", "6"], hits


@pytest.mark.parametrize("module,layer", [("horovod_quant.core.base", "codecs"),
                                          ("horovod_quant.torch.optimizer", "doors")])
def test_layer_prefixes(module: str, layer: str) -> None:
    assert LAYERS[layer_of(module)][0] == layer
