"""``mm.predict_memory``: its arithmetic on a config small enough to check by hand, the
``mmnnx train --memory-budget`` refusal before anything compiles, and one prediction against
the peak a pipelined step measures (arrays held plus the running program's temporaries)."""

import dataclasses
import pathlib

import jax
import optax
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.cli import main
from mmnnx.models import GPT, GPTConfig
from mmnnx.models.pretrained import pretrained_config
from mmnnx.models.stages import stage_rules
from mmnnx.modules import BlockConfig, LatentAttentionConfig, MLPConfig
from mmnnx.mpmd.run import runner
from mmnnx.mpmd.run.emit import Launch
from mmnnx.partition.memory import fitting_change
from mmnnx.train.generation import run_tasks
from mmnnx.train.loop import TrainConfig, make_steps

# D=32, V=64, H=128, one block a stage: a block is 2 norms (64) + q, k, v, out (4 x 32 x 32)
# + up and down with biases (2 x 32 x 128 + 128 + 32): 12,512 parameters
SMALL = GPTConfig(vocab_size=64, dim=32, depth=2, num_heads=2, max_seq_len=8)
BLOCK = 64 + 4 * 32 * 32 + 2 * 32 * 128 + 128 + 32


def test_the_arithmetic_by_hand():
    lay = mm.MemoryLayout(stages=2)
    p = mm.predict_memory(SMALL, lay, batch=4, microbatches=2, schedule="1f1b", remat="full")
    first, last = p.tasks
    assert first.parameters == 4 * (BLOCK + 64 * 32)  # float32; the embedding on the first
    assert last.parameters == 4 * (BLOCK + 32 * 64 + 32)  # the head and final norm on the last
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: GPT(SMALL, rngs=nnx.Rngs(0)))
    params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert first.parameters + last.parameters == 4 * params
    assert first.gradients == first.parameters and first.optimizer == 2 * first.parameters
    assert (first.in_flight, last.in_flight) == (2, 1)  # 1F1B: stage 0 holds two
    tokens = 2 * 8  # a microbatch: 2 rows of 8 tokens
    # remat full keeps each block's input, the first stage the token ids too
    assert first.activations == 2 * (tokens * 32 * 4 + tokens * 4)
    # an activation sent and its cotangent received (first); a cotangent sent back (last)
    assert (first.transfers, last.transfers) == (2 * tokens * 32 * 4, tokens * 32 * 4)
    assert first.update == 2 * (first.parameters + first.optimizer) + first.gradients
    assert p.peak == max(first.peak, last.peak) and p.worst in p.tasks

    gpipe = mm.predict_memory(SMALL, lay, batch=4, microbatches=2, schedule="gpipe", remat="full")
    assert [t.in_flight for t in gpipe.tasks] == [2, 2]
    none = mm.predict_memory(SMALL, lay, batch=4, microbatches=2, remat="none")
    assert none.tasks[0].activations > first.activations  # everything kept without remat
    split = mm.predict_memory(SMALL, lay, batch=4, microbatches=2, schedule="zero-bubble-h1")
    # the matmuls' output cotangents wait from the input-gradient pass to the weight-gradient one
    assert split.tasks[1].activations > none.tasks[1].activations
    tensor = mm.predict_memory(SMALL, mm.MemoryLayout(stages=2, tensor=2), batch=4, microbatches=2)
    # q, k, v, out, up, down and the vocabulary are split; norms and the down bias are not
    assert tensor.tasks[0].parameters == 4 * ((BLOCK - 64 - 32) / 2 + 64 + 32 + 64 * 32 / 2)
    fsdp = mm.MemoryLayout(stages=2, data=2, fsdp=2)
    sharded = mm.predict_memory(SMALL, fsdp, batch=4, microbatches=2).tasks[0]
    assert sharded.optimizer == none.tasks[0].optimizer / 2
    # the gradient sums are laid out as their parameters (sum_layouts): sharded too
    assert sharded.parameters == first.parameters / 2 and sharded.gradients == first.gradients / 2
    with pytest.raises(ValueError, match="MemoryLayout.fsdp 2 must divide data 1"):
        mm.MemoryLayout(stages=2, fsdp=2)
    assert "predicted bytes per device" in str(p)

    change = fitting_change(SMALL, lay, p.peak - 1, batch=4, microbatches=2, remat="none")
    assert change.prediction.peak <= p.peak - 1
    with pytest.raises(ValueError, match="remat 'some'"):
        mm.predict_memory(SMALL, lay, batch=4, remat="some")
    with pytest.raises(ValueError, match="does not split evenly"):
        mm.predict_memory(SMALL, mm.MemoryLayout(stages=2, data=4), batch=4, microbatches=2)
    longer = SMALL.max_seq_len + 1  # was predicted, for a model that cannot read it
    with pytest.raises(ValueError, match=rf"seq_len {longer} exceeds the model's max_seq_len"):
        mm.predict_memory(SMALL, lay, batch=4, seq_len=longer, microbatches=2)
    latent = LatentAttentionConfig(2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                   v_head_dim=8)  # fmt: skip
    layer = BlockConfig(latent, MLPConfig(64))
    mla = GPTConfig(vocab_size=64, dim=32, depth=2, num_heads=2, layers=(layer, layer))
    with nnx.use_eager_sharding(False):
        shapes = nnx.eval_shape(lambda: mm.models.GPT(mla, rngs=nnx.Rngs(0)))
    count = sum(v.size for v in jax.tree.leaves(nnx.state(shapes, nnx.Param)))
    latent_tasks = mm.predict_memory(mla, lay, batch=4, microbatches=2).tasks  # float32: 4 B each
    assert sum(t.parameters for t in latent_tasks) == 4 * count
    with pytest.raises(ValueError, match=r"MemoryLayout.blocks \(1,\)"):
        mm.MemoryLayout(stages=2, blocks=(1,))


def test_a_tied_head_and_its_loss_are_charged_to_the_first_task():
    """``embed.attend`` runs where the table lives: on 2 tasks in a loop the forward pass comes
    back to the first task as a stage of its own (1F1B: 3 stages, so at least 3 microbatches),
    which holds the logits, the table transposed per microbatch and the table's gradient until
    stage 0's backward adds it to its sums; the last task holds none of it. A V places the
    last model stage on the first task already; an interleaved loop cannot run it."""
    untied = GPTConfig(vocab_size=2048, dim=32, depth=4, num_heads=2, max_seq_len=16)
    tied = dataclasses.replace(untied, tie_embeddings=True)
    lay, kw = mm.MemoryLayout(stages=2, blocks=(2, 2)), dict(batch=16, microbatches=4)
    first, last = mm.predict_memory(tied, lay, **kw).tasks
    ufirst, ulast = mm.predict_memory(untied, lay, **kw).tasks
    logits = 16 // 4 * 16 * 2048 * 4  # a microbatch's float32 logits
    assert last.activations < logits < first.activations - ufirst.activations
    assert ulast.activations > logits and ulast.workspace > 2 * logits  # the loss's buffers
    assert first.in_flight == 3  # stage 0 of 3 holds 3 microbatches
    assert last.parameters == ulast.parameters - 4 * 2048 * 32  # no head of its own
    with pytest.raises(ValueError, match=r"stages \(3\), got 2.*head tied to the embedding"):
        mm.predict_memory(tied, lay, batch=16, microbatches=2)
    with pytest.raises(ValueError, match="a looped placement cannot fold in"):
        mm.predict_memory(tied, mm.MemoryLayout(stages=2, virtual_stages=2), batch=16,
                          microbatches=4, schedule="interleaved-1f1b")  # fmt: skip
    v = mm.MemoryLayout(stages=2, virtual_stages=2)
    vee, uvee = (mm.predict_memory(c, v, schedule="zero-bubble-v", **kw).tasks
                 for c in (tied, untied))  # fmt: skip
    assert vee[1] == uvee[1]  # the head's stage is the first task's either way
    assert vee[0].activations > uvee[0].activations  # with the table transposed and its gradient


def test_train_refuses_a_layout_over_the_budget_before_compiling(tmp_path, capsys, monkeypatch):
    def no_compile(*args, **kwargs):
        raise AssertionError("compiled before refusing")

    monkeypatch.setattr(jax.stages.Lowered, "compile", no_compile)
    monkeypatch.setattr(runner.Executable, "compile", no_compile)
    argv = ["train", "--dim", "32", "--depth", "2", "--heads", "2", "--seq-len", "16"]
    argv += ["--batch-size", "8", "--microbatches", "2", "--steps", "1", "--model-axis", "1"]
    argv += ["--output-dir", str(tmp_path / "run"), "--memory-budget", "600KiB"]
    assert main(argv) == 2  # the compilers above raise if called
    err = capsys.readouterr().err
    assert err.startswith("mmnnx train: error: --memory-budget 600KiB: stage 1 needs ")
    assert "--microbatches 4 fits" in err and "Traceback" not in err
    # nothing written: it left OUTPUT_DIR/checkpoints (the writer lock) and data/tokens.bin
    assert not (tmp_path / "run").exists()


def test_more_stages_are_suggested_only_as_many_as_the_devices_hold():
    from mmnnx.train.config import RunConfig
    from mmnnx.train.validate import memory_problem

    # 2 stages x data 2 x model 2 on 8 devices: only --stages 4 (16 devices) would fit
    options = dict(memory_budget="6200000", batch_size=8, microbatches=4, seq_len=16)
    run = RunConfig.of({**options, "remat": "full"})
    config = GPTConfig(vocab_size=256, dim=128, depth=8, num_heads=4, max_seq_len=16, remat="full")
    assert memory_problem(run, config, 2, 16).endswith("--stages 4 fits (5.7 MiB)")
    on_eight = memory_problem(run, config, 2, 8)
    assert "no single change fits" in on_eight and "--stages 4" not in on_eight
    # what it tried: an FSDP axis dividing the data axis (2), not "up to 8"
    assert "a larger --fsdp-axis of 2, 4 or 8 dividing --data-axis 2, nor" in on_eight


def test_weights_gathered_once_a_step_are_charged_and_gathering_per_program_is_named():
    from mmnnx.train.config import RunConfig
    from mmnnx.train.validate import memory_problem

    config = GPTConfig(vocab_size=256, dim=128, depth=8, num_heads=4, max_seq_len=16, remat="full")
    options = dict(memory_budget="7MiB", batch_size=8, microbatches=4, seq_len=16, fsdp_axis=2)
    per_program = RunConfig.of({**options, "remat": "full"})
    assert memory_problem(per_program, config, 2, 8) is None  # 6.1 MiB
    once = RunConfig.of({**options, "remat": "full", "fsdp_gather": "step"})
    assert memory_problem(once, config, 2, 8).endswith("--fsdp-gather microbatch fits (6.1 MiB)")
    tight = RunConfig.of({**options, "memory_budget": "1MiB", "fsdp_gather": "step"})
    assert "no single change fits: --fsdp-gather microbatch, not 1F1B" in memory_problem(
        tight, config, 2, 8
    )
    assert "fits: not 1F1B" in memory_problem(RunConfig.of({**options, "memory_budget": "1MiB"}),
                                              config, 2, 8)  # fmt: skip
    layout = mm.MemoryLayout(stages=2, data=2, fsdp=2)
    with pytest.raises(ValueError, match="fsdp_gather 'once': expected 'microbatch' or 'step'"):
        mm.predict_memory(config, layout, batch=8, microbatches=4, fsdp_gather="once")


@pytest.mark.parametrize(
    "fsdp, batch, microbatches, gather, vocab, tied",
    [  # FSDP 2 over a data axis of 2: a stage of mostly state, its weights gathered in each
        # program or once a step (held whole from the first forward to the last backward)
        (1, 16, 4, "microbatch", 64, False),
        (2, 4, 2, "microbatch", 64, False),
        (2, 4, 2, "step", 64, False),
        # logits larger than the weights: the loss's backward's buffers on the last stage
        (1, 16, 4, "microbatch", 2048, False),
        # a tied head runs on the first task, a stage of its own (3 stages on 2 tasks): its
        # logits, the table transposed and its gradient held there, none on the last task
        (1, 16, 4, "microbatch", 2048, True),
    ],
)
def test_prediction_within_10_percent_of_the_measured_peak(
    fsdp, batch, microbatches, gather, vocab, tied
):
    config = GPTConfig(vocab_size=vocab, dim=32, depth=2, num_heads=2, max_seq_len=16,
                       tie_embeddings=tied)  # fmt: skip
    tasks = run_tasks(2, fsdp, 1, fsdp_axis=fsdp)
    with nnx.use_eager_sharding(False):
        rules = stage_rules(nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0))), tasks,
                            report=False)  # fmt: skip
    if fsdp > 1:
        rules = mm.fsdp_rules(rules, axis="fsdp")
    model = mm.init(lambda: GPT(config, rngs=nnx.Rngs(0)), rules)
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    train = TrainConfig(microbatches=microbatches, schedule="1f1b", fsdp_gather=gather)
    step, _ = make_steps(train)
    tokens = jax.random.randint(jax.random.key(0), (batch, 17), 0, 64)
    step(model, opt, tokens)
    peak: dict[int, int] = {}
    original, index = runner.Executable._record, [0]

    def record(executable, env, memory):  # after each action: arrays held + its temporaries
        original(executable, env, memory)
        action = executable._steps[index[0]]
        index[0] += 1
        held: dict[int, int] = {}
        for value in {id(v): v for v in env if isinstance(v, jax.Array)}.values():
            for shard in value.addressable_shards:
                held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
        if isinstance(action, Launch):
            temp = action.program.memory_analysis().temp_size_in_bytes
            for device in jax.tree.leaves(action.program.output_shardings)[0].device_set:
                held[device.id] += temp
        for device, nbytes in held.items():
            peak[device] = max(peak.get(device, 0), nbytes)

    runner.Executable._record = record
    try:
        step.memory_profile(model, opt, tokens)
    finally:
        runner.Executable._record = original
    layout = mm.MemoryLayout(stages=2, data=fsdp, fsdp=fsdp)
    predicted = mm.predict_memory(
        config, layout, batch=batch, microbatches=microbatches, schedule="1f1b", fsdp_gather=gather
    )
    for task, t in zip(tasks, predicted.tasks, strict=True):
        measured = max(peak[d.id] for d in task.jax_mesh.devices.flat)
        assert abs(t.peak / measured - 1) <= 0.10, (task.name, t.peak, measured)


def test_partition_auto_skips_the_candidates_over_the_budget(capsys):
    from mmnnx.cli.partition import _within_budget
    from mmnnx.train.config import RunConfig
    from mmnnx.train.run_model import model_config

    options = dict(dim=32, depth=2, heads=2, seq_len=16, batch_size=8, model_axis=1)
    options.update(partition="auto", schedule="auto", memory_budget="700KiB")
    run = RunConfig.of(options)
    config = model_config(run, 256)
    schedules, counts = _within_budget(run, config, 2, None, [2, 4])
    printed = capsys.readouterr().out
    assert "skipped, predicted over --memory-budget 700KiB: gpipe M=2 (task 1: " in printed
    assert "1f1b" in schedules and "interleaved-1f1b" not in schedules and counts == [4, 2]
    with pytest.raises(ValueError, match="no candidate fits --memory-budget 100KiB: the smallest"):
        _within_budget(RunConfig.of({**options, "memory_budget": "100KiB"}), config, 2, None, [2])


def test_the_docs_worked_example_is_what_the_code_computes(capsys):
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "docs" / "memory.md").read_text()
    block = re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]
    scope: dict = {}
    exec(compile(block, "docs/memory.md", "exec"), scope)
    first = scope["p"].tasks[0]
    stated = re.search(r"The pipelined phase sums to \*\*([0-9,]+) B\*\*", text).group(1)
    assert first.pipelined == first.peak == int(stated.replace(",", ""))
    for value in (first.parameters, first.optimizer, first.activations, first.workspace):
        assert f"**{value:,} B**" in text


def test_gpt_oss_parameters_counted_as_its_model_holds_them():
    """gpt-oss's attention biases and sinks, its router's bias and its experts' biases are
    counted: the predicted parameter bytes over 1 and 2 stages equal the model's own
    (tests/transformers_fixtures/gpt-oss)."""
    fixture = pathlib.Path(__file__).parent / "transformers_fixtures" / "gpt-oss"
    config = pretrained_config(fixture)
    with nnx.use_eager_sharding(False):
        shapes = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    held = sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(nnx.state(shapes, nnx.Param)))
    for stages in (1, 2):
        lay = mm.MemoryLayout(stages=stages)
        tasks = mm.predict_memory(config, lay, batch=2, seq_len=4, schedule="gpipe").tasks
        assert sum(t.parameters for t in tasks) == held, stages


def test_a_tied_head_keeps_the_table_itself_for_its_backward_not_a_transposed_copy(capsys):
    """``x @ table.T`` saved the transposed table for the backward: a ``vocab x dim`` copy on
    the head's task for each microbatch in flight; contracting the table as stored keeps the
    Variable's own array (``predict_memory`` charges no copy)."""
    from jax.ad_checkpoint import print_saved_residuals

    from mmnnx.modules.embed import Embed

    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(Embed(64, 8, rngs=nnx.Rngs(0)))
    print_saved_residuals(
        lambda s, x: nnx.merge(graphdef, s).attend(x).sum(), state, jax.numpy.ones((2, 3, 8))
    )
    saved = capsys.readouterr().out
    assert "f32[64,8] from the argument" in saved and "[8,64]" not in saved, saved
