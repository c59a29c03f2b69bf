"""`mmnnx train` of a mixture-of-experts GPT: the flags (and TOML keys) and their errors, a tiny
run with expert parallelism and `--schedule auto` whose router metrics are read back from
TensorBoard, `mm.tabulate`'s experts per device, and what `mm.schedules.tune` measures of a MoE
stage."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.cli import main, parse_args
from mmnnx.models import GPT, GPTConfig
from mmnnx.mpmd.schedules import simulate
from mmnnx.train.config import RunConfig, gpt_config
from mmnnx.train.generation import run_tasks
from mmnnx.train.run_model import run_placement
from tests.test_cli import metrics
from tests.test_moe import all_to_alls
from tests.test_run_log import read_scalars


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["--expert-axis", "2"], "--expert-axis 2 needs --experts E"),
        (["--capacity-factor", "1.5"], "--capacity-factor needs --experts E"),
        (
            ["--experts", "6", "--expert-axis", "4"],
            "--experts 6 is not divisible by --expert-axis 4",
        ),
        (["--experts", "2", "--experts-per-token", "3"], "--experts-per-token 3 is more than"),
        (
            ["--experts", "4", "--expert-axis", "4"],
            "--stages 2 x --data-axis 2 x --expert-axis 4 x --model-axis 2 needs 32 devices, "
            "but --devices is 8",
        ),
        (
            ["--experts", "4", "--expert-axis", "2", "--model-axis", "1", "--batch-size", "8"],
            "a microbatch of 2 sequences is not divisible by --data-axis 2 x --expert-axis 2",
        ),
        (["--experts", "4", "--moe-every", "5"], "--moe-every 5 leaves none of --depth 4 blocks"),
        (["--experts", "4", "--moe-every", "2", "--scan-layers"], "use --moe-every 1 with it"),
        (
            ["--experts", "4", "--expert-hidden", "33"],
            "the experts' hidden size 33 (--expert-hidden) is not divisible by --model-axis 2",
        ),
    ],
)
def test_inconsistent_moe_flags_exit_2_with_one_line(argv, reason, capsys):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mmnnx train: error: ")
    assert reason in err


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["--capacity-factor", "0"], "--capacity-factor must be a finite number > 0, got '0'"),
        (["--experts", "0"], "--experts must be >= 1, got 0"),
        (["--router-aux-loss-coef", "-1"], "--router-aux-loss-coef must be a finite number >= 0"),
    ],
)
def test_bad_moe_values_exit_2(argv, reason, capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and reason in err


def test_the_moe_options_reach_gptconfig_and_leave_a_dense_model_alone():
    values = {"experts": 8, "experts_per_token": 1, "expert_hidden": 48, "moe_every": 2}
    values |= {"capacity_factor": 1.25, "router_aux_loss_coef": 0.0, "router_z_loss_coef": 0.01}
    config = gpt_config(RunConfig.of({**values, "dim": 32, "depth": 4, "model_axis": 1}), 256)
    assert {k: getattr(config, k) for k in values} == values
    dense = gpt_config(RunConfig(), 256)
    assert dense.experts == 0 and dense.router_aux_loss_coef == GPTConfig.router_aux_loss_coef


TINY = "--dim 32 --depth 2 --heads 2 --seq-len 16 --batch-size 8 --microbatches 2 --stages 2"
TINY += " --data-axis 1 --model-axis 1 --steps 2 --log-every 1 --eval-every 2 --eval-batches 1"


def test_a_moe_run_tunes_its_schedule_and_logs_its_routers(tmp_path, capsys):
    """2 stages x an expert axis of 2, `--schedule auto`: every logged step's router metrics
    in TensorBoard, metrics.jsonl and the plain line; dropless, each step's tokens per expert
    add up to its tokens x K. The MoE keys come from a TOML file; the timeline step (2)
    captures its metrics apart from the train step."""
    text, out = tmp_path / "text.txt", tmp_path / "run"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    toml = tmp_path / "moe.toml"
    toml.write_text(
        "[model]\nexperts = 4\nexperts-per-token = 2\nrouter_z_loss_coef = 0.001\n"
        "[layout]\nexpert_axis = 2\n"
    )
    argv = ["train", "--config", str(toml), *TINY.split(), "--schedule", "auto"]
    argv += ["--timeline-step", "2", "--text", str(text), "--output-dir", str(out)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert re.search(r"^schedule auto: \S+ with 2 microbatches", stdout, re.MULTILINE)
    assert "Experts per device" in stdout and "expert (EP 2)" in stdout

    scalars = read_scalars(out / "tensorboard")
    tags = ["router_aux_loss", "router_z_loss", "dropped_tokens", "expert_load_imbalance"]
    tags += [f"tokens_per_expert/{e}" for e in range(4)]
    for tag in tags:
        assert [s for s, _ in scalars[tag]] == [1, 2], tag
    rows = {r["step"]: r for r in metrics(out)}
    tokens = 8 * 16 * 2  # batch x seq_len x experts per token
    for step in (1, 2):
        counts = [dict(scalars[f"tokens_per_expert/{e}"])[step] for e in range(4)]
        assert sum(counts) == tokens and counts == rows[step]["tokens_per_expert"]
        assert dict(scalars["dropped_tokens"])[step] == 0.0
        aux = dict(scalars["router_aux_loss"])[step]
        assert aux == pytest.approx(rows[step]["router_aux_loss"], rel=1e-6)
        assert 1.0 <= aux <= 4.0  # E * sum f_e P_e: k when balanced, at most E
        assert dict(scalars["expert_load_imbalance"])[step] >= 1.0
        assert dict(scalars["router_z_loss"])[step] > 0
        line = re.search(rf"^step {step}/2 loss \S+ .* aux_loss (\S+) load max/mean (\S+)$",
                         stdout, re.MULTILINE)  # fmt: skip
        assert float(line.group(1)) == round(rows[step]["router_aux_loss"], 4)
    assert "experts = 4" in (out / "config.toml").read_text()


def test_moe_flags_read_from_a_config_file(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[model]\nexperts = 8\ncapacity_factor = 1.5\n[layout]\nexpert-axis = 4\n")
    args = parse_args(["train", "--config", str(toml)])
    assert (args.experts, args.capacity_factor, args.expert_axis) == (8, 1.5, 4)


def row(text, first_cell):
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("│").split("│")]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in\n{text}")


def experts_table(text):
    """The lines of tabulate's "Experts per device" table."""
    return text[text.index("Experts per device") :]


@pytest.mark.parametrize("expert_axis", [4, 1], ids=["EP4", "replicated"])
def test_tabulate_shows_the_experts_each_device_holds(expert_axis):
    config = GPTConfig(vocab_size=64, dim=16, depth=2, num_heads=2, experts=8, moe_every=2)
    tasks = run_tasks(2, 4 // expert_axis, 1, expert_axis)
    model = mm.init(lambda: GPT(config, rngs=nnx.Rngs(0)), run_placement(config, tasks))
    text = mm.tabulate(model, jnp.zeros((4, 8), jnp.int32))
    gate = model.blocks[1].mlp.experts.gate
    per_device = {s.data.nbytes for s in gate[...].addressable_shards}
    assert per_device == {gate[...].nbytes // expert_axis}
    spec = "P('expert', None, 'model')" if expert_axis > 1 else "P(None, None, 'model')"
    shard = f"{gate.nbytes // expert_axis:,} B"
    assert row(text, "blocks/1/mlp/experts/gate")[5:] == ["stage1", spec, shard]
    experts = experts_table(text)
    split = "expert (EP 4)" if expert_axis > 1 else "none (EP 1)"
    weights = model.blocks[1].mlp.experts
    held = sum(v[...].nbytes for v in (weights.gate, weights.up, weights.down)) // expert_axis
    per_task = ["stage1", "3", "8", split, str(8 // expert_axis), f"{held:,} B"]
    assert row(experts, "stage1") == per_task
    with pytest.raises(AssertionError):
        row(experts, "stage0")  # its block is dense
    with nnx.use_eager_sharding(False):
        dense = GPT(GPTConfig(vocab_size=64, dim=16, depth=1), rngs=nnx.Rngs(0))
    assert "Experts per device" not in mm.tabulate(dense)


# ------------------------------------------------------- what the tuner measures of a MoE stage

HEAVY = GPTConfig(
    vocab_size=64,
    dim=64,
    depth=2,
    num_heads=2,
    max_seq_len=32,
    mlp_hidden=128,
    experts=8,
    experts_per_token=4,
    expert_hidden=256,
    dense_layers=(1,),  # block 0 (stage 0) a mixture of 8 experts, block 1 (stage 1) dense
)


def test_tune_simulates_a_moe_stage_with_its_measured_all_to_all():
    tasks = run_tasks(2, 1, 1, expert_axis=2)
    model = mm.init(lambda: GPT(HEAVY, rngs=nnx.Rngs(0)), run_placement(HEAVY, tasks))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    @mm.jit
    def step(model, opt, batch):
        grad_fn = mm.microbatch(
            nnx.value_and_grad(lambda m, b: m.loss(b)), num=2, reduce="mean", schedule="gpipe"
        )
        loss, grads = grad_fn(model, batch)
        opt.update(model, grads)
        return loss

    batch = jax.random.randint(jax.random.key(0), (8, 33), 0, 64)
    before = jax.tree.map(np.asarray, nnx.state(model))
    result = mm.schedules.tune(step, model, opt, batch, schedules=["gpipe", "1f1b"])
    after = jax.tree.map(np.asarray, nnx.state(model))
    assert jax.tree.all(jax.tree.map(np.array_equal, before, after))  # values put back

    plan = step.plan(model, opt, batch)
    moe, dense = (sum(all_to_alls(f.ops) for f in plan.fragments_of(t)) for t in tasks)
    assert moe > 0 and dense == 0  # the programs timed for stage 0 hold the exchange
    costs = result.stage_costs
    assert set(costs) == {(k, s) for k in "FB" for s in (0, 1)}
    # a block of 4 of 8 experts (3 x 64 x 256 x 4 per token) against a dense one (2 x 64 x 128)
    assert costs[("F", 0)] > 2 * costs[("F", 1)] and costs[("B", 0)] > 2 * costs[("B", 1)]
    for candidate in result.candidates:  # the simulator ran on exactly those costs
        table = candidate.table
        acts = {(a.kind, a.stage): costs[(a.kind, a.stage)] for row in table.actions for a in row}
        options = result.transfers.simulate_options(table, result.launch_cost)
        assert simulate(table, action_costs=acts, **options).makespan == (
            candidate.predicted_seconds
        )
