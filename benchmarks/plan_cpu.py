"""Does ``mmnnx plan``'s cost model predict a step measured on this machine's CPU?

A GPT on 2 stages of one CPU device each, 1F1B with 4 microbatches, laid out two ways:

- ``processes`` (the one the verdict is on): each stage in a process of its own, pinned to its
  own core before JAX starts, XLA's Eigen threads off (``pinned.launch``): each device owns its
  compute, as the cost model's devices do;
- ``one process``: both devices in one process, where XLA:CPU runs either device's program on
  both cores (benchmarks/HISTORY.md, "a core per stage"): the devices are not independent, and
  an action timed alone has the cores that in the step it shares.

The CPU's "device spec" is measured, not assumed: its FLOP/s is each stage's forward FLOPs (the
cost model's count) over that stage's forward measured one action at a time (``timeline()``,
median), efficiency 1; its ``backward`` the measured backward over forward; its optimizer update
each stage's update timed alone; its link the runner's own copy of each boundary's bytes
(``measure_transfers``); its host's time per program launched ``measure_launch_cost``
(``DeviceSpec.launch``, each task launched by its own process's host: ``processes``; one host
for both: ``one process``). From these the cost model composes the step (the schedule
simulated with its bubble, transfers and launches, then the update); the step is then timed as
a call runs it (started on every process together, ended once each has its results). Each
round's costs predict that round's step, (a) from actions timed alone, (b) from actions timed
in the running step (``overlapped_timeline()``, mean, the link as above). Target: (a) within
10% for ``processes`` (median over rounds). Also printed per round's median: an action's
duration in the running step over alone (1 where devices are independent) and the share of the
step's busy time in which both devices computed at once (do they run concurrently?).

Run: python benchmarks/plan_cpu.py [--rounds N] [--only processes|one]
"""

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import pinned  # noqa: E402

BATCH, MICROBATCHES = 32, 4
LAYOUTS = ("processes", "one")


def timed(call, rounds: int) -> list[float]:
    """Seconds of ``call()`` (which blocks until its results are ready), ``rounds`` times."""
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        out.append(time.perf_counter() - start)
    return out


def both_busy(events) -> float:
    """The share of the time some device computed in which both did (transfers left out)."""
    actions = [e for e in events if e.kind != "T"]
    points = sorted({t for e in actions for t in (e.start, e.end)})
    both = some = 0.0
    for a, b in zip(points, points[1:], strict=False):
        busy = {e.rank for e in actions if e.start <= (a + b) / 2 < e.end}
        some += (b - a) if busy else 0.0
        both += (b - a) if len(busy) > 1 else 0.0
    return both / some


def measure(rounds: int) -> dict | None:
    """This process's share of the measurements (see the module docstring); process 0 returns
    them, the others ``None``."""
    import jax
    import optax
    from flax import nnx
    from report import own_results

    import mmnnx as mm
    from mmnnx.models import GPT, GPTConfig
    from mmnnx.mpmd import schedules as sched
    from mmnnx.partition.cost import ClusterLayout, DeviceSpec, stage_costs, step_cost
    from mmnnx.train.generation import run_tasks
    from mmnnx.train.loop import TrainConfig, make_steps
    from mmnnx.train.run_model import run_placement

    config = GPTConfig(vocab_size=256, dim=128, depth=4, num_heads=4, max_seq_len=64,
                       mlp_ratio=4)  # fmt: skip
    gather = mm.distributed.gather
    rules = run_placement(config, run_tasks(2, 1, 1, 1), schedule="1f1b")
    model = mm.init(lambda: GPT(config, rngs=nnx.Rngs(0)), rules)
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    step, _ = make_steps(TrainConfig(microbatches=MICROBATCHES, schedule="1f1b"))
    shape = (BATCH, config.max_seq_len + 1)
    tokens = jax.random.randint(jax.random.key(0), shape, 0, config.vocab_size)
    args = (model, opt, tokens)
    own_results(step(*args))  # compiles
    grads = mm.jit(lambda m: jax.tree.map(lambda x: x * 0 + 1e-3, nnx.state(m, nnx.Param)))(model)
    update = mm.jit(lambda m, o, g: o.update(m, g))

    def update_once():
        update(model, opt, grads)
        own_results(nnx.state(model))

    def together() -> float:  # one step started by every process at once, over on all
        gather(0)
        start = time.perf_counter()
        own_results(step(*args))
        gather(0)
        return max(gather(time.perf_counter() - start))

    update_once()  # compiles
    launch = statistics.mean(gather(mm.schedules.measure_launch_cost(step, *args, calls=5)))
    schedule = step.plan(*args).pipeline.schedule
    link = statistics.mean(
        mm.schedules.measure_transfers(step, *args).transfer_costs(schedule).values()
    )
    # each process times the updates of the stages it holds (one process: both, then split by
    # their bytes; they run at once in the step as they do here)
    layout = ClusterLayout(stages=2, microbatches=MICROBATCHES, schedule="1f1b")
    processes = jax.process_count()
    unit = DeviceSpec(name="cpu", flops=1.0, memory=2**40, intra_bandwidth=1.0,
                      inter_bandwidth=1.0, node_size=2, memory_bandwidth=1.0,
                      efficiency=1.0, launch=launch)  # fmt: skip
    seq = config.max_seq_len
    counted = stage_costs(config, layout, unit, batch=BATCH, seq=seq)  # FLOPs and bytes
    own = statistics.median(timed(update_once, rounds))
    if processes == 1:
        updates = [own * b / sum(counted.updates) for b in counted.updates]
    else:
        updates = gather(own)

    def predict(actions, transfer, device=unit):
        costs = dataclasses.replace(counted, actions=actions, transfer=transfer,
                                    gathers=[0.0, 0.0], updates=updates)  # fmt: skip
        cost = step_cost(config, layout, device, batch=BATCH, seq=seq, costs=costs,
                         one_host=processes == 1)  # fmt: skip
        return cost.step_seconds

    rows = []
    for _ in range(rounds):  # interleaved: each round's costs predict that round's step
        alone = sched.measured_costs(step.timeline(*args))
        running = step.overlapped_timeline(*args)
        actions = sched.measured_costs(running, "mean")
        seconds = together()
        moved = statistics.mean(sched.measured_transfer_costs(running, "mean").values())
        rows.append({
            "step": seconds,
            "a": predict(alone, link) / seconds,
            "b": predict(actions, link) / seconds,
            "a without launches": predict(alone, link, dataclasses.replace(unit, launch=0.0))
            / seconds,
            "b with transfers timed in the step": predict(actions, moved) / seconds,
            "transfer in the step ms": moved * 1e3,
            "alone": {f"{k}{s}": v for (k, s), v in alone.items()},
            "in step / alone": statistics.median(actions[key] / alone[key] for key in alone),
            "both busy": both_busy(running),
            "both busy, simulated": both_busy(sched.simulate(schedule, action_costs=alone).events),
        })  # fmt: skip
    if jax.process_index():
        return None
    alone = rows[0]["alone"]
    return {
        "rows": rows,
        "forward GFLOP/s": [counted.actions[("F", s)] / alone[f"F{s}"] / 1e9 for s in range(2)],
        "B / F": [alone[f"B{s}"] / alone[f"F{s}"] for s in range(2)],
        "update ms": [u * 1e3 for u in updates],
        "link ms": link * 1e3,
        "launch ms": launch * 1e3,
    }


def worker(rounds: int) -> None:
    """One process of a layout: measures, and hands process 0's results back."""
    if os.environ.get("MMNNX_NUM_PROCESSES"):
        pinned.pin_to_own_core()
    import mmnnx as mm

    mm.distributed.initialize()
    result = measure(rounds)
    if os.environ.get("MMNNX_NUM_PROCESSES"):
        pinned.write_result(result)  # every process: launch waits for each one's
    else:
        print(json.dumps(result))


def run(layout: str, rounds: int) -> dict:
    """Process 0's results of ``layout`` (each in processes of its own)."""
    args = ["--worker", str(rounds)]
    if layout == "processes":
        return pinned.launch(__file__, args)[0]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    done = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    if done.returncode:
        raise SystemExit(f"{layout}: failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def spread(values, scale: float = 1.0, digits: int = 3) -> str:
    """``median [min-max]`` of ``values`` times ``scale``."""
    v = sorted(x * scale for x in values)
    return f"{statistics.median(v):.{digits}f} [{v[0]:.{digits}f}-{v[-1]:.{digits}f}]"


def report(layout: str, result: dict) -> float:
    """Prints ``layout``'s results; returns (a)'s median predicted / measured."""
    rows = result["rows"]
    column = {key: [row[key] for row in rows] for key in rows[0] if key != "alone"}
    print(f"{layout}: forward {[round(x, 1) for x in result['forward GFLOP/s']]} GFLOP/s per "
          f"stage, backward / forward {[round(x, 2) for x in result['B / F']]}, update "
          f"{[round(x, 2) for x in result['update ms']]} ms, link {result['link ms']:.3f} ms, "
          f"host {result['launch ms']:.3f} ms per launch")  # fmt: skip
    print(f"  step measured {spread(column['step'], 1e3, 1)} ms; in the step an action takes "
          f"{spread(column['in step / alone'], digits=2)} x its time alone; both devices "
          f"busy {spread(column['both busy'], digits=2)} of the busy time (simulated from (a): "
          f"{spread(column['both busy, simulated'], digits=2)})")  # fmt: skip
    for key, label in (("a", "(a) actions timed alone"), ("b", "(b) actions timed in the step")):
        print(f"  {label}: predicted / measured {spread(column[key])}")
    print(f"  checks: (a) without launches {spread(column['a without launches'])}; (b) with "
          f"the transfers timed in the step ({spread(column['transfer in the step ms'], digits=2)}"
          f" ms) {spread(column['b with transfers timed in the step'])}")  # fmt: skip
    return statistics.median(column["a"])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=LAYOUTS)
    parser.add_argument("--worker", type=int)
    options = parser.parse_args()
    if options.worker:
        return worker(options.worker)
    load = os.getloadavg()[0]
    verdict = None
    for layout in [options.only] if options.only else LAYOUTS:
        ratio = report(layout, run(layout, options.rounds))
        verdict = ratio if layout == "processes" else verdict
    print(f"cores {os.cpu_count()}, load {load:.1f} -> {os.getloadavg()[0]:.1f}, rounds "
          f"{options.rounds}")  # fmt: skip
    if verdict is not None:
        print(f"VERDICT: with a core per device, predicted from actions timed alone / measured "
              f"{verdict:.3f} (median of {options.rounds} rounds): within 10%: "
              f"{'yes' if abs(verdict - 1) <= 0.10 else 'NO'}")  # fmt: skip


if __name__ == "__main__":
    main()
