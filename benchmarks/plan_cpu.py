"""Does ``mmnnx plan``'s cost model predict a step measured on this machine's CPU?

A GPT on 2 stages of one CPU device each, 1F1B with 4 microbatches. The CPU's "device spec" is
measured, not assumed: its FLOP/s is each stage's forward FLOPs (the cost model's count) over
that stage's forward measured one action at a time (``timeline()``, median), efficiency 1, and
its link the bytes/s of a ``device_put`` of one microbatch's activations between the two
devices. From these alone the cost model (backward = 2 x forward, its transfers, the schedule
simulated) predicts the step; the step is then timed as a call runs it (median of
``--rounds``, default 5, with min-max). Target: within 10%. The optimizer update is not
charged by the cost model; it is timed apart and reported.

Run: python benchmarks/plan_cpu.py [--rounds N]
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT, GPTConfig  # noqa: E402
from mmnnx.mpmd import schedules as sched  # noqa: E402
from mmnnx.partition.cost import (  # noqa: E402
    ClusterLayout,
    DeviceSpec,
    stage_action_costs,
    step_cost,
)
from mmnnx.train.generation import run_tasks  # noqa: E402
from mmnnx.train.loop import TrainConfig, make_steps  # noqa: E402
from mmnnx.train.run_model import run_placement  # noqa: E402

CONFIG = GPTConfig(vocab_size=256, dim=128, depth=4, num_heads=4, max_seq_len=64,
                   mlp_ratio=4)  # fmt: skip
BATCH, MICROBATCHES = 32, 4


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    tasks = run_tasks(2, 1, 1, 1)
    rules = run_placement(CONFIG, tasks, schedule="1f1b")
    model = mm.init(lambda: GPT(CONFIG, rngs=nnx.Rngs(0)), rules)
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    step, _ = make_steps(TrainConfig(microbatches=MICROBATCHES, schedule="1f1b"))
    shape = (BATCH, CONFIG.max_seq_len + 1)
    tokens = jax.random.randint(jax.random.key(0), shape, 0, CONFIG.vocab_size)
    jax.block_until_ready(step(model, opt, tokens))  # compiles

    layout = ClusterLayout(stages=2, microbatches=MICROBATCHES, schedule="1f1b")
    unit = DeviceSpec(name="cpu", flops=1.0, memory=2**40, intra_bandwidth=1.0,
                      inter_bandwidth=1.0, node_size=2, efficiency=1.0)  # fmt: skip
    seq = CONFIG.max_seq_len
    flop_costs, *_ = stage_action_costs(CONFIG, layout, unit, batch=BATCH, seq=seq)
    forward = sched.measured_costs(step.timeline(model, opt, tokens))
    speeds = [flop_costs[("F", s)] / forward[("F", s)] for s in range(2)]
    activation = jax.device_put(
        jax.numpy.ones((BATCH // MICROBATCHES, seq, CONFIG.dim)), jax.devices()[0]
    )
    jax.block_until_ready(jax.device_put(activation, jax.devices()[1]))
    start = time.perf_counter()
    for _ in range(20):
        jax.block_until_ready(jax.device_put(activation, jax.devices()[1]))
    bandwidth = 20 * activation.nbytes / (time.perf_counter() - start)
    cpu = DeviceSpec(name="cpu", flops=statistics.mean(speeds), memory=2**40,
                     intra_bandwidth=bandwidth, inter_bandwidth=bandwidth, node_size=2,
                     efficiency=1.0)  # fmt: skip
    predicted = step_cost(CONFIG, layout, cpu, batch=BATCH, seq=seq).step_seconds

    measured = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(step(model, opt, tokens))
        measured.append(time.perf_counter() - start)
    median = statistics.median(measured)
    ratios = sorted(predicted / t for t in measured)
    print(f"cores {os.cpu_count()}, load {os.getloadavg()[0]:.1f}")
    per_stage = [f"{s / 1e9:.2f}" for s in speeds]
    print(f"measured CPU: {cpu.flops / 1e9:.2f} GFLOP/s (stages {per_stage}), "
          f"link {bandwidth / 1e9:.2f} GB/s")  # fmt: skip
    ratio = [round(forward[("B", s)] / forward[("F", s)], 2) for s in range(2)]
    print(f"measured B / F per stage: {ratio} (the model assumes 2)")
    print(f"step: predicted {predicted * 1e3:.1f} ms, measured {median * 1e3:.1f} ms "
          f"[{min(measured) * 1e3:.1f}-{max(measured) * 1e3:.1f}]: predicted / measured "
          f"{predicted / median:.3f} [{ratios[0]:.3f}-{ratios[-1]:.3f}]; within 10%: "
          f"{'yes' if abs(predicted / median - 1) <= 0.10 else 'NO'}")  # fmt: skip


if __name__ == "__main__":
    main()
