"""A run's config file: the TOML form of the options of ``mmnnx.train.config``, one table per
dataclass, keyed by the options' names (``seq_len`` or ``seq-len``) and each switch's own name
(``no_pack_weights = true``); a key takes what its flag takes."""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import os
import pathlib
import tomllib
from collections.abc import Mapping
from typing import Any

import tomli_w

from mmnnx.train.config import RunConfig
from mmnnx.train.options import Option, spec, tables

CONFIG_FILE = "config.toml"  # the resolved config a run writes into its output directory


class ConfigError(ValueError):
    """A config file that cannot be read, or a table, key or value the schema does not take;
    the message is one line naming the file and the key."""


def _key(name: str) -> str:
    return name.strip("-").replace("-", "_")


def _keys(fields: tuple[dataclasses.Field, ...]) -> dict[str, tuple[dataclasses.Field, Any]]:
    """Each key of a table: to its field, and for a switch's own name the value it sets."""
    keys: dict[str, tuple[dataclasses.Field, Any]] = {f.name: (f, None) for f in fields}
    for field in fields:
        for flag, (value, _) in spec(field).switches.items():
            keys.setdefault(_key(flag), (field, value))
    return keys


def _value(option: Option, flag: str, value: Any, where: str) -> Any:
    """``value`` (from TOML) as the option's flag would have parsed it."""
    if option.many:
        if not isinstance(value, list) or not all(isinstance(v, str | int | float) for v in value):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if not value:
            raise ConfigError(f"{where}: expected at least one value")
        one = dataclasses.replace(option, many=False)
        return [_value(one, flag, v, where) for v in value]
    if isinstance(value, bool | list | dict):
        raise ConfigError(f"{where}: expected a value for {flag}, got {value!r}")
    if option.parse is None and not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    try:
        parsed = option.parse(flag, str(value)) if option.parse is not None else value
    except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
        raise ConfigError(f"{where}: {e}") from None
    choices = option.choice_list()
    if choices is not None and parsed not in choices:
        raise ConfigError(f"{where}: {parsed!r} is not one of {', '.join(map(str, choices))}")
    return parsed


def option_value(name: str, value: Any, where: str, schema: type = RunConfig) -> Any:
    """``value`` for the option ``name`` of ``schema`` (by its field's name) as its flag would
    have parsed it; a ``ConfigError`` starting with ``where`` for one its flag refuses.

    Example:
        >>> option_value("schedule", "gpipe", "plan.json: layout: schedule")
        'gpipe'
        >>> option_value("remat", "most", "plan.json: layout: remat")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        mmnnx.train.run_config.ConfigError: plan.json: layout: remat: 'most' is not one of none, ...
    """
    field = {f.name: f for fields in tables(schema).values() for f in fields}[name]
    option = spec(field)
    return _value(option, option.flag(field.name), value, where)


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The TOML file ``path`` parsed: UTF-8 text, a leading byte-order mark skipped (as
    Windows editors write it).

    Raises:
        ConfigError: the file cannot be read, is not UTF-8 (naming the first bad byte's
            offset) or not TOML.

    Example:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp(), "run.toml")
        >>> _ = path.write_bytes(b"\\xef\\xbb\\xbf[model]\\ndim = 32\\n")
        >>> read_toml(path)
        {'model': {'dim': 32}}
    """
    try:
        raw = pathlib.Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it: {e.strerror or e}") from None
    body = raw.removeprefix(codecs.BOM_UTF8)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        offset = e.start + len(raw) - len(body)
        raise ConfigError(
            f"{path}: not UTF-8: byte {offset} is {raw[offset : offset + 1]!r}; save it as UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def read_config(path: str | os.PathLike[str], schema: type = RunConfig) -> dict[str, Any]:
    """The option values ``path`` sets, by name, checked against ``schema``'s tables.

    Example:
        >>> import tempfile, pathlib
        >>> path = pathlib.Path(tempfile.mkdtemp(), "run.toml")
        >>> _ = path.write_text("[model]\\nseq-len = 32\\n[training]\\nno_pack_weights = true\\n")
        >>> read_config(path)
        {'seq_len': 32, 'pack_weights': False}
        >>> _ = path.write_text("[model]\\nseq_lenn = 32\\n")
        >>> read_config(path)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        mmnnx.train.run_config.ConfigError: ...: [model] seq_lenn: unknown key (known: dim, ...
    """
    data = read_toml(path)
    keys = {title: _keys(fields) for title, fields in tables(schema).items()}
    homes = {key: title for title, table in keys.items() for key in table}
    values: dict[str, Any] = {}
    for title, table in data.items():
        if not isinstance(table, dict):
            home = homes.get(_key(title))
            hint = f" (put it under [{home}])" if home else ""
            raise ConfigError(
                f"{path}: {title}: a key outside any table{hint}; tables: {', '.join(keys)}"
            )
        if title not in keys:
            raise ConfigError(f"{path}: [{title}]: unknown table (known: {', '.join(keys)})")
        for name, value in table.items():
            where = f"{path}: [{title}] {name}"
            key = _key(name)
            if key not in keys[title]:
                if key in homes:
                    raise ConfigError(f"{where}: belongs in [{homes[key]}], not [{title}]")
                raise ConfigError(f"{where}: unknown key (known: {', '.join(keys[title])})")
            field, constant = keys[title][key]
            option = spec(field)
            if key != field.name:  # a switch by its own name: no_pack_weights = true
                if not isinstance(value, bool):
                    raise ConfigError(f"{where}: expected true or false, got {value!r}")
                if not value:
                    continue
                value = constant
            elif option.switches:  # one of their constants, or a value of its default's type
                allowed = {type(v) for v, _ in option.switches.values()} | {type(field.default)}
                allowed.discard(type(None))
                if type(value) not in allowed:
                    kinds = sorted("true or false" if t is bool else t.__name__ for t in allowed)
                    names = " / ".join(option.switches)
                    raise ConfigError(
                        f"{where}: expected {' or '.join(kinds)} (as {names}), got {value!r}"
                    )
            else:
                value = _value(option, option.flag(field.name), value, where)
            if field.name in values:
                raise ConfigError(f"{where}: sets {field.name} a second time")
            values[field.name] = value
    return values


def resolved_config(values: Mapping[str, Any], schema: type = RunConfig) -> dict[str, dict]:
    """``values`` of options grouped in ``schema``'s tables; ``None`` values left out.

    Example:
        >>> resolved_config({"dim": 16, "text": None, "lr": 0.1, "profile_steps": (2, 3)})
        {'model': {'dim': 16}, 'training': {'lr': 0.1}, 'logging': {'profile_steps': '2:3'}}
    """
    grouped: dict[str, dict[str, Any]] = {}
    for title, fields in tables(schema).items():
        for field in fields:
            value, text = values.get(field.name), spec(field).text
            if value is not None:
                grouped.setdefault(title, {})[field.name] = text(value) if text else value
    return grouped


def write_config(
    path: str | os.PathLike[str], tables: Mapping[str, Mapping[str, Any]]
) -> pathlib.Path:
    """Writes ``tables`` (:func:`resolved_config`'s) to ``path`` as TOML, atomically."""
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(f".{target.name}.tmp")
    temporary.write_text(tomli_w.dumps({t: dict(v) for t, v in tables.items()}))
    os.replace(temporary, target)
    return target
