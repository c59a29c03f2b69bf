"""Block-quantized FP8 checkpoints as DeepSeek-V3 and Kimi K2 publish them
(``quantization_config: {quant_method: "fp8", weight_block_size: [128, 128]}``): each quantized
weight ``float8_e4m3fn`` beside its float32 ``<name>_scale_inv``, one number per block,
dequantized while each device reads its own slice."""

from __future__ import annotations

import fnmatch
import json
import math
from typing import Any

import numpy as np

from mmnnx.models.pretrained.files import DTYPES, CheckpointError, CheckpointFiles, TensorInfo

QUANTIZED_CODES = ("F8_E4M3", "F8_E5M2")
"""The safetensors dtypes of quantized weights."""
SCALE = "_scale_inv"


class Fp8Files:
    """``files`` (a ``CheckpointFiles`` of an FP8 checkpoint) as float32 tensors: the same
    ``directory``, ``config``, ``tensors`` (without the scales, quantized ones as ``F32``),
    ``dtype`` and ``read`` (by slices: only the slice's weights and its blocks' scales are
    read). Each block of ``block_size`` (rows, columns) of a weight is ``fp8 * scale_inv`` of
    its block, the edge blocks partial (a 576-row weight in 128-row blocks: 5 blocks, the last
    of 64 rows). Every scale's presence and shape is checked when it is made.

    Example:
        >>> import tempfile
        >>> import ml_dtypes
        >>> from mmnnx.models.pretrained.files import write_shards
        >>> d = tempfile.mkdtemp()
        >>> w = np.full((3, 2), 2.0, ml_dtypes.float8_e4m3fn)
        >>> write_shards(d, {"w": w, "w_scale_inv": np.array([[0.5], [4.0]], np.float32)})
        >>> files = Fp8Files(CheckpointFiles(d), (2, 2))
        >>> files.read("w", (slice(1, 3),), transpose=(1, 0)).tolist()  # rows 1, 2: blocks 0, 1
        [[1.0, 8.0], [1.0, 8.0]]
    """

    def __init__(self, files: CheckpointFiles, block_size: tuple[int, int]):
        self.files, self.block_size = files, block_size
        self.directory, self.config = files.directory, files.config
        self.tensors: dict[str, TensorInfo] = {}
        self.scales: dict[str, str] = {}
        self._headers: dict[str, tuple[int, dict[str, Any]]] = {}  # by file: data start, header
        for name, info in files.tensors.items():
            if name.endswith(SCALE):
                if name.removesuffix(SCALE) not in files.tensors:
                    raise CheckpointError(
                        f"{self.directory / info.file}: scale {name!r} has no weight "
                        f"{name.removesuffix(SCALE)!r} beside it"
                    )
                continue
            if info.dtype in QUANTIZED_CODES:
                self.scales[name] = self._checked_scale(name, info)
                info = info._replace(dtype="F32")
            self.tensors[name] = info

    def _checked_scale(self, name: str, info: TensorInfo) -> str:
        file = self.directory / info.file
        if len(info.shape) != 2:
            raise CheckpointError(
                f"{file}: quantized tensor {name!r} has shape {info.shape}; block scales need "
                "a matrix"
            )
        scale = name + SCALE
        want = tuple(math.ceil(n / b) for n, b in zip(info.shape, self.block_size, strict=True))
        if scale not in self.files.tensors:
            raise CheckpointError(
                f"{file}: quantized tensor {name!r} ({info.dtype}) has no {scale!r} (its "
                f"{want[0]} x {want[1]} block scales)"
            )
        found = self.files.tensors[scale]
        if found.shape != want or found.dtype not in ("F32", "BF16", "F16"):
            raise CheckpointError(
                f"{self.directory / found.file}: scale {scale!r} is {found.dtype} "
                f"{found.shape}, not a float of shape {want} (ceil({info.shape[0]} / "
                f"{self.block_size[0]}) x ceil({info.shape[1]} / {self.block_size[1]})) for "
                f"{name!r}"
            )
        return scale

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(np.float32) if name in self.scales else self.files.dtype(name)

    def read(self, name: str, index: tuple[slice, ...] = (), transpose: Any = None) -> np.ndarray:
        """As ``CheckpointFiles.read``; a quantized tensor's part dequantized, float32."""
        if name not in self.scales:
            return self.files.read(name, index, transpose)
        shape = self.files.tensors[name].shape
        slices = tuple(index) + (slice(None),) * (2 - len(index))
        (r0, r1, _), (c0, c1, _) = (s.indices(n) for s, n in zip(slices, shape, strict=True))
        part = self._quantized(name, slice(r0, r1), slice(c0, c1)).astype(np.float32)
        (br, bc), rows, cols = self.block_size, range(r0, r1), range(c0, c1)
        if part.size:
            blocks = (slice(r0 // br, (r1 - 1) // br + 1), slice(c0 // bc, (c1 - 1) // bc + 1))
            scale = self.files.read(self.scales[name], blocks).astype(np.float32)
            row_block = np.asarray(rows) // br - r0 // br
            col_block = np.asarray(cols) // bc - c0 // bc
            part = part * scale[row_block][:, col_block]
        return part if transpose is None else part.transpose(transpose)

    def _quantized(self, name: str, rows: slice, cols: slice) -> np.ndarray:
        """Rows and columns of a float8 tensor, read from its file's bytes (mapped: only the
        pages of those rows are read); safetensors' numpy reader has no float8 dtype."""
        info = self.files.tensors[name]
        path = self.directory / info.file
        if info.file not in self._headers:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                self._headers[info.file] = (8 + size, json.loads(f.read(size)))
        begin, header = self._headers[info.file]
        offset = begin + header[name]["data_offsets"][0]
        data = np.memmap(path, np.uint8, mode="r", offset=offset, shape=info.shape)
        return np.array(data[rows, cols]).view(DTYPES[info.dtype])


def fp8_files(files: CheckpointFiles, quant: dict) -> Fp8Files:
    """``files`` as :class:`Fp8Files`, blocks of ``quant``'s (``quantization_config``'s)
    ``weight_block_size`` (absent: 128 x 128, as transformers reads it; ``null``: whole tensors;
    ``quantized.dequantizing`` picks this reader).

    Example:
        >>> import tempfile, json, pathlib
        >>> from mmnnx.models.pretrained.files import write_shards
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> write_shards(d, {"w": np.zeros(2, np.float32)})
        >>> try:
        ...     fp8_files(CheckpointFiles(d), {"weight_block_size": [128]})
        ... except CheckpointError as e:
        ...     print(str(e).replace(str(d), "ckpt"))
        ckpt/config.json: quantization_config.weight_block_size: [128] is not two ints >= 1
    """
    return Fp8Files(files, _block_size(quant, files.directory / "config.json"))


def _block_size(quant: dict, where: Any) -> tuple[int, int]:
    """``quant``'s ``weight_block_size`` checked: absent, transformers' default ``[128, 128]``
    (``FineGrainedFP8Config``); ``null``, whole tensors."""
    block = quant.get("weight_block_size", [128, 128])
    if block is None:
        return (1 << 62, 1 << 62)  # one scale per tensor
    ok = isinstance(block, list) and len(block) == 2
    if not ok or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise CheckpointError(
            f"{where}: quantization_config.weight_block_size: {block!r} is not two ints >= 1"
        )
    return block[0], block[1]


FP8_MAX = 448.0
"""The largest float8_e4m3fn: each block's largest magnitude is written as it."""


def fp8_quantized(weight: np.ndarray, block_size: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """``weight`` (rows, columns) as DeepSeek-V3 publishes it: each block of ``block_size``
    (the edge blocks partial) divided by its ``scale_inv = amax / 448`` (float32, DeepSeek's
    ``act_quant``; ``1e-12`` for an all-zero block) and rounded to ``float8_e4m3fn``; returns
    the float8 weight and the float32 scales, ``ceil(rows / b) x ceil(columns / b)``.

    Example:
        >>> q, s = fp8_quantized(np.array([[896.0, 1.0, 7.0]]), (1, 2))  # blocks of 2 columns
        >>> q.astype(np.float32).tolist(), s.tolist()
        ([[448.0, 0.5, 448.0]], [[2.0, 0.015625]])
        >>> fp8_quantized(np.ones((3, 2)), (1 << 62, 1 << 62))[1].shape  # one scale a tensor
        (1, 1)
    """
    w = np.asarray(weight, np.float32)
    rows, cols = w.shape
    br, bc = (max(1, min(b, n)) for b, n in zip(block_size, w.shape, strict=True))
    padded = np.pad(np.abs(w), ((0, -rows % br), (0, -cols % bc)))
    amax = padded.reshape(padded.shape[0] // br, br, padded.shape[1] // bc, bc).max(axis=(1, 3))
    scale = np.maximum(amax, np.float32(1e-12)) / np.float32(FP8_MAX)
    full = np.repeat(np.repeat(scale, br, 0), bc, 1)[:rows, :cols]
    return np.clip(w / full, -FP8_MAX, FP8_MAX).astype(DTYPES["F8_E4M3"]), scale


def fp8_writer(quant: dict, where: Any) -> Any:
    """What ``save_pretrained(quantized=...)`` writes of each tensor for ``quant`` (an FP8
    ``quantization_config``): the tensors DeepSeek-V3 publishes in FP8 (every 2-D
    ``model.layers.*`` projection weight, ``*proj*.weight``, but those of
    ``modules_to_not_convert``) as :func:`fp8_quantized` with ``<name>_scale_inv``, else
    ``None`` (written in the checkpoint's dtype).

    Example:
        >>> write = fp8_writer({"quant_method": "fp8", "weight_block_size": [2, 2]}, "ckpt")
        >>> out = write("model.layers.0.self_attn.o_proj.weight", np.ones((3, 2)))
        >>> {k.rsplit(".", 1)[1]: (v.dtype.name, v.shape) for k, v in out.items()}
        {'weight': ('float8_e4m3fn', (3, 2)), 'weight_scale_inv': ('float32', (2, 1))}
        >>> write("model.layers.0.mlp.gate.weight", np.ones((3, 2))) is None  # the router's
        True
    """
    block = _block_size(quant, where)
    keep = quant.get("modules_to_not_convert") or []

    def write(name: str, value: np.ndarray) -> dict[str, np.ndarray] | None:
        module = name.removesuffix(".weight")
        leaf = module.rsplit(".", 1)[-1]
        if not name.startswith("model.layers.") or value.ndim != 2 or "proj" not in leaf:
            return None
        if module == name or any(fnmatch.fnmatch(module, p) for p in keep):
            return None
        weight, scale = fp8_quantized(value, block)
        return {name: weight, name + SCALE: scale}

    return write
