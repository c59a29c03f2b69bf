"""No two of mmnnx's modules import each other at import time, directly or round a loop
(docs/architecture.md: "No cycles between modules"). Read from the source."""

import ast
import pathlib

import mmnnx

ROOT = pathlib.Path(mmnnx.__file__).parent


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module of ours that ``name`` (a module, or a name in one) is."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[str]:
    """The modules of ours that ``module`` imports at its top level (not inside functions)."""
    targets = set()
    for node in ast.parse(MODULES[module].read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            owner = _owner(name)
            if owner is not None and owner != module:
                targets.add(owner)
    return targets


def test_no_import_cycles_between_modules():
    # a package's __init__ importing its own modules is how it re-exports them, not a cycle
    graph = {m: {t for t in _imports(m) if not t.startswith(m + ".")} for m in MODULES}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module) :]))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
