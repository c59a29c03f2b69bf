"""``save_pretrained(quantized=...)``: FP8 blocks (DeepSeek-V3) and MXFP4 experts (gpt-oss)
written as published, read back by mmnnx as the quantize-dequantize of the weights (computed
here, as the reference quantizers do, one block at a time), and the quantized fixtures saved
back without training as their own tensors. (transformers' verdict on what is written:
tests/test_family_deepseek.py and tests/test_family_gpt_oss.py.)"""

import json
import math
import pathlib
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from mmnnx.models import from_pretrained, pretrained_config, save_pretrained
from mmnnx.models.pretrained import CheckpointError, check_tensors
from mmnnx.models.pretrained.files import CheckpointFiles, write_shards
from mmnnx.models.pretrained.fp8 import Fp8Files
from mmnnx.models.pretrained.mxfp4 import FP4_VALUES

FIXTURES = pathlib.Path(__file__).parent / "transformers_fixtures"
DEEPSEEK, DEEPSEEK_FP8 = FIXTURES / "deepseek_v3", FIXTURES / "deepseek_v3_fp8"
GPT_OSS, GPT_OSS_MXFP4 = FIXTURES / "gpt-oss", FIXTURES / "gpt-oss-mxfp4"


def _fp8_round_trip(w: np.ndarray, block: int) -> np.ndarray:
    """DeepSeek's quantize-dequantize of ``w`` (out, in), one block at a time."""
    out = np.empty_like(w, np.float32)
    for i in range(math.ceil(w.shape[0] / block)):
        for j in range(math.ceil(w.shape[1] / block)):
            at = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
            scale = np.float32(np.abs(w[at]).max()) / np.float32(448)
            q = (w[at] / scale).astype(ml_dtypes.float8_e4m3fn)
            out[at] = q.astype(np.float32) * scale
    return out


def _mxfp4_round_trip(w: np.ndarray) -> np.ndarray:
    """OpenAI's MXFP4 quantize-dequantize of ``w`` (experts, in, out) along ``in``: per 32
    inputs, 2 ** ceil(log2(amax / 6)) times the nearest FP4 value, ties away from zero."""
    out = np.empty_like(w, np.float32)
    for index in np.ndindex(w.shape[0], w.shape[1] // 32, w.shape[2]):
        e, g, o = index
        x = w[e, 32 * g : 32 * (g + 1), o].astype(np.float64)
        power = 2.0 ** math.ceil(math.log2(np.abs(x).max() / 6))
        magnitudes = FP4_VALUES[:8].astype(np.float64)
        distance = np.abs(np.abs(x / power)[:, None] - magnitudes)
        nearest = 7 - np.argmin(distance[:, ::-1], axis=1)  # the larger on a tie
        out[e, 32 * g : 32 * (g + 1), o] = np.sign(x) * magnitudes[nearest] * power
    return out


def _params(model) -> dict:
    return {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _dtypes(path: pathlib.Path) -> dict[str, str]:
    return {name: info.dtype for name, info in CheckpointFiles(path).tensors.items()}


def test_fp8_written_reads_back_as_the_quantize_dequantize_of_the_weights(tmp_path):
    """Blocks of 8 over the fixture's 20-row ``kv_a_proj_with_mqa``: its last blocks partial;
    the tensors quantized are those the FP8 fixture has in FP8 (DeepSeek-V3's projections)."""
    model = from_pretrained(DEEPSEEK)
    quant = {"quant_method": "fp8", "weight_block_size": [8, 8]}
    path = save_pretrained(model, tmp_path / "fp8", quantized=quant)
    assert json.loads((path / "config.json").read_text())["quantization_config"] == quant
    assert _dtypes(path) == _dtypes(DEEPSEEK_FP8)
    before, after = _params(model), _params(from_pretrained(path))
    quantized = 0
    for key, value in before.items():
        if value.ndim == 2 and key[-1] == "kernel" and key[-2] not in ("head", "router"):
            expected = _fp8_round_trip(value.T, 8).T
            quantized += 1
        elif key[-2] == "experts":  # (experts, in, out): each expert's (out, in) weight
            expected = np.stack([_fp8_round_trip(w.T, 8).T for w in value])
            quantized += 1
        else:
            expected = value
        np.testing.assert_array_equal(after[key], expected, err_msg=str(key))
    assert quantized == 3 * 5 + 3 + 2 * 6  # attention, the dense MLP, experts and shared


def test_mxfp4_written_reads_back_as_the_quantize_dequantize_of_the_experts(tmp_path):
    model = from_pretrained(GPT_OSS)
    path = save_pretrained(model, tmp_path / "mxfp4", quantized={"quant_method": "mxfp4"})
    assert _dtypes(path) == _dtypes(GPT_OSS_MXFP4)
    before, after = _params(model), _params(from_pretrained(path))
    for key, value in before.items():
        quantized = key[-1] in ("gate_up", "down")
        expected = _mxfp4_round_trip(value) if quantized else value
        np.testing.assert_array_equal(after[key], expected, err_msg=str(key))
        assert quantized == (not np.array_equal(after[key], value)), key


def test_the_fp8_fixture_saved_back_quantized_is_its_own_bytes_and_scales(tmp_path):
    path = save_pretrained(from_pretrained(DEEPSEEK_FP8), tmp_path / "again", quantized=True)
    config = json.loads((DEEPSEEK_FP8 / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0  # written by mmnnx, whose GPT has none
    assert json.loads((path / "config.json").read_text()) == config
    ours, theirs = Fp8Files(CheckpointFiles(path), (8, 8)), CheckpointFiles(DEEPSEEK_FP8)
    assert sorted(ours.files.tensors) == sorted(theirs.tensors)
    for name, info in theirs.tensors.items():
        if info.dtype == "F8_E4M3":
            a = ours._quantized(name, slice(None), slice(None)).view(np.uint8)
            b = Fp8Files(theirs, (8, 8))._quantized(name, slice(None), slice(None))
            np.testing.assert_array_equal(a, b.view(np.uint8), err_msg=name)
        else:
            np.testing.assert_array_equal(ours.files.read(name), theirs.read(name), err_msg=name)


def test_the_mxfp4_fixture_saved_back_quantized_is_its_own_tensors_but_where_the_rule_differs(
    tmp_path,
):
    """The reference rounds each group's exponent from its largest magnitude up: the fixture's
    groups whose largest FP4 value is 3 (weights within 3 to 3.5 times their power of two) hold,
    dequantized, 6 times half that power, which the reference writes with the power one lower
    and every code's value doubled: there (and only there) other bytes, the same weights."""
    path = save_pretrained(from_pretrained(GPT_OSS_MXFP4), tmp_path / "again", quantized=True)
    assert json.loads((path / "config.json").read_text()) == json.loads(
        (GPT_OSS_MXFP4 / "config.json").read_text()
    )
    ours, theirs = CheckpointFiles(path), CheckpointFiles(GPT_OSS_MXFP4)
    assert sorted(ours.tensors) == sorted(theirs.tensors)
    differing = 0
    for name in theirs.tensors:
        if not name.endswith("_blocks"):
            if not name.endswith("_scales"):
                np.testing.assert_array_equal(ours.read(name), theirs.read(name), err_msg=name)
            continue
        scales = name.removesuffix("_blocks") + "_scales"
        (a, sa), (b, sb) = [(f.read(name), f.read(scales)) for f in (ours, theirs)]
        largest = np.abs(FP4_VALUES[np.stack([b & 15, b >> 4], -1)]).max(axis=(-1, -2))
        lowered = largest == 3.0
        np.testing.assert_array_equal(sa, np.where(lowered, sb - 1, sb), err_msg=name)
        np.testing.assert_array_equal(a[~lowered], b[~lowered], err_msg=name)
        codes = [np.stack([x & 15, x >> 4], -1)[lowered] for x in (a, b)]
        np.testing.assert_array_equal(FP4_VALUES[codes[0]], 2 * FP4_VALUES[codes[1]])
        differing += int(lowered.sum())
    assert differing > 0


def test_quantized_without_a_quantization_config_names_what_to_pass(tmp_path):
    model, block = from_pretrained(GPT_OSS), {"weight_block_size": [128]}
    with pytest.raises(CheckpointError, match="read from no quantized checkpoint") as error:
        save_pretrained(model, tmp_path / "m", quantized=True)
    assert 'quantized={"quant_method": "fp8", "weight_block_size": [128, 128]}' in str(error.value)
    assert not (tmp_path / "m").exists()
    with pytest.raises(CheckpointError, match='quant_method "int4" is not supported'):
        save_pretrained(model, tmp_path / "m", quantized={"quant_method": "int4"})
    with pytest.raises(CheckpointError, match="weight_block_size: \\[128\\] is not two ints"):
        save_pretrained(model, tmp_path / "m", quantized={"quant_method": "fp8", **block})
    assert not (tmp_path / "m").exists()
    written = save_pretrained(model, tmp_path / "bf16", dtype=jnp.bfloat16)
    assert "quantization_config" not in json.loads((written / "config.json").read_text())


def test_check_tensors_reads_quantized_checkpoints_as_from_pretrained_does(tmp_path):
    """``check_tensors`` (what ``mmnnx train --init-from`` runs before a run writes anything)
    sees FP8 and MXFP4 tensors as the floats ``from_pretrained`` reads: the published
    quantized layouts pass (their ``*_scale_inv``, ``*_blocks`` and ``*_scales`` were refused
    as tensors filling no Variable), misshapen MXFP4 scales are still refused naming them."""
    for path in (DEEPSEEK_FP8, GPT_OSS_MXFP4):
        check_tensors(path, pretrained_config(path))
    broken = tmp_path / "mxfp4"
    shutil.copytree(GPT_OSS_MXFP4, broken)
    files = CheckpointFiles(broken)
    tensors = {name: files.read(name) for name in files.tensors}
    scales = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[scales] = np.zeros((4, 32, 2), np.uint8)
    write_shards(broken, tensors)
    with pytest.raises(CheckpointError, match=f"MXFP4 scales '{scales}' are U8 \\(4, 32, 2\\)"):
        check_tensors(broken, pretrained_config(broken))


def test_an_fp8_config_without_weight_block_size_reads_128_by_128_blocks_as_transformers(
    tmp_path,
):
    # transformers' FineGrainedFP8Config defaults the key to (128, 128); mmnnx read its absence
    # as one scale per tensor and refused published-layout scales with a garbled shape
    from mmnnx.models.pretrained.fp8 import fp8_files, fp8_quantized

    weight = np.random.default_rng(0).normal(size=(136, 24)).astype(np.float32)
    fp8, scale = fp8_quantized(weight, (128, 128))  # partial edge blocks: 2 x 1 scales
    write_shards(tmp_path, {"w": fp8, "w_scale_inv": scale})
    files = fp8_files(CheckpointFiles(tmp_path), {"quant_method": "fp8"})
    read = files.read("w", (slice(0, 136),))
    np.testing.assert_allclose(read, fp8.astype(np.float32) * np.repeat(scale, [128, 8], 0))
    whole = {"quant_method": "fp8", "weight_block_size": None}  # null: one scale per tensor
    with pytest.raises(CheckpointError, match=r"scale 'w_scale_inv' is F32 \(2, 1\)"):
        fp8_files(CheckpointFiles(tmp_path), whole)
