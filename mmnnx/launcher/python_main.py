"""A Python command of ``mmnnx launch`` run through :mod:`~mmnnx.launcher.run_main`, so that
``raise SystemExit(n)``, n a failing status, is a failure like ``sys.exit(n)``.

Only a plain ``python [options] -c CODE | -m MODULE | FILE [args]`` is rewritten, with options
that take no value or ``-W``/``-X``/``--check-hash-based-pycs``; anything else runs as given.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "run_main.py")
_PYTHON = re.compile(r"python(\d+(\.\d+)*)?")
_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")
_PLAIN_OPTIONS = frozenset("bBdEIOPqsSuvR")  # options of python that take no value


def through_runner(command: Sequence[str]) -> list[str]:
    """``command`` with its program run by :mod:`~mmnnx.launcher.run_main`, when it is a plain
    Python command; else ``command`` as it is."""
    command = list(command)
    if not command or not _PYTHON.fullmatch(os.path.basename(command[0])):
        return command
    i = 1
    while i < len(command):
        arg = command[i]
        if arg in ("-c", "-m"):
            return command if i + 1 == len(command) else [*command[:i], RUNNER, *command[i:]]
        if arg in _WITH_VALUE:
            i += 2
        elif arg[:2] in _WITH_VALUE or (len(arg) > 1 and arg[0] == "-" and _plain(arg)):
            i += 1
        elif arg.startswith("-") or not os.path.isfile(arg):
            return command  # -i, -x, a directory or archive, ...: as given
        else:
            return [*command[:i], RUNNER, "file", *command[i:]]
    return command


def _plain(option: str) -> bool:
    """Whether ``option`` (``-u``, ``-uB``, ``-OO``) is made of options that take no value."""
    return set(option[1:]) <= _PLAIN_OPTIONS
