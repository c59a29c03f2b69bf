"""Every family ``from_pretrained`` builds against transformers 5, one fixture each (tiny random
checkpoints written by transformers' own ``save_pretrained``, tests/transformers_fixtures/):
float32 logits to 1e-5 of the largest on one device and on pipeline stages (2 stages; 4 where
the depth allows: Gemma 3's 4 layers), with ``scan_layers`` where every layer is alike (not
Qwen3-MoE's dense-then-sparse layers nor Gemma 3's sliding-then-global ones), the experts split
over an expert axis for the mixtures of experts; the greedy continuation of mmnnx's key/value
cache equal to transformers' ``generate`` (for the sliding-window families on two stages too,
their sliding layers' caches rings of the window); and each family's train step, pipelined over two
stages under 1F1B and under ZB-H1, equal to its step on one device (loss and gradients)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.models import from_pretrained
from tests.oracle import close, close_to_max
from tests.test_pretrained_moe import ep_stages
from tests.test_transformers_fixtures import F32, FIXTURES, TOKENS, _tasks, relative_error


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """A fixture and what its layers allow: ``scan`` (every layer alike), ``experts`` (staged
    over an expert axis), ``stages`` (its depth cut into these many), ``greedy`` (a
    transformers continuation kept beside it)."""

    fixture: str
    scan: bool
    experts: bool = False
    stages: tuple[int, ...] = (2,)
    greedy: bool = True
    window: bool = False  # sliding-window layers: decoded on the stages too (their ring caches)


FAMILIES = {
    "llama": Family(fixture="llama", scan=True),
    "llama3-scaled": Family(fixture="llama3-scaled", scan=False, greedy=False),
    "qwen3": Family(fixture="qwen3", scan=True),
    "qwen3-yarn": Family(fixture="qwen3-yarn", scan=False, greedy=False),
    "qwen3-moe": Family(fixture="qwen3-moe", scan=False, experts=True),
    "mistral": Family(fixture="mistral", scan=True, window=True),
    "mixtral": Family(fixture="mixtral", scan=True, experts=True),
    "mixtral-fused": Family(fixture="mixtral-fused", scan=True, experts=True, greedy=False),
    "gemma3": Family(fixture="gemma3", scan=False, stages=(2, 4), window=True),
}
"""The conformance cases: each family's fixture, and Llama 3 scaling, YaRN and the Mixtral in
transformers 5's fused expert layout as more."""

_forward = nnx.jit(lambda model, tokens: model(tokens))
_staged_forward = mm.jit(lambda model, tokens: model(tokens))


def expected(family: Family) -> dict:
    """transformers' tokens and logits (the fused Mixtral: the Mixtral's), and its greedy
    ``prompt`` and ``continuation`` where kept."""
    path = FIXTURES / family.fixture
    if (path / "expected.npz").exists():  # Gemma 3's fixture script keeps all in one file
        npz = np.load(path / "expected.npz")
        tokens = npz["tokens"]
        prompt = tokens[:, : int(npz["prompt"])]
        return dict(
            tokens=tokens, logits=npz["logits"], prompt=prompt, continuation=npz["continuation"]
        )
    source = FIXTURES / family.fixture.removesuffix("-fused")
    out = dict(tokens=TOKENS, logits=np.load(source / "logits.npy"))
    if family.greedy:
        greedy = json.loads((path / "greedy.json").read_text())
        out |= {k: np.asarray(v, np.int32) for k, v in greedy.items()}
    return out


def stage_tasks(family: Family, stages: int) -> list[mm.Task]:
    return ep_stages() if family.experts and stages == 2 else _tasks(stages)


@pytest.mark.parametrize("name", FAMILIES)
def test_logits_and_greedy_decoding_equal_transformers(name):
    family = FAMILIES[name]
    want = expected(family)
    tokens = jnp.asarray(want["tokens"], jnp.int32)
    one = from_pretrained(FIXTURES / family.fixture, max_seq_len=16)
    assert relative_error(_forward(one, tokens), want["logits"]) < F32
    if family.greedy:
        continuation = want["continuation"]
        greedy = one.generate(jnp.asarray(want["prompt"]), continuation.shape[1])
        np.testing.assert_array_equal(np.asarray(greedy), continuation)
    for stages in family.stages:
        tasks = stage_tasks(family, stages)
        staged = from_pretrained(
            FIXTURES / family.fixture, tasks=tasks, scan_layers=family.scan, max_seq_len=16
        )
        homes = {mm.task_of(staged.embed.embedding).name, mm.task_of(staged.norm.scale).name}
        assert homes == {tasks[0].name, tasks[-1].name} and staged.config.scan_layers == family.scan
        assert relative_error(_staged_forward(staged, tokens), want["logits"]) < F32, stages
        if family.window and stages == 2:
            greedy = staged.generate(jnp.asarray(want["prompt"]), continuation.shape[1])
            np.testing.assert_array_equal(np.asarray(greedy), continuation)
        if family.experts:  # 2 ways of the experts (an expert axis of 2 in each stage)
            experts = (staged.blocks if family.scan else staged.blocks[-1]).mlp.experts
            down, axis = experts.down[...], int(family.scan)
            assert {s.data.shape[axis] for s in down.addressable_shards} == {down.shape[axis] // 2}


TRAIN_TOKENS = jax.random.randint(jax.random.key(0), (16, 9), 0, 128)


def _loss_and_grads(model, tokens):
    return nnx.value_and_grad(lambda m, t: m.loss(t))(model, tokens)


_one_device_step = nnx.jit(_loss_and_grads)


def _pipelined(model, tokens):
    grad_fn = mm.microbatch(
        nnx.value_and_grad(lambda m, t: m.loss(t)), num=4, reduce="mean", schedule="1f1b"
    )
    return grad_fn(model, tokens)


_pipelined_step = mm.jit(_pipelined)


TRAINED = ("llama", "qwen3", "qwen3-moe", "mistral", "mixtral", "gemma3")
"""One fixture per family: a variant (RoPE scaling, the fused layout) trains as its family."""


@pytest.mark.parametrize("name", TRAINED)
def test_a_pipelined_train_step_equals_one_device_under_1f1b_and_zb_h1(name):
    family = FAMILIES[name]
    path = FIXTURES / family.fixture
    loss, grads = _one_device_step(from_pretrained(path), TRAIN_TOKENS)
    staged = from_pretrained(path, tasks=stage_tasks(family, 2))
    for schedule in ("1f1b", "zero-bubble-h1"):
        step = _pipelined_step.with_options(schedule=schedule)
        got_loss, got_grads = step(staged, TRAIN_TOKENS)
        close(got_loss, loss)
        close_to_max(got_grads, grads)


def test_a_fused_mixtral_tensor_that_does_not_split_or_fills_a_variable_twice_is_refused(tmp_path):
    """The fused fixture is what transformers 5 loads (its verdict); ``experts/up`` is read
    from ``gate_up_proj``'s second half, a slice of it (a device's shard) as that slice; an
    edited copy whose ``gate_up_proj`` has an odd row, or with a Variable's tensors in both
    layouts, is refused naming the file and tensor."""
    from safetensors.numpy import load_file, save_file

    from mmnnx.models import pretrained_config
    from mmnnx.models.pretrained import CheckpointError
    from mmnnx.models.pretrained.families.mistral import MIXTRAL
    from mmnnx.models.pretrained.files import CheckpointFiles
    from mmnnx.models.pretrained.load import read_part
    from mmnnx.models.pretrained.names import match

    source = FIXTURES / "mixtral-fused"
    verdict = json.loads((source / "fused_verdict.json").read_text())  # transformers 5 loads it
    assert verdict["missing"] == verdict["unexpected"] == [] and verdict["logits_error"] < F32
    tensors = load_file(source / "model.safetensors")
    assert sorted(tensors) == verdict["tensors"] and "lm_head.weight" in tensors
    files = CheckpointFiles(source)  # up is gate_up's second half; a slice of it, its slice
    rules = MIXTRAL.tensor_rules(pretrained_config(source))
    up = match(files.tensors, rules)[0]["blocks/1/mlp/experts/up"]
    whole = read_part(files, up, (slice(None),) * 3, np.float32)
    gate_up = "model.layers.1.mlp.experts.gate_up_proj"
    np.testing.assert_array_equal(whole, tensors[gate_up][:, 8:].transpose(0, 2, 1))
    part = read_part(files, up, (slice(2, 6), slice(None), slice(3, 7)), np.float32)
    np.testing.assert_array_equal(part, whole[2:6, :, 3:7])
    down = "model.layers.1.mlp.experts.down_proj"
    per_expert = {  # layer 1's down projections in the per-expert layout as well
        f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight": tensors[down][e] for e in range(8)
    }
    edits = {
        "odd": ({gate_up: tensors[gate_up][:, 1:]}, f"{gate_up}': shape \\(8, 15, 32\\) does not "
                "split into 2 equal parts along axis 1"),
        "twice": (per_expert, "fill Variable 'blocks/1/mlp/experts/down' through different rules"),
    }  # fmt: skip
    for case, (edit, message) in edits.items():
        path = tmp_path / case
        path.mkdir()
        (path / "config.json").write_text((source / "config.json").read_text())
        save_file(tensors | edit, path / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=message) as error:
            from_pretrained(path)
        assert str(path) in str(error.value), case
