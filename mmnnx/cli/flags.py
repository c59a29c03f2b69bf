"""``argparse`` flags derived from option fields (``mmnnx.train.options``), and the parser whose
every error is one line, exit status 2."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Iterable
from typing import Any

from mmnnx.train.options import spec, tables

GIVEN = "given_flags"
"""The attribute of a parsed namespace naming the options set on the command line (or, as
``mmnnx.cli.parse_args`` adds, in a ``--config`` file), as opposed to left at their
defaults."""


class Parser(argparse.ArgumentParser):
    """An ``argparse`` parser taking no abbreviated flag, each error one line (exit status 2)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        message = self._dashed_value(message) or message
        self.exit(2, f"{self.prog}: error: {message}\n")

    def _dashed_value(self, message: str) -> str | None:
        """For ``expected one argument`` before a value starting with ``-``: what is wrong
        with that value, or how to give it (``--partition=-1,3``).

        Example:
            >>> parser = Parser(prog="p")
            >>> _ = parser.add_argument("--name")
            >>> parser._argv = ["--name", "-x"]
            >>> parser._dashed_value("argument --name: expected one argument")
            "--name -x: a value starting with '-' reads as a flag; write --name=-x"
        """
        flag, _, what = message.removeprefix("argument ").partition(": ")
        argv = getattr(self, "_argv", [])
        for name in flag.split("/") if what == "expected one argument" else ():
            at = argv.index(name) + 1 if name in argv[:-1] else 0
            if at and argv[at].startswith("-"):
                kind = self._option_string_actions[name].type
                try:
                    if kind is not None:
                        kind(argv[at])
                except argparse.ArgumentTypeError as e:
                    return str(e)
                value, hint = argv[at], "a value starting with '-' reads as a flag"
                return f"{name} {value}: {hint}; write {name}={value}"
        return None


class _Store(argparse.Action):
    """argparse's ``store`` (with ``nargs=0``, ``store_const``: a switch), noting the option as
    given."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        setattr(namespace, GIVEN, given(namespace) | {self.dest})


def given(args: argparse.Namespace) -> frozenset[str]:
    """The options (by field name) given on the command line parsed into ``args``, not left
    at their defaults.

    Example:
        >>> from mmnnx.train.config import RunConfig
        >>> add_options(parser := Parser(), RunConfig)
        >>> sorted(given(parser.parse_args(["--dim", "128", "--scan-layers"])))
        ['dim', 'scan_layers']
    """
    return frozenset(getattr(args, GIVEN, frozenset()))


def add_fields(group: argparse._ActionsContainer, fields: Iterable[dataclasses.Field]) -> None:
    """One flag per option field (one per switch, taking no value); no default: required."""
    for field in fields:
        option = spec(field)
        for flag, (value, help) in option.switches.items():
            group.add_argument(
                flag, dest=field.name, action=_Store, nargs=0, const=value, help=help
            )
        if option.switches:
            group.set_defaults(**{field.name: field.default})
            continue
        flag = option.flag(field.name)
        required = field.default is dataclasses.MISSING
        group.add_argument(
            flag,
            action=_Store,
            type=None if option.parse is None else functools.partial(option.parse, flag),
            default=None if required else field.default,
            required=required,
            choices=option.choice_list(),
            nargs="+" if option.many else None,
            metavar=option.metavar,
            help=option.help_text(),
        )


def typed(schema: type, args: argparse.Namespace) -> Any:
    """The ``schema`` dataclass of the option fields ``args`` holds (as :func:`add_fields`
    declared them).

    Example:
        >>> @dataclasses.dataclass
        ... class Options:
        ...     steps: int = 1
        >>> typed(Options, argparse.Namespace(steps=3, other=0))
        Options(steps=3)
    """
    return schema(**{f.name: getattr(args, f.name) for f in dataclasses.fields(schema)})


def add_options(parser: argparse.ArgumentParser, schema: type) -> None:
    """One argument group per table of ``schema``, holding its options' flags.

    Example:
        >>> from mmnnx.train.config import RunConfig
        >>> add_options(parser := Parser(), RunConfig)
        >>> parser.parse_args(["--dim", "64", "--no-pack-weights"]).pack_weights
        False
    """
    for title, fields in tables(schema).items():
        add_fields(parser.add_argument_group(title), fields)
