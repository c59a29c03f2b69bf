"""Plan time of a deep scanned GPT split over pipeline stages, against the same model on one task.

A 256-block ``GPT(scan_layers=True)`` (dim 64) is pipelined over 4 stages (one device each; the
stacked blocks split into 64-block chunks, ``stage_rules``), and, as the baseline, placed whole
on one task. Both run the same train step (``mm.microbatch`` 1F1B, M = 8, AdamW). Measured:
- first-call plan time (``step.plan``: trace, split the scan over the stages, colour, lower;
  compiles nothing), 4 stages vs one task (targets: <= 5 s and <= 1.5x);
- first step (plan + compile + run) and a later step, for both, for context.
Each plan is built by a fresh ``mm.jit`` (no cache), best of 3.

Run: python benchmarks/scan_layers.py  (writes benchmarks/results/scan_layers.json)
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from report import publish  # noqa: E402

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT, GPTConfig, stage_rules  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "scan_layers.json"
DEPTH, DIM, STAGES, M, BATCH, SEQ = 256, 64, 4, 8, 16, 32
CONFIG = GPTConfig(vocab_size=256, dim=DIM, depth=DEPTH, num_heads=4, max_seq_len=SEQ)


def train_step(model, opt, tokens):
    loss_and_grads = nnx.value_and_grad(lambda m, t: m.loss(t))
    loss, grads = mm.microbatch(loss_and_grads, num=M, reduce="mean", schedule="1f1b")(
        model, tokens
    )
    opt.update(model, grads)
    return loss


def placed(rules_for):
    with nnx.use_eager_sharding(False):
        model = GPT(dataclasses.replace(CONFIG, scan_layers=True), rngs=nnx.Rngs(0))
    model = mm.place(model, rules_for(model))
    return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)


def plan_seconds(model, opt, tokens) -> float:
    best = float("inf")
    for _ in range(3):
        step = mm.jit(train_step)
        start = time.perf_counter()
        step.plan(model, opt, tokens)
        best = min(best, time.perf_counter() - start)
    return best


def step_seconds(model, opt, tokens) -> tuple[float, float]:
    step = mm.jit(train_step)
    start = time.perf_counter()
    jax.block_until_ready(step(model, opt, tokens))
    first = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(step(model, opt, tokens))
    return first, time.perf_counter() - start


def main() -> None:
    tasks = [mm.Task(f"s{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(STAGES)]
    solo = mm.Task("solo", mesh=mm.TaskMesh(devices=[0]))
    tokens = jax.random.randint(jax.random.key(0), (BATCH, SEQ + 1), 0, CONFIG.vocab_size)
    staged = placed(lambda model: stage_rules(model, tasks, report=False))
    whole = placed(lambda model: [(".*", solo)])
    plan_staged = plan_seconds(*staged, tokens)
    plan_whole = plan_seconds(*whole, tokens)
    first_staged, later_staged = step_seconds(*staged, tokens)
    first_whole, later_whole = step_seconds(*whole, tokens)
    results = {
        "setup": {
            "model": f"GPT(scan_layers=True), {DEPTH} blocks, dim {DIM}",
            "stages": STAGES,
            "microbatches": M,
            "schedule": "1f1b",
        },
        "plan time": {
            f"{STAGES} stages (s)": plan_staged,
            "one task (s)": plan_whole,
            f"{STAGES} stages / one task": plan_staged / plan_whole,
            "target: 4 stages <= 5 s": plan_staged <= 5.0,
            "target: ratio <= 1.5": plan_staged / plan_whole <= 1.5,
        },
        "steps": {
            f"first step, {STAGES} stages (s)": first_staged,
            "first step, one task (s)": first_whole,
            f"later step, {STAGES} stages (s)": later_staged,
            "later step, one task (s)": later_whole,
        },
    }
    publish(results, RESULTS, "scan_layers", ("setup", "plan time", "steps"))


if __name__ == "__main__":
    main()
