"""``argparse`` flags derived from a run's option fields (``mmnnx.train.options``), and the
parser whose every error is one line, exit status 2.

Example:
    >>> from mmnnx.train.config import RunConfig
    >>> parser = Parser(prog="mmnnx train")
    >>> add_options(parser, RunConfig)
    >>> parser.parse_args(["--dim", "64", "--no-pack-weights"]).pack_weights
    False
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from typing import Any

from mmnnx.train.config import tables
from mmnnx.train.options import Parse, spec


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose error is one line on stderr, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def typed(parse: Parse, flag: str) -> Callable[[str], Any]:
    """``parse`` as the ``type=`` of ``flag``: its reasons name the flag.

    Example:
        >>> from mmnnx.train.options import positive
        >>> typed(positive, "-n")("3")
        3
    """
    return functools.partial(parse, flag)


def add_options(parser: argparse.ArgumentParser, schema: type) -> None:
    """One argument group per table of ``schema``, one flag per option (a switch: one flag per
    switch, taking no value), named, typed, defaulted and helped by its field."""
    for title, fields in tables(schema).items():
        group = parser.add_argument_group(title)
        for field in fields:
            option = spec(field)
            for flag, (value, help) in option.switches.items():
                group.add_argument(
                    flag, dest=field.name, action="store_const", const=value, help=help
                )
            if option.switches:
                parser.set_defaults(**{field.name: field.default})
                continue
            flag = option.flag(field.name)
            group.add_argument(
                flag,
                type=None if option.parse is None else typed(option.parse, flag),
                default=field.default,
                choices=option.choice_list(),
                nargs="+" if option.many else None,
                metavar=option.metavar,
                help=option.help_text(),
            )
