"""The import structure of mmnnx and multimesh_compat, read from the source (nothing imported).

Every module is parsed; an import (inside a function too) is an edge to the module it names:
``from pkg import name`` goes to ``pkg.name`` where that is a module, else to ``pkg`` (its
``__init__``). The checks: no cycle between modules, none between subpackages, no import going
up the layer table below (docs/architecture.md draws the same table), ``jax._src`` imported only
inside the fence ``mmnnx/_jax/``, the launcher ``mmnnx/launcher/`` importing nothing but the
standard library and ``mmnnx._env``, and multimesh_compat using mmnnx's public names only.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import itertools
import pathlib
import sys
from collections.abc import Callable

import mmnnx
import mmnnx.cli
import mmnnx.train

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("mmnnx", "multimesh_compat")

# Lowest first. A module belongs to the longest entry that is its name or a package holding it;
# an import may go to the same layer or a lower one only. ``mmnnx`` is the package's __init__.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "mmnnx.errors",
        "mmnnx._nnx",
        "mmnnx._tables",
        "mmnnx._jax",
        "mmnnx._error_location",
        "mmnnx._gc",
        "mmnnx._env",
    ),
    ("mmnnx.sharding", "mmnnx.launcher"),
    ("mmnnx.mpmd",),
    ("mmnnx.distributed",),
    (
        "mmnnx.jit",
        "mmnnx._argnums",
        "mmnnx._call",
        "mmnnx.cached_partial",
        "mmnnx._added",
        "mmnnx.deep_models",
        "mmnnx.microbatch",
        "mmnnx.summary",
        "mmnnx.timeline",
        "mmnnx.modules",
        "mmnnx.tuning",
        "mmnnx.link_timing",
    ),
    ("mmnnx.models", "mmnnx.train", "mmnnx.partition", "mmnnx.schedules"),
    ("mmnnx.cli", "mmnnx.__main__", "mmnnx"),
    ("multimesh_compat",),  # on top of mmnnx's public API
)

FENCE = "mmnnx._jax"
LAUNCHER = "mmnnx.launcher"
# JAX's internals: ``jax._src`` anywhere; of ``jax.interpreters``, only the modules that
# register a primitive's rules (``ad``, ``batching``, ``mlir``) outside the fence.
REGISTRATION = frozenset(
    {"jax.interpreters.ad", "jax.interpreters.batching", "jax.interpreters.mlir"}
)


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the module imported (one of ours), or the external name
    names: tuple[str, ...]  # the names taken from it (``from target import names``)
    line: int

    def __str__(self) -> str:
        return f"{self.source} -> {self.target} ({_path(self.source)}:{self.line})"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.cache
def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def _path(module: str) -> str:
    return str(_modules()[module].relative_to(ROOT))


def _is_package(module: str) -> bool:
    return _modules()[module].name == "__init__.py"


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


@functools.cache
def _imports() -> tuple[Import, ...]:
    """Every import statement of every module, our targets resolved to modules."""
    modules = _modules()
    found = []
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = module if _is_package(module) else module.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.append(Import(module, alias.name, (), node.lineno))
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, *([base] if base else [])])
                names = tuple(alias.name for alias in node.names)
                if not _ours(base):
                    found.append(Import(module, base, names, node.lineno))
                    continue
                for name in names:
                    target = f"{base}.{name}" if f"{base}.{name}" in modules else base
                    found.append(Import(module, target, (name,), node.lineno))
    return tuple(found)


def _edges() -> dict[str, dict[str, Import]]:
    """Module -> the modules of ours it imports (one import statement each, for messages)."""
    graph: dict[str, dict[str, Import]] = {m: {} for m in _modules()}
    for imp in _imports():
        if _ours(imp.target) and imp.target != imp.source:
            graph[imp.source].setdefault(imp.target, imp)
    return graph


def _components(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm): each holds
    the nodes of one or more cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _a_cycle(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """A shortest cycle through ``start``, a node of the strongly connected ``component``,
    closed (``start`` repeated at the end)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if w in component and w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    return sorted(component)


def _describe(cycle: list[str], statement: Callable[[str, str], Import]) -> str:
    """A cycle's nodes, then the import statement of each of its edges."""
    return " -> ".join(cycle) + "".join(
        f"\n    {statement(a, b)}" for a, b in itertools.pairwise(cycle)
    )


def _layer(module: str) -> int | None:
    best, layer = "", None
    for number, names in enumerate(LAYERS):
        for name in names:
            covers = module == name or (name != "mmnnx" and module.startswith(name + "."))
            if covers and len(name) > len(best):
                best, layer = name, number
    return layer


def _unit(module: str) -> str:
    """The subpackage a module belongs to (``mmnnx.mpmd`` for ``mmnnx.mpmd.lower.plan``), or the
    module itself when it sits at a package's top level (``mmnnx.jit``, ``mmnnx``)."""
    parts = module.split(".")
    if len(parts) >= 2 and _is_package(".".join(parts[:2])):
        return ".".join(parts[:2])
    return module


def test_every_import_of_ours_names_a_module_that_exists():
    missing = [str(imp) for imp in _imports() if _ours(imp.target) and imp.target not in _modules()]
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)


def test_no_cycle_between_modules():
    edges = _edges()
    graph = {m: set(targets) for m, targets in edges.items()}
    bad = _components(graph)
    lines = [
        f"{sorted(c)}, e.g. " + _describe(_a_cycle(graph, c, min(c)), lambda a, b: edges[a][b])
        for c in bad
    ]
    assert not bad, "import cycles between modules:\n" + "\n".join(lines)


def test_no_cycle_between_subpackages():
    edges = _edges()
    units: dict[str, set[str]] = {}
    witness: dict[tuple[str, str], Import] = {}
    for source, targets in edges.items():
        for target, imp in targets.items():
            a, b = _unit(source), _unit(target)
            if a != b:
                units.setdefault(a, set()).add(b)
                witness.setdefault((a, b), imp)
    cycles = _components(units)
    lines = [
        f"{sorted(c)}, e.g. " + _describe(_a_cycle(units, c, min(c)), lambda a, b: witness[a, b])
        for c in cycles
    ]
    assert not cycles, "import cycles between subpackages:\n" + "\n".join(lines)


def test_every_module_has_a_layer():
    missing = sorted(m for m in _modules() if _layer(m) is None)
    assert not missing, f"modules missing from the layer table LAYERS: {missing}"


# The engine's folders, one per stage of a step's life, in order: a module of one imports only
# from its own stage, an earlier one, or the engine's top level (the IR, its primitives, the
# step's input and output records, the schedules); the entry (engine.py) and the package's
# __init__ sit above all four.
ENGINE_STAGES = ("mmnnx.mpmd.trace", "mmnnx.mpmd.plan", "mmnnx.mpmd.lower", "mmnnx.mpmd.run")
ENGINE_ENTRY = ("mmnnx.mpmd", "mmnnx.mpmd.engine")


def _engine_stage(module: str) -> int | None:
    """0 for the engine's top level, 1-4 for its stages, 5 for its entry, None outside it."""
    if module in ENGINE_ENTRY:
        return len(ENGINE_STAGES) + 1
    for number, stage in enumerate(ENGINE_STAGES, start=1):
        if module == stage or module.startswith(stage + "."):
            return number
    return 0 if module.startswith("mmnnx.mpmd.") else None


def test_the_engine_is_grouped_by_stage():
    at_top = sorted(
        m
        for m in _modules()
        if m.count(".") == 2
        and m.startswith("mmnnx.mpmd.")
        and not (_is_package(m) or m in ENGINE_ENTRY)
    )
    assert at_top == [
        "mmnnx.mpmd.evaluate",
        "mmnnx.mpmd.ir",
        "mmnnx.mpmd.op_kinds",
        "mmnnx.mpmd.primitives",
        "mmnnx.mpmd.step_io",
    ], f"modules of the engine outside its stage folders: {at_top}"
    backward = _imports_going_up(_engine_stage, "stage")
    assert not backward, "imports going to a later stage of the engine:\n" + "\n".join(backward)


def _imports_going_up(rank: Callable[[str], int | None], word: str) -> list[str]:
    """Each import from a module to one of higher ``rank`` (both ranked), described."""
    return [
        f"{imp} ({word} {rank(imp.source)} -> {rank(imp.target)})"
        for targets in _edges().values()
        for imp in targets.values()
        if rank(imp.source) is not None
        and rank(imp.target) is not None
        and rank(imp.target) > rank(imp.source)
    ]


def test_imports_go_to_the_same_or_a_lower_layer():
    upward = _imports_going_up(_layer, "layer")
    assert not upward, "imports going up the layer table:\n" + "\n".join(upward)


def _internal(name: str) -> bool:
    parts = name.split(".")
    if parts[:2] == ["jax", "_src"]:
        return True
    interpreters = parts[:2] == ["jax", "interpreters"] and len(parts) > 2
    return interpreters and ".".join(parts[:3]) not in REGISTRATION


def _jax_internal(imp: Import) -> bool:
    """Whether ``imp`` imports JAX's internals (``from jax import _src`` too)."""
    return _internal(imp.target) or any(_internal(f"{imp.target}.{n}") for n in imp.names)


def test_jax_internals_only_inside_the_fence():
    outside = [
        str(imp)
        for imp in _imports()
        if not (imp.source == FENCE or imp.source.startswith(FENCE + ".")) and _jax_internal(imp)
    ]
    assert not outside, f"JAX internals imported outside {FENCE}:\n" + "\n".join(outside)


def test_the_fence_imports_nothing_of_mmnnx_but_its_errors():
    inside = [
        str(imp)
        for imp in _imports()
        if (imp.source == FENCE or imp.source.startswith(FENCE + "."))
        and _ours(imp.target)
        and not (imp.target == "mmnnx.errors" or imp.target.startswith(FENCE))
    ]
    assert not inside, "the fence imports mmnnx:\n" + "\n".join(inside)


def test_the_launcher_imports_the_standard_library_and_the_environment_names_only():
    # ``mmnnx launch`` is a program of its own: nothing of JAX, nor the per-process runtime
    found = [
        str(imp)
        for imp in _imports()
        if imp.source.startswith(LAUNCHER + ".")
        and not imp.target.startswith(LAUNCHER)
        and imp.target not in ("mmnnx._env", "__future__")
        and imp.target.split(".")[0] not in sys.stdlib_module_names
    ]
    assert not found, f"{LAUNCHER} imports more than it must:\n" + "\n".join(found)


def test_every_name_a_package_exports_is_found_where_it_says():
    # the packages import their names on first use (mmnnx, mmnnx.train: from where their
    # __init__.pyi says; mmnnx.cli: parse_args from its commands module)
    for package in (mmnnx, mmnnx.train, mmnnx.cli):
        missing = [n for n in package.__all__ if not _resolves(package, n)]
        assert not missing, f"{package.__name__} names what is not there: {missing}"
        assert sorted(dir(package)) == sorted(package.__all__)
    assert mmnnx.jit.__module__ == "mmnnx.jit"  # the function, not its module


def _resolves(package, name: str) -> bool:
    try:
        getattr(package, name)
    except (AttributeError, ImportError):
        return False
    return True


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not p.endswith("__") for p in dotted.split("."))


def test_multimesh_compat_uses_only_public_mmnnx_names():
    private = []
    for imp in _imports():
        if not imp.source.startswith("multimesh_compat") or not imp.target.startswith("mmnnx"):
            continue
        if _private(imp.target) or any(_private(n) for n in imp.names):
            private.append(str(imp))
    for module, path in _modules().items():  # attributes of mmnnx read through an alias
        if not module.startswith("multimesh_compat"):
            continue
        tree = ast.parse(path.read_text())
        aliases = {
            alias.asname or alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
            if alias.name.split(".")[0] == "mmnnx"
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                root = node.value
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(root, ast.Name) and root.id in aliases:
                    private.append(f"{module}: {ast.unparse(node)} ({_path(module)}:{node.lineno})")
    assert not private, "multimesh_compat uses private mmnnx names:\n" + "\n".join(private)


# Records built with positional arguments whose construction other changes own: runner.py
# (to be split) and train/ (its own owners). Each entry is (path, class); remove it once keyword.
MAX_POSITIONAL = 3


def _name_of(node: ast.expr) -> str | None:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", None)


def _is_record(node: ast.ClassDef) -> bool:
    """A dataclass (``@dataclass``, ``@dataclasses.dataclass(...)``) or a NamedTuple."""
    decorators = (d.func if isinstance(d, ast.Call) else d for d in node.decorator_list)
    return any(_name_of(d) == "dataclass" for d in decorators) or any(
        _name_of(b) == "NamedTuple" for b in node.bases
    )


def test_records_are_built_by_keyword():
    """A dataclass or NamedTuple of mmnnx built with more than MAX_POSITIONAL positional
    arguments (``Transfer(v, source, task, shape, ...)``) reads wrong silently when a field is
    added or reordered; build it by keyword."""
    trees = {
        module: ast.parse(path.read_text())
        for module, path in _modules().items()
        if module.startswith("mmnnx")
    }
    classes = [n for tree in trees.values() for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    records = {c.name for c in classes if _is_record(c)}
    found = []
    for module, tree in trees.items():
        path = _path(module)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or len(node.args) <= MAX_POSITIONAL:
                continue
            name = _name_of(node.func)
            if name in records:
                where = f"{path}:{node.lineno}"
                found.append(f"{name}(...) with {len(node.args)} positional at {where}")
    assert not found, "records built with positional arguments:\n" + "\n".join(found)
