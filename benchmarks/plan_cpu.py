"""Does ``mmnnx plan``'s cost model predict a step measured on this machine's CPU?

A GPT on 2 stages of one CPU device each, 1F1B with 4 microbatches. The CPU's "device spec" is
measured, not assumed: its FLOP/s is each stage's forward FLOPs (the cost model's count) over
that stage's forward measured one action at a time (``timeline()``, median), efficiency 1; its
``backward`` the measured backward over forward (XLA:CPU's is near 3, a GPU's matmuls 2); its
memory bandwidth the optimizer update's bytes (the cost model's count) over the update timed
alone; its link the bytes/s of a ``device_put`` of one microbatch's activations between the
two devices. From these the cost model composes the step (the schedule simulated with its
bubble and transfers, then the update); the step is then timed as a call runs it (median of
``--rounds``, default 5, with min-max). Target: within 10%.

Run: python benchmarks/plan_cpu.py [--rounds N]
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT, GPTConfig  # noqa: E402
from mmnnx.mpmd import schedules as sched  # noqa: E402
from mmnnx.partition.cost import ClusterLayout, DeviceSpec, stage_costs, step_cost  # noqa: E402
from mmnnx.train.generation import run_tasks  # noqa: E402
from mmnnx.train.loop import TrainConfig, make_steps  # noqa: E402
from mmnnx.train.run_model import run_placement  # noqa: E402

CONFIG = GPTConfig(vocab_size=256, dim=128, depth=4, num_heads=4, max_seq_len=64,
                   mlp_ratio=4)  # fmt: skip
BATCH, MICROBATCHES = 32, 4


def timed(call, rounds: int) -> list[float]:
    """Seconds of ``call()`` (which blocks until its results are ready), ``rounds`` times."""
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        out.append(time.perf_counter() - start)
    return out


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
    grads = jax.tree.map(lambda x: x * 0 + 1e-3, nnx.state(model, nnx.Param))
    update = mm.jit(lambda m, o, g: o.update(m, g))

    def update_once():
        update(model, opt, grads)
        jax.block_until_ready(nnx.state(model))

    update_once()  # compiles

    layout = ClusterLayout(stages=2, microbatches=MICROBATCHES, schedule="1f1b")
    unit = DeviceSpec(name="cpu", flops=1.0, memory=2**40, intra_bandwidth=1.0,
                      inter_bandwidth=1.0, node_size=2, memory_bandwidth=1.0,
                      efficiency=1.0)  # fmt: skip
    seq = CONFIG.max_seq_len
    counted = stage_costs(CONFIG, layout, unit, batch=BATCH, seq=seq)  # FLOPs and bytes
    update_seconds = statistics.median(timed(update_once, rounds))
    bandwidth_memory = sum(counted.updates) / update_seconds  # the update's bytes/s
    activation = jax.device_put(
        jax.numpy.ones((BATCH // MICROBATCHES, seq, CONFIG.dim)), jax.devices()[0]
    )
    move = statistics.median(
        timed(lambda: jax.block_until_ready(jax.device_put(activation, jax.devices()[1])), 20)
    )

    def predict(actions, transfer):
        costs = dataclasses.replace(
            counted, actions=actions, transfer=transfer, gathers=[0.0, 0.0],
            updates=[b / bandwidth_memory for b in counted.updates],
        )  # fmt: skip
        return step_cost(CONFIG, layout, unit, batch=BATCH, seq=seq, costs=costs)

    rows = {"alone": [], "running": []}
    steps = []
    for _ in range(rounds):  # interleaved: each round's costs predict that round's step
        alone = sched.measured_costs(step.timeline(model, opt, tokens))
        rows["alone"].append((predict(alone, move), alone))
        running = step.overlapped_timeline(model, opt, tokens)
        moved = sched.measured_transfer_costs(running, "mean").values()
        actions = sched.measured_costs(running, "mean")
        rows["running"].append((predict(actions, statistics.mean(moved)), actions))
        steps.append(timed(lambda: jax.block_until_ready(step(model, opt, tokens)), 1)[0])
    median = statistics.median(steps)
    print(f"cores {os.cpu_count()}, load {os.getloadavg()[0]:.1f}, rounds {rounds}")
    alone = rows["alone"][0][1]
    speeds = [f"{counted.actions[('F', s)] / alone[('F', s)] / 1e9:.1f}" for s in range(2)]
    b_over_f = [round(alone[("B", s)] / alone[("F", s)], 2) for s in range(2)]
    print(f"measured alone (round 1): forward {speeds} GFLOP/s per stage, backward / forward "
          f"{b_over_f} (FLOPs say 2); update {update_seconds * 1e3:.1f} ms "
          f"({bandwidth_memory / 1e9:.2f} GB/s); activation move {move * 1e3:.2f} ms")  # fmt: skip
    print(f"step measured {median * 1e3:.1f} ms [{min(steps) * 1e3:.1f}-{max(steps) * 1e3:.1f}]")
    labels = {"alone": "actions timed alone, link by device_put",
              "running": "actions and transfers timed in the running step"}  # fmt: skip
    for key, label in labels.items():
        predicted = [cost.step_seconds for cost, _ in rows[key]]
        ratios = sorted(p / t for p, t in zip(predicted, steps, strict=True))
        ratio = statistics.median(ratios)
        cost = rows[key][0][0]
        print(f"  from {label}: predicted {statistics.median(predicted) * 1e3:.1f} ms (round 1: "
              f"makespan {cost.makespan * 1e3:.1f}, bubble {cost.bubble:.1%}, update "
              f"{cost.per_step_seconds * 1e3:.1f}); predicted / measured per round "
              f"{ratio:.3f} [{ratios[0]:.3f}-{ratios[-1]:.3f}]; within 10%: "
              f"{'yes' if abs(ratio - 1) <= 0.10 else 'NO'}")  # fmt: skip


if __name__ == "__main__":
    main()
