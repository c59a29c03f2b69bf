"""Rich tables as text that also displays as HTML in Jupyter (``tabulate``, ``schedules.tune``)."""

from __future__ import annotations

import io
import sys

from rich.console import Console
from rich.table import Table


class Tabulation(str):
    """The text of one or more tables; displays as a rich HTML table in Jupyter."""

    html: str = ""

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return str(self)


def render(*tables: Table) -> Tabulation:
    """``tables`` as text (styled when stdout is a terminal) with their HTML attached.

    Example:
        >>> t = Table("a")
        >>> t.add_row("1")
        >>> "a" in render(t) and "<table" not in render(t)
        True
    """
    tty = sys.stdout.isatty()
    console = Console(
        file=io.StringIO(),
        width=100_000,
        record=True,
        force_terminal=tty,
        color_system="auto" if tty else None,
        force_jupyter=False,
    )
    for t in tables:
        console.print(t)
    text = console.export_text(styles=tty, clear=False)
    result = Tabulation("\n".join(line.rstrip() for line in text.splitlines()))
    result.html = console.export_html(inline_styles=True)
    return result
