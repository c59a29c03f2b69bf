"""``mmnnx train --resume --layout-from PLAN``: a run trained under one layout, planned for by
``mmnnx plan --run`` on the 8 simulated CPU devices, continues under the plan's layout (other
FSDP, model stages per task, schedule, microbatches and remat); its checkpoint restores
bit-exact onto that layout and the continued losses equal an uninterrupted run."""

import contextlib
import dataclasses
import io
import json
import pathlib
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.cli import main
from mmnnx.cli.plan_run import PlannedRun
from mmnnx.models import GPT
from mmnnx.partition.cost import ClusterLayout
from mmnnx.train import Checkpointer
from mmnnx.train.config import MAY_CHANGE_ON_RESUME, RunConfig
from mmnnx.train.generation import run_tasks
from mmnnx.train.run_config import resolved_config, write_config
from mmnnx.train.run_model import fsdp_placement, run_placement
from mmnnx.train.tokenizers import BPETokenizer

TINY = ["--dim", "32", "--depth", "4", "--heads", "2", "--seq-len", "16", "--batch-size", "8",
        "--microbatches", "2", "--eval-every", "2", "--eval-batches", "1", "--checkpoint-every",
        "2", "--timeline-step", "0", "--no-tensorboard", "--log-every", "1", "--schedule-steps",
        "4", "--warmup-steps", "1"]  # fmt: skip
# this host's CPU as the plan sees it (given, as --device cpu asks), and a memory budget small
# enough that the planner shards and recomputes
CPU = ["--devices", "8", "--device", "cpu", "--flops", "2e9", "--bandwidth", "1e9", "--memory",
       "400KiB"]  # fmt: skip


def _rows(run) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_every_field_of_a_planned_layout_is_a_train_option_a_resume_may_change():
    options = ClusterLayout().train_options()
    assert len(options) == len(dataclasses.fields(ClusterLayout))
    assert set(options) <= set(MAY_CHANGE_ON_RESUME), set(options) - set(MAY_CHANGE_ON_RESUME)
    assert set(options) <= set(RunConfig.of({}).options())


def test_a_run_resumes_bit_exact_under_the_layout_mmnnx_plan_chose(tmp_path, capsys):
    straight, parts = tmp_path / "straight", tmp_path / "parts"
    with contextlib.redirect_stdout(io.StringIO()):  # layout A: the defaults, 2 x (2 x 2)
        assert main(["train", *TINY, "--steps", "4", "--output-dir", str(straight)]) == 0
    shutil.copytree(straight, parts)  # the same run stopped at step 2
    shutil.rmtree(parts / "checkpoints" / "4")

    assert main(["plan", "--run", str(parts), *CPU, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    layout_b = ClusterLayout.of_json(plan["layout"])
    layout_a = ClusterLayout(stages=2, data=2, tensor=2, microbatches=2)
    assert plan["fits"] and (plan["batch"], plan["seq_len"]) == (8, 16)
    changed = {f.name for f in dataclasses.fields(ClusterLayout)
               if getattr(layout_a, f.name) != getattr(layout_b, f.name)}  # fmt: skip
    assert layout_b.fsdp > 1 and len(changed) >= 3, layout_b

    # step 2, saved under A, restored onto B's placement: every parameter as saved, bit-exact
    config = PlannedRun.read(str(parts)).config()
    tasks = run_tasks(layout_b.stages, layout_b.data, layout_b.tensor, fsdp_axis=layout_b.fsdp)
    placement = run_placement(config, tasks, virtual_stages=layout_b.virtual_stages,
                              schedule=layout_b.schedule)  # fmt: skip
    with nnx.use_eager_sharding(False):
        model = GPT(config, rngs=nnx.Rngs(1))
    mm.place(model, fsdp_placement(placement))
    with Checkpointer(parts / "checkpoints") as checkpoints:
        checkpoints.restore(2, model=model)
    saved = ocp.StandardCheckpointer().restore(parts / "checkpoints" / "2" / "model")
    restored = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    flat = {path: v for path, v in _flat(saved).items() if path in restored}
    assert len(flat) == len(restored) > 0
    for path, value in flat.items():
        np.testing.assert_array_equal(np.asarray(restored[path].get_value()), value, str(path))
    assert any("fsdp" in str(spec) for _, spec in mm.placement(model).values())

    # resumed under B through the CLI: the steps after 2 as the straight run's
    argv = ["train", "--output-dir", str(parts), "--resume", "--steps", "4"]
    assert main([*argv, "--layout-from", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert f"--layout-from {tmp_path / 'plan.json'}: --stages {layout_b.stages} " in out
    assert "resumed from step 2" in out
    recorded = (parts / "config.toml").read_text()
    assert f"fsdp_axis = {layout_b.fsdp}\n" in recorded
    assert f'schedule = "{layout_b.schedule}"\n' in recorded
    a, b = _rows(straight), _rows(parts)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        for key in ("loss", "eval_loss"):
            if key in x:
                assert y[key] == pytest.approx(x[key], rel=1e-5), (x, y)


def _flat(tree, prefix=()) -> dict[tuple, np.ndarray]:
    """A restored orbax tree's arrays by their path of keys (as ``nnx.to_flat_state``'s)."""
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out |= _flat(value, (*prefix, int(key) if str(key).isdigit() else key))
        return out
    return {prefix: np.asarray(tree)}


def test_layout_from_refuses_a_contradicting_flag_another_batch_and_a_bad_file(tmp_path, capsys):
    layout = dataclasses.asdict(ClusterLayout(stages=2, data=2, tensor=2, microbatches=2))
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"layout": layout, "batch": 8, "seq_len": 16}))
    base = ["train", *TINY, "--steps", "1", "--output-dir", str(tmp_path / "run")]
    for extra, said in [
        (["--stages", "4"], f"--stages 4 on the command line, but {plan} plans --stages 2"),
        (["--batch-size", "16"], f"--layout-from {plan}: planned for 8 sequences of 16 tokens"),
    ]:
        assert main([*base, *extra, "--layout-from", str(plan)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    plan.write_text(json.dumps({"layout": {**layout, "fsdp": "2"}}))
    assert main([*base, "--layout-from", str(plan)]) == 2
    assert "layout: fsdp is '2', expected an int >= 1" in capsys.readouterr().err
    for field, value in [("schedule", "bogus"), ("remat", "most")]:  # no flag takes them
        plan.write_text(json.dumps({"layout": {**layout, field: value}}))
        assert main([*base, "--layout-from", str(plan)]) == 2  # was a traceback for a schedule
        err = capsys.readouterr().err
        assert f"--layout-from {plan}: layout: {field}: '{value}' is not one of " in err, err
        assert err.count("\n") == 1 and not (tmp_path / "run").exists()
    del layout["remat"]
    plan.write_text(json.dumps({"layout": layout}))
    assert main([*base, "--layout-from", str(plan)]) == 2
    assert "no 'remat' (a plan names every field of its layout)" in capsys.readouterr().err
    assert main([*base, "--layout-from", str(tmp_path / "none.json")]) == 2
    assert "none.json: No such file or directory" in capsys.readouterr().err
    assert main(["plan", "--run", str(tmp_path / "none"), *CPU]) == 2
    assert "config.toml is missing: not an mmnnx train run" in capsys.readouterr().err
    # a run's vocabulary of 258 tokens, padded to 258 by --model-axis 2, to 260 by 4
    run = tmp_path / "bpe"
    tokenizer = BPETokenizer.train(["ab ab cd cd " * 20], 258)
    tokenizer.save(run / "tokenizer")
    options = {"dim": 32, "heads": 4, "tokenizer": "bpe", "vocab_size": 258}
    write_config(run / "config.toml", resolved_config(RunConfig.of(options).options()))
    assert tokenizer.vocab_size == 258
    assert main(["plan", "--run", str(run), *CPU, "--layout", "tp=4"]) == 2
    assert (
        "--layout tp=4: --model-axis 4 pads the vocabulary of the run's tokenizer (258) otherwise "
        "than its --model-axis 2: another model"
    ) in capsys.readouterr().err
    # a DPO run is refused (its pairs and reference forward are not modelled); a LoRA run is
    # planned with its base frozen: no gradients, optimizer state, weight gradients or update
    plans = {}
    for extra in ({}, {"lora_rank": 4}, {"dpo": True}):
        write_config(
            run / "config.toml", resolved_config(RunConfig.of({**options, **extra}).options())
        )
        code = main(
            ["plan", "--run", str(run), *CPU, "--memory", "1GiB", "--layout", "tp=2", "--json"]
        )
        out, err = capsys.readouterr()
        assert code == (2 if "dpo" in extra else 0), err
        plans[tuple(extra)] = json.loads(out) if code == 0 else err
    assert "is a --dpo run: mmnnx plan models a step of next-token training" in plans[("dpo",)]
    full, lora = plans[()], plans[("lora_rank",)]
    assert (full["trainable"], lora["trainable"]) == (1.0, 0.0)
    assert [a for a in lora["assumptions"] if a not in full["assumptions"]] == [
        "0% of the weights trained (LoRA: the frozen base has no gradients, optimizer state, "
        "weight gradients' matmuls or reduce; the adapters are not charged)"
    ]
    assert all(t["gradients"] == t["optimizer"] == 0 for t in lora["stages"])
    assert all(t["gradients"] > 0 and t["optimizer"] > 0 for t in full["stages"])
    peaks = [max(t["peak_bytes"] for t in plan["stages"]) for plan in (full, lora)]
    assert peaks[1] < peaks[0] and lora["step_seconds"] < full["step_seconds"]
    llama = str(pathlib.Path(__file__).parent / "plan_fixtures" / "configs" / "llama3-70b")
    assert main(["plan", "--init-from", llama, "--devices", "8", "--device", "cpu"]) == 2
    assert "--device cpu has no published numbers: give --flops and --bandwidth" in (
        capsys.readouterr().err
    )
