"""What a run was trained with, saved in each of its checkpoints (``extra["run"]``) and checked
when it is resumed, generated from or exported: the options a resumed run may not change, its
tokenizer's fingerprint and its ``--init-from`` checkpoint's ``config.json`` and tensors' index.
A checkpoint saved without a record is not checked, and not refused."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import struct
from collections.abc import Mapping
from typing import Any

from mmnnx.train.checkpoint import CheckpointCorruptError, Checkpointer
from mmnnx.train.config import FIELDS, MAY_CHANGE_ON_RESUME, RunConfig
from mmnnx.train.options import spec, tables
from mmnnx.train.tokenizers import Tokenizer, fingerprint

KEY = "run"
"""The entry of a checkpoint's ``extra`` holding the record."""


def _recorded(name: str, value: Any) -> Any:
    """``value`` of option ``name`` as ``config.toml`` writes it, as JSON gives it back."""
    text = spec(FIELDS[name]).text
    return json.loads(json.dumps(text(value) if text and value is not None else value))


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """An option whose ``value`` differs from the ``recorded`` one (``None``: not set)."""

    name: str
    value: Any
    recorded: Any

    def as_flags(self) -> tuple[str, str]:
        """Both as flags: ``--heads 4``, ``--scan-layers``, ``no --clip-grad-norm``."""
        option = spec(FIELDS[self.name])

        def flag(value: Any) -> str:
            on = [f for f, (constant, _) in option.switches.items() if constant == value]
            if on:
                return on[0]
            if value is None or option.switches:
                return f"no {' / '.join(option.switches) or option.flag(self.name)}"
            shown = " ".join(map(str, value)) if isinstance(value, list) else value
            return f"{option.flag(self.name)} {shown}"

        return flag(self.value), flag(self.recorded)

    def as_keys(self) -> tuple[str, str]:
        """Both as ``config.toml`` keys: ``heads = 4``, ``no clip_grad_norm``."""

        def key(value: Any) -> str:
            return f"no {self.name}" if value is None else f"{self.name} = {json.dumps(value)}"

        return key(self.value), key(self.recorded)


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """The ``options`` a run was trained with (name -> value as ``config.toml`` writes it,
    ``None`` when not set), every option but those a resumed run may change, and its
    ``tokenizer``'s :func:`~mmnnx.train.tokenizers.fingerprint`.

    Example:
        >>> from mmnnx.train.tokenizers import ByteTokenizer
        >>> record = RunRecord.of({"heads": 2, "steps": 8}, ByteTokenizer())
        >>> record.options["heads"], "steps" in record.options  # --steps may change
        (2, False)
        >>> record.mismatch({"heads": 4}).as_flags()
        ('--heads 4', '--heads 2')
        >>> RunRecord.from_extra(record.extra()) == record
        True
    """

    options: dict[str, Any]
    tokenizer: str
    base: dict[str, Any] | None = None  # the --init-from checkpoint's (base_model)

    @classmethod
    def of(cls, values: Mapping[str, Any], tokenizer: Tokenizer) -> RunRecord:
        """The record of a run of option ``values`` (by name, as parsed) and ``tokenizer``."""
        options = {
            name: _recorded(name, values.get(name))
            for name in FIELDS
            if name not in MAY_CHANGE_ON_RESUME
        }
        init_from = values.get("init_from")
        base = None if init_from is None else base_model(init_from)
        return cls(options, fingerprint(tokenizer), base)

    def extra(self) -> dict[str, Any]:
        """The record as a checkpoint's ``extra`` holds it (under :data:`KEY`)."""
        saved = {"options": self.options, "tokenizer": self.tokenizer}
        return {KEY: saved if self.base is None else {**saved, "base": self.base}}

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> RunRecord | None:
        """The record a checkpoint's ``extra`` holds; ``None`` when it holds none."""
        saved = extra.get(KEY)
        if not isinstance(saved, dict) or not isinstance(saved.get("options"), dict):
            return None
        base = saved.get("base") if isinstance(saved.get("base"), dict) else None
        return cls(dict(saved["options"]), str(saved.get("tokenizer")), base)

    def base_changed(self, init_from: Any) -> str | None:
        """How ``--init-from``'s checkpoint differs from the one the run was trained from, or
        ``None`` (the same, or not recorded).

        Example:
            >>> from mmnnx.train.tokenizers import ByteTokenizer
            >>> RunRecord({}, "t").base_changed("anywhere") is None  # nothing recorded
            True
        """
        if self.base is None or init_from is None:
            return None
        now = base_model(init_from)
        was_config, now_config = self.base.get("config") or {}, now["config"] or {}
        for key in sorted(set(was_config) | set(now_config)):
            if was_config.get(key) != now_config.get(key):
                was, got = (json.dumps(c.get(key)) for c in (was_config, now_config))
                return f"its config.json has {key} = {got}, the run was trained from {was}"
        if self.base.get("tensors") != now["tensors"]:
            return "its safetensors files hold other tensors (names, shapes or dtypes)"
        return None

    def base_problem(self, init_from: Any, step: int) -> str | None:
        """:meth:`base_changed` as one line naming the checkpoint ``step`` that records it."""
        changed = self.base_changed(init_from)
        if changed is None:
            return None
        return (
            f"--init-from {init_from} changed since the run was trained from it (checkpoint step "
            f"{step} records it): {changed}; restore its files, or start a new run"
        )

    def mismatch(self, values: Mapping[str, Any]) -> Mismatch | None:
        """The first recorded option known here whose value in ``values`` differs."""
        mismatches = (
            Mismatch(name, _recorded(name, values.get(name)), recorded)
            for name, recorded in self.options.items()
            if name in FIELDS
        )
        return next((m for m in mismatches if m.value != m.recorded), None)


@dataclasses.dataclass(frozen=True)
class Saved:
    """The record of checkpoint ``step`` (and its whole ``extra``)."""

    step: int
    record: RunRecord | None  # None: saved without one
    extra: dict[str, Any] | None = dataclasses.field(default=None, compare=False, repr=False)


def saved_record(checkpointer: Checkpointer, step: int | None = None) -> Saved | None:
    """The record of checkpoint ``step`` (default: the newest whose ``extra`` reads back), or
    ``None`` when none reads back (the restore then says why).

    Example:
        >>> import tempfile
        >>> from flax import nnx
        >>> from mmnnx.train.tokenizers import ByteTokenizer
        >>> with Checkpointer(tempfile.mkdtemp()) as ckpt:
        ...     record = RunRecord.of({"heads": 2}, ByteTokenizer())
        ...     ckpt.save(5, model=nnx.Linear(1, 1, rngs=nnx.Rngs(0)), extra=record.extra())
        ...     saved_record(ckpt) == Saved(5, record)
        True
    """
    for candidate in [step] if step is not None else reversed(checkpointer.all_steps()):
        try:
            extra = checkpointer.read_extra(candidate)
        except (CheckpointCorruptError, FileNotFoundError):
            continue
        return Saved(candidate, RunRecord.from_extra(extra), extra)
    return None


def may_change() -> str:
    """The options a resumed run may change (:data:`mmnnx.train.config.MAY_CHANGE_ON_RESUME`),
    in words: whole tables, then single flags.

    Example:
        >>> may_change()  # doctest: +ELLIPSIS
        'a resumed run may change only its [layout], [logging] and [outputs] options, ...'
    """
    whole, flags = [], []
    for title, fields in tables(RunConfig).items():
        changing = [f for f in fields if f.name in MAY_CHANGE_ON_RESUME]
        if len(changing) == len(fields):
            whole.append(f"[{title}]")
            continue
        for field in changing:
            option = spec(field)
            flags.append("/".join(option.switches) or option.flag(field.name))
    tables_named = ", ".join(whole[:-1]) + f" and {whole[-1]}" if len(whole) > 1 else whole[0]
    return (
        f"a resumed run may change only its {tables_named} options, {', '.join(flags)} and "
        "the process count"
    )


def base_model(init_from: Any) -> dict[str, Any]:
    """What a run records of its ``--init-from`` checkpoint: its ``config.json`` (``None`` where
    unreadable) and ``tensors``, a fingerprint of every ``*.safetensors`` file's header (each
    tensor's name, dtype, shape and place in the file).

    Example:
        >>> import tempfile
        >>> base_model(tempfile.mkdtemp())["config"] is None
        True
    """
    directory = pathlib.Path(init_from)
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        config = None
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as f:
            head = f.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            digest.update(path.name.encode() + head + f.read(min(size, 100_000_000)))
    return {"config": config if isinstance(config, dict) else None, "tensors": digest.hexdigest()}
