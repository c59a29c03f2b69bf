"""ZB-H2, ZB-V and interleaved zero bubble as data: structure, the paper's bubble formulas,
memory against the schedules they improve on, CSV and printing."""

from fractions import Fraction

import pytest

from mmnnx.mpmd import schedules
from mmnnx.mpmd.run.timing import Event
from mmnnx.mpmd.schedules import (
    dualpipe_v,
    from_csv,
    get,
    interleaved_1f1b,
    interleaved_zero_bubble,
    one_f_one_b,
    simulate,
    zero_bubble_h1,
    zero_bubble_h2,
    zero_bubble_v,
)
from mmnnx.mpmd.schedules.simulation import _held_peaks
from mmnnx.mpmd.schedules.zero_bubble import (
    POLICIES,
    _rounded,
    list_schedule,
    v_stages,
)

COSTS = [(1, 2, None), (1, 2, Fraction(1, 2)), (1, 3, 1), (2, 2, 1)]


def _split(backward, weight):
    w = Fraction(backward, 2) if weight is None else Fraction(weight)
    return backward - w, w


@pytest.mark.parametrize(("forward", "backward", "weight"), COSTS)
@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(2, 3), (4, 7), (4, 16), (6, 12)])
def test_zero_bubble_h2_rank_zero_idles_the_paper_formula(
    forward, backward, weight, num_stages, num_microbatches
):
    # The paper's bubbles (arXiv 2401.10241, table 2): 1F1B (p-1)(F+B), ZB-H1 (p-1)(F+I-W),
    # ZB-H2 (p-1)(F+I-2W), each the idle time inside the first rank's span (M >= 2p - 1 and
    # 2W <= F + I, where the paper's formulas hold).
    i, w = _split(backward, weight)
    p = num_stages
    h2 = simulate(zero_bubble_h2(p, num_microbatches), forward, backward, weight)
    h1 = simulate(zero_bubble_h1(p, num_microbatches), forward, backward, weight)
    ofb = simulate(one_f_one_b(p, num_microbatches), forward, backward, weight)
    assert h2.rank_idle[0] == (p - 1) * (forward + i - 2 * w)
    assert h1.rank_idle[0] == (p - 1) * (forward + i - w)
    assert ofb.rank_idle[0] == (p - 1) * (forward + backward)
    assert h2.rank_idle[0] <= h1.rank_idle[0] < ofb.rank_idle[0]


@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(2, 3), (4, 8), (5, 9)])
def test_zero_bubble_h2_has_no_bubble_with_equal_passes_at_twice_the_memory(
    num_stages, num_microbatches
):
    result = simulate(zero_bubble_h2(num_stages, num_microbatches), 1, 2)  # F = I = W = 1
    assert result.rank_idle == (0,) * num_stages
    assert result.peak_in_flight == (2 * num_stages - 1,) * num_stages
    assert max(simulate(one_f_one_b(num_stages, num_microbatches)).peak_in_flight) == num_stages


def test_v_placement():
    schedule = zero_bubble_v(4, 8)
    assert schedule.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert [schedule.stages_of(r) for r in range(4)] == [v_stages(r, 4) for r in range(4)]
    assert get("zero-bubble-v", 8, 8, virtual_stages=2) == schedule
    with pytest.raises(ValueError, match="needs virtual_stages=2 and an even number"):
        get("zero-bubble-v", 8, 8)
    with pytest.raises(ValueError, match="needs virtual_stages=2 and an even number"):
        get("zero-bubble-v", 9, 8, virtual_stages=2)
    with pytest.raises(ValueError, match=r"zero-bubble-v needs at least .* use 4 microbatches"):
        zero_bubble_v(4, 3)


@pytest.mark.parametrize(
    ("num_ranks", "num_microbatches"), [(2, 2), (2, 5), (3, 6), (4, 8), (4, 16)]
)
def test_zero_bubble_v_beats_zero_bubble_h1_at_one_f_one_b_memory(num_ranks, num_microbatches):
    # The same model: R ranks of F = 2, B = 4 (one stage each), or 2R stages of F = 1, B = 2.
    v = simulate(zero_bubble_v(num_ranks, num_microbatches), 1, 2)
    h1 = simulate(zero_bubble_h1(num_ranks, num_microbatches), 2, 4)
    ofb = simulate(one_f_one_b(num_ranks, num_microbatches), 2, 4)
    work = 6 * num_microbatches
    assert v.makespan == work + (num_ranks - 1)  # rank 0 waits one stage's forward per rank
    assert h1.makespan == work + 2 * (num_ranks - 1)
    assert ofb.makespan == work + 6 * (num_ranks - 1)
    # memory in stage-microbatches: 1F1B's first rank holds R microbatches of two stages' worth
    schedule = zero_bubble_v(num_ranks, num_microbatches)
    for rank in range(num_ranks):
        assert _rank_peak(schedule, rank) <= 2 * num_ranks


@pytest.mark.parametrize(("num_ranks", "num_microbatches"), [(6, 12), (8, 16)])
def test_zero_bubble_v_stays_ahead_on_deeper_pipelines(num_ranks, num_microbatches):
    v = simulate(zero_bubble_v(num_ranks, num_microbatches), 1, 2)
    h1 = simulate(zero_bubble_h1(num_ranks, num_microbatches), 2, 4)
    assert v.makespan < h1.makespan


@pytest.mark.parametrize(
    ("num_ranks", "num_microbatches", "virtual_stages"),
    [(2, 4, 2), (4, 8, 2), (4, 8, 3), (2, 6, 3)],
)
def test_interleaved_zero_bubble_beats_interleaved_1f1b_in_its_memory(
    num_ranks, num_microbatches, virtual_stages
):
    zb = interleaved_zero_bubble(num_ranks, num_microbatches, virtual_stages)
    plain = interleaved_1f1b(num_ranks, num_microbatches, virtual_stages)
    assert zb.stage_to_rank == plain.stage_to_rank
    costs = (Fraction(1, virtual_stages), Fraction(2, virtual_stages))
    assert simulate(zb, *costs).makespan < simulate(plain, *costs).makespan
    for rank in range(num_ranks):
        assert _rank_peak(zb, rank) <= _rank_peak(plain, rank)


def _rank_peak(schedule, rank):
    return _held_peaks(schedule, by_rank=True)[rank]


@pytest.mark.parametrize(
    "schedule",
    [zero_bubble_h2(4, 8), zero_bubble_v(3, 5), interleaved_zero_bubble(2, 4, 2)],
    ids=lambda s: s.name,
)
def test_csv_round_trip_and_grid(schedule):
    assert from_csv(schedule.to_csv(), name=schedule.name) == schedule
    grid = str(schedule).splitlines()
    assert grid[0].startswith(f"{schedule.name}: ") and "unit-time steps" in grid[0]
    assert len(grid) == 1 + schedule.num_ranks
    assert schedule.splits_backward


def test_registered_under_their_names():
    for name in ("zero-bubble-h2", "zero-bubble-v", "interleaved-zero-bubble", "dualpipev"):
        assert name in schedules.names()
    assert get("zero-bubble-h2", 4, 8) == zero_bubble_h2(4, 8)
    assert get("interleaved-zero-bubble", 8, 8, 2) == interleaved_zero_bubble(4, 8, 2)


def test_list_scheduler_limits():
    with pytest.raises(ValueError, match="at least one microbatch"):
        list_schedule("zb", (0, 1), 2, limits=(0, 1))
    # one microbatch at a time everywhere: each rank runs F, I, W per microbatch in turn
    one = list_schedule("zb", (0, 1), 3, limits=(1, 1))
    assert [str(a) for a in one.actions_of(0)][:3] == ["F0.0", "I0.0", "W0.0"]


@pytest.mark.parametrize(
    ("num_ranks", "num_microbatches"), [(1, 2), (2, 4), (3, 7), (4, 8), (4, 13)]
)
def test_dualpipe_v_phases(num_ranks, num_microbatches):
    schedule = dualpipe_v(num_ranks, num_microbatches)  # validated: complete, no deadlock
    assert schedule.stage_to_rank == zero_bubble_v(num_ranks, num_ranks).stage_to_rank
    R, M = num_ranks, num_microbatches
    for r in range(R):
        row = [str(a) for a in schedule.actions_of(r)]
        down, up = v_stages(r, R)
        # phase 1 and 2: 2(R - r - 1) + 1 chunk-0 forwards before the first chunk-1 forward
        assert row.index(f"F{up}.0") == 2 * (R - r - 1) + 1
        # the main phase pairs a forward with the backward of the other chunk
        assert f"F{down}.{M - 1}" in row and row[row.index(f"F{down}.{M - 1}") + 1][0] in "BI"
    v = simulate(schedule, 1, 2)
    assert v.makespan <= simulate(zero_bubble_h1(R, M), 2, 4).makespan
    assert v.makespan < simulate(one_f_one_b(R, M), 2, 4).makespan or R == 1  # no bubble at R=1
    assert from_csv(schedule.to_csv(), name="dualpipev") == schedule


@pytest.mark.parametrize(
    ("num_ranks", "num_microbatches"), [(1, 2), (2, 4), (3, 7), (4, 8), (4, 13), (8, 34)]
)
def test_dualpipe_v_fused_pairs(num_ranks, num_microbatches):
    R, M = num_ranks, num_microbatches
    fused = dualpipe_v(R, M, fuse_pairs=True)  # validated with the pairs' semantics
    assert fused.actions == dualpipe_v(R, M).actions
    assert not any(dualpipe_v(R, M).overlapped)
    for r in range(R):
        pairs = fused.pairs_of(r)
        down, up = v_stages(r, R)
        # DeepSeek's: two pairs per main-phase round (the last rank's first one apart), one per
        # phase-5 round; a forward first, then the other chunk's backward, other microbatches
        main = M - 2 * R + r + 1
        assert len(pairs) == 2 * main - (r == R - 1) + (R - r - 1)
        for first, second in pairs:
            assert first.kind == "F" and second.kind == "B"
            assert {first.stage, second.stage} == {down, up}
            assert first.microbatch > second.microbatch
    assert from_csv(fused.to_csv(), name="dualpipev") == fused
    assert "+" in fused.to_csv() and "+" not in dualpipe_v(R, M).to_csv()
    # a fused pair waits for both inputs and hands on its results at its end: never faster in a
    # model without communication
    assert simulate(fused, 1, 2).makespan >= simulate(dualpipe_v(R, M), 1, 2).makespan


def test_overlapped_pair_timing():
    # rank 0 pairs F0.1 (ready at once) with B0.0 (waits for B1.0, which ends at 4): the pair
    # starts at 4, and F1.1 on rank 1 gets F0.1's result only when the pair ends (7)
    fused = schedules.custom([["F0.0", "F0.1+B0.0", "B0.1"], ["F1.0", "B1.0", "F1.1", "B1.1"]])
    apart = schedules.custom([["F0.0", "F0.1", "B0.0", "B0.1"], ["F1.0", "B1.0", "F1.1", "B1.1"]])
    assert fused.overlapped == ((1,), ())
    assert fused.pairs_of(0) == ((schedules.Action("F", 0, 1), schedules.Action("B", 0, 0)),)

    def start(schedule, text):
        action = schedules.Action.parse(text)
        return next(
            e.start
            for e in simulate(schedule, 1, 2).events
            if (e.kind, e.stage, e.microbatch) == (action.kind, action.stage, action.microbatch)
        )

    assert (start(fused, "F0.1"), start(fused, "B0.0"), start(fused, "F1.1")) == (4, 5, 7)
    assert (start(apart, "F0.1"), start(apart, "B0.0"), start(apart, "F1.1")) == (1, 4, 4)
    print(fused)  # the grid draws a pair as its two actions in turn


@pytest.mark.parametrize(
    ("table", "match"),
    [
        ([["F0.0+B0.0"]], r"overlapped pair F0.0\+B0.0 on rank 0 has one microbatch"),
        ([["F0.0+F0.1+B0.0", "B0.1"]], r"cannot read 'F0.0\+F0.1\+B0.0' on rank 0"),
    ],
)
def test_overlapped_pair_errors(table, match):
    with pytest.raises(ValueError, match=match):
        schedules.custom(table)


def test_overlapped_positions_are_checked():
    rows = [[schedules.Action.parse(a) for a in ("F0.0", "F0.1", "B0.0", "B0.1")]]

    def make(pairs):
        return schedules.validate(schedules.Schedule("s", 1, 2, 1, (0,), rows, pairs))

    assert make([(1,)]).pairs_of(0)[0][0] == schedules.Action("F", 0, 1)
    with pytest.raises(ValueError, match=r"pair at position 3 on rank 0: .* in 0\.\.2"):
        make([(3,)])
    with pytest.raises(ValueError, match=r"positions 0 and 1 on rank 0 share action F0.1"):
        make([(0, 1)])
    with pytest.raises(ValueError, match=r"listed at positions 2 then 0: list them in increasing"):
        make([(2, 0)])
    with pytest.raises(ValueError, match=r"overlapped has 2 rows for 1 ranks"):
        make([(1,), ()])


def test_measured_costs_split_a_fused_pair():
    events = [  # as a step's timeline() gives them
        Event("t0", "F", 0, 0, 0.0, 1.0),  # apart: F0 takes 1
        Event("t0", "F", 0, 1, 1.0, 4.0, fused=True),  # a pair: the two together take 3
        Event("t1", "B", 1, 0, 1.0, 4.0, fused=True),  # B1 was never timed apart
    ]
    assert schedules.measured_costs(events) == {("F", 0): 1.0, ("B", 1): 1.5}


def test_simulate_costs_an_overlapped_pair_what_it_was_measured_to_take():
    schedule = dualpipe_v(2, 8, fuse_pairs=True)
    costs = {"F": 2, "B": 4, "I": 2, "W": 2}
    plain = simulate(schedule, action_costs=costs)
    pairs = {
        ((a.kind, a.stage), (b.kind, b.stage))
        for rank in range(schedule.num_ranks)
        for a, b in schedule.pairs_of(rank)
    }
    assert pairs
    # a pair costed at the sum of its halves is simulated as without pair costs
    summed = simulate(schedule, action_costs=costs, pair_costs=dict.fromkeys(pairs, 6))
    assert summed.events == plain.events
    # a pair run as one program in 4 units instead of 6: each pair spans 4, its halves share
    # them 2 : 4 (as F : B), and the step is shorter
    faster = simulate(schedule, action_costs=costs, pair_costs=dict.fromkeys(pairs, Fraction(4)))
    assert faster.makespan < plain.makespan
    by_action = {(e.kind, e.stage, e.microbatch): e for e in faster.events}
    for rank in range(schedule.num_ranks):
        for a, b in schedule.pairs_of(rank):
            first = by_action[a.kind, a.stage, a.microbatch]
            second = by_action[b.kind, b.stage, b.microbatch]
            assert first.end == second.start
            assert second.end - first.start == 4
            assert (first.end - first.start) * 2 == second.end - second.start
    # the same with the per-kind costs
    per_kind = simulate(schedule, 2, 4, 2, pair_costs=dict.fromkeys(pairs, Fraction(4)))
    assert per_kind.events == faster.events


def test_measured_pair_costs_time_each_kind_of_pair_whole():
    events = [  # as a step's timeline() gives them: two pairs of one kind, one alone
        Event("t0", "F", 0, 1, 1.0, 4.0, fused=True, rank="t0"),
        Event("t0:1", "B", 3, 0, 1.0, 4.0, fused=True, rank="t0"),
        Event("t0", "F", 0, 2, 5.0, 10.0, fused=True, rank="t0"),
        Event("t0:1", "B", 3, 1, 5.0, 10.0, fused=True, rank="t0"),
        Event("t1", "F", 1, 1, 5.0, 10.0, rank="t1"),
    ]
    assert schedules.measured_pair_costs(events) == {(("F", 0), ("B", 3)): 4.0}
    assert schedules.measured_pair_costs(events, average="mean") == {(("F", 0), ("B", 3)): 4.0}
    with pytest.raises(ValueError, match="average must be one of"):
        schedules.measured_pair_costs(events, average="max")


@pytest.mark.parametrize(
    "pair_costs, match",
    [
        ({("F", 0): 1}, "names no overlapped pair"),
        ({(("F", 0), ("B", 9)): 1}, "names no overlapped pair"),
        ({(("X", 0), ("B", 1)): 1}, "names no overlapped pair"),
        ({(("F", 0), ("B", 3)): -1}, "must be a number >= 0"),
    ],
)
def test_simulate_refuses_pair_costs_naming_no_pair(pair_costs, match):
    with pytest.raises(ValueError, match=match):
        simulate(dualpipe_v(2, 8, fuse_pairs=True), pair_costs=pair_costs)


def test_measured_costs_give_an_untimed_half_of_a_split_backward_zero():
    events = [schedules.Event(0, "W", 0, 0, 0.0, 2.0), schedules.Event(1, "I", 1, 0, 0.0, 1.0)]
    assert schedules.measured_costs(events) == {
        ("W", 0): 2.0,
        ("I", 0): 0.0,  # the first stage's input gradient: nothing to compute
        ("I", 1): 1.0,
        ("W", 1): 0.0,  # a stage without parameters
    }


def test_dualpipe_v_needs_twice_the_ranks_in_microbatches():
    with pytest.raises(ValueError, match=r"dualpipev needs at least twice .* use 8 microbatches"):
        dualpipe_v(4, 7)
    assert get("dualpipev", 8, 8, virtual_stages=2) == dualpipe_v(4, 8)


BENCHMARK_COSTS = {"F": 20, "I": 11.4, "W": 4}  # per half stage, measured by benchmarks/pipeline.py


@pytest.mark.parametrize(
    "build",
    [
        lambda costs: zero_bubble_v(2, 8, costs),
        lambda costs: interleaved_zero_bubble(2, 8, 2, costs),
        lambda costs: zero_bubble_h2(4, 8, costs),
    ],
    ids=["zero-bubble-v", "interleaved-zero-bubble", "zero-bubble-h2"],
)
def test_built_for_measured_costs_is_faster_under_them(build):
    def step_time(schedule):
        durations = {
            (a.kind, a.stage): BENCHMARK_COSTS[a.kind] for r in schedule.actions for a in r
        }
        return simulate(schedule, action_costs=durations).makespan

    equal, measured = build(None), build(BENCHMARK_COSTS)
    assert step_time(measured) <= step_time(equal)
    assert build({"F": 3, "I": 3, "W": 3}).actions == equal.actions  # only ratios matter


def test_costs_through_get():
    schedule = get("zero-bubble-v", 4, 8, 2, costs=BENCHMARK_COSTS)
    assert schedule == zero_bubble_v(2, 8, BENCHMARK_COSTS)
    per_stage = {(k, s): c for k, c in BENCHMARK_COSTS.items() for s in range(4)}
    assert get("zero-bubble-v", 4, 8, 2, costs=per_stage) == schedule
    with pytest.raises(schedules.CostsNotUsed, match="'1f1b' is built the same whatever"):
        get("1f1b", 4, 8, costs=BENCHMARK_COSTS)
    with pytest.raises(ValueError, match="the cost of 'W' must be positive"):
        zero_bubble_h2(2, 4, {"F": 1, "I": 1, "W": 0})
    with pytest.raises(ValueError, match="no duration for W passes of stage 0"):
        zero_bubble_h2(2, 4, {"F": 1, "I": 1})


def test_any_positive_costs_build_a_valid_schedule():
    # with uneven durations every rank can end up waiting on another's memory; the list
    # scheduler then lets one forward over the limit instead of looping forever
    rng = __import__("random").Random(0)
    for _ in range(60):
        ranks = rng.randint(1, 4)
        m = rng.randint(ranks, 3 * ranks) * 2
        costs = {kind: rng.choice([1e-6, 0.01, 0.5, 1, 3, 20]) for kind in "FIW"}
        validated = [get("zero-bubble-h2", ranks, m, costs=costs)]
        validated.append(get("zero-bubble-v", 2 * ranks, m, 2, costs=costs))
        if m % ranks == 0:
            validated.append(get("interleaved-zero-bubble", 2 * ranks, m, 2, costs=costs))
        assert all(s.num_microbatches == m for s in validated)


def _per_stage(quarter, first_weight):
    """Durations per (kind, stage) of four stages whose first has no input gradient to make:
    its whole backward is its weight pass."""
    f, i, w = quarter
    costs = {("F", s): f for s in range(4)} | {("I", s): i for s in range(1, 4)}
    costs |= {("W", s): w for s in range(1, 4)} | {("I", 0): 1e-6, ("W", 0): first_weight}
    return costs


# ms per quarter of benchmarks/pipeline.py's matmul layers, measured on a 16-core machine
MATMUL_QUARTER, MATMUL_FIRST_WEIGHT = (13.0, 35.6, 26.6), 61.0


def _time(schedule, costs):
    needed = {(a.kind, a.stage) for row in schedule.actions for a in row}
    return simulate(schedule, action_costs={key: costs[key] for key in needed}).makespan


def test_zero_bubble_v_built_for_costs_where_the_first_stage_ends_the_step():
    """The first stage's backward is all weight pass (4.7 forwards long here), so the last
    microbatch's ends the step: the critical-path policy starts it in time, and ZB-V built for
    these durations beats the greedy zero-bubble order, ZB-V built for equal durations, and
    ZB-H1 on the same layers cut in two stages."""
    v_costs = _per_stage(MATMUL_QUARTER, MATMUL_FIRST_WEIGHT)
    h1_costs = {
        (kind, s): v_costs[kind, 2 * s] + v_costs[kind, 2 * s + 1]
        for kind in "FIW"
        for s in range(2)
    }
    built = zero_bubble_v(2, 8, v_costs)
    greedy = list_schedule("zero-bubble-v", (0, 1, 1, 0), 8, (4, 4), v_costs)
    assert _time(built, v_costs) < _time(greedy, v_costs)
    assert _time(built, v_costs) < _time(zero_bubble_v(2, 8), v_costs)
    assert _time(built, v_costs) < _time(zero_bubble_h1(2, 8), h1_costs)
    assert max(_held_peaks(built, by_rank=True)) <= max(
        _held_peaks(zero_bubble_v(2, 8), by_rank=True)
    )  # 1F1B's memory


@pytest.mark.parametrize("policy", ["zero-bubble", "critical-path"])
def test_every_policy_builds_a_valid_schedule(policy):
    costs = _per_stage(MATMUL_QUARTER, MATMUL_FIRST_WEIGHT)
    for limits in [(4, 4), (2, 3), (8, 8)]:
        schedule = list_schedule("zb", (0, 1, 1, 0), 8, limits, costs, policy)
        assert schedules.validate(schedule) is schedule
    with pytest.raises(ValueError, match="unknown policy 'fastest'"):
        list_schedule("zb", (0, 1), 2, (1, 1), policy="fastest")


# ms per pass of the eight matmul parts of benchmarks/pipeline.py on four ranks ("zero bubble on
# four ranks"), measured in the running pipeline on a 16-core machine; part 0 has no input
# gradient to make, so its weight pass holds its whole backward
FOUR_RANK_PARTS = {
    "F": (13.4, 13.2, 13.4, 13.3, 12.1, 13.5, 13.1, 13.9),
    "I": (1e-6, 36.2, 39.4, 38.6, 37.5, 38.8, 37.7, 37.2),
    "W": (64.0, 32.7, 32.9, 32.7, 33.0, 33.3, 33.4, 33.0),
}


def test_built_for_costs_rounds_them_too():
    """The list scheduler is greedy: ZB-V built for exactly these durations simulates 12% slower
    than built for them rounded to a tenth of their mean, and slower than ZB-H1 on the same
    parts in four stages. Built for costs, it tries the rounded costs too and keeps the fastest
    under the exact ones, which then beats ZB-H1 at 1F1B's memory."""
    v_costs = {(k, s): c for k, row in FOUR_RANK_PARTS.items() for s, c in enumerate(row)}
    h1_costs = {}  # stage s holds parts 2s and 2s + 1; stage 0's backward is all weight pass
    for s in range(4):
        for kind in "FIW":
            h1_costs[kind, s] = v_costs[kind, 2 * s] + v_costs[kind, 2 * s + 1]
    h1_costs["W", 0] += h1_costs["I", 0]
    h1_costs["I", 0] = 1e-6
    stage_to_rank, limits = (0, 1, 2, 3, 3, 2, 1, 0), (8, 8, 8, 8)
    exact = min(
        _time(list_schedule("zb", stage_to_rank, 8, limits, v_costs, policy), v_costs)
        for policy in POLICIES
    )
    rounded = _rounded(v_costs, 0.1)
    assert _time(list_schedule("zb", stage_to_rank, 8, limits, rounded), v_costs) < exact / 1.1
    built = zero_bubble_v(4, 8, v_costs)
    assert _time(built, v_costs) < _time(zero_bubble_h1(4, 8), h1_costs) < exact
    assert max(_held_peaks(built, by_rank=True)) <= max(
        _held_peaks(zero_bubble_v(4, 8), by_rank=True)
    )  # 1F1B's memory


def test_simulate_delays_a_reader_on_another_rank_by_its_transfer():
    plain = simulate(one_f_one_b(2, 4))
    sent = simulate(one_f_one_b(2, 4), transfer_costs={"F": Fraction(1, 2), ("B", 1): 1})
    assert sent.makespan > plain.makespan
    first_f1 = next(e for e in sent.events if (e.kind, e.stage) == ("F", 1))
    assert first_f1.start == 1 + Fraction(1, 2)  # F0 of stage 0 ends at 1, then its transfer
    w = next(e for e in sent.events if (e.kind, e.stage, e.microbatch) == ("B", 0, 0))
    b1 = next(e for e in sent.events if (e.kind, e.stage, e.microbatch) == ("B", 1, 0))
    assert w.start >= b1.end + 1  # stage 1's input gradient crossed to rank 0
    for bad, match in (({("F", 2): 1}, "names no action"), ({"F": -1}, "must be a number")):
        with pytest.raises(ValueError, match=match):
            simulate(one_f_one_b(2, 4), transfer_costs=bad)


def test_simulate_waits_for_the_host_to_launch_each_program_in_the_runner_s_order():
    one_f = one_f_one_b(2, 2)
    order = [str(first) for first, _ in schedules.dispatch_order(one_f)]
    assert order == ["F0.0", "F0.1", "F1.0", "B1.0", "B0.0", "F1.1", "B1.1", "B0.1"]
    late = simulate(one_f, launch_cost=Fraction(1, 2))
    assert late.events[0].start == Fraction(1, 2)  # F0.0 starts once launched
    assert late.makespan == simulate(one_f).makespan + Fraction(1, 2)
    # a host slower than the devices: the 8th program is launched at 8 x 3 = 24 and runs 2
    assert simulate(schedules.gpipe(2, 2), launch_cost=3).makespan == 26
    # two processes: process 0's host offers F0.1's activations once it has launched F0.1, so
    # they arrive (at 3) while stage 1 runs B1.0 and F1.1 starts when B1.0 ends, at 5 (offered
    # at F1.1's place in the order, after B1.0's gradient had come back at 6, it started at 7)
    sent = {"F": 1, "B": 1}
    apart = simulate(one_f, transfer_costs=sent, processes=(0, 1))
    starts = {f"{e.kind}{e.stage}.{e.microbatch}": e.start for e in apart.events}
    assert (starts["B0.0"], starts["F1.1"], starts["B0.1"], apart.makespan) == (6, 5, 9, 11)
    together = simulate(one_f, transfer_costs=sent, processes=(0, 0))
    assert together.makespan == simulate(one_f, transfer_costs=sent).makespan == 11
    # process 1's host waits for each value from process 0 before it goes on: F0.0 ends at
    # 3/2 (launched at 1/2), its activations arrive at 5/2, and F1.0 is launched only then
    half = Fraction(1, 2)
    apart = simulate(one_f, transfer_costs=sent, processes=(0, 1), launch_cost=half)
    f10 = next(e for e in apart.events if (e.kind, e.stage, e.microbatch) == ("F", 1, 0))
    assert f10.start == 3
    together = simulate(one_f, transfer_costs=sent, processes=(0, 0), launch_cost=half)
    assert (apart.makespan, together.makespan) == (Fraction(25, 2), Fraction(23, 2))
    for bad, match in (
        (dict(launch_cost=-1), "launch_cost must be a number >= 0"),
        (dict(processes=(0,)), "a process number .* for each of the 2 ranks"),
        (dict(processes=(0, -1)), "a process number"),
    ):
        with pytest.raises(ValueError, match=match):
            simulate(one_f, **bad)


def test_transfer_costs_price_each_boundary_over_the_link_between_its_ranks():
    link = schedules.Link(latency=Fraction(1, 4), bandwidth=Fraction(4))
    one_f = one_f_one_b(2, 4)
    costs = schedules.transfer_costs(one_f, {(1, 0): link}, {"F": 1, ("B", 1): 3})
    assert costs == {("F", 0): Fraction(1, 2), ("B", 1): 1}  # a link given one way serves both
    assert simulate(one_f, transfer_costs=costs) == simulate(
        one_f, transfer_costs={"F": Fraction(1, 2), "B": 1}
    )
    # stages 0 and 3 share rank 0 in a V: only boundaries between two ranks cost anything
    v = zero_bubble_v(2, 4)
    priced = schedules.transfer_costs(v, {(0, 1): link}, {"F": 1, "I": 1})
    assert set(priced) == {("F", 0), ("F", 2), ("I", 3), ("I", 1)}
    for links, nbytes, match in (
        ({(0, 2): link}, {"F": 1}, r"links key \(0, 2\) is not a pair of two distinct ranks"),
        ({(0, 0): link}, {"F": 1}, "not a pair of two distinct ranks"),
        ({(0, 1): 2.0}, {"F": 1}, "must be a Link"),
        ({}, {"F": 1, "B": 1}, "no link between ranks 0 and 1, which F0 sends to"),
        ({(0, 1): link}, {"F": -1, "B": 1}, r"nbytes\['F'\] must be a number >= 0"),
        ({(0, 1): link}, {"F": 1}, r"no size for \('B', 1\)"),
        ({(0, 1): link}, {("F", 4): 1}, "names no action"),
    ):
        with pytest.raises(ValueError, match=match):
            schedules.transfer_costs(one_f, links, nbytes)
