"""Shared by the benchmark scripts: write the results file and print one table per section."""

import json
import pathlib
from collections.abc import Callable

from rich.console import Console
from rich.table import Table


def publish(results: dict, path: pathlib.Path, title: str, sections: tuple[str, ...]) -> None:
    """Writes ``results`` as JSON to ``path`` and prints each section as a measure/value table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2) + "\n")
    console = Console()
    for name in sections:
        table = Table(title=f"{title}: {name}")
        table.add_column("measure")
        table.add_column("value", justify="right")
        for k, v in results[name].items():
            table.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
        console.print(table)
    console.print(f"written to {path}")


def run_sections(
    sections: dict[str, Callable[[], dict]],
    path: pathlib.Path,
    title: str,
    only: list[str] | None = None,
    device: str = "",
) -> None:
    """Runs every section, or those named in ``only`` (their results then replace theirs in the
    file at ``path``, the others kept), and publishes them with ``device`` beside."""
    names = only or list(sections)
    unknown = set(names) - set(sections)
    if unknown:
        raise SystemExit(f"unknown section(s) {sorted(unknown)}; known: {list(sections)}")
    results = json.loads(path.read_text()) if only and path.exists() else {}
    for name in names:
        results[name] = sections[name]()
    results["device"] = device
    publish(results, path, title, tuple(names))


def only_sections(argv: list[str]) -> list[str] | None:
    """The section names after ``--only`` on a command line, else ``None`` (every section)."""
    return argv[argv.index("--only") + 1 :] if "--only" in argv else None
