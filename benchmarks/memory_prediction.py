"""Predicted vs measured peak bytes per device (``mm.predict_memory``), one pipelined GPT
train step per configuration: stages 2 / 4, a tensor axis of 2, an expert axis of 2 with
experts, FSDP 2, GPipe vs 1F1B vs the split-backward ZB-H1 and ZB-V (two stages per task), remat
none / dots / full; and held-out ones checked after the terms were written.

Measured: the step runs once in ``memory_profile`` mode, which interprets its actions one by
one; after each, the bytes of every array the step holds (its state, gradient sums,
activations, moves; each array's shards on each device) plus, for a launched program, its
compiled ``memory_analysis().temp_size_in_bytes`` on its devices; a device's peak is the most
over the step. Predicted: ``predict_memory`` from the config and layout alone. Target: each
task's predicted peak within 10% of its devices' measured one.

This is XLA:CPU's buffer assignment (temporaries, no donation of the step's state): the
workspace term is the one its numbers least bind on another backend; with bfloat16 compute
XLA:CPU's temporaries grow rather than halve (its bfloat16 arithmetic goes through float32),
so that held-out row is not expected to meet the target here. Byte counts do not vary from run
to run: one round.

Run: python benchmarks/memory_prediction.py  (writes benchmarks/results/memory_prediction.json)
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from report import record_run, results_path  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT, GPTConfig  # noqa: E402
from mmnnx.mpmd.run import runner  # noqa: E402
from mmnnx.mpmd.run.emit import Launch  # noqa: E402
from mmnnx.train.generation import run_tasks  # noqa: E402
from mmnnx.train.loop import TrainConfig, make_steps  # noqa: E402
from mmnnx.train.run_model import fsdp_placement, run_placement  # noqa: E402

RESULTS = results_path("memory_prediction.json")
BASE = dict(vocab_size=128, dim=64, depth=4, num_heads=4, max_seq_len=32, mlp_hidden=256)
CONFIGS = {  # name: (GPTConfig changes, layout, schedule, microbatches, batch)
    "2 stages, 1F1B, remat none": ({}, dict(stages=2), "1f1b", 4, 16),
    "2 stages, 1F1B, remat full": (dict(remat="full"), dict(stages=2), "1f1b", 4, 16),
    "2 stages, 1F1B, remat dots": (dict(remat="dots"), dict(stages=2), "1f1b", 4, 16),
    "2 stages, GPipe, remat none": ({}, dict(stages=2), "gpipe", 4, 16),
    "4 stages, 1F1B, remat full, M=8": (dict(remat="full"), dict(stages=4), "1f1b", 8, 16),
    "4 stages (8 blocks), GPipe, remat full, M=8": (
        dict(remat="full", depth=8), dict(stages=4), "gpipe", 8, 16),
    "2 stages x tensor 2, 1F1B, remat none": ({}, dict(stages=2, tensor=2), "1f1b", 4, 16),
    "2 stages x expert 2, 4 experts, 1F1B, remat none": (
        dict(experts=4, expert_hidden=128), dict(stages=2, expert=2), "1f1b", 4, 16),
    # a split backward: what waits between its two passes and their buffers
    "2 stages, ZB-H1, remat none": ({}, dict(stages=2), "zero-bubble-h1", 4, 16),
    "2 stages x 2 virtual (8 blocks), ZB-V, remat none": (
        dict(depth=8), dict(stages=2, virtual_stages=2), "zero-bubble-v", 4, 16),
    "2 stages x 2 virtual (8 blocks), ZB-V, remat full": (
        dict(depth=8, remat="full"), dict(stages=2, virtual_stages=2), "zero-bubble-v", 4, 16),
    # held out: checked only after the terms were written from the configurations above
    "held out: 2 stages x data 2 (FSDP 2), 1F1B, remat none": (
        {}, dict(stages=2, data=2, fsdp=2), "1f1b", 4, 16),
    "held out: 2 stages x 2 virtual (8 blocks), interleaved 1F1B, remat none": (
        dict(depth=8), dict(stages=2, virtual_stages=2), "interleaved-1f1b", 4, 16),
    "held out: gated MLP, 2 KV heads, 64 tokens, 2 stages, 1F1B, remat none": (
        dict(gated_mlp=True, mlp_bias=False, num_kv_heads=2, max_seq_len=64),
        dict(stages=2), "1f1b", 4, 16),
    "held out: 6 blocks of dim 96, 2 stages x data 2, 1F1B, remat full": (
        dict(remat="full", depth=6, dim=96, num_heads=6, mlp_hidden=384),
        dict(stages=2, data=2), "1f1b", 4, 16),
    "held out: bfloat16 compute, 2 stages, 1F1B, remat dots": (
        dict(remat="dots", dtype="bfloat16"), dict(stages=2), "1f1b", 4, 16),
}  # fmt: skip


class PeakRecorder:
    """Each device's most bytes held by a step's arrays plus its running program's temporaries,
    recorded after every action of a ``memory_profile`` run (the runner's ``_record`` hook)."""

    def __init__(self):
        self.peak: dict[int, int] = {}
        self._index = 0
        self._original = runner.Executable._record

    def __enter__(self):
        recorder = self

        def record(executable: Any, env: list, memory: dict) -> None:
            recorder._original(executable, env, memory)
            recorder.observe(executable._steps[recorder._index], env)
            recorder._index += 1

        runner.Executable._record = record
        return self

    def __exit__(self, *exc):
        runner.Executable._record = self._original

    def observe(self, step: Any, env: list) -> None:
        held: dict[int, int] = {}
        seen = set()
        for value in env:
            if isinstance(value, jax.Array) and id(value) not in seen:
                seen.add(id(value))
                for shard in value.addressable_shards:
                    held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
        if isinstance(step, Launch):
            program = step.program
            temp = program.memory_analysis().temp_size_in_bytes
            shardings = jax.tree.leaves((program.input_shardings, program.output_shardings))
            for device in shardings[0].device_set if shardings else ():
                held[device.id] = held.get(device.id, 0) + temp
        for device, nbytes in held.items():
            self.peak[device] = max(self.peak.get(device, 0), nbytes)


def measure(config: GPTConfig, layout: dict, schedule: str, m: int, batch: int) -> list[int]:
    """Each task's measured peak bytes on its most loaded device."""
    sizes = (layout.get(k, 1) for k in ("data", "tensor", "expert"))
    tasks = run_tasks(layout["stages"], *sizes, fsdp_axis=layout.get("fsdp", 1))
    v = layout.get("virtual_stages", 1)
    rules = fsdp_placement(run_placement(config, tasks, virtual_stages=v, schedule=schedule))
    model = mm.init(lambda: GPT(config, rngs=nnx.Rngs(0)), rules)
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    step, _ = make_steps(TrainConfig(microbatches=m, schedule=schedule, virtual_stages=v))
    shape = (batch, config.max_seq_len + 1)
    tokens = jax.random.randint(jax.random.key(0), shape, 0, config.vocab_size)
    step(model, opt, tokens)  # compiles
    with PeakRecorder() as recorder:
        step.memory_profile(model, opt, tokens)
    return [max(recorder.peak.get(d.id, 0) for d in task.jax_mesh.devices.flat) for task in tasks]


def main():
    rows = {}
    for name, (changes, layout, schedule, m, batch) in CONFIGS.items():
        config = GPTConfig(**{**BASE, **changes})
        measured = measure(config, layout, schedule, m, batch)
        predicted = mm.predict_memory(
            config, mm.MemoryLayout(**layout), batch=batch, schedule=schedule, microbatches=m
        )
        rows[name] = [
            {"measured": b, "predicted": t.peak, "error": round(t.peak / b - 1, 4)}
            for t, b in zip(predicted.tasks, measured, strict=True)
        ]
        print(name, [r["error"] for r in rows[name]], flush=True)
    key = "predicted / measured peak bytes per device, per task (target: within 10%)"
    results = {"base config": BASE, key: rows}
    record_run(results, (key,), "one run: byte counts, the same in every run")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    table = Table(title="mm.predict_memory: predicted vs measured peak per device (XLA:CPU)")
    for col in ("configuration", "task", "measured", "predicted", "error", "within 10%"):
        table.add_column(col, justify="left" if col == "configuration" else "right")
    for name, per_task in rows.items():
        for i, r in enumerate(per_task):
            table.add_row(
                name if i == 0 else "", str(i), f"{r['measured']:,}", f"{r['predicted']:,}",
                f"{r['error']:+.1%}", "yes" if abs(r["error"]) <= 0.10 else "NO",
            )  # fmt: skip
    Console().print(table)
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
