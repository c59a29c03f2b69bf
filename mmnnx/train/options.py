"""How a run's option is declared: a dataclass field (:func:`option`, :func:`switch`) whose
:class:`Option` holds its flag's help, parser and switches. ``mmnnx.cli.flags`` derives
``argparse`` flags from such fields, ``mmnnx.train.run_config`` TOML keys."""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Parse = Callable[[str, str], Any]
"""``parse(flag, text)``: the value of ``text`` given to ``flag``, or an
``argparse.ArgumentTypeError`` whose message names the flag."""


@dataclasses.dataclass(frozen=True)
class Option:
    """A field's flag; ``help`` and ``choices`` may be callables, called as the parser is built."""

    help: str | Callable[[], str] = ""  # %(default)s is the default
    parse: Parse | None = None  # None: the text as is
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None
    metavar: str | None = None
    many: bool = False  # one value or more, a list
    # flags taking no value: flag -> (the value it sets, its help)
    switches: Mapping[str, tuple[Any, str]] = dataclasses.field(default_factory=dict)
    from_run: bool = True  # --resume takes it from the resumed run
    api: str | None = None  # its name in TrainConfig or GPTConfig, when not its own
    omit: tuple[Any, ...] = ()  # values leaving that field its default
    text: Callable[[Any], Any] | None = None  # its value as config.toml holds it
    architecture: bool = False  # describes a model from scratch: --init-from gives it instead
    moe: bool = False  # an option of a mixture of experts, needing --experts
    may_change: bool = False  # a resumed run may change it (for a whole table: table())
    unrecorded: bool = False  # what one start does, not what the run is: not in its config.toml

    def help_text(self) -> str:
        return self.help() if callable(self.help) else self.help

    def choice_list(self) -> Sequence[str] | None:
        return self.choices() if callable(self.choices) else self.choices

    def flag(self, name: str) -> str:
        return "--" + name.replace("_", "-")


def option(default: Any, help: str | Callable[[], str] = "", parse: Parse | None = None, **more):
    """A dataclass field with ``default`` (``dataclasses.MISSING``: a required flag) and its
    :class:`Option` (``help``, ``parse`` and ``more`` of its attributes).

    Example:
        >>> @dataclasses.dataclass
        ... class Model:
        ...     dim: int = option(128, "model width (%(default)s)", positive)
        >>> spec(dataclasses.fields(Model)[0]).parse("--dim", "0")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: --dim must be >= 1, got 0
    """
    return dataclasses.field(default=default, metadata={"option": Option(help, parse, **more)})


def switch(flag: str, help: str, *, default: bool = False, **more):
    """A boolean field that ``flag``, taking no value, sets to ``not default``."""
    return option(default, help, switches={flag: (not default, help)}, **more)


def spec(field: dataclasses.Field) -> Option:
    """The :class:`Option` of a field made by :func:`option` or :func:`switch`."""
    return field.metadata["option"]


def integer(minimum: int, maximum: int | None = None) -> Parse:
    """An int of at least ``minimum`` (and at most ``maximum``)."""

    def parse(flag: str, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{flag} must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{flag} must be <= {maximum}, got {value}")
        return value

    return parse


positive = integer(1)


def finite(*, positive: bool) -> Parse:
    """A finite float, > 0 if ``positive`` else >= 0.

    Example:
        >>> finite(positive=True)("--lr", "nan")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: --lr must be a finite number > 0, got 'nan'
    """

    def parse(flag: str, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            bound = "> 0" if positive else ">= 0"
            raise argparse.ArgumentTypeError(
                f"{flag} must be a finite number {bound}, got {text!r}"
            )
        return value

    return parse


def names(allowed: Sequence[str]) -> Parse:
    """Comma-separated names among ``allowed``, as a tuple, each once.

    Example:
        >>> names(("q", "k", "v"))("--lora-targets", "q,v")
        ('q', 'v')
        >>> names(("q", "k", "v"))("--lora-targets", "q,o")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: --lora-targets: 'o' is not one of q, k, v
    """

    def parse(flag: str, text: str) -> tuple[str, ...]:
        chosen = tuple(n.strip() for n in text.split(","))
        for name in chosen:
            if name not in allowed:
                raise argparse.ArgumentTypeError(
                    f"{flag}: {name!r} is not one of {', '.join(allowed)}"
                )
        if len(set(chosen)) < len(chosen):
            raise argparse.ArgumentTypeError(f"{flag}: a name given twice in {text!r}")
        return chosen

    return parse


def nonempty(flag: str, text: str) -> str:
    """``text`` as it is, if it holds more than blanks.

    Example:
        >>> nonempty("--wandb", " ")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: --wandb must not be empty, got ' '
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{flag} must not be empty, got {text!r}")
    return text


def step_range(flag: str, text: str) -> tuple[int, int]:
    """``A:B`` (or ``A``) as ``(A, B)``, steps with ``1 <= A <= B``: ``10:12`` -> ``(10, 12)``."""
    first, colon, last = text.partition(":")
    try:
        steps = (int(first), int(last if colon else first))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{flag} must be FIRST:LAST steps, e.g. 10:12, got {text!r}"
        ) from None
    if not 1 <= steps[0] <= steps[1]:
        raise argparse.ArgumentTypeError(f"{flag} needs 1 <= FIRST <= LAST, got {text!r}")
    return steps


def split_or(choices: Sequence[str]) -> Parse:
    """One of ``choices``, or comma-separated counts (blocks per stage: ``3,1``), as text: each
    >= 1 but the first and the last, which may be 0 (a stage holding only the embedding, or
    only the head and the loss).

    Example:
        >>> parse = split_or(("params", "auto"))
        >>> parse("--partition", "3, 1"), parse("--partition", "auto"), parse("--partition", "4,0")
        ('3,1', 'auto', '4,0')
    """

    def parse(flag: str, text: str) -> str:
        if text in choices:
            return text
        parts = [p.strip() for p in text.split(",")]
        inner = parts[1:-1]
        if not all(p.isdigit() for p in parts) or not all(int(p) >= 1 for p in inner):
            raise argparse.ArgumentTypeError(
                f"{flag} must be {', '.join(choices)} or blocks per stage such as 3,1 (only the "
                f"first and the last may be 0), got {text!r}"
            )
        return ",".join(str(int(p)) for p in parts)

    return parse


def table(options: type, *, may_change: bool = False):
    """A schema's field holding the table ``options``, all of which may change if ``may_change``."""
    return dataclasses.field(default_factory=options, metadata={"may_change": may_change})


def options_where(schema: type, attribute: str) -> tuple[str, ...]:
    """The names of the options of ``schema`` whose :class:`Option` (or table) sets
    ``attribute``, in the schema's order.

    Example:
        >>> from mmnnx.train.config import RunConfig
        >>> options_where(RunConfig, "architecture")[:4]
        ('dim', 'depth', 'heads', 'gated_mlp')
    """
    return tuple(
        f.name
        for t in dataclasses.fields(schema)
        for f in dataclasses.fields(t.default_factory)
        if getattr(spec(f), attribute) or t.metadata.get(attribute)
    )


def tables(schema: type) -> dict[str, tuple[dataclasses.Field, ...]]:
    """Each table of ``schema`` (a dataclass of dataclasses of option fields) and its fields.

    Example:
        >>> from mmnnx.train.config import RunConfig
        >>> [f.name for f in tables(RunConfig)["precision"]]
        ['dtype', 'param_dtype', 'optimizer_dtype', 'clip_grad_norm']
    """
    return {t.name: dataclasses.fields(t.default_factory) for t in dataclasses.fields(schema)}
