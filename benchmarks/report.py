"""Shared by the benchmark scripts: write the results file and print one table per section."""

import json
import pathlib

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
