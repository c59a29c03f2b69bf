"""mm.schedules.tune: one measured run, every candidate simulated, the fastest that fits."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.tuning import _TIMED_RUNS
from tests.models import four_tasks, placed_gpt


def pipelined(num: int):
    @mm.jit
    def step(model, opt, tokens):
        grad_fn = mm.microbatch(
            nnx.value_and_grad(lambda m, t: m.loss(t)), num=num, reduce="mean", schedule="1f1b"
        )
        loss, grads = grad_fn(model, tokens)
        opt.update(model, grads)
        return loss

    return step


def test_a_budget_that_excludes_gpipe_picks_a_1f1b_family_schedule():
    model = placed_gpt(four_tasks())
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(0), (16, 9), 0, 32)
    step = pipelined(16)
    before = [np.asarray(x) for x in jax.tree.leaves(nnx.state((model, opt)))]
    free = mm.schedules.tune(step, model, opt, tokens, microbatches=(3, 8, 16))
    after = [np.asarray(x) for x in jax.tree.leaves(nnx.state((model, opt)))]
    assert all((a == b).all() for a, b in zip(before, after, strict=True))  # nothing trained
    by = {(c.schedule, c.num_microbatches): c for c in free.candidates}
    names = ("gpipe", "1f1b", "zero-bubble-h1", "zero-bubble-h2")  # one stage per task
    assert set(by) == {(s, m) for s in names for m in (3, 8, 16)}
    for name in names:  # 3 does not divide the batch of 16: listed, never chosen
        assert by[(name, 3)].rejected == "cannot run: 3 microbatches do not divide the batch of 16"
        assert by[(name, 3)].predicted_seconds is None
    assert free.best.num_microbatches != 3
    gpipe, one_f = by[("gpipe", 16)], by[("1f1b", 16)]
    assert one_f.table == mm.schedules.get("1f1b", 4, 16)  # what was simulated, to run
    assert by[("zero-bubble-h2", 16)].table.name == "zero-bubble-h2"  # ordered for the step
    assert gpipe.peak_bytes > one_f.peak_bytes  # GPipe holds all 16 microbatches
    # more microbatches, a smaller bubble (ZB-H1 against 1F1B is left out: with these tiny
    # stages an I and a W launched apart can take longer than the joint B, so which is smaller
    # depends on the run)
    assert all(0 <= c.bubble < 1 for c in free.candidates if c.num_microbatches != 3)
    assert one_f.bubble < by[("1f1b", 8)].bubble
    budget = (gpipe.peak_bytes + max(one_f.peak_bytes, by[("zero-bubble-h1", 16)].peak_bytes)) // 2
    plain = ("gpipe", "1f1b")  # no second (split-backward) measurement needed
    tuned = mm.schedules.tune(
        step, model, opt, tokens, memory_budget=budget, candidates=[(s, 16) for s in plain]
    )
    assert {(c.schedule, c.num_microbatches) for c in tuned.candidates} == {
        ("1f1b", 16),
        ("gpipe", 16),
    }
    assert tuned.best.schedule == "1f1b"
    assert "over the budget" in next(c for c in tuned.candidates if c.schedule == "gpipe").rejected
    assert "chosen" in str(tuned)
    with pytest.raises(mm.MPMDError, match="no candidate fits the memory budget"):
        mm.schedules.tune(step, model, opt, tokens, memory_budget="1KiB", schedules=plain)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(memory_budget=-1), "memory_budget must be positive"),
        (dict(memory_budget="lots"), "expected a number of bytes"),
        # was float()'s own "could not convert string to float: '..'"
        (dict(memory_budget=".."), "memory size '..': expected a number of bytes"),
        (dict(memory_budget="1.2.3GiB"), "memory size '1.2.3GiB': expected a number of bytes"),
        (dict(schedules="1f1c"), "unknown schedule '1f1c'"),
        (dict(schedules=()), "schedules= is empty"),
        (dict(microbatches=()), "microbatches= is empty"),
        (dict(microbatches=(4, 0)), "an int >= 1, got 0"),
        (dict(candidates=[("1f1b", 8)], microbatches=8), "not both"),
        (dict(candidates=["1f1b"]), "not a \\(schedule, microbatches\\) pair"),
    ],
)
def test_bad_tuner_options_are_refused_before_the_step_runs(options, message):
    def step(*args):
        raise AssertionError("the step ran")

    with pytest.raises(ValueError, match=message):
        mm.schedules.tune(step, **options)


def test_one_schedule_name_is_one_candidate():
    from mmnnx.tuning import _candidate_pairs

    assert _candidate_pairs("1f1b", 8, None) == [("1f1b", 8)]
    assert _candidate_pairs(None, (4, 8), None) == [(None, 4), (None, 8)]
    assert _candidate_pairs(None, None, None) is None


def sched_keys(schedule):
    return {(a.kind, a.stage) for row in schedule.actions for a in row}


def test_a_step_without_a_pipeline_is_refused():
    model = placed_gpt(four_tasks())
    step = mm.jit(lambda m, t: m.loss(t))
    with pytest.raises(mm.MPMDError, match="tune: the step has no pipelined mm.microbatch"):
        mm.schedules.tune(step, model, jnp.zeros((4, 9), jnp.int32))
    with pytest.raises(mm.MPMDError, match="boundary_bytes: the step has no pipelined"):
        mm.schedules.measure_transfers(step, model, jnp.zeros((4, 9), jnp.int32))


def test_candidates_must_place_stages_as_the_step_does():
    from mmnnx.mpmd.schedules import get
    from mmnnx.tuning import _fits, _same_ranks

    v_step = ["t0", "t1", "t1", "t0"]  # stage_rules(..., virtual_stages=2, order="v") homes
    loop_step = ["t0", "t1", "t0", "t1"]
    measured = get("zero-bubble-v", 4, 4, 2)
    assert _fits("zero-bubble-v", measured, 2, v_step)
    assert not _fits("interleaved-1f1b", measured, 2, v_step)
    looped = get("interleaved-zero-bubble", 4, 4, 2)
    assert not _fits("zero-bubble-v", looped, 2, loop_step)
    assert _fits("interleaved-zero-bubble", looped, 2, loop_step)
    assert not _fits("1f1b", looped, 2, loop_step)
    # a tied head: the forward pass ends on t0 again, a stage of its own (on a rank of its own)
    tied = ["t0", "t1", "t0"]
    assert _fits("1f1b", get("1f1b", 3, 4), 1, tied)
    assert _fits("zero-bubble-h1", get("1f1b", 3, 4), 1, tied)
    assert _same_ranks((0, 1, 2), ["a", "b", "c"]) and not _same_ranks((0, 1, 0), ["a", "b", "c"])


def test_peak_memory_counts_a_rank_s_stages_at_once():
    from mmnnx.mpmd.schedules import get, simulate
    from mmnnx.tuning import _peak_held

    schedule = get("gpipe", 2, 3)
    events = simulate(schedule).events
    # one task holding both stages: six microbatch-stages at once under GPipe
    assert _peak_held(events, {0: 1.0, 1: 2.0}, ["t", "t"]) == {"t": 9.0}
    assert _peak_held(events, {0: 1.0, 1: 2.0}, ["a", "b"]) == {"a": 3.0, "b": 6.0}


def test_the_split_backward_is_measured_on_the_user_s_step_with_its_options(monkeypatch):
    model = placed_gpt(four_tasks())
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(0), (8, 9), 0, 32)
    step = mm.jit(pipelined(4).fun, pack_residuals=False, recompute_residuals=False, pack_weights=0)
    measured = []
    timeline = mm.JitFunction.timeline

    def recording(self, *args, **kwargs):
        schedule = self.plan(*args, **kwargs).pipeline.schedule.name
        options = (self.pack_residuals, self.recompute_residuals, self.pack_weights)
        measured.append((schedule, *options))
        return timeline(self, *args, **kwargs)

    monkeypatch.setattr(mm.JitFunction, "timeline", recording)
    result = mm.schedules.tune(step, model, opt, tokens, candidates=[("zero-bubble-h1", 4)])
    assert result.best.schedule == "zero-bubble-h1"
    # the step as given (a warm-up, then measured), then the same step with a split backward
    runs = 1 + _TIMED_RUNS
    assert measured == [("1f1b", 0, False, 0)] * runs + [("zero-bubble-h1", 0, False, 0)] * runs


def test_a_cached_partial_step_keeps_its_bound_arguments_values():
    model = placed_gpt(four_tasks())
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(0), (8, 9), 0, 32)
    before = [np.asarray(x) for x in jax.tree.leaves(nnx.state((model, opt)))]
    step = mm.cached_partial(pipelined(4), model, opt)
    result = mm.schedules.tune(step, tokens, candidates=[("1f1b", 4), ("zero-bubble-h1", 4)])
    assert {c.schedule for c in result.candidates} == {"1f1b", "zero-bubble-h1"}
    # each candidate's time takes the links its boundaries cross (each way), the bytes each
    # moves per microbatch of 2 rows (hidden states (2, 8, 16) float32: one activation per
    # boundary, as the colouring counts a value once per receiving task) and the host's launches
    transfers = result.transfers
    ranks = [("t0", "t1"), ("t1", "t2"), ("t2", "t3")]
    assert set(transfers.links) == {*ranks, *(pair[::-1] for pair in ranks)}
    boundaries = [("F", 0), ("F", 1), ("F", 2), ("B", 1), ("B", 2), ("B", 3)]
    sizes = dict.fromkeys(boundaries, 4 * 2 * 8 * 16)
    assert transfers.nbytes == sizes
    assert result.launch_cost > 0
    one_f = next(c for c in result.candidates if c.schedule == "1f1b")
    costs = {key: result.stage_costs[key] for key in sched_keys(one_f.table)}
    options = transfers.simulate_options(one_f.table, result.launch_cost)
    predicted = mm.schedules.simulate(one_f.table, action_costs=costs, **options).makespan
    assert predicted == one_f.predicted_seconds
    assert predicted > mm.schedules.simulate(one_f.table, action_costs=costs).makespan
    with pytest.raises(ValueError, match="'gpipe' has 2 stages, the step measured 4"):
        transfers.transfer_costs(mm.schedules.gpipe(2, 4))
    after = [np.asarray(x) for x in jax.tree.leaves(nnx.state((model, opt)))]
    assert all((a == b).all() for a, b in zip(before, after, strict=True))  # nothing trained
    with pytest.raises(mm.MPMDError, match="donates its arguments"):
        mm.schedules.tune(mm.cached_partial(mm.jit(pipelined(4).fun, donate_argnums=0), model))
