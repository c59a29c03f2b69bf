"""Quantized checkpoints read as float tensors: ``config.json``'s
``quantization_config.quant_method`` picks the reader (:data:`QUANT_METHODS`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mmnnx.models.pretrained import fp8, mxfp4
from mmnnx.models.pretrained.files import CheckpointError, CheckpointFiles

QUANT_METHODS: dict[str, tuple[Callable[[CheckpointFiles, dict], Any], Callable]] = {
    "fp8": (fp8.fp8_files, fp8.fp8_writer),  # DeepSeek-V3, Kimi K2: float8 e4m3, block scales
    "mxfp4": (mxfp4.mxfp4_files, mxfp4.mxfp4_writer),  # gpt-oss: 4-bit experts, 2 ** e per 32
}
"""Each ``quant_method`` mmnnx reads and writes: its reader, given the files and the
``quantization_config``, and its writer (of each tensor: its quantized tensors, or ``None``),
given the ``quantization_config`` and where it is written."""


def dequantizing(files: CheckpointFiles) -> Any:
    """``files`` itself, or its quantization's reader over it (as ``CheckpointFiles``: the same
    ``directory``, ``config``, ``tensors``, ``dtype`` and ``read``, dequantized); another
    ``quant_method`` is refused naming it and those read.

    Example:
        >>> import tempfile, json, pathlib
        >>> import numpy as np
        >>> from mmnnx.models.pretrained.files import write_shards
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> write_shards(d, {"w": np.zeros(2, np.float32)})
        >>> _ = (d / "config.json").write_text(json.dumps({"quantization_config":
        ...                                               {"quant_method": "awq"}}))
        >>> try:
        ...     dequantizing(CheckpointFiles(d))
        ... except CheckpointError as e:
        ...     print(str(e).replace(str(d), "ckpt"))
        ckpt/config.json: quantization_config.quant_method "awq" is not supported (only "fp8", \
"mxfp4")
    """
    quant = (files.config or {}).get("quantization_config")
    if quant is None:
        return files
    return QUANT_METHODS[_method(quant, files.directory / "config.json")][0](files, quant)


def quantizing(quant: Any, where: Any) -> Any:
    """The writer of ``quant``'s (a ``quantization_config``'s) method (:data:`QUANT_METHODS`):
    of each tensor ``(name, float array)``, the tensors that store it quantized, or ``None``.

    Example:
        >>> import numpy as np
        >>> write = quantizing({"quant_method": "mxfp4"}, "out/config.json")
        >>> write("model.layers.0.mlp.router.weight", np.ones((4, 32))) is None  # not quantized
        True
    """
    return QUANT_METHODS[_method(quant, where)][1](quant, where)


def _method(quant: Any, where: Any) -> str:
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method not in QUANT_METHODS:
        read = ", ".join(f'"{m}"' for m in QUANT_METHODS)
        raise CheckpointError(
            f'{where}: quantization_config.quant_method "{method}" is not supported (only {read})'
        )
    return method
