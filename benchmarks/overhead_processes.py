"""Issue 54 item 5 with a core per stage: ``pipeline_overhead.py``'s MLP (``overhead_mlp.py``:
8 parts of two ``Linear(256)``, 8 x 64 rows, M = 8) pipelined over two processes of one device
each, each pinned to its own core (``pinned.py``: ``mmnnx launch -n 2 --devices-per-process 1
--collectives gloo``, Eigen's threads off), against the data-parallel ``jax.jit`` step of the
same model over the same two processes (a 2-device mesh, one device per process, the batch
split, the gradients all-reduced through gloo).

Each process pins itself before its JAX backend starts (``pinned.pin_to_own_core``, as
partition.py's ``gpt_processes``: XLA:CPU then sizes its thread pools for one core); with
``--pin-after-start``, once it has started (its pools sized for both cores, all on one). One
launch; in each of ``--rounds`` rounds every candidate
once, in turn, each started by both processes together (a barrier) and timed per process over
``CALLS`` steps ended by waiting for the process's own results; a candidate's step is the
slower process's:

- GPipe, 1F1B, ZB-H1: step / data-parallel step (target for GPipe and 1F1B: <= 1.18, the bubble
  (M + S - 1) / M = 1.125 plus 5%), and step / the data-parallel step's compute alone (each
  process its half of the batch on its own device at once, nothing all-reduced: what data
  parallelism costs with a free all-reduce);
- for reference, on process 0 alone (process 1 waits at the barrier): the data-parallel step of
  the whole batch on its one device (against the compute alone: whether two pinned cores do
  twice one's work; against the two-process step: what gloo's all-reduce costs); and one
  stage's forward + backward per microbatch, timed one action at a time (``timeline``, the
  slower stage), so (M + S - 1) x it is the bubble-only step;
- where the time goes, GPipe and 1F1B, from an ``overlapped_timeline`` per round: per rank, its
  actions' time and the gaps before them waiting for the other rank to make an input, for the
  transfer bringing it, or for the host to launch the program (``overhead_mlp.waits``); each
  cross-process transfer's time in the running step against what the link measured for its
  bytes (``measure_transfers``); per process, the host's CPU time per launch
  (``measure_launch_cost``) and per step, and the cores it kept busy (CPU / wall).

Run: python benchmarks/overhead_processes.py [--rounds N] [--pin-after-start] (prints one JSON
line; ``python benchmarks/pipeline.py --only overhead_processes`` runs it both ways and records
its results).
"""

import sys

import pinned

LATE = "--pin-after-start"
if __name__ == "__main__" and sys.argv[1:2] == ["--worker"] and LATE not in sys.argv:
    pinned.pin_to_own_core()  # before JAX starts: XLA:CPU sizes its thread pools for one core

import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402
from overhead_mlp import MLP, WAITS, M, S, batch, loss_fn, pipelined, stage_time, waits  # noqa: E402
from report import (  # noqa: E402
    interleaved,
    median,
    own_results,
    per_call,
    ratio_spread,
    ratios,
    rounds_option,
    spread,
)

import mmnnx as mm  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "zero-bubble-h1")
ANALYSED = ("gpipe", "1f1b")
CALLS = 10  # steps per timed sample
DP = "data parallel, 2 processes"
DP_LOCAL = "data parallel's compute alone: each process its half of the batch, at once"
DP_ONE = "data parallel, process 0 alone, whole batch"


def measure(rounds: int, pin_after_start: bool = False) -> dict:
    """Launches the two pinned processes, and reads their samples (see the module docstring);
    ``pin_after_start``: each pins itself once its JAX backend has started, instead of before."""
    args = ["--worker", str(rounds), *([LATE] if pin_after_start else [])]
    ranks = pinned.launch(__file__, args, collectives="gloo")
    wall = {
        name: [max(r[name][i]["wall"] for r in ranks) for i in range(rounds)]
        for name in (DP, DP_LOCAL, *SCHEDULES)
    }
    wall[DP_ONE] = [s["wall"] for s in ranks[0][DP_ONE]]
    dp = wall[DP]
    analyses = ranks[0]["timelines"]  # every process gets every process's events
    t_stage = [a["stage"] for a in analyses]
    out: dict = {
        "layout": "2 processes of 1 device each, each pinned to its own core, gloo collectives",
        "pinned": "after the JAX backend started" if pin_after_start else "before it starts",
        f"{DP} step ms": spread(dp, 1e3),
        f"{DP_LOCAL} ms": spread(wall[DP_LOCAL], 1e3),
        f"{DP_ONE} / {DP_LOCAL} (2.0: two cores do twice one's work)": ratio_spread(
            wall[DP_ONE], wall[DP_LOCAL], 3
        ),
        f"{DP_ONE} step ms": spread(wall[DP_ONE], 1e3),
        f"{DP} / {DP_ONE}": ratio_spread(dp, wall[DP_ONE], 3),
        "ms per step beyond half the one-process step (gloo's all-reduce, the split)": spread(
            [d - one / 2 for d, one in zip(dp, wall[DP_ONE], strict=True)], 1e3
        ),
        "stage F + B per microbatch, one action at a time, ms": spread(t_stage, 1e3),
        "(M + S - 1) x stage / data parallel (the bubble alone)": ratio_spread(
            [(M + S - 1) * t for t in t_stage], dp, 3
        ),
        f"S x M x stage / {DP_ONE} (64-row microbatches against one 512-row batch)": (
            ratio_spread([S * M * t for t in t_stage], wall[DP_ONE], 3)
        ),
    }
    for name in SCHEDULES:
        out[f"{name}: step ms"] = spread(wall[name], 1e3)
        out[f"{name}: step / data parallel"] = ratio_spread(wall[name], dp, 3)
        out[f"{name}: step / {DP_LOCAL}"] = ratio_spread(wall[name], wall[DP_LOCAL], 3)
        out[f"{name}: step / (M + S - 1) x stage"] = ratio_spread(
            wall[name], [(M + S - 1) * t for t in t_stage], 3
        )
    for name in ANALYSED:
        out.update(_where_it_goes(name, [a[name] for a in analyses], wall[name]))
    for rank, got in enumerate(ranks):
        out[f"process {rank}: host CPU ms per launch, {', '.join(ANALYSED)}"] = ", ".join(
            f"{got['launch'][name] * 1e3:.3f}" for name in ANALYSED
        )
        for name in (DP, DP_LOCAL, *SCHEDULES):
            cpu = [s["cpu"] for s in got[name]]
            out[f"process {rank}, {name}: cores busy (CPU / wall)"] = ratio_spread(
                cpu, [s["wall"] for s in got[name]]
            )
            out[f"process {rank}, {name}: host thread CPU ms per step"] = spread(
                [s["host"] for s in got[name]], 1e3
            )
    for name in ANALYSED:
        out[f"target: {name} <= 1.18x data parallel (median)"] = (
            median(ratios(wall[name], dp)) <= 1.18
        )
        out[f"{name} <= 1.18x {DP_LOCAL} (median)"] = (
            median(ratios(wall[name], wall[DP_LOCAL])) <= 1.18
        )
    return out


def _where_it_goes(name: str, analyses: list[dict], wall: list[float]) -> dict:
    """The overlapped timelines' readings of schedule ``name``, one per round."""
    out = {
        f"{name}: overlapped timeline's span / step": ratio_spread(
            [a["span"] for a in analyses], wall, 3
        ),
        f"{name}: transfers per step": str(analyses[0]["transfers"]),
        f"{name}: ms per transfer in the running step (all rounds' transfers)": spread(
            [t for a in analyses for t in a["transfer s"]], 1e3, 3
        ),
        f"{name}: ms per transfer over the link (measured alone, its bytes)": spread(
            analyses[0]["link s"], 1e3, 3
        ),
    }
    for rank in sorted(analyses[0]["waits"]):
        for what, label in WAITS.items():
            out[f"{name}: {rank} {label} ms"] = spread(
                [a["waits"][rank][what] for a in analyses], 1e3
            )
    return out


def _timed(fn):
    """A candidate for ``interleaved``: after a barrier, ``CALLS`` calls of ``fn`` (``None``:
    none, this process only waits), the last one's results waited for; per call, wall seconds,
    the process's CPU seconds and its host thread's."""

    def sample() -> dict | None:
        mm.distributed.gather(0, what="barrier")
        if fn is None:
            return None
        cpu, host = time.process_time(), time.thread_time()
        wall = per_call(fn, CALLS, own_results)()
        return {
            "wall": wall,
            "cpu": (time.process_time() - cpu) / CALLS,
            "host": (time.thread_time() - host) / CALLS,
        }

    return sample


def _data_parallel(x, mesh):
    """The data-parallel step over ``mesh`` (parameters replicated, rows split), as a function
    of no arguments."""
    graphdef, state = nnx.split(MLP())

    def put(value, spec):
        host = np.asarray(value)
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    state = jax.tree.map(lambda v: put(v, PartitionSpec()), state)
    rows = put(x, PartitionSpec("data"))
    step = jax.jit(jax.value_and_grad(lambda s, x: loss_fn(nnx.merge(graphdef, s), x)))
    return lambda: step(state, rows)


def _timelines(steps: dict, x) -> dict:
    """One round's readings: a stage's F + B from GPipe's ``timeline``; per schedule of
    ``ANALYSED``, one ``overlapped_timeline``'s span, waits and cross-process transfers."""
    step, model = steps["gpipe"]
    out: dict = {"stage": stage_time(step.timeline(model, x))}
    for name in ANALYSED:
        step, model = steps[name]
        events = step.overlapped_timeline(model, x)
        moves = [e for e in events if e.kind == mm.schedules.TRANSFER]
        out[name] = {
            "span": max(e.end for e in events) - min(e.start for e in events),
            "waits": waits(events),
            "transfers": len(moves),
            "transfer s": [e.end - e.start for e in moves],
        }
    return out


def _worker(rounds: int) -> None:
    """One of the two processes: every candidate in ``rounds`` interleaved rounds."""
    mm.distributed.initialize()
    if LATE in sys.argv:
        jax.devices()  # the backend started, its thread pools sized for every core
        pinned.pin_to_own_core()
    x = batch()
    steps = {name: pipelined(name, x) for name in SCHEDULES}
    launch, links = {}, {}
    for name in ANALYSED:
        step, model = steps[name]
        launch[name] = mm.schedules.measure_launch_cost(step, model, x)
        schedule = step.plan(model, x).pipeline.schedule
        costs = mm.schedules.measure_transfers(step, model, x).transfer_costs(schedule)
        links[name] = list(costs.values())
    here = Mesh(np.array(jax.local_devices()[:1]), ("data",))
    half = len(x) // S
    own_half = x[jax.process_index() * half : (jax.process_index() + 1) * half]
    alone = _data_parallel(x, here) if jax.process_index() == 0 else None
    candidates = {
        DP: _timed(_data_parallel(x, Mesh(np.array(jax.devices()[:S]), ("data",)))),
        DP_LOCAL: _timed(_data_parallel(own_half, here)),
    }
    for name, (step, model) in steps.items():
        candidates[name] = _timed(functools.partial(step, model, x))
    candidates[DP_ONE] = _timed(alone)
    for candidate in candidates.values():  # compiled and warmed up
        candidate()
    candidates["timelines"] = lambda: _timelines(steps, x)
    candidates["timelines"]()
    runs = interleaved(candidates, rounds)
    for name in ANALYSED:
        for analysis in runs["timelines"]:
            analysis[name]["link s"] = links[name]
    runs["launch"] = launch
    pinned.write_result(runs)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(int(sys.argv[2]))
    else:
        print(json.dumps(measure(rounds_option(sys.argv), LATE in sys.argv)))
