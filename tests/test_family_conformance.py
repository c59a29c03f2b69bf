"""Every family ``from_pretrained`` builds against transformers 5 (tiny random checkpoints written
by transformers' own ``save_pretrained``, tests/transformers_fixtures/): on each family's
4-layer fixture (``deep/``, its layers of mixed kinds where the family has them), float32
logits to 1e-5 of the largest on one device, with ``scan_layers``, on 4 pipeline stages and
scanned on 2 (a stacked segment split over them), the experts split over an expert axis of 2
for the mixtures of experts; transformers' greedy continuation scanned (each segment's cache),
and Gemma 3's on the 4 stages too (sliding layers' caches rings of the window, global ones
whole); Llama 3 scaling, YaRN and the Mixtral in transformers 5's fused expert layout as more;
and each family's train step, pipelined over two stages under 1F1B and under ZB-H1, equal to
its step on one device (loss and gradients)."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx._nnx import variables_of
from mmnnx.models import from_pretrained, save_pretrained
from mmnnx.models.pretrained.files import CheckpointFiles
from tests.oracle import close, close_to_max
from tests.test_pretrained_moe import ep_stages
from tests.test_transformers_fixtures import F32, FIXTURES, TOKENS, _tasks, relative_error

DEEP = FIXTURES / "deep"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
    """A fixture and what it has: ``experts`` (staged over an expert axis), ``window``
    (decoded on the stages too: Gemma 3's sliding and global layers, one kind of cache each),
    layers of several kinds are scanned in segments."""

    fixture: str
    experts: bool = False
    window: bool = False


FAMILIES = {
    "llama": Family(fixture="deep/llama"),
    "qwen3": Family(fixture="deep/qwen3"),
    "qwen3-moe": Family(fixture="deep/qwen3-moe", experts=True),  # dense, MoE, dense, MoE
    "mistral": Family(fixture="deep/mistral"),  # every layer windowed: decoded scanned
    "mixtral": Family(fixture="deep/mixtral", experts=True),
    "gemma3": Family(fixture="deep/gemma3", window=True),  # sliding, global, sliding, global
    "gpt-oss": Family(fixture="deep/gpt-oss", experts=True),  # sliding, full, sliding, full
    "deepseek_v3": Family(fixture="deep/deepseek_v3", experts=True),  # dense, then 3 MoE
    "llama3-scaled": Family(fixture="llama3-scaled"),
    "qwen3-yarn": Family(fixture="qwen3-yarn"),
    "mixtral-fused": Family(fixture="mixtral-fused", experts=True),
}
"""Each family's 4-layer fixture, and Llama 3 scaling, YaRN and the Mixtral in transformers
5's fused expert layout (2 layers, no greedy continuation kept) as more."""

SETUPS = {  # how each is built: (stages, scan_layers)
    "one device": (1, False),
    "scanned": (1, True),
    "4 stages": (4, False),
    "2 stages scanned": (2, True),
}
CASES = [
    (name, setup)
    for name, family in FAMILIES.items()
    if family.fixture.startswith("deep/")
    for setup in SETUPS
] + [
    ("llama3-scaled", "one device"),
    ("qwen3-yarn", "one device"),
    ("mixtral-fused", "one device"),
]

_forward = nnx.jit(lambda model, tokens: model(tokens))
_staged_forward = mm.jit(lambda model, tokens: model(tokens))


def expected(family: Family) -> dict:
    """transformers' tokens and logits (the fused Mixtral: the Mixtral's), and its greedy
    ``prompt`` and ``continuation`` where kept."""
    path = FIXTURES / family.fixture
    if (path / "expected.npz").exists():
        npz = np.load(path / "expected.npz")
        tokens = npz["tokens"]
        prompt = tokens[:, : int(npz["prompt"])]
        return dict(
            tokens=tokens, logits=npz["logits"], prompt=prompt, continuation=npz["continuation"]
        )
    return dict(
        tokens=TOKENS,
        logits=np.load(FIXTURES / family.fixture.removesuffix("-fused") / "logits.npy"),
    )


def stage_tasks(family: Family, stages: int) -> list[mm.Task]:
    """``stages`` tasks of the 8 devices; with experts, each stage's an expert axis of 2."""
    if not family.experts:
        return _tasks(stages)
    if stages == 2:
        return ep_stages()
    mesh = mm.MultiMesh(axis_sizes=(stages, 2), axis_names=("stage", "expert"))
    rules = mm.logical_rules(expert="expert")
    return [mm.Task(f"s{i}", mesh=mesh.slice(stage=i), logical_axes=rules) for i in range(stages)]


@pytest.mark.parametrize("name, setup", CASES)
def test_logits_and_greedy_decoding_equal_transformers(name, setup):
    family, (stages, scan) = FAMILIES[name], SETUPS[setup]
    want = expected(family)
    tokens = jnp.asarray(want["tokens"], jnp.int32)
    tasks = stage_tasks(family, stages) if stages > 1 else None
    model = from_pretrained(
        FIXTURES / family.fixture, tasks=tasks, scan_layers=scan, max_seq_len=16
    )
    assert model.config.scan_layers == scan
    forward = _forward if tasks is None else _staged_forward
    assert relative_error(forward(model, tokens), want["logits"]) < F32
    if "continuation" in want and (setup == "scanned" or (setup == "4 stages" and family.window)):
        continuation = want["continuation"]
        greedy = model.generate(jnp.asarray(want["prompt"]), continuation.shape[1])
        np.testing.assert_array_equal(np.asarray(greedy), continuation)
    if tasks is None:
        return
    homes = {mm.task_of(model.embed.embedding).name, mm.task_of(model.norm.scale).name}
    assert homes == {tasks[0].name, tasks[-1].name}
    if family.experts:  # each expert Variable's expert axis split in 2 (3 from the last)
        kernels = [v for p, v in variables_of(model) if "experts" in p and v.ndim >= 3]
        assert kernels
        for v in kernels:
            axis = v.ndim - 3
            assert {s.data.shape[axis] for s in v[...].addressable_shards} == {v.shape[axis] // 2}


def test_a_segment_is_staged_whole_or_split_evenly_else_refused(tmp_path):
    """Scanned, a stacked segment is split over the stages in equal chunks (gpt-oss's
    2 x [sliding, full] over 2 stages) and the segments of a model of several go whole on a
    stage each (DeepSeek-V3's dense layer, then its 3 MoE layers stacked); a stage count
    that does not divide them is refused as the stages of alike layers are. The staged,
    scanned gpt-oss is written back tensor for tensor as transformers wrote it."""
    gpt_oss = from_pretrained(DEEP / "gpt-oss", tasks=_tasks(2), scan_layers=True)
    kernel = gpt_oss.blocks.layers["0"].attn.q.kernel
    assert kernel.shape[0] == 2 and {s.data.shape[0] for s in kernel[...].addressable_shards} == {1}
    before = CheckpointFiles(DEEP / "gpt-oss")
    after = CheckpointFiles(save_pretrained(gpt_oss, tmp_path / "gpt-oss"))
    assert sorted(after.tensors) == sorted(before.tensors)
    for name in before.tensors:
        np.testing.assert_array_equal(after.read(name), before.read(name), err_msg=name)
    deepseek = from_pretrained(DEEP / "deepseek_v3", tasks=_tasks(2), scan_layers=True)
    assert [g.repeats for g in deepseek.config.segments] == [1, 3]
    assert mm.task_of(deepseek.blocks[0].mlp.up.kernel).name == "s0"
    assert mm.task_of(deepseek.blocks[1].mlp.experts.gate).name == "s1"
    with pytest.raises(ValueError, match="2 stacked blocks cannot be split evenly over 4 tasks"):
        from_pretrained(DEEP / "gpt-oss", tasks=_tasks(4), scan_layers=True)
    with pytest.raises(ValueError, match=r"2 block\(s\) cannot fill 4 tasks"):
        from_pretrained(DEEP / "deepseek_v3", tasks=_tasks(4), scan_layers=True)


TRAIN_TOKENS = jax.random.randint(jax.random.key(0), (16, 9), 0, 64)  # in every vocabulary


def _loss_and_grads(model, tokens):
    return nnx.value_and_grad(lambda m, t: m.loss(t))(model, tokens)


_one_device_step = nnx.jit(_loss_and_grads)


def _pipelined(model, tokens):
    grad_fn = mm.microbatch(
        nnx.value_and_grad(lambda m, t: m.loss(t)), num=4, reduce="mean", schedule="1f1b"
    )
    return grad_fn(model, tokens)


_pipelined_step = mm.jit(_pipelined)


TRAINED = ("llama", "qwen3", "qwen3-moe", "mistral", "mixtral", "gemma3", "gpt-oss", "deepseek_v3")
"""Each family trained on its first fixture, shallower than ``deep/`` and so cheaper (2 layers;
Gemma 3's 4, DeepSeek-V3's 3); a variant (RoPE scaling, the fused layout) trains as its family."""


@pytest.mark.parametrize("name", TRAINED)
def test_a_pipelined_train_step_equals_one_device_under_1f1b_and_zb_h1(name):
    family = FAMILIES[name]
    path = FIXTURES / name
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
