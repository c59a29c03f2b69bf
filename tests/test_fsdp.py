"""FSDP inside each stage (``mm.fsdp_rules``, ``mmnnx train --fsdp-axis N``): the pipelined step
equals one device, parameters and optimizer state take 1/N of their bytes per device, each
stage's forward program gathers each sharded weight once per microbatch (what GSPMD compiles),
a sharded checkpoint restores bit-exact onto a layout without FSDP, and bad input is named."""

import re
import warnings

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import mmnnx as mm
from mmnnx._nnx import variables_of
from mmnnx.cli import main
from mmnnx.models import GPT, GPTConfig
from mmnnx.mpmd.run.emit import Launch
from mmnnx.sharding import FSDPReplicatedWarning, TaskMesh, bytes_per_device, path_str
from mmnnx.sharding.fsdp import shard_largest
from mmnnx.sharding.place import plan_placement
from mmnnx.train import Checkpointer
from mmnnx.train.generation import run_tasks
from mmnnx.train.run_model import fsdp_placement, run_placement
from tests.models import SMALL_GPT, gpt_step, reference_loss_and_grads, reference_step, small_gpt
from tests.oracle import close, params_close

STEPS, LR = 2, 3e-3


def test_the_largest_free_dimension_takes_the_axis_and_bad_rules_are_named():
    sizes = {"fsdp": 2, "model": 2}
    assert shard_largest(P(None, "model"), (16, 64), "fsdp", sizes) == P("fsdp", "model")
    assert shard_largest(P(), (8, 6), "fsdp", sizes) == P("fsdp", None)  # the first of ties: 8
    assert shard_largest(P("model"), (12,), "fsdp", sizes) == P(("model", "fsdp"))
    assert shard_largest(P("fsdp"), (3,), "fsdp", sizes) == P("fsdp")  # already there
    assert shard_largest(P(), (4, 6), "fsdp", sizes, skip=1) == P(None, "fsdp")  # a layer axis
    assert shard_largest(P(), (3, 5), "fsdp", sizes) is None

    class Odd(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(np.ones((4, 6), np.float32))
            self.scale = nnx.Param(np.ones((), np.float32))

    task = mm.Task("t", mesh=TaskMesh(devices=range(2), axis_names=("fsdp",)))
    with pytest.warns(FSDPReplicatedWarning, match=r"'scale' of shape \(\) on task 't'.*'fsdp'"):
        odd = mm.place(Odd(), mm.fsdp_rules([(".*", task)]))
    assert mm.placement(odd) == {"scale": ("t", P()), "w": ("t", P(None, "fsdp"))}
    assert odd.w.get_value().addressable_shards[0].data.shape == (4, 3)

    plain = mm.Task("plain", mesh=TaskMesh(devices=range(2), axis_names=("data",)))
    with pytest.raises(ValueError, match=r"rule 1 .*task 'plain' has no mesh axis 'fsdp'.*'data'"):
        mm.fsdp_rules([("w", task), ("scale", plain)])
    with pytest.raises(ValueError, match=r"--fsdp-axis 3 does not divide --data-axis 2"):
        run_tasks(2, 2, 1, fsdp_axis=3)


def test_moe_experts_and_stacked_layers_keep_their_axes_and_shard_another():
    config = GPTConfig(vocab_size=64, dim=16, depth=2, num_heads=2, experts=4, scan_layers=True)
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    tasks = run_tasks(2, 2, 1, expert_axis=2, fsdp_axis=2)
    assert tasks[0].spec(("batch",)) == P(("data", "fsdp", "expert"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", FSDPReplicatedWarning)  # every Variable is sharded
        planned = plan_placement(abstract, fsdp_placement(run_placement(config, tasks)))
    specs = {path_str(a.path): a.spec for a in planned}
    gate = specs["blocks/mlp/experts/gate"]  # (layers, experts, dim, hidden)
    assert gate[0] is None and gate[1] == "expert" and "fsdp" in gate
    assert all(s[0] is None for p, s in specs.items() if p.startswith("blocks/"))
    assert all("fsdp" in str(s) for s in specs.values())


def _stage_bytes(model_or_opt) -> int:
    """Bytes one device holds of the Variables of ``model_or_opt`` (its first device's shards)."""
    held = 0
    for leaf in jax.tree.leaves(nnx.state(model_or_opt)):
        if isinstance(leaf, jax.Array) and leaf.ndim:
            held += leaf.addressable_shards[0].data.nbytes
    return held


@pytest.fixture(scope="module")
def fsdp_run():
    """SMALL_GPT over 2 stages x (fsdp 2 x model 2), 2 steps of 1f1b, and its one-device oracle."""
    tokens = jax.random.randint(jax.random.key(0), (16, SMALL_GPT.max_seq_len + 1), 0, 64)
    tasks = run_tasks(2, 2, 2, fsdp_axis=2)
    model = small_gpt()
    mm.place(model, fsdp_placement(run_placement(SMALL_GPT, tasks)))
    opt = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)
    step = mm.jit(gpt_step("1f1b"))
    losses = [step(model, opt, tokens) for _ in range(STEPS)]
    (executable, _), *_ = step._cache.values()
    return tokens, tasks, model, opt, losses, executable


def test_a_pipelined_fsdp_step_equals_one_device_with_half_the_bytes(fsdp_run):
    tokens, tasks, model, opt, losses, executable = fsdp_run
    ref = small_gpt()
    ref_opt = nnx.Optimizer(ref, optax.adamw(LR), wrt=nnx.Param)
    _, ref_grads = reference_loss_and_grads(small_gpt(), tokens)
    for loss in losses:
        close(loss, reference_step(ref, ref_opt, tokens))
    params_close(model, ref, ref_grads, steps=STEPS, lr=LR)

    # Every parameter and moment: 1/2 of what the same tasks hold without FSDP (tensor
    # parallelism alone), read from the arrays' own shards
    plain = {
        path_str(a.path): a
        for a in plan_placement(small_gpt(), run_placement(SMALL_GPT, run_tasks(2, 2, 2)))
    }
    for path, variable in variables_of(model):
        name, spec = path_str(path), variable.get_value().sharding.spec
        value, without = variable.get_value(), plain[path_str(path)]
        whole = bytes_per_device(value.shape, value.dtype, without.spec, without.task.jax_mesh)
        assert "fsdp" in str(spec), name
        assert value.addressable_shards[0].data.nbytes * 2 == whole, (name, spec)
    mu = opt.opt_state[0].mu
    assert mu["head"]["kernel"].get_value().sharding == model.head.kernel.get_value().sharding
    assert _stage_bytes(opt) == 2 * _stage_bytes(model)  # Adam's two moments, as sharded

    # GSPMD gathers each sharded weight a stage's forward reads, in every microbatch's program
    sharded = sum(task == "stage1" and "fsdp" in str(s) for task, s in mm.placement(model).values())
    forwards = [
        s
        for s in executable._steps
        if isinstance(s, Launch) and s.labels and s.labels[0][0] and s.labels[0][0][:2] == (
            "stage1", "F")
    ]  # fmt: skip
    assert len(forwards) == 4
    gathers = [len(re.findall(r"\ball-gather(?:-start)?\(", s.program.as_text())) for s in forwards]
    assert gathers == [sharded] * 4, (gathers, sharded)


def _restored(directory, placement):
    """SMALL_GPT and its AdamW state placed by ``placement``, restored from ``directory``."""
    model = small_gpt()
    mm.place(model, placement)
    opt = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)
    with Checkpointer(directory) as ckpt:
        ckpt.restore(model=model, opt=opt)
    return model, opt


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_checkpoint_moves_bit_exact_between_fsdp_and_no_fsdp(fsdp_run, tmp_path):
    _, tasks, model, opt, _, _ = fsdp_run
    with Checkpointer(tmp_path / "fsdp") as ckpt:
        ckpt.save(STEPS, model=model, opt=opt)
    plain = run_placement(SMALL_GPT, run_tasks(2, 2, 2))  # tensor-parallel only
    fresh, fresh_opt = _restored(tmp_path / "fsdp", plain)
    assert "fsdp" not in str(mm.placement(fresh))
    _assert_same((model, opt), (fresh, fresh_opt))

    with Checkpointer(tmp_path / "plain") as ckpt:
        ckpt.save(STEPS, model=fresh, opt=fresh_opt)
    back, back_opt = _restored(tmp_path / "plain", fsdp_placement(run_placement(SMALL_GPT, tasks)))
    assert mm.placement(back) == mm.placement(model)
    _assert_same((model, opt), (back, back_opt))


TINY = "--dim 32 --depth 2 --heads 2 --seq-len 16 --batch-size 8 --microbatches 2 --stages 2"
TINY += " --model-axis 1 --steps 2 --log-every 1 --eval-every 2 --eval-batches 1"


def test_the_cli_trains_two_steps_with_fsdp_experts_and_lora_and_refuses_a_bad_axis(
    tmp_path, capsys
):
    text, out = tmp_path / "text.txt", tmp_path / "run"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    argv = ["train", *TINY.split(), "--data-axis", "2", "--fsdp-axis", "2"]
    argv += ["--experts", "4", "--expert-axis", "2", "--lora-rank", "2"]  # they compose
    assert main([*argv, "--text", str(text), "--output-dir", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert re.search(r"^step 2/2 loss \S+ .* aux_loss ", stdout, re.MULTILINE)
    assert re.search(r"│ embed/embedding +│ Param .*P\('model', 'fsdp'\) +│ +16,384 B", stdout)
    assert "fsdp_axis = 2" in (out / "config.toml").read_text()

    assert main(["train", *TINY.split(), "--data-axis", "2", "--fsdp-axis", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--fsdp-axis 4 does not divide --data-axis 2" in err
