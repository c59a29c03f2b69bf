"""mm.init against building the model eagerly and placing it (mm.place), in the same run
(ratios only).

A GPT (dim 64) of 32 blocks on one task and of 64 blocks on 4 tasks of 2 devices. mm.init never
holds the whole model on one device; the baseline builds it on the default device first.
Each round is a fresh process that measures, for the 32-block case then the 64-block one, the
first mm.init and the first eager build + place in it (every op compiles in the 32-block case;
mm.init goes first, so the baseline finds them compiled; the 64-block case has the same layer
shapes, so its ops are already compiled), then each once again ("again"). Reported: each time
and each ratio as the median [min-max] over the rounds (``--rounds N``, default 5), the ratio
taken per round: one round alone swings by 1.3x either way on this machine, as Python's full
garbage collections land in one or the other. Target: mm.init <= 1.5x eager build + place.

Run: XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/init.py [--rounds N]
Writes benchmarks/results/init.json.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from report import interleaved, publish, ratio_spread, results_path, rounds_option, spread  # noqa: E402

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT, GPTConfig, stage_rules  # noqa: E402

RESULTS = results_path("init.json")
CASES = {"gpt32_1task": (32, 1), "gpt64_4tasks": (64, 4)}


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
    """This process's first mm.init and eager build + place of the GPT, then each again."""
    config = GPTConfig(dim=64, depth=depth, num_heads=4, max_seq_len=64)
    tasks = tasks_of(num_tasks)

    def factory():
        return GPT(config, rngs=nnx.Rngs(0))

    with nnx.use_eager_sharding(False):
        rules = stage_rules(nnx.eval_shape(factory), tasks, report=False)

    def eager():
        with nnx.use_eager_sharding(False):
            return mm.place(factory(), rules)

    return {
        "init_first": seconds(lambda: mm.init(factory, rules)),
        "eager_first": seconds(eager),
        "init_again": seconds(lambda: mm.init(factory, rules)),
        "eager_again": seconds(eager),
    }


def in_fresh_process() -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--round"], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(rounds: int):
    runs = interleaved({"process": in_fresh_process}, rounds)["process"]
    results = {}
    for name in CASES:
        got = {k: [r[name][k] for r in runs] for k in runs[0][name]}
        results[name] = {
            "init_first_s": spread(got["init_first"]),
            "eager_place_first_s": spread(got["eager_first"]),
            "ratio_first": ratio_spread(got["init_first"], got["eager_first"]),
            "init_again_s": spread(got["init_again"]),
            "eager_place_again_s": spread(got["eager_again"]),
            "ratio_again": ratio_spread(got["init_again"], got["eager_again"]),
            "target": "ratio <= 1.5",
        }
    results["device"] = str(jax.devices()[0])
    publish(results, RESULTS, "init", tuple(CASES), rounds)


if __name__ == "__main__":
    if "--round" in sys.argv:  # one round, in this fresh process: each case in turn
        print(json.dumps({name: case(*args) for name, args in CASES.items()}))
    else:
        main(rounds_option(sys.argv))
