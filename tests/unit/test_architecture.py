"""The package's architecture rules (docs/dev/architecture.md), checked on its source.

* Every module is in a layer, or is one of the few that stand outside them (which no layer
  imports); no import cycles (lazy imports included); imports run one way through the layers.
* No module outside the codec modules names a codec; codecs declare what the other layers need.
* Only a door's exchange runtime builds exchanges, codec states and configuration checks.
* Outside the codecs' layer a decision about a codec reads its traits (``codec.traits``): no
  ``isinstance`` with a capability type, no read of what the traits carry from anything else.
* Backends share only the protocol: no backend imports another, and only the backend picker
  (and the public GPU helpers) import a backend implementation.
* The layers below the doors import no framework and no Horovod.
* The exchange layer and the fallback controller read no environment variable: the doors read
  their settings once (``doors.DoorEnvironment``) and hand the values down.
* The exchange uses only what ``Codec`` declares (methods and attributes); no module fills
  another module's table on import (registration is written where the table is read).
* Sizes a reader can take in: no class over 300 lines, no module docstring over 20 lines, no
  one-letter module alias, no issue number or commit hash.
* A module is what its file says: none writes into ``sys.modules`` (to replace itself, or its
  class: a callable module).

The rules read the source with :mod:`ast`; nothing is imported but the registry and ``Codec``.
Each rule also runs on made-up source that breaks it, so that it can fail.
"""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import horovod_quant
from horovod_quant.core import registry
from horovod_quant.core.base import Codec
from horovod_quant.core.contract import (
    DECLARED,
    CombinedDecodable,
    GlobalNorm,
    Reduced,
    SideInformation,
    SumDecodable,
)

PACKAGE_DIR = Path(horovod_quant.__file__).resolve().parent
PACKAGE = "horovod_quant"

#: Layers from the bottom: a module may import its own layer and the ones before it, never a
#: later one. The first prefix that matches a module decides its layer (the most specific
#: prefixes first); every module is in one, except those of :data:`OUTSIDE_LAYERS`.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("environment", ("horovod_quant.env",)),
    ("backends", ("horovod_quant.backends",)),
    ("codecs", ("horovod_quant.core",)),
    ("gpu helpers", ("horovod_quant.gpu",)),
    ("exchange", ("horovod_quant.exchange",)),
    ("fallback controller", ("horovod_quant.fallback",)),
    ("doors", ("horovod_quant.doors", "horovod_quant.policy", "horovod_quant.stats",
               "horovod_quant.process_sets", "horovod_quant.addresses", "horovod_quant.store",
               "horovod_quant.rendezvous", "horovod_quant.torch", "horovod_quant.tensorflow")),
]

#: Modules that stand outside the layers (docs/dev/architecture.md): the package's top, and the
#: applications of the package, which may import any layer and which no layer imports: the
#: demo, the tools (``horovod_quant.tools``: the predictor) and the predictor's command
#: (``python -m horovod_quant.predict``).
OUTSIDE_LAYERS = {"horovod_quant", "horovod_quant.demo", "horovod_quant.tools",
                  "horovod_quant.tools.predict", "horovod_quant.predict",
                  "horovod_quant.tools.simulated"}

#: Modules that may name codecs besides the modules that define them: the registry and the
#: registration in the codecs' package, and the demo, which is an application of the package
#: (it picks codecs by name as a user's script does). The tools ask the registry and the
#: codecs' declarations instead (a spec's suffix: ``Codec.spec_suffixes``).
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


def unplaced(modules: list[str]) -> list[str]:
    """The ``modules`` in no layer and not in :data:`OUTSIDE_LAYERS`."""
    return [m for m in modules if layer_of(m) is None and m not in OUTSIDE_LAYERS]


def test_every_module_is_in_a_layer() -> None:
    found = unplaced(sorted(package_modules()))
    assert not found, ("modules in no layer (add a prefix to a layer of LAYERS and place them in "
                       "docs/dev/architecture.md's picture):\n" + "\n".join(found))


def imports_of_the_outside(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a module outside the layers by a module in one."""
    return [f"{module} ({LAYERS[layer_of(module)][0]}) imports {target}"
            for module, targets in sorted(graph.items()) if layer_of(module) is not None
            for target in sorted(targets) if target in OUTSIDE_LAYERS]


def test_no_layer_imports_an_application() -> None:
    found = imports_of_the_outside(import_graph())
    assert not found, ("layers import modules outside them (an application's code that a layer "
                       "needs belongs in that layer):\n" + "\n".join(found))


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


#: The backend implementations; they share only ``horovod_quant.backends.protocol``.
BACKENDS = ("horovod_quant.backends.numba", "horovod_quant.backends.cuda")
#: Modules outside the implementations that may import one: the picker (``backend_of``) and the
#: public GPU helpers, which are helpers over the CUDA backend.
MAY_IMPORT_BACKENDS = {"horovod_quant.backends", "horovod_quant.gpu"}
#: Frameworks the layers below the doors never import (the CUDA backend views torch tensors,
#: so the backends layer is not among them).
FRAMEWORKS = ("horovod", "torch", "tensorflow")
FRAMEWORK_FREE_LAYERS = ("codecs", "gpu helpers", "exchange", "fallback controller")
#: Modules of the doors' layer that every door uses and that import no framework, nor does a
#: module of the doors' layer they import (the layers below obey their own rules): the
#: rendezvous beside Horovod and its store (the TensorFlow door must not load torch).
FRAMEWORK_FREE_DOORS = ("horovod_quant.addresses", "horovod_quant.store",
                        "horovod_quant.rendezvous")
#: Layers that read no environment variable (the doors read it, once, and pass values down).
ENVIRONMENT_FREE_LAYERS = ("gpu helpers", "exchange", "fallback controller")
#: What reads the environment in ``os``; this package's helpers are the functions of
#: :data:`ENV_MODULE` (any import of it counts, and so does a call of a helper's name).
OS_ENVIRONMENT = {"environ", "environb", "getenv", "getenvb"}
ENV_MODULE = "horovod_quant.env"
MAX_CLASS_LINES = 300
MAX_MODULE_DOC_LINES = 20
#: The capabilities a codec may have (horovod_quant/core/contract.py).
CAPABILITIES = (SumDecodable, Reduced, GlobalNorm, SideInformation)
#: The capability types no module outside the codecs' layer checks a codec against.
CAPABILITY_NAMES = {cap.__name__ for cap in (*CAPABILITIES, CombinedDecodable)}
#: What a codec's traits carry and a codec class once declared as attributes, and the string
#: flags they replaced: read only on traits (``codec.traits.wire_dtype``) outside the codecs.
TRAIT_DECLARATIONS = set(DECLARED) | {"horovod_allreduce", "norm_op"}
#: What ``Codec`` and its capabilities declare: the names the exchange may use on a codec.
CODEC_DECLARES = set(dir(Codec)) | set(Codec.__annotations__) | {"params", "world_size"} | {
    name for cap in CAPABILITIES for name in set(dir(cap)) | set(cap.__annotations__)}
ISSUE_REFERENCE = re.compile(r"\b(?:issues?|PR|pull request)\s*#?\s*\d+\b|/issues/\d+"
                             r"|\bcommit\s+[0-9a-f]{7,40}\b", re.IGNORECASE)


def env_helpers() -> set[str]:
    """The names of the functions :data:`ENV_MODULE` defines (the environment's helpers)."""
    path = PACKAGE_DIR / "env.py"
    return {node.name for node in ast.parse(path.read_text(), str(path)).body
            if isinstance(node, ast.FunctionDef)}


def environment_reads(module: str, path: Path) -> list[str]:
    """Reads of the environment in ``module``'s source, as ``line: text``: ``os.environ``
    and ``os.getenv`` (through any name ``os`` is bound to, or imported from ``os``), an
    import of :data:`ENV_MODULE` or of a name from it, and a call of one of its helpers."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    os_names = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                for a in node.names if a.name == "os"}
    helpers = env_helpers()
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in OS_ENVIRONMENT \
                and isinstance(node.value, ast.Name) and node.value.id in os_names:
            read = True
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "os":
            read = any(a.name in OS_ENVIRONMENT for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node)
            read = base == ENV_MODULE or any(f"{base}.{a.name}" == ENV_MODULE
                                             for a in node.names)
        elif isinstance(node, ast.Import):
            read = any(a.name == ENV_MODULE for a in node.names)
        elif isinstance(node, ast.Call):
            func = node.func
            read = (isinstance(func, ast.Name) and func.id in helpers) or (
                isinstance(func, ast.Attribute) and func.attr in helpers)
        else:
            continue
        if read:
            hits.append((node.lineno, ast.unparse(node)))
    return [f"{line}: {text}" for line, text in sorted(hits)]


def implementation_of(module: str) -> str | None:
    """The backend implementation ``module`` belongs to, or None."""
    return next((b for b in BACKENDS if module == b or module.startswith(b + ".")), None)


def backend_leaks(graph: dict[str, set[str]]) -> tuple[list[str], list[str]]:
    """(imports of one backend by another, imports of a backend by a module that is neither
    one nor in :data:`MAY_IMPORT_BACKENDS`)."""
    across, outside = [], []
    for module, targets in sorted(graph.items()):
        mine = implementation_of(module)
        for target in sorted(targets):
            theirs = implementation_of(target)
            if theirs is None or theirs == mine:
                continue
            if mine is not None:
                across.append(f"{module} imports {target}")
            elif module not in MAY_IMPORT_BACKENDS:
                outside.append(f"{module} imports {target}")
    return across, outside


def external_imports(path: Path) -> list[tuple[int, str]]:
    """Top-level names of the modules outside the package that ``path`` imports, anywhere in
    its source, as (line, name)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def _is_codec(node: ast.AST) -> bool:
    """An expression that holds a codec by this package's naming: ``codec`` or ``<x>.codec``."""
    return (isinstance(node, ast.Name) and node.id == "codec") or \
        (isinstance(node, ast.Attribute) and node.attr == "codec")


def undeclared_codec_uses(path: Path) -> list[str]:
    """``codec.<name>`` (and ``getattr(codec, "<name>")``) with a name ``Codec`` does not
    declare, as ``line: name``."""
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and _is_codec(node.value):
            name = node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 \
                and _is_codec(node.args[0]) and isinstance(node.args[1], ast.Constant):
            name = node.args[1].value
        else:
            continue
        if name not in CODEC_DECLARES:
            hits.append(f"{node.lineno}: {name}")
    return hits


def _is_traits(node: ast.AST) -> bool:
    """``traits`` or ``<x>.traits``: where what :data:`TRAIT_DECLARATIONS` names may be read."""
    return (isinstance(node, ast.Name) and node.id == "traits") or \
        (isinstance(node, ast.Attribute) and node.attr == "traits")


def capability_dispatch(path: Path) -> list[str]:
    """Decisions on a codec that bypass its traits, as ``line: text``: ``isinstance`` or
    ``issubclass`` with a capability type (by its name, an alias of it or ``<module>.<name>``,
    alone or in a tuple), and a read of a name of :data:`TRAIT_DECLARATIONS` on anything but
    traits (``x.<name>``, ``getattr(x, "<name>")``)."""
    tree = ast.parse(path.read_text(), str(path))
    capabilities = CAPABILITY_NAMES | {a.asname for node in ast.walk(tree)
                                       if isinstance(node, ast.ImportFrom)
                                       for a in node.names
                                       if a.name in CAPABILITY_NAMES and a.asname}

    def is_capability(node: ast.AST) -> bool:
        if isinstance(node, ast.Tuple):
            return any(is_capability(e) for e in node.elts)
        return (isinstance(node, ast.Name) and node.id in capabilities) or \
            (isinstance(node, ast.Attribute) and node.attr in CAPABILITY_NAMES)

    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            name, args = node.func.id, node.args
            if name in ("isinstance", "issubclass") and len(args) == 2 \
                    and is_capability(args[1]):
                hits.append((node.lineno, ast.unparse(node)))
            elif name in ("getattr", "hasattr") and len(args) >= 2 \
                    and isinstance(args[1], ast.Constant) \
                    and args[1].value in TRAIT_DECLARATIONS and not _is_traits(args[0]):
                hits.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Attribute) and node.attr in TRAIT_DECLARATIONS \
                and not _is_traits(node.value):
            hits.append((node.lineno, ast.unparse(node)))
    return [f"{line}: {text}" for line, text in sorted(hits)]


def long_classes(path: Path, limit: int = MAX_CLASS_LINES) -> list[tuple[str, int]]:
    """Classes of more than ``limit`` lines (decorators and docstring included)."""
    tree = ast.parse(path.read_text(), str(path))
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > limit]


def module_doc_lines(path: Path) -> int:
    doc = ast.get_docstring(ast.parse(path.read_text(), str(path)), clean=False)
    return len(doc.splitlines()) if doc else 0


def one_letter_aliases(path: Path) -> list[str]:
    """Imports bound to a one-letter name (``import x as Y``, ``from . import x as Y``)."""
    return [f"{node.lineno}: {a.name} as {a.asname}"
            for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, (ast.Import, ast.ImportFrom))
            for a in node.names if a.asname is not None and len(a.asname) == 1]


def issue_references(path: Path) -> list[str]:
    """Lines naming an issue, a pull request or a commit (they belong in the history)."""
    return [f"{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
            if ISSUE_REFERENCE.search(line)]


def _is_sys_modules(node: ast.AST, aliases: set[str]) -> bool:
    """``sys.modules``, or a name bound by ``from sys import modules``."""
    return (isinstance(node, ast.Attribute) and node.attr == "modules"
            and isinstance(node.value, ast.Name) and node.value.id == "sys") or \
        (isinstance(node, ast.Name) and node.id in aliases)


def _reaches_sys_modules(node: ast.AST, aliases: set[str]) -> bool:
    """``node`` is ``sys.modules`` or an item or attribute of it (``sys.modules[n].x``)."""
    while True:
        if _is_sys_modules(node, aliases):
            return True
        if not isinstance(node, (ast.Subscript, ast.Attribute)):
            return False
        node = node.value


def sys_modules_writes(path: Path) -> list[str]:
    """Writes into ``sys.modules`` or into a module found there, as ``line: text``: item and
    attribute assignments (``sys.modules[__name__] = ...``, ``sys.modules[__name__].__class__
    = ...``), ``setattr`` on one, and ``sys.modules``' own ``update``, ``setdefault`` and
    ``__setitem__``."""
    tree = ast.parse(path.read_text(), str(path))
    aliases = {a.asname or a.name for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.module == "sys"
               for a in node.names if a.name == "modules"}
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            written = any(_reaches_sys_modules(t, aliases) for t in targets)
        elif isinstance(node, ast.Call):
            func = node.func
            written = (isinstance(func, ast.Name) and func.id == "setattr" and node.args
                       and _reaches_sys_modules(node.args[0], aliases)) or (
                isinstance(func, ast.Attribute)
                and func.attr in ("update", "setdefault", "__setitem__")
                and _is_sys_modules(func.value, aliases))
        else:
            continue
        if written:
            hits.append(f"{node.lineno}: {ast.unparse(node)}")
    return hits


def test_no_module_replaces_itself_in_sys_modules() -> None:
    found = {m: hits for m, p in package_modules().items()
             for hits in [sys_modules_writes(p)] if hits}
    assert not found, ("modules write into sys.modules (a module is what its file says: export "
                       "a function under its own name, run a command from a module of its "
                       "own):\n" + "\n".join(f"{m}: {h}" for m, h in found.items()))


def test_backends_do_not_import_each_other() -> None:
    across, _ = backend_leaks(import_graph())
    assert not across, ("a backend imports another (share what both need through "
                        "horovod_quant/backends/protocol.py):\n" + "\n".join(across))


def test_only_the_backend_picker_imports_a_backend() -> None:
    _, outside = backend_leaks(import_graph())
    assert not outside, ("modules import a backend implementation (use horovod_quant.backends: "
                         "backend_of and the protocol's constants):\n" + "\n".join(outside))


def test_layers_below_the_doors_import_no_framework() -> None:
    found = []
    for module, path in package_modules().items():
        layer = layer_of(module)
        if layer is None or LAYERS[layer][0] not in FRAMEWORK_FREE_LAYERS:
            continue
        found += [f"{module}:{line} imports {name}" for line, name in external_imports(path)
                  if name in FRAMEWORKS]
    assert not found, ("framework imports below the doors (move them into a door, e.g. "
                       "horovod_quant/process_sets.py):\n" + "\n".join(found))


def framework_imports_of(modules: tuple[str, ...], graph: dict[str, set[str]],
                         paths: dict[str, Path], within: str = "doors") -> list[str]:
    """Framework imports of ``modules`` and of every module of the layer ``within`` they
    import, directly or not, as ``module:line imports name``."""
    seen, todo = set(), list(modules)
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += [m for m in graph.get(module, ())
                     if layer_of(m) is not None and LAYERS[layer_of(m)][0] == within]
    return [f"{module}:{line} imports {name}" for module in sorted(seen)
            for line, name in external_imports(paths[module]) if name in FRAMEWORKS]


def test_the_rendezvous_beside_horovod_imports_no_framework() -> None:
    found = framework_imports_of(FRAMEWORK_FREE_DOORS, import_graph(), package_modules())
    assert not found, ("the rendezvous beside Horovod (or a module it imports) imports a "
                       "framework; every door uses it:\n" + "\n".join(found))


def test_framework_imports_of_a_module_and_its_doors_are_found(tmp_path: Path) -> None:
    texts = {"horovod_quant.store": "from . import doors\n",
             "horovod_quant.doors": "from .core import base\ndef f():\n    import torch\n",
             "horovod_quant.core.base": "import tensorflow\n",  # its layer's rule tells
             "horovod_quant.policy": "import horovod\n"}  # not imported
    paths = {}
    for module, text in texts.items():
        paths[module] = tmp_path / f"{module}.py"
        paths[module].write_text(text)
    graph = {"horovod_quant.store": {"horovod_quant.doors"},
             "horovod_quant.doors": {"horovod_quant.core.base"}}
    assert framework_imports_of(("horovod_quant.store",), graph, paths) == [
        "horovod_quant.doors:3 imports torch"]


def test_the_exchange_and_the_fallback_read_no_environment() -> None:
    found = {module: hits for module, path in package_modules().items()
             if layer_of(module) is not None
             and LAYERS[layer_of(module)][0] in ENVIRONMENT_FREE_LAYERS
             for hits in [environment_reads(module, path)] if hits}
    assert not found, ("the exchange layer or the fallback controller reads the environment "
                       "(read it once at the door, horovod_quant.doors.DoorEnvironment, and "
                       "pass the value down):\n"
                       + "\n".join(f"{m}: {h}" for m, h in found.items()))


#: what only a door's runtime builds (horovod_quant.exchange.runtime), and the modules that may
#: build one besides: the module defining it, and the exchange's own codec states (an Exchange
#: built without a door, by a test or a benchmark, keeps its own)
RUNTIME_PARTS = {"Exchange": {"horovod_quant.exchange.driver"},
                 "CodecStates": {"horovod_quant.exchange.codec_states",
                                 "horovod_quant.exchange.driver"},
                 "ConfigCheck": {"horovod_quant.exchange.check"}}
RUNTIME_MODULE = "horovod_quant.exchange.runtime"


def runtime_constructions(module: str, path: Path) -> list[str]:
    """Calls in ``module``'s source that build an exchange, a codec state or a check
    (:data:`RUNTIME_PARTS`, by name or attribute) outside the runtime and the part's own
    module, as ``line: text``."""
    if module == RUNTIME_MODULE:
        return []
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else (
            func.attr if isinstance(func, ast.Attribute) else None)
        if name in RUNTIME_PARTS and module not in RUNTIME_PARTS[name]:
            hits.append(f"{node.lineno}: {ast.unparse(node)}")
    return hits


def test_only_the_runtime_builds_exchanges_codec_states_and_checks() -> None:
    found = {module: hits for module, path in package_modules().items()
             for hits in [runtime_constructions(module, path)] if hits}
    assert not found, ("a module builds an exchange, a codec state or a check itself (a door "
                       "hands (key, vector) to its horovod_quant.exchange.runtime."
                       "ExchangeRuntime, which builds them):\n"
                       + "\n".join(f"{m}: {h}" for m, h in found.items()))


def test_runtime_constructions_are_found_on_a_made_up_module(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from ..exchange.driver import Exchange\n"
                   "from ..exchange import check\n"
                   "e = Exchange(codec, comm)\n"
                   "c = check.ConfigCheck(comm, {})\n"
                   "s = CodecStates()\n"
                   "t = Exchange\n")
    hits = runtime_constructions("horovod_quant.torch.m", src)
    assert [h.split(":")[0] for h in hits] == ["3", "4", "5"], hits
    assert runtime_constructions(RUNTIME_MODULE, src) == []
    assert [h.split(":")[0] for h in runtime_constructions("horovod_quant.exchange.driver",
                                                           src)] == ["4"]


def test_the_exchange_uses_only_what_codec_declares() -> None:
    found = {module: hits for module, path in package_modules().items()
             if layer_of(module) is not None and LAYERS[layer_of(module)][0] == "exchange"
             for hits in [undeclared_codec_uses(path)] if hits}
    assert not found, ("the exchange uses codec names Codec does not declare (declare them on "
                       "Codec, with a capability flag and a contract):\n"
                       + "\n".join(f"{m}: {h}" for m, h in found.items()))


def test_decisions_on_a_codec_read_its_traits() -> None:
    found = {module: hits for module, path in package_modules().items()
             if layer_of(module) is None or LAYERS[layer_of(module)][0] != "codecs"
             for hits in [capability_dispatch(path)] if hits}
    assert not found, ("modules outside the codecs decide on a codec by its type or by what its "
                       "traits carry (read codec.traits, horovod_quant/core/contract.py; add a "
                       "trait there where one is missing):\n"
                       + "\n".join(f"{m}: {h}" for m, h in found.items()))


def import_side_registrations(path: Path) -> list[str]:
    """Module-level item assignments into a name imported from the package (``TABLE[key] =
    value`` with ``TABLE`` from another package module: a registration run by importing), as
    ``line: text``."""
    tree = ast.parse(path.read_text(), str(path))
    imported = {(a.asname or a.name).split(".")[0] for node in tree.body
                if isinstance(node, ast.ImportFrom) and (node.level > 0 or (
                    node.module or "").split(".")[0] == PACKAGE)
                or isinstance(node, ast.Import) and node.names[0].name.split(".")[0] == PACKAGE
                for a in node.names}
    hits = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            base = target
            while isinstance(base, (ast.Subscript, ast.Attribute)):
                base = base.value
            if target is not base and isinstance(base, ast.Name) and base.id in imported:
                hits.append(f"{node.lineno}: {ast.unparse(node)}")
    return hits


def test_no_module_registers_into_another_on_import() -> None:
    found = {m: hits for m, p in package_modules().items()
             for hits in [import_side_registrations(p)] if hits}
    assert not found, ("modules fill another module's table when imported (write the entry "
                       "where the table is defined, so that no import order matters):\n"
                       + "\n".join(f"{m}: {h}" for m, h in found.items()))


def test_no_class_is_over_300_lines() -> None:
    found = [f"{module}.{name}: {lines} lines" for module, path in package_modules().items()
             for name, lines in long_classes(path)]
    assert not found, (f"classes over {MAX_CLASS_LINES} lines (split them by idea):\n"
                       + "\n".join(found))


def test_module_docstrings_state_the_contract_in_20_lines() -> None:
    found = [f"{module}: {lines} lines" for module, path in package_modules().items()
             for lines in [module_doc_lines(path)] if lines > MAX_MODULE_DOC_LINES]
    assert not found, (f"module docstrings over {MAX_MODULE_DOC_LINES} lines (move "
                       f"measurements and derivations into docs/ and cite them):\n"
                       + "\n".join(found))


def test_no_one_letter_module_aliases() -> None:
    found = {m: hits for m, p in package_modules().items()
             for hits in [one_letter_aliases(p)] if hits}
    assert not found, ("one-letter import aliases (import the module by its name):\n"
                       + "\n".join(f"{m}: {h}" for m, h in found.items()))


def test_no_issue_numbers_in_the_package() -> None:
    found = {m: hits for m, p in package_modules().items()
             for hits in [issue_references(p)] if hits}
    assert not found, ("issue, pull-request or commit references in the package (say what the "
                       "code does; the history keeps why):\n"
                       + "\n".join(f"{m}: {h}" for m, h in found.items()))


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


def test_an_unplaced_module_is_found() -> None:
    assert unplaced(["horovod_quant.torch.buckets", "horovod_quant.demo",
                     "horovod_quant.tools.predict", "horovod_quant.newcomer"]) == [
        "horovod_quant.newcomer"]


def test_a_layer_importing_an_application_is_found() -> None:
    graph = {"horovod_quant.exchange.cost": {"horovod_quant.tools.predict",
                                             "horovod_quant.exchange.topology"},
             "horovod_quant.tools.predict": {"horovod_quant.exchange.cost"}}
    assert imports_of_the_outside(graph) == [
        "horovod_quant.exchange.cost (exchange) imports horovod_quant.tools.predict"]


def test_writes_into_sys_modules_are_found(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import sys\nfrom sys import modules as loaded\n"
                   "torch = sys.modules.get('torch')\n"
                   "sys.modules[__name__] = object()\n"
                   "sys.modules[__name__].__class__ = type\n"
                   "setattr(sys.modules[__name__], '__call__', print)\n"
                   "loaded.update(x=sys)\n"
                   "if 'numba' in sys.modules:\n    pass\n")
    assert [h.split(":")[0] for h in sys_modules_writes(src)] == ["4", "5", "6", "7"]


def test_backend_leaks_are_found_on_a_made_up_graph() -> None:
    graph = {"horovod_quant.backends.cuda.levels": {"horovod_quant.backends.numba.packing",
                                                    "horovod_quant.backends.protocol"},
             "horovod_quant.core.quantizers": {"horovod_quant.backends.numba.elias",
                                               "horovod_quant.backends"},
             "horovod_quant.backends": {"horovod_quant.backends.numba"},
             "horovod_quant.backends.numba": {"horovod_quant.backends.numba.levels"}}
    across, outside = backend_leaks(graph)
    assert across == ["horovod_quant.backends.cuda.levels imports "
                      "horovod_quant.backends.numba.packing"]
    assert outside == ["horovod_quant.core.quantizers imports horovod_quant.backends.numba.elias"]


def test_environment_reads_are_found_on_a_made_up_module(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import os\n"
                   "import os as system\n"
                   "from os import environ, getenv as lookup, path\n"
                   "from ..env import env_flag\n"
                   "from horovod_quant import env\n"
                   "a = os.environ.get('HQ_A')\n"
                   "b = system.getenv('HQ_B')\n"
                   "c = env_flag('HQ_C')\n"
                   "d = env.env_text('HQ_D')\n"
                   "e = os.path.join('x', 'y'), path.sep, os.cpu_count()\n")
    hits = environment_reads("horovod_quant.exchange.m", src)
    assert [h.split(":")[0] for h in hits] == ["3", "4", "5", "6", "7", "8", "9"], hits
    assert environment_reads("horovod_quant.exchange.cost",
                             PACKAGE_DIR / "exchange" / "cost.py") == []
    assert environment_reads("horovod_quant.doors", PACKAGE_DIR / "doors.py")  # the door reads


def test_capability_dispatch_is_found_on_a_made_up_module(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("from ..core import contract\n"
                   "from ..core.contract import GlobalNorm, SideInformation as Side\n"
                   "def f(codec: GlobalNorm, c, traits):\n"
                   "    if isinstance(codec, GlobalNorm) or isinstance(c, (int, Side)):\n"
                   "        return issubclass(type(c), contract.Reduced)\n"
                   "    if c.horovod_allreduce == 'keep' or type(codec).wire_dtype:\n"
                   "        return getattr(codec, 'head_nbytes', 0), codec.norm_op\n"
                   "    return (codec.traits.wire_dtype, traits.collective, isinstance(c, int),\n"
                   "            getattr(c.traits, 'horovod_wire'))\n")
    hits = capability_dispatch(src)
    assert [h.split(":")[0] for h in hits] == ["4", "4", "5", "6", "6", "7", "7"], hits
    assert capability_dispatch(PACKAGE_DIR / "exchange" / "plans.py") == []


def test_source_rules_fail_on_made_up_modules(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    doc = "\n".join(f"line {i}" for i in range(MAX_MODULE_DOC_LINES + 1))
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_CLASS_LINES))
    src.write_text(f'"""{doc}"""\n'
                   "from horovod.common.process_sets import global_process_set\n"
                   "from . import dithered as D\n"
                   "import numpy as np\n"
                   "def f(codec, p):\n"
                   "    codec.decode_side_info(1)  # see issue 123\n"
                   "    return p.codec.last_stats, getattr(codec, 'levels', None), codec.encode\n"
                   f"class Big:\n{body}\n")
    assert module_doc_lines(src) == MAX_MODULE_DOC_LINES + 1
    assert ("horovod" in [name for _, name in external_imports(src)])
    first = MAX_MODULE_DOC_LINES + 1  # the line the docstring ends on
    assert one_letter_aliases(src) == [f"{first + 2}: dithered as D"]
    assert undeclared_codec_uses(src) == [f"{first + 5}: decode_side_info",
                                          f"{first + 6}: last_stats", f"{first + 6}: levels"]
    assert long_classes(src) == [("Big", MAX_CLASS_LINES + 1)]
    assert [h.split(":")[0] for h in issue_references(src)] == [str(first + 5)]
    registers = tmp_path / "r.py"
    registers.write_text("from .driver import TABLE\nfrom . import other\nlocal = {}\n"
                         "TABLE['name'] = 1\nother.TABLE['x'] = 2\nlocal['y'] = 3\n")
    assert [h.split(":")[0] for h in import_side_registrations(registers)] == ["4", "5"]
    assert not issue_references(Path(__file__).with_name("conftest.py"))
