"""Several processes: the pipeline benchmark's two single-core stages, one per process.

Two processes of one CPU device each (`mmnnx launch -n 2 --devices-per-process 1`), the model of
benchmarks/pipeline.py (stage s0 on process 0, s1 on process 1), M = 8, 1F1B. Measured against
baselines taken in the same run:
- time per step vs the same layout in one process (two devices) (the cost of processes);
- pipeline efficiency vs ideal: (M + S - 1) * t_stage / step time, t_stage (one stage's F + B
  for one microbatch) timed action by action in the one-process run;
- transfer: a microbatch's round trip across the stage boundary (ROWS x WIDTH float32, 4 MiB, to
  s1 and back, between three elementwise programs), vs the same programs hand-written around the
  chosen mechanism (`jax.experimental.transfer` offer + pull, no mmnnx) (target <= 1.2x).

Run: python benchmarks/multiprocess.py (starts the processes itself).
Writes benchmarks/results/multiprocess.json.
"""

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).parent
RESULTS = HERE / "results" / "multiprocess.json"
MICROBATCHES = 8


def pipeline_numbers() -> dict:
    """Step time and this process's stage time (F + B per microbatch) of the 1F1B step."""
    import jax
    from pipeline import build, median_time

    import mmnnx as mm

    step, model, x = build(MICROBATCHES, "1f1b")

    def run():
        out = step(model, x)
        return [a for a in jax.tree.leaves(out) if a.is_fully_addressable]

    t_step = median_time(run)
    per_action: dict = {}
    for _ in range(5):
        for e in step.timeline(model, x):
            per_action.setdefault((e.task, e.kind), []).append(e.end - e.start)
    median = statistics.median
    stages = {
        task: median(per_action[(task, "F")]) + median(per_action[(task, "B")])
        for task in {t for t, _ in per_action}
    }
    mm.distributed.fetch(jax.numpy.zeros(()))  # everyone done before the next measurement
    return {"t_step": t_step, "t_stage": stages}


def transfer_numbers() -> dict:
    """A microbatch's round trip (activation to s1, its answer back to s0, as a forward pass and
    its cotangent cross a stage boundary) through mm.jit vs hand-written around the transfer
    server: rank 0's time per step, which waits for the answer, so both sides run in lock-step."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import SingleDeviceSharding
    from pipeline import ROWS, WIDTH, median_time

    import mmnnx as mm
    from mmnnx.distributed.transport import transport

    s0 = mm.Task("s0", mesh=mm.TaskMesh(devices=[0]))
    s1 = mm.Task("s1", mesh=mm.TaskMesh(devices=[1]))

    class Scale(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.full((WIDTH,), 1.01))

    a, b = mm.place(Scale(), [(".*", s0)]), mm.place(Scale(), [(".*", s1)])
    x = jnp.ones((ROWS, WIDTH))

    @mm.jit
    def round_trip(a, b, x):
        there = jnp.tanh(a.w[...] * x)  # on s0
        back = jnp.tanh(b.w[...] * there)  # on s1
        return jnp.tanh(a.w[...] * back)  # on s0

    def through_mmnnx():
        return [o for o in [round_trip(a, b, x)] if o.is_fully_addressable]

    me = jax.process_index()
    d0 = [d for d in jax.devices() if d.process_index == 0][0]
    d1 = [d for d in jax.devices() if d.process_index == 1][0]
    layer = jax.jit(lambda w, h: jnp.tanh(w * h))
    wa, wb = a.w.get_value(), b.w.get_value()
    x0 = jax.device_put(x, d0) if me == 0 else None

    def spec(device):
        layout = SingleDeviceSharding(device)
        return jax.ShapeDtypeStruct((ROWS, WIDTH), jnp.float32, sharding=layout)

    def by_hand():
        if me == 0:
            transport().send(1, [layer(wa, x0)])
            (back,) = transport().receive(1, [spec(d0)])
            return [layer(wa, back)]
        (there,) = transport().receive(0, [spec(d1)])
        transport().send(0, [layer(wb, there)])
        return []

    # alternating blocks, so a slow spell of this shared machine falls on both alike
    samples: dict[str, list[float]] = {"mm.jit": [], "by hand": []}
    for _ in range(20):
        for name, fn in (("mm.jit", through_mmnnx), ("by hand", by_hand)):
            samples[name].append(median_time(fn, repeats=15))
            mm.distributed.fetch(jnp.zeros(()))
    return {name: statistics.median(times) for name, times in samples.items()}


def worker(out_dir: str) -> None:
    import jax

    import mmnnx as mm

    mm.distributed.initialize()
    result = {"pipeline": pipeline_numbers()}
    if jax.process_count() > 1:
        result["transfer"] = transfer_numbers()
    me = jax.process_index()
    pathlib.Path(out_dir, f"rank{me}.json").write_text(json.dumps(result))


def main() -> None:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as alone, tempfile.TemporaryDirectory() as together:
        single = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=2")
        subprocess.run(
            [sys.executable, __file__, "--worker", alone], env=single, check=True, timeout=900
        )
        subprocess.run(
            [sys.executable, "-m", "mmnnx", "launch", "-n", "2", "--devices-per-process", "1",
             "--", sys.executable, __file__, "--worker", together],
            env=env, check=True, timeout=900,
        )  # fmt: skip
        one = json.loads(pathlib.Path(alone, "rank0.json").read_text())
        ranks = [json.loads(pathlib.Path(together, f"rank{i}.json").read_text()) for i in (0, 1)]
    t_one = one["pipeline"]["t_step"]
    t_two = max(r["pipeline"]["t_step"] for r in ranks)
    # stage time from the one-process run: timed there, an action's inputs are on its devices;
    # in a process of its own, an action's timed span also holds the wait for its peer's data
    t_stage = max(one["pipeline"]["t_stage"].values())
    ideal = (MICROBATCHES + 2 - 1) * t_stage
    hop = ranks[0]["transfer"]  # rank 0 waits for the round trip
    results = {
        "pipeline": {
            "microbatches": MICROBATCHES,
            "one process ms": t_one * 1e3,
            "two processes ms": t_two * 1e3,
            "two processes / one process": t_two / t_one,
            "t_stage ms (slowest stage, one process)": t_stage * 1e3,
            "ideal ms": ideal * 1e3,
            "pipeline efficiency, one process": ideal / t_one,
            "pipeline efficiency, two processes": ideal / t_two,
        },
        "transfer": {
            "4 MiB round trip, mm.jit ms": hop["mm.jit"] * 1e3,
            "4 MiB round trip, by hand over jax.experimental.transfer ms": hop["by hand"] * 1e3,
            "mm.jit / by hand (target <= 1.2)": hop["mm.jit"] / hop["by hand"],
        },
    }
    from report import publish

    publish(results, RESULTS, "multiprocess", ("pipeline", "transfer"))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2])
    else:
        main()
