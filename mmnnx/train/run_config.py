"""A run's config file: the TOML form of a command's flags, read as defaults and written back.

Each argument group of an ``argparse`` parser (``mmnnx train``'s ``model``, ``layout``,
``training``, ``outputs``) is a TOML table; its keys are the flags' names (``seq_len`` or
``seq-len``). A key takes what its flag takes, checked by the flag's own parser (``type=`` and
``choices``); a switch (``--scan-layers``) takes ``true`` or ``false``. Everything is derived
from the parser's actions, so a flag added to a group is a config key with no further code.
:func:`read_config` checks a file against a parser, :func:`resolved_config` turns parsed flags
back into tables and :func:`write_config` writes them (``None`` values are left out: TOML has
no null, and a missing key is the flag's default).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import tomllib
from collections.abc import Mapping
from typing import Any

import tomli_w

CONFIG_FILE = "config.toml"
"""The name of the resolved config a run writes into its output directory."""


class ConfigError(ValueError):
    """A config file that cannot be read, or a table, key or value its parser does not take;
    the message is one line naming the file and the key."""


def _tables(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    """The parser's own argument groups (not its positional/options groups) and their flags."""
    default = {id(parser._positionals), id(parser._optionals)}  # noqa: SLF001
    return {
        group.title: [a for a in group._group_actions if a.option_strings]  # noqa: SLF001
        for group in parser._action_groups  # noqa: SLF001
        if id(group) not in default and group.title
    }


def _key(name: str) -> str:
    return name.strip("-").replace("-", "_")


def _where(actions: list[argparse.Action]) -> dict[str, list[argparse.Action]]:
    """Each config key of a table: the dest of its flags, and the name of each switch whose
    name is not its dest (``no_pack_weights``), to the actions that set it."""
    keys: dict[str, list[argparse.Action]] = {}
    for action in actions:
        keys.setdefault(action.dest, []).append(action)
    for action in actions:
        if action.nargs == 0:
            for option in action.option_strings:
                if _key(option) != action.dest:
                    keys.setdefault(_key(option), [action])
    return keys


def _parsed(action: argparse.Action, value: Any, where: str) -> Any:
    """``value`` (from TOML) as the flag ``action`` would have parsed it."""
    if action.nargs in ("+", "*"):
        if not isinstance(value, list) or not all(isinstance(v, str | int | float) for v in value):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if action.nargs == "+" and not value:
            raise ConfigError(f"{where}: expected at least one value")
        return [_one(action, v, where) for v in value]
    return _one(action, value, where)


def _one(action: argparse.Action, value: Any, where: str) -> Any:
    if isinstance(value, bool | list | dict):
        raise ConfigError(
            f"{where}: expected a value for {action.option_strings[0]}, got {value!r}"
        )
    if action.type is None and not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    try:
        parsed = action.type(str(value)) if action.type is not None else value
    except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from None
    if action.choices is not None and parsed not in action.choices:
        choices = ", ".join(map(str, action.choices))
        raise ConfigError(f"{where}: {parsed!r} is not one of {choices}")
    return parsed


def _switch(actions: list[argparse.Action], value: Any, where: str) -> Any:
    """A value for the dest of switches (flags taking no argument): one of their constants, or
    of the type of the dest's default (``pack_residuals`` = a byte count)."""
    allowed = {type(a.const) for a in actions} | {type(a.default) for a in actions}
    allowed.discard(type(None))
    if type(value) not in allowed:
        names = " / ".join(o for a in actions for o in a.option_strings)
        kinds = " or ".join(sorted("true or false" if t is bool else t.__name__ for t in allowed))
        raise ConfigError(f"{where}: expected {kinds} (as {names}), got {value!r}")
    return value


def read_config(path: str | os.PathLike[str], parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The flag values ``path`` sets, by dest, checked against ``parser``'s flags.

    Raises:
        ConfigError: the file is missing or not TOML, or holds a table or key that is no
            argument group or flag of ``parser``, or a value its flag refuses.

    Example:
        >>> import argparse, tempfile, pathlib
        >>> parser = argparse.ArgumentParser()
        >>> _ = parser.add_argument_group("model").add_argument("--seq-len", type=int, default=8)
        >>> path = pathlib.Path(tempfile.mkdtemp(), "run.toml")
        >>> _ = path.write_text("[model]\\nseq-len = 32\\n")
        >>> read_config(path, parser)
        {'seq_len': 32}
        >>> _ = path.write_text("[model]\\nseq_lenn = 32\\n")
        >>> read_config(path, parser)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        mmnnx.train.run_config.ConfigError: ...: [model] seq_lenn: unknown key (known: seq_len)
    """
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    tables = _tables(parser)
    keys = {title: _where(actions) for title, actions in tables.items()}
    homes = {key: title for title, table in keys.items() for key in table}
    values: dict[str, Any] = {}
    for title, table in data.items():
        if not isinstance(table, dict):
            home = homes.get(_key(title))
            hint = f" (put it under [{home}])" if home else ""
            raise ConfigError(
                f"{path}: {title}: a key outside any table{hint}; tables: {', '.join(tables)}"
            )
        if title not in tables:
            raise ConfigError(f"{path}: [{title}]: unknown table (known: {', '.join(tables)})")
        for name, value in table.items():
            where = f"{path}: [{title}] {name}"
            key = _key(name)
            if key not in keys[title]:
                home = homes.get(key)
                if home:
                    raise ConfigError(f"{where}: belongs in [{home}], not [{title}]")
                raise ConfigError(f"{where}: unknown key (known: {', '.join(keys[title])})")
            actions = keys[title][key]
            if all(a.nargs == 0 for a in actions):
                if key != actions[0].dest:  # a switch by its own name: no_pack_weights = true
                    if not isinstance(value, bool):
                        raise ConfigError(f"{where}: expected true or false, got {value!r}")
                    if not value:
                        continue
                    value = actions[0].const
                else:
                    value = _switch(actions, value, where)
            else:
                value = _parsed(next(a for a in actions if a.nargs != 0), value, where)
            dest = actions[0].dest
            if dest in values:
                raise ConfigError(f"{where}: sets {dest} a second time")
            values[dest] = value
    return values


def resolved_config(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> dict[str, dict[str, Any]]:
    """Every flag's value in ``args``, grouped in ``parser``'s tables; ``None`` values left out.

    Example:
        >>> import argparse
        >>> parser = argparse.ArgumentParser()
        >>> group = parser.add_argument_group("model")
        >>> _ = group.add_argument("--dim", type=int, default=8)
        >>> _ = group.add_argument("--text", default=None)
        >>> resolved_config(parser.parse_args(["--dim", "16"]), parser)
        {'model': {'dim': 16}}
    """
    tables: dict[str, dict[str, Any]] = {}
    for title, actions in _tables(parser).items():
        table = tables.setdefault(title, {})
        for action in actions:
            value = getattr(args, action.dest, None)
            if value is not None and action.dest not in table:
                table[action.dest] = value
    return {title: table for title, table in tables.items() if table}


def write_config(
    path: str | os.PathLike[str], tables: Mapping[str, Mapping[str, Any]]
) -> pathlib.Path:
    """Writes ``tables`` (as :func:`resolved_config` makes them) to ``path`` as TOML,
    atomically (a reader never sees half a file); returns the path.

    Example:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> write_config(folder / "config.toml", {"model": {"dim": 8}}).read_text()
        '[model]\\ndim = 8\\n'
    """
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.tmp")
    temporary.write_text(tomli_w.dumps({t: dict(v) for t, v in tables.items()}))
    os.replace(temporary, target)
    return target
