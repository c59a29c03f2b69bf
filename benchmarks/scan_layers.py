"""Plan time of a deep scanned GPT split over pipeline stages, against the same model on one task.

A 256-block ``GPT(scan_layers=True)`` (dim 64) is pipelined over 4 stages (one device each; the
stacked blocks split into 64-block chunks, ``stage_rules``), and, as the baseline, placed whole
on one task. Both run the same train step (``mm.microbatch`` 1F1B, M = 8, AdamW). Measured:
- plan time (``step.plan``: trace, split the scan over the stages, colour, lower; compiles
  nothing), 4 stages vs one task (targets: <= 5 s and <= 1.5x): each plan built by a fresh
  ``mm.jit`` (no cache), after one plan of each has warmed JAX up, the two alternating over the
  rounds;
- first step (plan + compile + run) and a later step, for both, for context: each in a fresh
  process, the two alternating over the rounds.
Each reported as the median [min-max] over the rounds (``--rounds N``, default 5), a ratio taken
per round.

Run: python benchmarks/scan_layers.py [--rounds N]  (writes benchmarks/results/scan_layers.json)
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from report import (  # noqa: E402
    interleaved,
    median,
    publish,
    ratio_spread,
    ratios,
    results_path,
    rounds_option,
    spread,
)

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT, GPTConfig, stage_rules  # noqa: E402

RESULTS = results_path("scan_layers.json")
DEPTH, DIM, STAGES, M, BATCH, SEQ = 256, 64, 4, 8, 16, 32
CONFIG = GPTConfig(vocab_size=256, dim=DIM, depth=DEPTH, num_heads=4, max_seq_len=SEQ)


def train_step(model, opt, tokens):
    loss_and_grads = nnx.value_and_grad(lambda m, t: m.loss(t))
    loss, grads = mm.microbatch(loss_and_grads, num=M, reduce="mean", schedule="1f1b")(
        model, tokens
    )
    opt.update(model, grads)
    return loss


def placed(layout: str):
    """The model and its optimizer, ``layout`` "staged" (over the stages) or "whole" (one task)."""
    with nnx.use_eager_sharding(False):
        model = GPT(dataclasses.replace(CONFIG, scan_layers=True), rngs=nnx.Rngs(0))
    if layout == "staged":
        tasks = [mm.Task(f"s{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(STAGES)]
        rules = stage_rules(model, tasks, report=False)
    else:
        rules = [(".*", mm.Task("solo", mesh=mm.TaskMesh(devices=[0])))]
    model = mm.place(model, rules)
    return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)


def tokens():
    return jax.random.randint(jax.random.key(0), (BATCH, SEQ + 1), 0, CONFIG.vocab_size)


def plan_seconds(model, opt, batch) -> float:
    step = mm.jit(train_step)  # a fresh mm.jit: nothing cached
    start = time.perf_counter()
    step.plan(model, opt, batch)
    return time.perf_counter() - start


def step_seconds(layout: str) -> dict:
    """First step (plan, compile, run) and a later one, in this (fresh) process."""
    model, opt = placed(layout)
    batch = tokens()
    step = mm.jit(train_step)
    start = time.perf_counter()
    jax.block_until_ready(step(model, opt, batch))
    first = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(step(model, opt, batch))
    return {"first": first, "later": time.perf_counter() - start}


def in_fresh_process(layout: str) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--steps", layout], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(rounds: int) -> None:
    batch = tokens()
    staged, whole = placed("staged"), placed("whole")
    plan_seconds(*staged, batch), plan_seconds(*whole, batch)  # JAX warmed up
    plans = interleaved(
        {
            "staged": lambda: plan_seconds(*staged, batch),
            "whole": lambda: plan_seconds(*whole, batch),
        },
        rounds,
    )
    steps = interleaved(
        {"staged": lambda: in_fresh_process("staged"), "whole": lambda: in_fresh_process("whole")},
        rounds,
    )

    def of(layout: str, which: str) -> list[float]:
        return [s[which] for s in steps[layout]]

    plan_ratios = ratios(plans["staged"], plans["whole"])
    results = {
        "setup": {
            "model": f"GPT(scan_layers=True), {DEPTH} blocks, dim {DIM}",
            "stages": STAGES,
            "microbatches": M,
            "schedule": "1f1b",
        },
        "plan time": {
            f"{STAGES} stages (s)": spread(plans["staged"], digits=3),
            "one task (s)": spread(plans["whole"], digits=3),
            f"{STAGES} stages / one task": spread(plan_ratios),
            "target: 4 stages <= 5 s (median)": median(plans["staged"]) <= 5.0,
            "target: ratio <= 1.5 (median)": median(plan_ratios) <= 1.5,
        },
        "steps": {
            f"first step, {STAGES} stages (s)": spread(of("staged", "first")),
            "first step, one task (s)": spread(of("whole", "first")),
            f"first step, {STAGES} stages / one task": ratio_spread(
                of("staged", "first"), of("whole", "first")
            ),
            f"later step, {STAGES} stages (s)": spread(of("staged", "later")),
            "later step, one task (s)": spread(of("whole", "later")),
        },
    }
    publish(results, RESULTS, "scan_layers", ("setup", "plan time", "steps"), rounds)


if __name__ == "__main__":
    if "--steps" in sys.argv:
        print(json.dumps(step_seconds(sys.argv[sys.argv.index("--steps") + 1])))
    else:
        main(rounds_option(sys.argv))
