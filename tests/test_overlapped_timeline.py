"""``overlapped_timeline``: a step timed as a call runs it (tasks overlapping), against the
schedule's order, the step's own results and a normal call's updates."""

import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.mpmd.run.timing import OverlapTimer
from tests.models import four_tasks, one_device_tasks, placed_gpt
from tests.oracle import close

M = 8


@pytest.fixture(scope="module")
def tasks():
    return four_tasks()


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(0), (M, 9), 0, 32)


def loss_fn(model, tokens):
    return model.loss(tokens)


def train_step(schedule):
    def step(model, opt, tokens):
        grad_fn = mm.microbatch(
            nnx.value_and_grad(loss_fn), num=M, reduce="mean", schedule=schedule
        )
        loss, grads = grad_fn(model, tokens)
        opt.update(model, grads)
        return loss

    return step


def timers_running():
    return [t for t in threading.enumerate() if t.name.startswith("mmnnx-timer")]


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h1"])
def test_overlapped_timeline_follows_the_schedule_and_updates_as_a_call(tasks, tokens, schedule):
    model, twin = placed_gpt(tasks), placed_gpt(tasks)
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    twin_opt = nnx.Optimizer(twin, optax.adamw(3e-3), wrt=nnx.Param)
    step = mm.jit(train_step(schedule))
    interval = sys.getswitchinterval()
    timed = step.overlapped_timeline(model, opt, tokens)
    assert sys.getswitchinterval() == interval
    assert not timers_running()
    events = [e for e in timed if e.kind != "T"]
    transfers = {(e.carries, e.stage, e.microbatch): e for e in timed if e.kind == "T"}

    pipeline = step.plan(model, opt, tokens).pipeline
    schedule_table = pipeline.schedule
    cut = {label[1:3] for label in pipeline.parts.values()}  # actions run as several programs

    def runs(a):  # stage 0 has no input gradient to make: its I runs nothing
        return (a.kind, a.stage) != ("I", 0)

    expected = sorted(
        (f"t{schedule_table.stage_to_rank[a.stage]}", a.kind, a.stage, a.microbatch)
        for rank in range(schedule_table.num_ranks)
        for a in schedule_table.actions_of(rank)
        if runs(a)
    )
    assert sorted((e.task, e.kind, e.stage, e.microbatch) for e in events) == expected
    assert all(e.end >= e.start >= e.launched >= 0 for e in timed)
    assert all(e.rank == e.task for e in timed)
    assert 0 <= mm.schedules.measured_bubble(timed) == mm.schedules.measured_bubble(events) < 1
    # a rank runs one program at a time, in the schedule's order
    for rank in range(schedule_table.num_ranks):
        mine = sorted((e for e in events if e.task == f"t{rank}"), key=lambda e: e.start)
        order = [
            (a.kind, a.stage, a.microbatch) for a in schedule_table.actions_of(rank) if runs(a)
        ]
        assert [(e.kind, e.stage, e.microbatch) for e in mine] == order
        assert all(b.start >= a.end for a, b in zip(mine, mine[1:], strict=False))
    # an action starts once what it reads is made and has crossed to its devices: forwards
    # after the previous stage's, backwards (input gradients) after the next stage's, each
    # value's transfer (timed apart from its reader) in between
    at = {(e.kind, e.stage, e.microbatch): e for e in events}
    back = "B" if schedule == "1f1b" else "I"
    crossings = [(kind, stage, m) for kind, stage, m in at if (kind, stage) in
                 {*(("F", s) for s in range(3)), *((back, s) for s in range(1, 4))}]  # fmt: skip
    assert sorted(transfers) == sorted(crossings)
    for (kind, stage, m), moved in transfers.items():
        to = stage + 1 if kind == "F" else stage - 1
        reader = at.get((kind, to, m)) or at[("W", to, m)]  # stage 0's I runs nothing
        assert (moved.source, moved.rank) == (at[(kind, stage, m)].rank, reader.rank)
        made = at[(kind, stage, m)]  # a cut action's value may leave before its last part ends
        assert (made.start if (kind, stage) in cut else made.end) <= moved.start
        # and a cut reader may start with its part before the core, before the value arrives
        early = (reader.kind, reader.stage) in cut
        assert moved.start <= moved.end <= (reader.end if early else reader.start)
    # the run was a step: the model and optimizer moved as a normal call moves them
    step(twin, twin_opt, tokens)
    for a, b in zip(
        jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(twin)), strict=True
    ):
        close(a, b)
    # and the costs it measured feed the simulator
    costs = mm.schedules.measured_costs(events, average="mean")
    assert set(costs) == {(a.kind, a.stage) for row in schedule_table.actions for a in row}
    if schedule == "zero-bubble-h1":  # stage 0's I ran nothing: no event, no time
        assert costs[("I", 0)] == 0.0
    assert mm.schedules.simulate(schedule_table, action_costs=costs).makespan > 0


def test_cached_partial_overlapped_timeline_times_the_same_actions(tasks, tokens):
    model = placed_gpt(tasks)
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    bound = mm.cached_partial(mm.jit(train_step("1f1b")), model, opt)
    overlapped = bound.overlapped_timeline(tokens)
    alone = bound.timeline(tokens)
    assert sorted((e.task, e.kind, e.stage, e.microbatch) for e in overlapped) == sorted(
        (e.task, e.kind, e.stage, e.microbatch) for e in alone
    )
    assert len([e for e in overlapped if e.kind != "T"]) == 2 * 4 * M


def test_overlapped_timeline_of_a_failing_step_raises_and_stops_its_watchers():
    s0, s1 = one_device_tasks(2)
    model = mm.place(
        nnx.Sequential(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.Linear(32, 16, rngs=nnx.Rngs(1))),
        [("layers/0", s0), ("layers/1", s1)],
    )
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) / 100
    armed = {"on": True}

    def tripwire(x):
        if armed["on"]:
            raise RuntimeError("tripwire")

    def failing_loss(model, x):
        jax.debug.callback(tripwire, x)
        return jnp.mean(model(x) ** 2)

    def step_fn(model, opt, x):
        grad_fn = mm.microbatch(nnx.value_and_grad(failing_loss), num=4, reduce="mean")
        loss, grads = grad_fn(model, x)
        opt.update(model, grads)
        return loss

    step = mm.jit(step_fn)
    before = [np.asarray(v) for v in jax.tree.leaves(nnx.state(model))]
    interval = sys.getswitchinterval()
    with pytest.raises(mm.StepError, match="tripwire"):
        step.overlapped_timeline(model, opt, x)
    assert sys.getswitchinterval() == interval
    assert not timers_running()
    for a, b in zip(before, jax.tree.leaves(nnx.state(model)), strict=True):
        np.testing.assert_array_equal(a, b)
    armed["on"] = False
    kinds = [e.kind for e in step.overlapped_timeline(model, opt, x)]
    assert len(kinds) == 2 * 2 * 4 + 2 * 4  # F and B, 2 stages, M=4; a transfer each way


class _Pending:
    """A result that is ready once the test says so."""

    def __init__(self):
        self.done = threading.Event()

    def is_deleted(self):
        return False

    def block_until_ready(self):
        self.done.wait(10)
        return self


def test_overlap_timer_starts_an_action_after_its_rank_and_its_inputs():
    """Rank 0 runs F0 of microbatches 0 and 1; rank 1 runs F1 of microbatch 0, reading F0's
    result moved to it; a rank-0 program with no pipeline action (an update) comes last."""
    timer = OverlapTimer()
    timer.begin()
    f0_m0, f0_m1, f1_m0, update = _Pending(), _Pending(), _Pending(), _Pending()
    now = time.perf_counter()
    timer.launched("s0", [(("s0", "F", 0, 0), 0)], [0], [1], [f0_m0], now)
    timer.moved(1, 2)
    timer.launched("s1", [(("s1", "F", 1, 0), 0)], [2], [3], [f1_m0], now)
    timer.launched("s0", [(("s0", "F", 0, 0), 1)], [0], [4], [f0_m1], now)
    timer.launched("s0", [(None, None)], [0], [5], [update], now)
    for result in (f0_m0, f0_m1, f1_m0, update):
        time.sleep(0.01)
        result.done.set()
    events = {(e.stage, e.microbatch): e for e in timer.events()}
    assert len(events) == 3  # the update is no pipeline action
    assert events[(1, 0)].start == events[(0, 0)].end  # waited for its input
    assert events[(0, 1)].start == events[(0, 0)].end  # waited for its rank
    assert events[(0, 0)].end < events[(0, 1)].end < events[(1, 0)].end
    assert events[(0, 0)].start == pytest.approx(now - timer._start, abs=1e-9)
    assert not timers_running()


def test_measured_bubble():
    from mmnnx.mpmd.run.timing import Event

    # rank t0 runs t0 and its virtual stage t0:1; a fused pair's two actions share one span
    events = [
        Event("t0", "F", 0, 0, 0.0, 1.0, rank="t0"),
        Event("t1", "F", 1, 0, 1.0, 2.0, rank="t1"),
        Event("t1:1", "F", 2, 0, 2.0, 3.0, rank="t1"),
        Event("t0:1", "F", 3, 0, 3.0, 4.0, rank="t0"),
        Event("t0:1", "B", 3, 0, 4.0, 6.0, fused=True, rank="t0"),
        Event("t0", "F", 0, 1, 4.0, 6.0, fused=True, rank="t0"),
    ]
    # busy: t0 1 + 1 + 2 = 4, t1 2; 2 ranks over 6 s
    assert mm.schedules.measured_bubble(events) == pytest.approx(1 - 6 / 12)
    for name in ("gpipe", "1f1b", "zero-bubble-v"):
        result = mm.schedules.simulate(mm.schedules.get(name, 4, 8, 2 if name.endswith("v") else 1))
        assert mm.schedules.measured_bubble(result.events) == pytest.approx(result.bubble_fraction)
    with pytest.raises(ValueError, match="no events"):
        mm.schedules.measured_bubble([])


def test_measured_costs_average():
    events = [mm.schedules.Event(0, "F", 0, m, 0.0, d) for m, d in enumerate((1.0, 1.0, 4.0))]
    assert mm.schedules.measured_costs(events) == {("F", 0): 1.0}
    assert mm.schedules.measured_costs(events, average="mean") == {("F", 0): 2.0}
    with pytest.raises(ValueError, match="average must be one of"):
        mm.schedules.measured_costs(events, average="max")


def test_overlapped_timeline_of_a_step_without_pipeline_is_empty(tasks):
    model = placed_gpt(tasks)
    step = mm.jit(lambda model, tokens: model.loss(tokens))
    assert step.overlapped_timeline(model, jnp.zeros((2, 9), jnp.int32)) == []
    assert not timers_running()
