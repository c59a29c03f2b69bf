"""FSDP inside each stage (``mm.fsdp_rules``, ``mmnnx train --fsdp-axis N``): the pipelined step
equals one device, parameters and optimizer state take 1/N of their bytes per device, each
stage's forward program gathers each sharded weight once per microbatch (what GSPMD compiles)
unless ``mm.jit(gather_weights=...)`` gathers it once per step, gradient sums are sharded as their
parameters, a sharded checkpoint restores bit-exact onto a layout without FSDP, and bad input
is named."""

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
from mmnnx.mpmd.lower.program import PackWeights, Zeros
from mmnnx.mpmd.run.emit import Launch, Move
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
    # and each gradient's running sum, laid out as its parameter (mpmd/lower/sum_layouts.py)
    sums = sorted(str(s) for s in _sum_layouts(executable) if s != P())  # P(): the loss's
    assert sums == sorted(str(s) for _, s in mm.placement(model).values())

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
    argv += ["--fsdp-gather", "step"]
    assert main([*argv, "--text", str(text), "--output-dir", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert re.search(r"^step 2/2 loss \S+ .* aux_loss ", stdout, re.MULTILINE)
    assert re.search(r"│ embed/embedding +│ Param .*P\('model', 'fsdp'\) +│ +16,384 B", stdout)
    assert "fsdp_axis = 2" in (out / "config.toml").read_text()
    assert 'fsdp_gather = "step"' in (out / "config.toml").read_text()
    assert main(["train", *TINY.split(), "--fsdp-gather", "step"]) == 2
    assert "--fsdp-gather step needs --fsdp-axis N" in capsys.readouterr().err

    assert main(["train", *TINY.split(), "--data-axis", "2", "--fsdp-axis", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--fsdp-axis 4 does not divide --data-axis 2" in err


def _fsdp_mlp(tasks):
    """Two Linear layers, one per task, each sharded over its task's ``fsdp`` axis."""
    model = nnx.Sequential(
        nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.tanh, nnx.Linear(32, 16, rngs=nnx.Rngs(1))
    )
    if tasks is not None:
        mm.place(model, mm.fsdp_rules([("layers/0", tasks[0]), ("layers/2", tasks[1])]))
    return model


def _mlp_step(model, opt, x, y):
    def loss_fn(m, x, y):  # data parallel over the fsdp axis
        rows = mm.with_sharding_constraint(x, ("fsdp", None))
        return ((m(rows) - y) ** 2).mean()

    grad_fn = mm.microbatch(
        nnx.value_and_grad(loss_fn), num=4, reduce="mean", schedule="gpipe", argnums=(1, 2)
    )
    loss, grads = grad_fn(model, x, y)
    opt.update(model, grads)
    return loss


def _programs(executable, kind: str) -> list[str]:
    """The HLO of every ``kind`` (F or B) program the step launches."""
    return [
        s.program.as_text()
        for s in executable._steps
        if isinstance(s, Launch) and s.labels and s.labels[0][0] and s.labels[0][0][1] == kind
    ]


def _sum_layouts(executable) -> list:
    """The layouts of the running sums the step starts at zero, in order."""
    zeros = []
    for action in executable.plan.program.actions:
        made = getattr(action, "zeros", action) if isinstance(action, PackWeights) else action
        if isinstance(made, Zeros):
            zeros += [s.spec for s in made.shardings]
    return zeros


def test_gradient_sums_are_sharded_and_gather_weights_gathers_once_per_step():
    tasks = [
        mm.Task(f"s{i}", mesh=TaskMesh(devices=(2 * i, 2 * i + 1), axis_names=("fsdp",)))
        for i in range(2)
    ]
    x, y = jax.random.normal(jax.random.key(0), (2, 8, 16))
    ref = _fsdp_mlp(None)
    ref_opt = nnx.Optimizer(ref, optax.adamw(LR), wrt=nnx.Param)

    @nnx.jit
    def ref_step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m: ((m(x) - y) ** 2).mean())(model)
        opt.update(model, grads)
        return loss

    ref_losses = [ref_step(ref, ref_opt, x, y) for _ in range(STEPS)]
    runs = {}
    for gather in (None, "fsdp"):
        model = _fsdp_mlp(tasks)
        opt = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)
        step = mm.jit(_mlp_step, gather_weights=gather)
        for ref_loss in ref_losses:
            close(step(model, opt, x, y), ref_loss)
        for (_, a), (_, b) in zip(variables_of(model), variables_of(ref), strict=True):
            close(a.get_value(), b.get_value())
        (executable, _), *_ = step._cache.values()
        runs[gather] = executable

    # Each gradient's running sum takes its parameter's layout (1/2 per device), not a whole copy
    specs = [s for _, (_, s) in sorted(mm.placement(model).items())]
    assert sorted(map(str, specs)) == sorted(
        ["P('fsdp',)"] * 2 + ["P(None, 'fsdp')", "P('fsdp', None)"]
    )
    for executable in runs.values():
        sums = [s for s in _sum_layouts(executable) if s != P()]  # P(): the loss's sum
        assert sorted(map(str, sums)) == sorted(map(str, specs))

    # Per microbatch, the forwards and backwards gather what GSPMD chooses to; once per step,
    # none of them gathers: the step gathers each sharded weight once, on its own task
    gathers = re.compile(r"\ball-gather(?:-start)?\(")
    per_microbatch = [len(gathers.findall(h)) for k in "FB" for h in _programs(runs[None], k)]
    once = [len(gathers.findall(h)) for k in "FB" for h in _programs(runs["fsdp"], k)]
    assert len(once) == len(per_microbatch) == 16 and sum(per_microbatch) > 0, per_microbatch
    assert once == [0] * 16
    on_task = [
        s
        for s in runs["fsdp"]._steps
        if isinstance(s, Move)
        and s.source_layout is not None
        and s.source_layout.device_set == s.sharding.device_set
    ]
    assert sorted(str(s.sharding.spec) for s in on_task) == ["P(None, None)"] * 2 + ["P(None,)"] * 2
    assert all(t.source != t.target for t in runs["fsdp"].plan.transfers)  # not a transfer

    with pytest.raises(TypeError, match=r"gather_weights 3 is not a mesh axis name"):
        mm.jit(_mlp_step, gather_weights=3)
    before = np.asarray(model.layers[0].kernel.get_value())
    with pytest.raises(
        ValueError, match=r"gather_weights='data' names no mesh axis .*'s0': \('fsdp',\)"
    ):
        mm.jit(_mlp_step, gather_weights="data")(model, opt, x, y)
    np.testing.assert_array_equal(np.asarray(model.layers[0].kernel.get_value()), before)
