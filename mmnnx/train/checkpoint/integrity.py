"""Whether a step reads back as written: checksums, damaged files, ``CheckpointCorruptError``.

Every array is saved with a checksum (a position-weighted sum of its bits, computed where it
lives: :func:`checksums` on device, :func:`checksum` of a host chunk, the same number), and a
step's ``extra`` with the SHA-256 of its canonical JSON (:func:`extra_checksum`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from mmnnx.train.checkpoint.layout import EXTRA, MODEL, OPT, STEP_METADATA

_JSON_FILES = (STEP_METADATA, "_METADATA", "_sharding", "metadata")
_GOLDEN = 2654435761  # Knuth's multiplicative hash: weights that differ for every position


class CheckpointCorruptError(RuntimeError):
    """A checkpoint step's files cannot be read (truncated, damaged or missing), or what they
    hold cannot be used.

    ``step`` and ``directory`` (the step's directory) say which checkpoint; ``file`` the damaged
    or missing file when it can be found, else ``None``; ``array`` the saved array whose data
    read back different from what was written (caught by the checksum saved with it), if that
    was the failure; ``reason`` why the step cannot be used when its files read back whole (its
    ``extra`` names another step, say), else ``None``. Nothing was written into the model.
    """

    def __init__(
        self,
        step: int,
        directory: str,
        *,
        file: str | None = None,
        cause: BaseException | None = None,
        array: str | None = None,
        reason: str | None = None,
    ):
        self.step, self.directory, self.file, self.array = step, directory, file, array
        self.reason = reason
        if reason is not None:
            what = reason
        elif array is not None:
            what = f"the data of {array!r} reads back different from what was saved (checksum)"
        else:
            where = f"file {file}" if file else "one of its files"
            first = next((ln.strip() for ln in str(cause).splitlines() if ln.strip()), "")
            what = f"{where} cannot be read ({type(cause).__name__}: {first[:300]})"
        super().__init__(
            f"checkpoint step {step} in {directory} is damaged: {what}; restore another step "
            "(Checkpointer.all_steps() lists them) or save again"
        )

    @property
    def summary(self) -> str:
        """What is wrong in a few words, as a resume reports a step it passed over:
        ``FILE cannot be read``, ``array 'P' fails its checksum`` or the ``reason``."""
        if self.reason is not None:
            return self.reason
        if self.array is not None:
            return f"array {self.array!r} fails its checksum"
        return f"{self.file or 'one of its files'} cannot be read"

    def report(self) -> dict[str, Any]:
        """Its message and fields, JSON-able: what another process needs to raise it too
        (:meth:`reported`)."""
        return {"message": str(self), **{name: getattr(self, name) for name in _FIELDS}}

    @classmethod
    def reported(cls, report: Mapping[str, Any]) -> CheckpointCorruptError:
        """The error :meth:`report` describes, as another process raised it: the same message
        and fields."""
        error = cls.__new__(cls)
        RuntimeError.__init__(error, report["message"])
        for name in _FIELDS:
            setattr(error, name, report[name])
        return error


_FIELDS = ("step", "directory", "file", "array", "reason")


@jax.jit
def _checksum(x: jax.Array) -> jax.Array:
    """:func:`checksum`, computed where ``x`` lives; only the scalar comes to the host."""
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    words = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)
    position = jnp.arange(words.size, dtype=jnp.uint32)
    return jnp.sum(words * (position * jnp.uint32(_GOLDEN) + jnp.uint32(1)), dtype=jnp.uint32)


def checksums(values: Mapping[str, Any]) -> dict[str, int]:
    """The checksum of each array of ``values`` (by name), each computed on its devices."""
    sums = {name: _checksum(jnp.asarray(value)) for name, value in values.items()}
    return {name: int(value) for name, value in jax.device_get(sums).items()}


def checksum(values: np.ndarray) -> int:
    """A position-weighted sum of ``values``' bits as uint32 words (wrapping): any changed,
    lost or moved word changes it; the same as :func:`checksums` computes on device."""
    values = np.ascontiguousarray(values)
    if values.dtype == np.bool_:
        values = values.astype(np.uint8)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[values.dtype.itemsize]
    words = values.view(unsigned).reshape(-1).astype(np.uint32)
    position = np.arange(words.size, dtype=np.uint32)
    with np.errstate(over="ignore"):
        weights = position * np.uint32(_GOLDEN) + np.uint32(1)
        return int(np.sum(words * weights, dtype=np.uint32))


def verify(
    step: int, folder: epath.Path, values: Mapping[str, Any], info: Mapping[str, Any]
) -> None:
    """A :class:`CheckpointCorruptError` naming the first of ``values`` failing its checksum."""
    checked = {name: v for name, v in values.items() if "checksum" in info.get(name, {})}
    for name, value in checksums(checked).items():
        if value != info[name]["checksum"]:
            raise CheckpointCorruptError(step, os.fspath(folder), array=name)


def extra_checksum(extra: Mapping[str, Any]) -> str:
    """The checksum of a step's ``extra``, over its canonical JSON."""
    canonical = json.dumps(extra, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_extra(step: int, folder: epath.Path, extra: Any, saved_checksum: str | None) -> None:
    """A :class:`CheckpointCorruptError` when ``extra`` (``None``: missing) fails its checksum."""
    if saved_checksum is None:
        return
    where = os.fspath(folder)
    if extra is None:
        missing = FileNotFoundError(f"the step's {EXTRA}/ item is missing")
        raise CheckpointCorruptError(
            step, where, file=os.path.join(where, EXTRA, "metadata"), cause=missing
        )
    if extra_checksum(extra) != saved_checksum:
        raise CheckpointCorruptError(step, where, array=EXTRA)


def check_items(
    step: int,
    folder: epath.Path,
    arrays: Mapping[str, Mapping[Any, Any] | None],
    info: Mapping[str, Any],
    items: Iterable[str],
) -> None:
    """A :class:`CheckpointCorruptError` naming the first of ``items`` (``model``, ``opt``)
    whose saved tree cannot be read (``arrays[item]`` is ``None``) although mmnnx's description
    ``info`` lists its arrays: the item was saved and is damaged (its directory or its
    ``_METADATA`` deleted), not absent from the checkpoint."""
    for item in items:
        described = sum(name.split("/")[0] == item for name in info)
        if arrays.get(item) is None and described:
            where = os.fspath(folder)
            missing = FileNotFoundError(
                f"no readable tree, though {described} of its arrays were saved"
            )
            raise CheckpointCorruptError(step, where, file=os.path.join(where, item), cause=missing)


def read_or_corrupt(step: int, folder: epath.Path, read: Callable[[], Any]) -> Any:
    """``read()``; a failure is a :class:`CheckpointCorruptError` naming the file if found."""
    try:
        return read()
    except Exception as e:
        where = os.fspath(folder)
        raise CheckpointCorruptError(step, where, file=_damaged_file(where, e), cause=e) from e


def _damaged_file(folder: str, error: BaseException) -> str | None:
    """The file of step directory ``folder`` that ``error`` came from: a missing OCDBT manifest,
    else the longest path under ``folder`` named in the error (or its causes), else a JSON file
    that does not parse; ``None`` when none is found."""
    for item in (MODEL, OPT):
        item_dir = os.path.join(folder, item)
        manifest = os.path.join(item_dir, "manifest.ocdbt")
        if os.path.isdir(os.path.join(item_dir, "d")) and not os.path.exists(manifest):
            return manifest
    text, cause = "", error
    while cause is not None:
        text += f"\n{cause}"
        cause = cause.__cause__ or cause.__context__
    named = re.findall(re.escape(folder) + r"/[^\s'\",\\}]+", text)
    if named:
        return max(named, key=len).rstrip("/.")
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            if name in _JSON_FILES:
                path = os.path.join(root, name)
                try:
                    with open(path, "rb") as f:
                        json.loads(f.read() or b"!")
                except (OSError, ValueError):
                    return path
    return None
