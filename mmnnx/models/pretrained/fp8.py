"""Block-quantized FP8 checkpoints as DeepSeek-V3 and Kimi K2 publish them
(``quantization_config: {quant_method: "fp8", weight_block_size: [128, 128]}``): each quantized
weight ``float8_e4m3fn`` beside its float32 ``<name>_scale_inv``, one number per block,
dequantized while each device reads its own slice."""

from __future__ import annotations

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
    ``weight_block_size``, else whole tensors (``quantized.dequantizing`` picks this reader).

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
    where = f"{files.directory / 'config.json'}: quantization_config"
    block = quant.get("weight_block_size")
    if block is None:
        return Fp8Files(files, (1 << 62, 1 << 62))  # one scale per tensor
    ok = isinstance(block, list) and len(block) == 2
    if not ok or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise CheckpointError(f"{where}.weight_block_size: {block!r} is not two ints >= 1")
    return Fp8Files(files, (block[0], block[1]))
