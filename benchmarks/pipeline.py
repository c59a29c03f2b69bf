"""Pipeline efficiency of mm.jit + mm.microbatch, against baselines measured in the same run.

Two stages on single devices (0 and 1), M = 8 microbatches. XLA:CPU splits every large kernel
over all cores of the machine, so two stages that run big kernels cannot overlap on this 2-core
machine: one stage alone already fills both cores. Each stage here is therefore a stack of
elementwise layers applied to chunks of 16 rows in a `lax.scan`: small kernels, one core per stage,
so two stages overlap as on two accelerators. The backward pass is a scan of the same shape
(`jax.custom_vjp`: recompute a chunk, then its vjp): measured in plain JAX for one stage of 2048
rows, JAX's own transpose of the scan took 2.1x as long as this one and two stages of it overlapped
1.2-1.4x, against 1.7-2.0x with the chunk-scan backward.
- efficiency = ideal GPipe time (M + S - 1) * t_stage / measured step time (target >= 0.9), where
  t_stage is one stage's forward + backward time for one microbatch, timed action by action;
  measured for GPipe and again for 1F1B (same ideal: both idle (S - 1) slots per rank);
- speed-up over running the same actions without overlap (blocking after each) (target >= 1.4x);
- the same for 1F1B with each stage's output through ``nnx.Dropout(0.1)`` (its RNG count
  updated per microbatch: traced once and pipelined; target: the same efficiency);
- per schedule (every registered one, and the zero-bubble ones again built for the durations
  their first run measured: the model cut into four quarters, two per device, placed
  as one stage per device, looped for the interleaved ones or in a V for ZB-V and DualPipeV), the
  step time ``mm.schedules.simulate`` predicts from the step's own measured action durations,
  each value crossing between the devices taking what the link between them measured for its
  bytes (``measure_transfers``) and each program waiting for the host to launch it
  (``measure_launch_cost``, in the runner's order), against the measured step time (target:
  within 10%), from durations measured one action at a time (``timeline``) and from durations
  measured in the running pipeline (``overlapped_timeline``; and from these without transfers
  or launches), and the measured bubble against the analytic one (target: ZB-H1's
  below 1F1B's, ZB-V's below ZB-H1's), three ways: the work measured one action at a time
  against the step time, the work measured in the running pipeline against it, and the idle
  time of each rank as the step ran (``mm.schedules.measured_bubble`` of each
  ``overlapped_timeline``, one per round). The schedules' step times and in-pipeline
  durations are taken in interleaved rounds (each round runs every schedule once), so that the
  machine's load changing during the minutes this takes does not favour one schedule over
  another;
- the same for 1F1B, ZB-H1, interleaved 1F1B, ZB-V (and ZB-V built for the measured durations)
  and DualPipeV on ``MatmulQuarter`` layers, whose weight gradients are matmuls: a zero-bubble
  stage runs their backward scan as two (input gradient, then weight gradients), the split the
  zero-bubble paper's schedules assume (on the elementwise layers the weight gradients stay in
  the backward scan: see docs/pipelining.md);
- the same for 1F1B, ZB-H1 and ZB-V on matmul layers over four ranks, where the analytic
  bubbles lie further apart (1F1B 0.27, ZB-H1 0.11, ZB-V 0.06 at M = 8) than on two (0.11,
  0.04, 0.02); it needs a core per stage besides the host's, so it is skipped on fewer than 6;
- ``mm.schedules.tune``'s predicted ranking of GPipe, 1F1B and ZB-H1 against their measured
  step times (also timed in interleaved rounds);
- host overhead per action (step span minus device time, per action) at M = 4 and M = 32
  (target: flat);
- ``overhead``: the pipeline's own overhead, GPipe / 1F1B / ZB-H1 / ZB-V against the
  data-parallel step of the same MLP, and where the time beyond the bubble goes
  (``pipeline_overhead.py``, run in a process of its own with XLA's Eigen thread pool off;
  target: GPipe and 1F1B at most 1.18x data parallel);
- ``overhead_processes``: the same with each stage in a process of its own pinned to its own
  core, against data parallelism over the same two processes (``overhead_processes.py``); and
  ``overhead_processes, pinned after JAX started``, the processes pinned once their JAX
  backend has started instead of before.

Every timing is taken in interleaved rounds (``--rounds N``, default 5; the candidates of a
section take turns in each round) and reported as the median [min-max] over the rounds, a ratio
taken per round; targets are checked on the medians.

Run: python benchmarks/pipeline.py [--only SECTION ...] [--rounds N] (sections: the keys of
``SECTIONS``; with ``--only``, their results replace theirs in the file and the others stay).
Writes benchmarks/results/pipeline.json.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import functools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import overhead_processes as overhead_processes_harness  # noqa: E402
from flax import nnx  # noqa: E402
from report import (  # noqa: E402
    interleaved,
    median,
    only_sections,
    per_call,
    ratio_spread,
    results_path,
    rounds_option,
    run_sections,
    spread,
)

import mmnnx as mm  # noqa: E402

RESULTS = results_path("pipeline.json")
WIDTH, LAYERS, ROWS, CHUNK = 512, 24, 2048, 16
MATMUL_WIDTH, MATMUL_LAYERS = 256, 4


def layers(weights, chunk):
    for w in weights:  # a matmul layer's weight is a matrix, an elementwise one's a vector
        chunk = jnp.tanh((chunk @ w if w.ndim == 2 else chunk * w) + 0.1)
    return chunk


def by_chunks(h):
    return h.reshape(-1, CHUNK, h.shape[-1])


@jax.custom_vjp
def chunked_layers(weights, h):
    out = jax.lax.scan(lambda carry, chunk: (carry, layers(weights, chunk)), None, by_chunks(h))
    return out[1].reshape(h.shape)


def chunked_layers_fwd(weights, h):
    return chunked_layers(weights, h), (weights, h)


def chunked_layers_bwd(residuals, grad):
    weights, h = residuals

    def chunk_vjp(grad_weights, chunk_and_grad):
        chunk, chunk_grad = chunk_and_grad
        d_weights, d_chunk = jax.vjp(layers, weights, chunk)[1](chunk_grad)
        return jax.tree.map(jnp.add, grad_weights, d_weights), d_chunk

    zeros = jax.tree.map(jnp.zeros_like, weights)
    d_weights, d_h = jax.lax.scan(chunk_vjp, zeros, (by_chunks(h), by_chunks(grad)))
    return d_weights, d_h.reshape(h.shape)


chunked_layers.defvjp(chunked_layers_fwd, chunked_layers_bwd)


class Stage(nnx.Module):
    def __init__(self, rngs, dropout: bool = False, layers: int = LAYERS):
        self.w = nnx.List(
            [
                nnx.Param(1.0 + 0.1 * jax.random.normal(rngs.params(), (WIDTH,)))
                for _ in range(layers)
            ]
        )
        self.drop = nnx.Dropout(0.1, rngs=rngs) if dropout else None

    def __call__(self, h):
        h = chunked_layers([w[...] for w in self.w], h)
        return h if self.drop is None else self.drop(h)


class TwoStages(nnx.Module):
    def __init__(self, dropout: bool = False):
        self.a = Stage(nnx.Rngs(0), dropout)
        self.b = Stage(nnx.Rngs(1), dropout)

    def __call__(self, x):
        return self.b(self.a(x))


class MatmulQuarter(nnx.Module):
    """``MATMUL_LAYERS`` layers ``tanh(h @ w + 0.1)`` of width ``MATMUL_WIDTH``, by chunks as
    ``Stage``: each pass's work is matmuls, the weight gradients (``x.T @ g``) as costly as
    the forward, as in the transformer layers the zero-bubble paper schedules."""

    def __init__(self, rngs):
        scale = 0.5 / MATMUL_WIDTH**0.5
        self.w = nnx.List(
            [
                nnx.Param(
                    jnp.eye(MATMUL_WIDTH)
                    + scale * jax.random.normal(rngs.params(), (MATMUL_WIDTH, MATMUL_WIDTH))
                )
                for _ in range(MATMUL_LAYERS)
            ]
        )

    def __call__(self, h):
        return chunked_layers([w[...] for w in self.w], h)


class Parts(nnx.Module):
    """The same layers as ``TwoStages`` in ``2 * ranks`` modules, two per rank: on two ranks,
    four modules of half a stage each (or ``MatmulQuarter``s, as many as there are parts)."""

    def __init__(self, matmul: bool = False, ranks: int = 2):
        self.q = nnx.List(
            [
                MatmulQuarter(nnx.Rngs(i)) if matmul else Stage(nnx.Rngs(i), layers=LAYERS // 2)
                for i in range(2 * ranks)
            ]
        )

    def __call__(self, x):
        for quarter in self.q:
            x = quarter(x)
        return x


def part_rules(schedule, ranks=2, devices=None):
    """Plain schedules: parts 2r and 2r + 1 on rank r; interleaved: looped (part p on rank
    p mod R); ZB-V, DualPipeV: in a V (part p on rank p going down, on rank 2R - 1 - p coming
    back up as its second virtual stage). Rank r is device ``devices[r]`` (default r)."""
    devices = devices or range(ranks)
    tasks = [mm.Task(f"s{r}", mesh=mm.TaskMesh(devices=[devices[r]])) for r in range(ranks)]
    parts = range(2 * ranks)
    if schedule in ("zero-bubble-v", "dualpipev"):
        order = [
            tasks[p] if p < ranks else tasks[2 * ranks - 1 - p].virtual_stage(1) for p in parts
        ]
        virtual = 2
    elif schedule.startswith("interleaved"):
        order, virtual = [tasks[p % ranks] for p in parts], 2
    else:
        order, virtual = [tasks[p // 2] for p in parts], 1
    return [(f"^q/{p}/", t) for p, t in enumerate(order)], virtual


def loss_fn(model, x):
    return jnp.mean(model(x) ** 2)


def build(num, schedule="gpipe", dropout=False):
    s0 = mm.Task("s0", mesh=mm.TaskMesh(devices=[0]))
    s1 = mm.Task("s1", mesh=mm.TaskMesh(devices=[1]))
    model = mm.place(TwoStages(dropout), [("^a/", s0), ("^b/", s1)])
    step = mm.jit(
        mm.microbatch(nnx.value_and_grad(loss_fn), num=num, reduce="mean", schedule=schedule)
    )
    x = jax.random.normal(jax.random.key(2), (num * ROWS, WIDTH))
    return step, model, x


def build_quarters(num, schedule, placed_as=None, matmul=False, ranks=2, devices=None):
    rules, virtual = part_rules(placed_as or schedule, ranks, devices)
    model = mm.place(Parts(matmul, ranks), rules)
    grad_fn = mm.microbatch(
        nnx.value_and_grad(loss_fn),
        num=num,
        reduce="mean",
        schedule=schedule,
        virtual_stages=virtual,
    )
    x = jax.random.normal(jax.random.key(2), (num * ROWS, MATMUL_WIDTH if matmul else WIDTH))
    return mm.jit(grad_fn), model, x


def step_seconds(step, *args):
    """A candidate for ``interleaved``: seconds of one call of ``step(*args)``."""
    return per_call(lambda: step(*args), 1, jax.block_until_ready)


def efficiency(rounds: int, num=8, schedule="gpipe", dropout=False):
    """Per round: one step's time, and one ``timeline`` (each action run to completion alone):
    its span (the actions without overlap) and the stage time (the slower stage's median forward
    plus median backward over its microbatches); efficiency and speed-up taken per round."""
    step, model, x = build(num, schedule, dropout)
    jax.block_until_ready(step(model, x))
    step.timeline(model, x)  # warmed up

    def timeline_round() -> tuple[float, float]:
        events = step.timeline(model, x)
        per_action = {}
        for e in events:
            per_action.setdefault((e.task, e.kind), []).append(e.end - e.start)
        t_stage = max(
            statistics.median(per_action[(task, "F")]) + statistics.median(per_action[(task, "B")])
            for task in ("s0", "s1")
        )
        return max(e.end for e in events) - min(e.start for e in events), t_stage

    runs = interleaved({"step": step_seconds(step, model, x), "timeline": timeline_round}, rounds)
    t_step = runs["step"]
    blocking = [b for b, _ in runs["timeline"]]
    ideal = [(num + 2 - 1) * t for _, t in runs["timeline"]]
    return {
        "microbatches": num,
        "t_stage ms": spread([t for _, t in runs["timeline"]], 1e3),
        "ideal GPipe ms": spread(ideal, 1e3, 1),
        "measured step ms": spread(t_step, 1e3, 1),
        "blocking (no overlap) ms": spread(blocking, 1e3, 1),
        "pipeline efficiency": ratio_spread(ideal, t_step),
        "speed-up over no overlap": ratio_spread(blocking, t_step),
        "compiled programs": step.plan(model, x).num_programs,
        "pipelined (not unrolled)": not step.plan(model, x).unrolled,
    }


def predicted_from(events, schedule, **options) -> float:
    """The step ``simulate`` predicts for ``schedule`` from one overlapped timeline's mean
    durations (taken right after the round's step: the machine's load alike), ``options``
    (transfer costs, launch cost, processes) passed on."""
    return mm.schedules.simulate(
        schedule,
        action_costs=every_action_costed(events, schedule, "mean"),
        pair_costs=mm.schedules.measured_pair_costs(events, "mean"),
        **options,
    ).makespan


def every_action_costed(events, schedule, average):
    """``measured_costs`` of ``events`` (from runs of ``step.timeline`` or
    ``step.overlapped_timeline``), with every action of ``schedule`` costed: a pass with no ops
    (stage 0's I) runs nothing and costs 0."""
    costs = mm.schedules.measured_costs(events, average=average)
    for row in schedule.actions:
        for a in row:
            costs.setdefault((a.kind, a.stage), 0.0)
    return costs


MATMUL_SCHEDULES = ("1f1b", "zero-bubble-h1", "interleaved-1f1b", "zero-bubble-v", "dualpipev")


def measured_vs_simulated(rounds: int, num=8, matmul=False, ranks=2, names=None):
    """Per schedule: the step time ``simulate`` predicts from the durations the step's own
    timelines measured, against the measured step time, twice:

    - from ``timeline()`` (each action run alone, ``rounds`` timelines; median per action kind
      and stage);
    - from ``overlapped_timeline()`` (the step run as a call runs it; mean per kind and stage):
      "in-pipeline durations", which include what the stages slow each other down by when they
      share the machine's cores (on this 2-core machine the host thread shares them too); each
      round's own, taken right after its step, predicts that round's step (the machine's load
      swings between rounds, and the two then see it alike);

    each with the transfers over the links measured between the tasks (``measure_transfers``:
    the runner's own copy of each boundary's bytes) and the host's launches
    (``measure_launch_cost``, in the order the runner launches them); the second also without
    either, as before transfers were timed apart from the actions reading them;

    and the bubble (idle share of the ranks' time in the measured step) from either set of
    durations, and as the step ran (the gaps between each rank's actions in each overlapped
    run: ``measured_bubble``), against the analytic one (F = 1, B = 2).

    ``matmul``: on ``MatmulQuarter``s, whose weight gradients are matmuls that a zero-bubble
    stage defers (its backward scan split in two), for ``MATMUL_SCHEDULES``; else on the
    elementwise quarters for every registered schedule, whose weight gradients (a product and
    a sum per layer) stay in the backward scan. ``ranks``: the layers in ``2 * ranks`` parts,
    two per rank (see :func:`part_rules`); ``names``: only these schedules.

    The step times, one overlapped timeline per step and the bubble as it ran are taken in
    ``rounds`` interleaved rounds, every schedule once per round; each step time, prediction
    / measured step and bubble is reported as median [min-max] over the rounds (the predicted
    step, from the durations pooled over the rounds, against each round's step), and the
    targets are checked on the medians."""
    out = {}
    measured_costs = {}
    if matmul:
        names, built_for_costs = names or MATMUL_SCHEDULES, ("zero-bubble-v",)
    else:
        names = names or mm.schedules.names()
        built_for_costs = ("zero-bubble-h2", "zero-bubble-v", "interleaved-zero-bubble")
    runs = [(name, name) for name in names]
    runs += [(f"{name} (built for measured costs)", name) for name in built_for_costs]
    if not matmul:
        runs.append(("dualpipev (fused pairs)", "dualpipev"))
    built, alone, alone_pairs = {}, {}, {}
    for label, name in runs:  # built in order: a schedule built for costs needs its plain one's
        schedule = name
        if label == "dualpipev (fused pairs)":  # each overlapped pair one program
            schedule = mm.schedules.dualpipe_v(ranks, num, fuse_pairs=True)
        elif label != name:  # the same schedule, its passes ordered for the durations measured
            _, v = part_rules(name, ranks)
            schedule = mm.schedules.get(name, ranks * v, num, v, costs=measured_costs[name])
        step, model, x = build_quarters(num, schedule, placed_as=name, matmul=matmul, ranks=ranks)
        schedule = step.plan(model, x).pipeline.schedule
        built[label] = (step, model, x, schedule)
        events = [e for _ in range(rounds) for e in step.timeline(model, x)]
        alone[label] = every_action_costed(events, schedule, "median")
        alone_pairs[label] = mm.schedules.measured_pair_costs(events, "median")
        if label == name:
            measured_costs[name] = {key: max(c, 1e-6) for key, c in alone[label].items()}
    # What the host and the links cost each step: its launches (a call that also warms it up)
    # and the link each stage boundary crosses with the bytes it moves.
    hosts = {
        label: (
            mm.schedules.measure_launch_cost(step, model, x, calls=1),
            mm.schedules.measure_transfers(step, model, x),
        )
        for label, (step, model, x, _) in built.items()
    }
    # The step times and the in-pipeline durations that the bubbles compare, taken in rounds
    # across every schedule: a change in the machine's load while they run lands on all of
    # them alike.

    def one_round(step, model, x) -> tuple[float, list]:
        """One step's seconds, then one overlapped timeline's events."""
        seconds = step_seconds(step, model, x)()
        return seconds, step.overlapped_timeline(model, x)

    runs = interleaved(
        {label: functools.partial(one_round, *b[:3]) for label, b in built.items()}, rounds
    )
    samples = {label: [t for t, _ in got] for label, got in runs.items()}
    overlapped = {label: [e for _, events in got for e in events] for label, got in runs.items()}
    as_it_ran = {  # measured_bubble of each overlapped run
        label: [mm.schedules.measured_bubble(events) for _, events in got]
        for label, got in runs.items()
    }
    medians = {}  # what the targets are checked on
    for label, (_, _, _, schedule) in built.items():
        t_step = samples[label]
        virtual = schedule.num_stages // schedule.num_ranks
        costs = alone[label]
        in_pipeline = every_action_costed(overlapped[label], schedule, "mean")
        # each value crossing between the devices takes what its link measured for its bytes,
        # each program waits for the host to launch it; a pair run as one program costs what
        # it took whole (fused DualPipeV), not its halves
        launch, transfers = hosts[label]
        options = transfers.simulate_options(schedule, launch)
        predicted = mm.schedules.simulate(
            schedule, action_costs=costs, pair_costs=alone_pairs[label], **options
        )
        predicted_in_pipeline = mm.schedules.simulate(
            schedule,
            action_costs=in_pipeline,
            pair_costs=mm.schedules.measured_pair_costs(overlapped[label], "mean"),
            **options,
        )

        paired = [(events, t) for (_, events), t in zip(runs[label], t_step, strict=True)]
        moved = mm.schedules.measured_transfer_costs(overlapped[label], "mean")
        busy = sum(e.end - e.start for e in predicted.events)
        busy_in_pipeline = sum(e.end - e.start for e in predicted_in_pipeline.events)
        kinds = {}
        for (kind, _), seconds in costs.items():
            kinds.setdefault(kind, []).append(seconds * 1e3)
        out[f"{label}: ms per action, mean over stages"] = {
            kind: round(statistics.mean(ms), 2) for kind, ms in sorted(kinds.items())
        }
        out[f"{label}: in-pipeline ms per action and stage"] = {
            f"{kind}{stage}": round(seconds * 1e3, 2)
            for (kind, stage), seconds in sorted(in_pipeline.items(), key=lambda kv: kv[0][::-1])
        }
        out[f"{label}: ms per transfer, over its link (in pipeline)"] = {
            f"{kind}{stage}": f"{seconds * 1e3:.2f} ({moved.get((kind, stage), 0) * 1e3:.2f})"
            for (kind, stage), seconds in sorted(options["transfer_costs"].items())
        }
        out[f"{label}: host ms per launch"] = round(launch * 1e3, 3)
        # no schedule of these actions ends before its busiest rank's work does
        busiest = max(sum(in_pipeline[a.kind, a.stage] for a in row) for row in schedule.actions)
        per_round = {
            "busiest rank's in-pipeline work / step": [busiest / t for t in t_step],
            "predicted / measured step": [predicted.makespan / t for t in t_step],
            "predicted from in-pipeline durations / measured step": [
                predicted_from(events, schedule, **options) / t for events, t in paired
            ],
            "predicted from in-pipeline durations, no transfers or launches / measured step": [
                predicted_from(events, schedule) / t for events, t in paired
            ],
            "predicted from in-pipeline durations and transfers / measured step": [
                predicted_from(events, schedule, **{**options, "transfer_costs": transfer}) / t
                for events, t in paired
                for transfer in [mm.schedules.measured_transfer_costs(events, "mean")]
            ],
            "bubble measured": [1 - busy / (schedule.num_ranks * t) for t in t_step],
            "bubble in pipeline": [1 - busy_in_pipeline / (schedule.num_ranks * t) for t in t_step],
            "bubble as it ran": as_it_ran[label],
        }
        out[f"{label}: step ms"] = spread(t_step, 1e3, 1)
        for measure, values in per_round.items():
            out[f"{label}: {measure}"] = spread(values, digits=3)
            medians[f"{label}: {measure}"] = median(values)
        analytic = mm.schedules.simulate(schedule, 1 / virtual, 2 / virtual).bubble_fraction
        out[f"{label}: bubble analytic"] = float(analytic)
    for durations, suffix in (
        ("", "predicted / measured step"),
        (
            " from in-pipeline durations, transfers and launches",
            "predicted from in-pipeline durations / measured step",
        ),
    ):
        out[f"target: every prediction{durations} within 10% (medians)"] = all(
            abs(v - 1) <= 0.1 for k, v in medians.items() if k.endswith(suffix)
        )
    for measure in ("bubble measured", "bubble in pipeline", "bubble as it ran"):
        bubble = {n: medians[f"{n}: {measure}"] for n in names}
        tuned_v = medians[f"zero-bubble-v (built for measured costs): {measure}"]
        out[f"target ({measure}): ZB-H1 below 1F1B"] = bubble["zero-bubble-h1"] < bubble["1f1b"]
        out[f"target ({measure}): ZB-V below ZB-H1"] = (
            bubble["zero-bubble-v"] < bubble["zero-bubble-h1"]
        )
        out[f"target ({measure}): ZB-V built for measured costs below ZB-H1"] = (
            tuned_v < bubble["zero-bubble-h1"]
        )
    if not matmul:
        out["DualPipeV step, fused pairs / two programs"] = ratio_spread(
            samples["dualpipev (fused pairs)"], samples["dualpipev"]
        )
    return out


def zero_bubble_on_matmul_layers(rounds: int, num=8):
    """:func:`measured_vs_simulated` on matmul layers, whose weight gradients zero-bubble
    schedules defer."""
    return measured_vs_simulated(rounds, num, matmul=True)


def zero_bubble_on_four_ranks(rounds: int, num=8):
    """:func:`measured_vs_simulated` on matmul layers over four single-device ranks, for 1F1B,
    ZB-H1 and ZB-V: on two ranks the analytic bubbles of ZB-H1 and ZB-V differ by 2% of the
    step (0.04 against 0.02 at M = 8), within this benchmark's noise; on four, by 5% (0.11
    against 0.06; 1F1B 0.27). Four stages need a core each besides the host thread's, so on a
    machine of fewer than 6 cores this is skipped."""
    cores = os.cpu_count() or 1
    if cores < 6:
        return {
            "skipped": f"four single-core stages and the host thread need 6 cores, {cores} here"
        }
    names = ("1f1b", "zero-bubble-h1", "zero-bubble-v")
    return measured_vs_simulated(rounds, num, matmul=True, ranks=4, names=names)


def tuner_ranking(rounds: int, num=8):
    """``mm.schedules.tune`` on the benchmark step: its predicted step times for GPipe, 1F1B and
    ZB-H1 against each one's measured step, and whether the predicted order is the measured one
    (predictions within 2% of each other count as a tie, either order agreeing)."""
    step, model, x = build(num, "gpipe")
    names = ("gpipe", "1f1b", "zero-bubble-h1")
    tuned = mm.schedules.tune(step, model, x, schedules=names)
    predicted = {c.schedule: c.predicted_seconds for c in tuned.candidates}
    steps = {name: build(num, name) for name in names}
    for step, model, x in steps.values():
        jax.block_until_ready(step(model, x))
    samples = interleaved({name: step_seconds(*s) for name, s in steps.items()}, rounds)
    measured = {name: median(times) for name, times in samples.items()}
    agree = all(
        abs(predicted[a] - predicted[b]) <= 0.02 * max(predicted[a], predicted[b])
        or (predicted[a] < predicted[b]) == (measured[a] < measured[b])
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    )
    out = {f"{n}: predicted ms": predicted[n] * 1e3 for n in names}
    out.update({f"{n}: measured ms": spread(samples[n], 1e3, 1) for n in names})
    out["tuner's choice"] = tuned.best.schedule
    out["measured fastest"] = min(measured, key=measured.get)
    out["predicted order agrees with measured (medians)"] = agree
    return out


def host_overhead(rounds: int):
    """Host time between actions: a step's span minus its actions' and transfers' device time,
    per action, at M = 4 and M = 32, one timeline of each per round.

    Measured in timeline mode (each action and transfer timed to completion), so device time is
    exact and the remainder is the executor's own work: dispatch, bookkeeping.
    """
    built = {num: build(num) for num in (4, 32)}

    def per_action(step, model, x) -> float:
        events = step.timeline(model, x)
        span = max(e.end for e in events) - min(e.start for e in events)
        busy = sum(e.end - e.start for e in events)
        return (span - busy) / sum(e.kind != mm.schedules.TRANSFER for e in events)

    for step, model, x in built.values():
        jax.block_until_ready(step(model, x))
        step.timeline(model, x)  # warmed up
    out = interleaved({num: functools.partial(per_action, *b) for num, b in built.items()}, rounds)
    return {
        "host us per action (M=4)": spread(out[4], 1e6, 0),
        "host us per action (M=32)": spread(out[32], 1e6, 0),
        "growth M=4 -> M=32": ratio_spread(out[32], out[4]),
    }


def overhead(rounds: int) -> dict:
    """``pipeline_overhead.py`` in a fresh process (its XLA flags set before JAX starts there):
    the pipelined MLP against data parallelism, and where the time beyond the bubble goes."""
    script = pathlib.Path(__file__).with_name("pipeline_overhead.py")
    done = subprocess.run(
        [sys.executable, str(script), "--rounds", str(rounds)],
        capture_output=True,
        text=True,
        check=False,
        cwd=script.parent,
    )
    if done.returncode != 0:
        raise SystemExit(f"{script.name} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def overhead_processes(rounds: int, pin_after_start: bool = False) -> dict:
    """``overhead_processes.py``: the same MLP with each stage in a process of its own, pinned
    to its own core, against data parallelism over the same two processes."""
    return overhead_processes_harness.measure(rounds, pin_after_start)


SECTIONS = {
    "efficiency": efficiency,
    "efficiency 1f1b": lambda rounds: efficiency(rounds, schedule="1f1b"),
    "efficiency 1f1b, dropout": lambda rounds: efficiency(rounds, schedule="1f1b", dropout=True),
    "measured vs simulated": measured_vs_simulated,
    "zero bubble on matmul layers": zero_bubble_on_matmul_layers,
    "zero bubble on four ranks": zero_bubble_on_four_ranks,
    "tuner": tuner_ranking,
    "host": host_overhead,
    "overhead": overhead,
    "overhead_processes": overhead_processes,
    "overhead_processes, pinned after JAX started": lambda rounds: overhead_processes(rounds, True),
}


def main(only: list[str] | None, rounds: int):
    """Runs every section, or those in ``only`` (their results replace theirs in the file)."""
    run_sections(SECTIONS, RESULTS, "pipeline", only, str(jax.devices()[0]), rounds)


if __name__ == "__main__":
    main(only_sections(sys.argv), rounds_option(sys.argv))
