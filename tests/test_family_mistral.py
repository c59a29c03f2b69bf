"""Mistral (``MistralForCausalLM``, a sliding window of attention) and Mixtral
(``MixtralForCausalLM``, top-2 of 8 experts in every layer) checkpoints written by transformers
5's own ``save_pretrained`` (tests/transformers_fixtures/{mistral,mixtral}/, made by
make_mistral_fixtures.py): the window matters, the Mixtral's losses equal transformers',
``save_pretrained`` writes back what transformers wrote, and transformers 5 loads what mmnnx
writes (its verdict, mistral_verdict.json). Their logits (and the Mixtral's in the fused layout),
greedy decoding and pipelined training: tests/test_family_conformance.py."""

import contextlib
import dataclasses
import io
import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mmnnx.cli import main
from mmnnx.models import GPT, GPTConfig, from_pretrained, pretrained_config, save_pretrained
from mmnnx.models.pretrained import CheckpointError
from mmnnx.models.pretrained.families.llama import LLAMA
from mmnnx.models.pretrained.families.mistral import MISTRAL, MIXTRAL
from mmnnx.models.pretrained.files import CheckpointFiles
from mmnnx.modules import AttentionConfig, BlockConfig, MoEConfig, NormConfig, RopeConfig
from tests.test_transformers_fixtures import (
    F32,
    FIXTURES,
    TEXT,
    TOKENS,
    _tasks,
    base_with_tokenizer,
    relative_error,
)

NAMES = ("mistral", "mixtral")
_logits = nnx.jit(lambda model, tokens: model(tokens))


def _config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def _edited(tmp_path: pathlib.Path, name: str, **edit) -> pathlib.Path:
    path = tmp_path / f"{name}-edited"
    shutil.copytree(FIXTURES / name, path)
    (path / "config.json").write_text(json.dumps(_config(name) | edit))
    return path


def test_mistrals_window_matters_here(tmp_path):
    """Read without its window of 4, the same weights give other logits than transformers'
    (which mmnnx's equal: tests/test_family_conformance.py)."""
    theirs = np.load(FIXTURES / "mistral" / "logits.npy")
    model = from_pretrained(FIXTURES / "mistral")
    assert {b.attention.sliding_window for b in model.config.block_configs} == {4}
    unwindowed = from_pretrained(_edited(tmp_path, "mistral", sliding_window=None))
    assert unwindowed.config.block_configs[0].attention.sliding_window is None
    assert relative_error(_logits(unwindowed, TOKENS), theirs) > 100 * F32


def test_mixtrals_config_and_losses_equal_transformers(tmp_path):
    """The loss (no load-balancing term unless ``output_router_logits``, as transformers adds
    it) and the load-balancing loss itself equal transformers' (its logits on one device and
    expert-parallel stages: tests/test_family_conformance.py)."""
    losses = json.loads((FIXTURES / "mixtral" / "loss.json").read_text())
    config = pretrained_config(FIXTURES / "mixtral")
    moe = {b.feed_forward for b in config.block_configs}
    assert moe == {MoEConfig(8, num_experts=8, top_k=2, norm_topk_prob=True)}
    assert {b.attention.sliding_window for b in config.block_configs} == {None}
    assert config.block_configs[0].attention.rope.theta == 1e6
    assert config.router_aux_loss_coef == 0 and not losses["loss_by_default_has_aux"]
    edited = _edited(tmp_path, "mixtral", output_router_logits=True)
    assert pretrained_config(edited).router_aux_loss_coef == losses["router_aux_loss_coef"]
    one = from_pretrained(FIXTURES / "mixtral")
    forward = nnx.jit(lambda m, t: (m.forward(t[:, :-1])[1], m.loss(t)))  # inputs, targets
    stats, loss = forward(one, jnp.asarray(TOKENS))
    np.testing.assert_allclose(stats.aux_loss, losses["aux_loss"], rtol=F32)
    np.testing.assert_allclose(loss, losses["cross_entropy"], rtol=F32)


@pytest.mark.parametrize("name", NAMES)
def test_a_loaded_model_is_written_back_as_transformers_wrote_it(tmp_path, name):
    model = from_pretrained(FIXTURES / name, tasks=_tasks(2), max_seq_len=32)
    same = save_pretrained(model, tmp_path / "same")
    assert json.loads((same / "config.json").read_text()) == _config(name)
    names = sorted(CheckpointFiles(same).tensors)
    assert names == sorted(CheckpointFiles(FIXTURES / name).tensors)
    if name == "mixtral":  # the published per-expert layout, as transformers 5 writes it
        assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in names


def test_transformers_reads_what_save_pretrained_writes(tmp_path):
    """make_mistral_fixtures.py --check loaded the checkpoints ``save_saves`` writes in
    transformers 5: every tensor, none left over, its window and experts, logits equal."""
    verdict = json.loads((FIXTURES / "mistral_verdict.json").read_text())
    written = save_saves(tmp_path, logits=False)  # the verdict compared them
    assert sorted(verdict["cases"]) == sorted(written)
    for case, seen in verdict["cases"].items():
        config = json.loads((written[case] / "config.json").read_text())
        assert config == seen["config"], case  # what transformers read is what is written now
        assert seen["missing"] == seen["unexpected"] == seen["mismatched"] == [], case
        assert seen["class"] == config["architectures"][0], case
        assert seen["sliding_window"] == config["sliding_window"], case
        assert seen["experts"] == config.get("num_local_experts"), case
        assert seen["logits_error"] < F32, case
    assert verdict["cases"]["fresh-mixtral"]["sliding_window"] == 3


def save_saves(root: pathlib.Path, logits: bool = True) -> dict[str, pathlib.Path]:
    """The checkpoints make_mistral_fixtures.py --check gives transformers 5: each fixture
    loaded and re-saved in bfloat16, and a Mixtral with a window of 3 not loaded from any;
    beside each (with ``logits``), ``<case>.npy``: mmnnx's logits for :data:`TOKENS` from the
    files it wrote."""
    out = {}
    for name in NAMES:
        model = from_pretrained(FIXTURES / name)
        out[f"{name}-bf16"] = save_pretrained(model, root / f"{name}-bf16", dtype=jnp.bfloat16)
    attention = AttentionConfig(4, num_kv_heads=2, rope=RopeConfig(1e6), sliding_window=3)
    layer = BlockConfig(attention, MoEConfig(16, num_experts=8, top_k=2), NormConfig("rms", 1e-5))
    config = GPTConfig(vocab_size=128, dim=32, depth=2, num_heads=4, num_kv_heads=2,
                       norm_eps=1e-5, max_seq_len=64, layers=(layer, layer))  # fmt: skip
    with nnx.use_eager_sharding(False):
        fresh = GPT(config, rngs=nnx.Rngs(0))
    out["fresh-mixtral"] = save_pretrained(
        fresh, root / "fresh-mixtral", architecture="MixtralForCausalLM"
    )
    for case, path in out.items() if logits else ():
        np.save(root / f"{case}.npy", np.asarray(from_pretrained(path)(jnp.asarray(TOKENS))))
    return out


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("window", [0, -4, 2.5, "4", True])
def test_a_sliding_window_not_a_positive_int_or_null_is_refused(tmp_path, name, window):
    path = _edited(tmp_path, name, sliding_window=window)
    with pytest.raises(CheckpointError, match="sliding_window: .* is not an int >= 1 or null"):
        pretrained_config(path)
    with pytest.raises(CheckpointError) as error:
        from_pretrained(path)
    assert f"{path}/config.json" in str(error.value) and "sliding_window" in str(error.value)


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"num_local_experts": 0}, "num_local_experts: 0 is not an int >= 1"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok: 9 is more than num_local_experts 8"),
        ({"intermediate_size": None}, "no 'intermediate_size' \\(the hidden size of every expert"),
        ({"output_router_logits": "no"}, 'output_router_logits: "no" is not true or false'),
    ],
)
def test_a_mixtrals_own_keys_are_checked(tmp_path, edit, message):
    path = _edited(tmp_path, "mixtral", **edit)
    with pytest.raises(CheckpointError, match=message) as error:
        pretrained_config(path)
    assert f"{path}/config.json" in str(error.value)


def test_models_mixtral_cannot_hold_are_refused(tmp_path):
    mixtral = pretrained_config(FIXTURES / "mixtral")
    assert MIXTRAL.cannot_hold(mixtral) == []
    assert MISTRAL.cannot_hold(mixtral) == ["mixture-of-experts blocks (MistralForCausalLM: dense)"]
    moe = mixtral.block_configs[0].feed_forward
    unnormalised = dataclasses.replace(moe, norm_topk_prob=False)
    layers = tuple(dataclasses.replace(b, feed_forward=unnormalised) for b in mixtral.layers)
    assert MIXTRAL.cannot_hold(dataclasses.replace(mixtral, layers=layers)) == [
        "top-k weights not renormalised (MixtralForCausalLM renormalises them)"
    ]
    dense = GPTConfig(vocab_size=64, dim=32, depth=2, gated_mlp=True, mlp_bias=False)
    with nnx.use_eager_sharding(False):
        model = GPT(dense, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"no mixture-of-experts blocks \(MixtralForCausalLM\)"):
        save_pretrained(model, tmp_path / "d", architecture="MixtralForCausalLM")
    assert not (tmp_path / "d").exists()
    mistral = pretrained_config(FIXTURES / "mistral")  # a window Llama's config.json cannot say
    assert LLAMA.cannot_hold(mistral) == ["a sliding window (LlamaForCausalLM: full attention)"]


def test_train_init_from_mistral_two_steps(tmp_path):
    """``mmnnx train --init-from`` a Mistral over two stages: its windowed attention trains
    (forward and backward through the mask, pipelined)."""
    source = shutil.copytree(FIXTURES / "mistral", tmp_path / "mistral")
    tokenizer = base_with_tokenizer(tmp_path / "llama") / "tokenizer.json"  # 128 tokens
    shutil.copy(tokenizer, source)
    (tmp_path / "text.txt").write_text(TEXT)
    run = tmp_path / "run"
    argv = ["train", "--init-from", str(source), "--stages", "2",
            "--data-axis", "1", "--model-axis", "1", "--seq-len", "16", "--batch-size", "4",
            "--microbatches", "2", "--steps", "2", "--eval-every", "100", "--eval-batches", "1",
            "--timeline-step", "0", "--warmup-steps", "0", "--lr", "1e-2", "--no-tensorboard",
            "--text", str(tmp_path / "text.txt"), "--output-dir", str(run)]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(argv) == 0
    assert "step 2/2 loss" in out.getvalue()
