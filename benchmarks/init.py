"""mm.init against building the model eagerly and placing it (mm.place), in the same run
(ratios only).

A GPT (dim 64) of 32 blocks on one task and of 64 blocks on 4 tasks of 2 devices. mm.init never
holds the whole model on one device; the baseline builds it on the default device first.
"first" is the first mm.init and eager build in this process for the 32-block case (every op
compiles; mm.init goes first, so the baseline finds them compiled). "again" repeats them in
ROUNDS alternating rounds and compares the medians: one round alone swings by 1.3x either way
on this machine, as Python's full garbage collections land in one or the other. The 64-block
case has the same layer shapes, so its ops are already compiled. Target: mm.init <= 1.5x eager
build + place.

Run: XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/init.py
Writes benchmarks/results/init.json.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pathlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from report import publish  # noqa: E402

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT, GPTConfig, stage_rules  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "init.json"
ROUNDS = 7


def tasks_of(count: int) -> list[mm.Task]:
    per = 8 // count if count > 1 else 1
    return [
        mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=range(i * per, (i + 1) * per)))
        for i in range(count)
    ]


def seconds(fn) -> float:
    start = time.perf_counter()
    model = fn()
    jax.block_until_ready(nnx.state(model))
    return time.perf_counter() - start


def case(depth: int, num_tasks: int) -> dict:
    config = GPTConfig(dim=64, depth=depth, num_heads=4, max_seq_len=64)
    tasks = tasks_of(num_tasks)

    def factory():
        return GPT(config, rngs=nnx.Rngs(0))

    with nnx.use_eager_sharding(False):
        rules = stage_rules(nnx.eval_shape(factory), tasks, report=False)

    def eager():
        with nnx.use_eager_sharding(False):
            return mm.place(factory(), rules)

    row = {
        "init_first_s": seconds(lambda: mm.init(factory, rules)),
        "eager_place_first_s": seconds(eager),
    }
    row["ratio_first"] = row["init_first_s"] / row["eager_place_first_s"]
    rounds = [(seconds(lambda: mm.init(factory, rules)), seconds(eager)) for _ in range(ROUNDS)]
    row["init_again_s"] = statistics.median(i for i, _ in rounds)
    row["eager_place_again_s"] = statistics.median(e for _, e in rounds)
    row["ratio_again"] = row["init_again_s"] / row["eager_place_again_s"]
    row["ratio per round"] = ", ".join(f"{i / e:.2f}" for i, e in rounds)
    row["target"] = "ratio <= 1.5"
    return row


def main():
    results = {
        "gpt32_1task": case(32, 1),
        "gpt64_4tasks": case(64, 4),
        "device": str(jax.devices()[0]),
    }
    publish(results, RESULTS, "init", ("gpt32_1task", "gpt64_4tasks"))


if __name__ == "__main__":
    main()
