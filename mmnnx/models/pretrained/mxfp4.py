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


def mxfp4_quantized(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``weight`` ``(*lead, in, out)`` as gpt-oss publishes it: ``(blocks, scales)`` of
    :class:`Mxfp4Files`' layout, as OpenAI's ``downcast_to_mxfp`` (triton_kernels, which
    transformers' ``quantize_to_mxfp4`` calls) computes them: per output and 32 inputs, the
    exponent of ``amax / 6`` rounded up (``scales``: it + 127), each input divided by its power
    of two and rounded to the nearest FP4 value, ties away from zero, at most 6. (transformers
    rounds the weights to bfloat16 first; here they are quantized as they are.)

    Example:
        >>> w = np.zeros((32, 1), np.float32)
        >>> w[:4, 0] = [12.0, -2.6, 0.5, 3.0]  # amax 12: scale 2 ** 1; 2.6 / 2 = 1.3 -> 1.5
        >>> blocks, scales = mxfp4_quantized(w)
        >>> blocks.shape, scales.tolist(), hex(blocks[0, 0, 0]), hex(blocks[0, 0, 1])
        ((1, 1, 16), [[128]], '0xb7', '0x31')
    """
    w = np.swapaxes(np.asarray(weight, np.float32), -1, -2)  # (*lead, out, in)
    *lead, out, inputs = w.shape
    if inputs % BLOCK:
        raise ValueError(f"{inputs} inputs are not a multiple of MXFP4's blocks of {BLOCK}")
    groups = w.reshape(*lead, out, inputs // BLOCK, BLOCK)
    scale = (np.abs(groups).max(-1) / np.float32(6.0)).astype(np.float32)
    power = (scale.view(np.uint32) + np.uint32(0x7FFFFF)) & np.uint32(0x7F800000)
    inverse = np.divide(1, power.view(np.float32), out=np.zeros_like(scale), where=power > 0)
    bits = (groups * inverse[..., None]).view(np.uint32)
    sign, exponent, mantissa = bits >> 31, (bits >> 23) & 0xFF, bits & 0x7FFFFF
    below = (0x400000 | (mantissa >> 1)) >> np.clip(126 - exponent, 0, 31)  # subnormal FP4
    mantissa = np.where(exponent < 127, below, mantissa)
    exponent = np.maximum(exponent, 126) - 126
    codes = np.minimum((((exponent << 2) | (mantissa >> 21)) + 1) >> 1, 7) | (sign << 3)
    codes = codes.astype(np.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (power >> 23).astype(np.uint8)


EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
"""The tensors gpt-oss publishes in MXFP4: its experts' fused weights."""


def mxfp4_writer(quant: dict, where: Any) -> Any:
    """What ``save_pretrained(quantized=...)`` writes of each tensor for an MXFP4
    ``quantization_config``: :data:`EXPERTS` as ``<name>_blocks`` and ``<name>_scales``
    (:func:`mxfp4_quantized`), else ``None`` (written in the checkpoint's dtype).

    Example:
        >>> write = mxfp4_writer({"quant_method": "mxfp4"}, "ckpt")
        >>> out = write("model.layers.0.mlp.experts.down_proj", np.ones((2, 32, 4)))
        >>> {k.rsplit(".", 1)[1]: v.shape for k, v in out.items()}
        {'down_proj_blocks': (2, 4, 1, 16), 'down_proj_scales': (2, 4, 1)}
    """

    def write(name: str, value: np.ndarray) -> dict[str, np.ndarray] | None:
        if not name.endswith(EXPERTS):
            return None
        try:
            blocks, scales = mxfp4_quantized(value)
        except ValueError as e:
            raise CheckpointError(f"{where}: tensor {name!r} {value.shape}: {e}") from None
        return {name + BLOCKS: blocks, name + SCALES: scales}

    return write
