"""First call of a pipelined train step (trace, plan, compile, run) against the same step
under ``jax.jit`` on one device, in the same run (ratios only).

A 32-block GPT (dim 64) pipelined over 4 stages of one device each with 1F1B, M = 16, AdamW,
against the plain full-batch step (no microbatching) of the same model under ``nnx.jit`` on
one device. Each step is a fresh function (nothing cached in this process for it); the
compiled-program count of the pipeline is reported. Target (issue 16): <= 1.5x.

Run: XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/first_call.py
Writes benchmarks/results/first_call.json.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pathlib  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from report import publish  # noqa: E402

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT, GPTConfig, stage_rules  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "first_call.json"
CONFIG = GPTConfig(vocab_size=256, dim=64, depth=32, num_heads=4, max_seq_len=32)
STAGES, M, BATCH = 4, 16, 32


def pipelined_step(model, opt, tokens):
    grad_fn = mm.microbatch(
        nnx.value_and_grad(lambda m, t: m.loss(t)), num=M, reduce="mean", schedule="1f1b"
    )
    loss, grads = grad_fn(model, tokens)
    opt.update(model, grads)
    return loss


def plain_step(model, opt, tokens):
    loss, grads = nnx.value_and_grad(lambda m, t: m.loss(t))(model, tokens)
    opt.update(model, grads)
    return loss


def first_call(step, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(step(*args))
    return time.perf_counter() - start


def main():
    tokens = jax.random.randint(jax.random.key(0), (BATCH, CONFIG.max_seq_len + 1), 0, 256)
    with nnx.use_eager_sharding(False):
        model, reference = GPT(CONFIG, rngs=nnx.Rngs(0)), GPT(CONFIG, rngs=nnx.Rngs(0))
    tasks = [mm.Task(f"s{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(STAGES)]
    mm.place(model, stage_rules(model, tasks, report=False))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(reference, optax.adamw(1e-3), wrt=nnx.Param)
    one_device = first_call(nnx.jit(plain_step), reference, ref_opt, tokens)
    step = mm.jit(pipelined_step)
    pipelined = first_call(step, model, opt, tokens)
    results = {
        "gpt32_4stages_m16": {
            "pipelined_first_call_s": pipelined,
            "one_device_jit_first_call_s": one_device,
            "ratio": pipelined / one_device,
            "programs": step.plan(model, opt, tokens).num_programs,
            "target": "ratio <= 1.5",
        },
        "device": str(jax.devices()[0]),
    }
    publish(results, RESULTS, "first call", ("gpt32_4stages_m16",))


if __name__ == "__main__":
    main()
