"""The ``mmnnx`` command line (``mmnnx train``, ``generate``, ``export``, ``eval``, ``plan``,
``launch``): one module per command; :mod:`~mmnnx.cli.commands` parses and dispatches them.

``mmnnx launch`` is a program of its own that only starts and watches processes: it is parsed
and run by :mod:`~mmnnx.cli.launch` alone, importing nothing of JAX (it starts in a tenth of a
second, not the three JAX and the model code take).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import lazy_loader

# parse_args is imported on first use, from commands (which imports the model code and JAX)
__getattr__, _, _ = lazy_loader.attach(__name__, submod_attrs={"commands": ["parse_args"]})
__all__ = ["main", "parse_args"]


def __dir__() -> list[str]:
    return __all__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mmnnx`` console script.

    Example (the reason goes to stderr; bad flags exit with status 2):
        >>> main(["train", "--stages", "3", "--devices", "4"])
        2
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        from mmnnx.cli import launch  # noqa: PLC0415

        return launch.main(argv[1:])
    from mmnnx.cli import commands  # noqa: PLC0415

    return commands.main(argv)
