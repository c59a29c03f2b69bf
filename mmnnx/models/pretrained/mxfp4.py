"""MXFP4 checkpoints as gpt-oss is published (``quantization_config: {quant_method: "mxfp4"}``):
each quantized expert weight ``<name>`` stored as ``<name>_blocks`` (uint8, two 4-bit FP4
codes a byte) and ``<name>_scales`` (uint8, a power of two per 32 inputs), dequantized while
each device reads its own slice, as transformers' ``convert_moe_packed_tensors`` does."""

from __future__ import annotations

from typing import Any

import numpy as np

from mmnnx.models.pretrained.files import CheckpointError, CheckpointFiles, TensorInfo

FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
"""The value of each 4-bit code (E2M1: the high bit the sign)."""
BLOCKS, SCALES = "_blocks", "_scales"
BLOCK = 32  # inputs sharing one scale: 16 bytes of two codes


class Mxfp4Files:
    """``files`` (a ``CheckpointFiles`` of an MXFP4 checkpoint) as float32 tensors: the same
    ``directory``, ``config``, ``tensors`` (each ``<name>_blocks`` / ``<name>_scales`` pair
    as the tensor ``<name>`` it dequantizes to), ``dtype`` and ``read``, by slices: only the
    blocks and scales of a slice's experts, outputs and blocks of 32 inputs are read.

    ``<name>_blocks`` ``(*lead, out, G, 16)`` and ``<name>_scales`` ``(*lead, out, G)`` hold
    ``<name>`` ``(*lead, 32 * G, out)``: input ``32 g + 2 j`` of output ``o`` is the low nibble
    of byte ``j`` of block ``(o, g)``, input ``32 g + 2 j + 1`` its high nibble, each code's
    FP4 value times ``2 ** (scale - 127)``. Every pair's presence and shapes are checked when
    it is made.

    Example:
        >>> import tempfile
        >>> from mmnnx.models.pretrained.files import write_shards
        >>> d = tempfile.mkdtemp()
        >>> blocks = np.full((1, 2, 1, 16), 0x92, np.uint8)  # codes 2 (1.0), then 9 (-0.5)
        >>> scales = np.array([[[127], [128]]], np.uint8)  # 2 ** 0, 2 ** 1
        >>> write_shards(d, {"w_blocks": blocks, "w_scales": scales})
        >>> files = Mxfp4Files(CheckpointFiles(d))
        >>> files.tensors["w"].shape, files.read("w", (slice(None), slice(0, 3))).tolist()
        ((1, 32, 2), [[[1.0, 2.0], [-0.5, -1.0], [1.0, 2.0]]])
    """

    def __init__(self, files: CheckpointFiles):
        self.files = files
        self.directory, self.config = files.directory, files.config
        self.tensors: dict[str, TensorInfo] = {}
        self.quantized: set[str] = set()
        for name, info in files.tensors.items():
            if name.endswith(SCALES):
                if name.removesuffix(SCALES) + BLOCKS not in files.tensors:
                    raise CheckpointError(
                        f"{self.directory / info.file}: scales {name!r} have no blocks "
                        f"{name.removesuffix(SCALES) + BLOCKS!r} beside them"
                    )
            elif name.endswith(BLOCKS):
                weight = name.removesuffix(BLOCKS)
                self.tensors[weight] = self._checked(weight, info)
                self.quantized.add(weight)
            else:
                self.tensors[name] = info

    def _checked(self, weight: str, info: TensorInfo) -> TensorInfo:
        """The dequantized tensor's info, its blocks and scales checked."""
        blocks, scales = weight + BLOCKS, weight + SCALES
        file = self.directory / info.file
        if info.dtype != "U8" or len(info.shape) < 3 or info.shape[-1] != BLOCK // 2:
            raise CheckpointError(
                f"{file}: MXFP4 blocks {blocks!r} are {info.dtype} {info.shape}, not uint8 of "
                f"shape (..., out, groups, {BLOCK // 2})"
            )
        if scales not in self.files.tensors:
            raise CheckpointError(
                f"{file}: MXFP4 blocks {blocks!r} have no scales {scales!r} (uint8 of shape "
                f"{info.shape[:-1]})"
            )
        found = self.files.tensors[scales]
        if found.dtype != "U8" or found.shape != info.shape[:-1]:
            raise CheckpointError(
                f"{self.directory / found.file}: MXFP4 scales {scales!r} are {found.dtype} "
                f"{found.shape}, not uint8 of shape {info.shape[:-1]} (those of {blocks!r})"
            )
        *lead, out, groups, _ = info.shape
        return TensorInfo(info.file, (*lead, groups * BLOCK, out), "F32")

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(np.float32) if name in self.quantized else self.files.dtype(name)

    def read(self, name: str, index: tuple[slice, ...] = (), transpose: Any = None) -> np.ndarray:
        """As ``CheckpointFiles.read``; a quantized tensor's part dequantized, float32."""
        if name not in self.quantized:
            return self.files.read(name, index, transpose)
        shape = self.tensors[name].shape
        slices = tuple(index) + (slice(None),) * (len(shape) - len(index))
        ranges = [range(*s.indices(n)) for s, n in zip(slices, shape, strict=True)]
        if any(r.step != 1 for r in ranges):
            raise IndexError(f"tensor {name!r}: read takes slices of step 1, got {index}")
        *lead, inputs, outputs = (slice(r.start, r.stop) for r in ranges)
        if inputs.stop <= inputs.start:
            part = np.zeros([len(r) for r in ranges], np.float32)
        else:
            groups = slice(inputs.start // BLOCK, (inputs.stop - 1) // BLOCK + 1)
            blocks = self.files.read(name + BLOCKS, (*lead, outputs, groups))
            scales = self.files.read(name + SCALES, (*lead, outputs, groups))
            codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # (..., out, g, 16, 2)
            values = FP4_VALUES[codes] * np.exp2(scales.astype(np.int32) - 127)[..., None, None]
            values = values.astype(np.float32).reshape(*values.shape[:-3], -1)  # (..., out, in)
            start = inputs.start - groups.start * BLOCK
            part = np.swapaxes(values[..., start : start + len(ranges[-2])], -1, -2)
        return part if transpose is None else part.transpose(transpose)


def mxfp4_files(files: CheckpointFiles, quant: dict) -> Mxfp4Files:
    """``files`` as :class:`Mxfp4Files` (``quantized.dequantizing`` picks this reader; MXFP4
    has no options in ``quant``).

    Example:
        >>> import tempfile, pathlib
        >>> from mmnnx.models.pretrained.files import write_shards
        >>> d = pathlib.Path(tempfile.mkdtemp())
        >>> write_shards(d, {"w": np.zeros(2, np.float32)})
        >>> type(mxfp4_files(CheckpointFiles(d), {"quant_method": "mxfp4"})).__name__
        'Mxfp4Files'
    """
    return Mxfp4Files(files)
