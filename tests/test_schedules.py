"""Pipeline schedules as data: builders, validation, CSV, printing and the timing simulator."""

import inspect
from collections import Counter
from fractions import Fraction

import pytest

from mmnnx.mpmd import schedules
from mmnnx.mpmd.schedules import (
    Action,
    Schedule,
    custom,
    from_csv,
    get,
    gpipe,
    interleaved_1f1b,
    interleaved_gpipe,
    interleaved_zero_bubble,
    one_f_one_b,
    simulate,
    validate,
    zero_bubble_h1,
)

SIZES = [(2, 4), (4, 8), (4, 16)]

BUILT = [
    pytest.param(lambda: gpipe(1, 1), id="gpipe-1x1"),
    pytest.param(lambda: gpipe(3, 2), id="gpipe-3x2"),
    pytest.param(lambda: gpipe(4, 8), id="gpipe-4x8"),
    pytest.param(lambda: one_f_one_b(1, 3), id="1f1b-1x3"),
    pytest.param(lambda: one_f_one_b(4, 4), id="1f1b-4x4"),
    pytest.param(lambda: one_f_one_b(4, 9), id="1f1b-4x9"),
    pytest.param(lambda: interleaved_1f1b(4, 8, 2), id="interleaved-4r-v2-8"),
    pytest.param(lambda: interleaved_1f1b(2, 4, 3), id="interleaved-2r-v3-4"),
    pytest.param(lambda: interleaved_1f1b(3, 3, 2), id="interleaved-3r-v2-3"),
    pytest.param(lambda: interleaved_1f1b(3, 6, 1), id="interleaved-3r-v1-6"),
    pytest.param(lambda: interleaved_gpipe(4, 8, 2), id="interleaved-gpipe-4r-v2-8"),
    pytest.param(lambda: interleaved_gpipe(2, 3, 3), id="interleaved-gpipe-2r-v3-3"),
    pytest.param(lambda: interleaved_gpipe(4, 2, 2), id="interleaved-gpipe-4r-v2-2"),
    pytest.param(lambda: zero_bubble_h1(1, 2), id="zb-1x2"),
    pytest.param(lambda: zero_bubble_h1(4, 4), id="zb-4x4"),
    pytest.param(lambda: zero_bubble_h1(4, 10), id="zb-4x10"),
    pytest.param(lambda: custom([["F0.0", "F1.0", "B1.0", "B0.0"]]), id="custom-one-rank"),
]


# ---------------------------------------------------------------------------- actions


def test_action_short_form_round_trips():
    action = Action("F", 0, 3)
    assert str(action) == "F0.3"
    assert Action.parse("F0.3") == action
    assert Action.parse(str(Action("W", 12, 7))) == Action("W", 12, 7)


@pytest.mark.parametrize("text", ["X0.1", "F0", "F-1.0", "F0.1.2", ""])
def test_action_parse_rejects_bad_text(text):
    with pytest.raises(ValueError, match="cannot read action"):
        Action.parse(text)


def test_action_rejects_bad_fields():
    with pytest.raises(ValueError, match="kind must be one of F, B, I, W"):
        Action("X", 0, 0)
    with pytest.raises(ValueError, match="stage must be a non-negative int"):
        Action("F", -1, 0)


# ---------------------------------------------------------------------------- builders


@pytest.mark.parametrize("build", BUILT)
def test_every_stage_microbatch_appears_exactly_once_per_kind(build):
    schedule = build()
    counts = Counter()
    for rank, row in enumerate(schedule.actions):
        for action in row:
            assert schedule.stage_to_rank[action.stage] == rank
            counts[action] += 1
    assert set(counts.values()) == {1}
    for stage in range(schedule.num_stages):
        for m in range(schedule.num_microbatches):
            kinds = {kind for kind in "FBIW" if counts[Action(kind, stage, m)]}
            assert kinds in ({"F", "B"}, {"F", "I", "W"}), (stage, m, kinds)
    assert sum(counts.values()) == sum(len(row) for row in schedule.actions)


def test_one_f_one_b_order():
    schedule = one_f_one_b(3, 4)
    assert " ".join(map(str, schedule.actions_of(0))) == "F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 B0.2 B0.3"
    assert " ".join(map(str, schedule.actions_of(2))) == "F2.0 B2.0 F2.1 B2.1 F2.2 B2.2 F2.3 B2.3"


def test_interleaved_layout_and_groups():
    schedule = interleaved_1f1b(num_ranks=4, num_microbatches=8, virtual_stages=2)
    assert schedule.num_stages == 8 and schedule.num_ranks == 4
    assert [schedule.stages_of(r) for r in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    forwards = [a for a in schedule.actions_of(0) if a.kind == "F"]
    # First group of num_ranks microbatches through stage 0, then through stage 4, then group 2.
    assert [(a.stage, a.microbatch) for a in forwards[:12]] == (
        [(0, m) for m in range(4)] + [(4, m) for m in range(4)] + [(0, m) for m in range(4, 8)]
    )


def test_interleaved_with_one_virtual_stage_is_1f1b():
    assert interleaved_1f1b(4, 8, 1).actions == one_f_one_b(4, 8).actions


def test_zero_bubble_defers_w_by_rank_index():
    schedule = zero_bubble_h1(3, 5)
    for rank, row in enumerate(schedule.actions):
        assert all(action.kind != "B" for action in row)
        order = [str(action) for action in row]
        for m in range(5 - rank):
            # W(m) comes right after I(m + rank).
            assert order.index(f"W{rank}.{m}") == order.index(f"I{rank}.{m + rank}") + 1


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: one_f_one_b(4, 3), r"1f1b needs at least .* use 4 microbatches or more.*'gpipe'"),
        (lambda: zero_bubble_h1(3, 2), r"zero-bubble-h1 .*use 3 microbatches or more.*'gpipe'"),
        (lambda: interleaved_1f1b(4, 2, 2), r"use 4 microbatches or more.*'gpipe'"),
        (lambda: interleaved_1f1b(4, 6, 2), r"multiple of 4, got 6"),
        (
            lambda: interleaved_zero_bubble(2, 5, 2),
            r"^interleaved-zero-bubble .*multiple of 2, got 5",
        ),
        (lambda: interleaved_1f1b(4, 8, 0), r"virtual_stages must be >= 1"),
        (lambda: gpipe(0, 4), r"num_stages must be a positive int"),
        # builders taking a rank count name it (they said num_stages)
        (lambda: schedules.dualpipe_v(0, 4), r"^num_ranks must be a positive int, got 0"),
        (lambda: schedules.zero_bubble_v(0, 4), r"^num_ranks must be a positive int, got 0"),
        (lambda: interleaved_1f1b(-1, 4, 2), r"^num_ranks must be a positive int, got -1"),
        (lambda: one_f_one_b(2, -1), r"num_microbatches must be a positive int"),
    ],
)
def test_builders_reject_bad_sizes(build, message):
    with pytest.raises(ValueError, match=message):
        build()


# ---------------------------------------------------------------------------- get


@pytest.mark.parametrize(
    ("name", "builder"),
    [("gpipe", gpipe), ("1f1b", one_f_one_b), ("zero-bubble-h1", zero_bubble_h1)],
)
def test_get_maps_names_to_builders(name, builder):
    assert get(name, 4, 8) == builder(4, 8)
    assert get(name, 4, 8).name == name


def test_get_interleaved_counts_model_stages():
    assert get("interleaved-1f1b", 8, 8, virtual_stages=2) == interleaved_1f1b(4, 8, 2)


def test_get_unknown_name_lists_valid_names():
    with pytest.raises(ValueError) as info:
        get("nope", 4, 8)
    message = str(info.value)
    assert "'nope'" in message
    for name in schedules.names():
        assert repr(name) in message


def test_get_rejects_bad_virtual_stages():
    with pytest.raises(ValueError, match="virtual_stages=3 does not divide num_stages=8"):
        get("interleaved-1f1b", 8, 8, virtual_stages=3)
    with pytest.raises(ValueError, match="several stages per rank") as info:
        get("1f1b", 4, 8, virtual_stages=2)
    assert "'zero-bubble-v'" in str(info.value) and "'1f1b' runs one stage" in str(info.value)
    with pytest.raises(ValueError, match="virtual_stages must be an int >= 1"):
        get("interleaved-1f1b", 4, 8, virtual_stages=0)
    for name in ("interleaved-1f1b", "interleaved-gpipe", "interleaved-zero-bubble"):
        with pytest.raises(ValueError, match=f"{name} with virtual_stages=1 would run one stage"):
            get(name, 4, 8)


def test_one_record_per_name_says_its_placement_and_costs():
    from mmnnx.mpmd.schedules.registry import Placement, registered

    several = [
        n for n in schedules.names() if registered(n).placement is not Placement.ONE_PER_RANK
    ]
    assert several == [
        "interleaved-1f1b",
        "interleaved-gpipe",
        "zero-bubble-v",
        "interleaved-zero-bubble",
        "dualpipev",
    ]
    assert registered("zero-bubble-v").placement is Placement.V_SHAPED
    for name in schedules.names():  # the record says what the builder's signature does
        entry = registered(name)
        assert entry.name == name
        assert entry.takes_costs == ("costs" in inspect.signature(entry.builder).parameters)
    with pytest.raises(ValueError, match="several stages per rank \\('interleaved-1f1b', "):
        get("gpipe", 4, 8, virtual_stages=2)

    def with_costs(num_stages, num_microbatches, virtual_stages, costs=None):
        return gpipe(num_stages, num_microbatches)

    schedules.register("with-costs", with_costs)
    try:
        user = registered("with-costs")
        assert (user.placement, user.takes_costs) == (Placement.BUILDER_DECIDES, True)
        assert get("with-costs", 2, 2, costs={"F": 1, "B": 2}) == gpipe(2, 2)
        assert "with-costs" not in str(pytest.raises(ValueError, get, "1f1b", 2, 2, 2).value)
    finally:
        schedules.unregister("with-costs")


# ---------------------------------------------------------------------------- simulation


@pytest.mark.parametrize("builder", [gpipe, one_f_one_b])
@pytest.mark.parametrize(("num_stages", "num_microbatches"), SIZES)
@pytest.mark.parametrize(("forward", "backward"), [(1, 2), (1, 1), (2, 5)])
def test_gpipe_and_1f1b_bubble_formula(builder, num_stages, num_microbatches, forward, backward):
    result = simulate(builder(num_stages, num_microbatches), Fraction(forward), Fraction(backward))
    assert result.makespan == (num_microbatches + num_stages - 1) * (forward + backward)
    assert result.bubble_fraction == Fraction(num_stages - 1, num_microbatches + num_stages - 1)


def test_bubble_fraction_with_plain_numbers():
    assert simulate(one_f_one_b(4, 8)).bubble_fraction == pytest.approx(3 / 11, rel=1e-12)


@pytest.mark.parametrize(("num_stages", "num_microbatches"), SIZES)
def test_peak_in_flight_1f1b_vs_gpipe(num_stages, num_microbatches):
    assert simulate(gpipe(num_stages, num_microbatches)).peak_in_flight == (
        (num_microbatches,) * num_stages
    )
    peak = simulate(one_f_one_b(num_stages, num_microbatches)).peak_in_flight
    assert peak[0] == num_stages <= num_microbatches
    assert peak == tuple(num_stages - s for s in range(num_stages))


@pytest.mark.parametrize(
    ("num_ranks", "virtual_stages", "num_microbatches"),
    [(4, 2, 8), (4, 2, 16), (2, 3, 4), (4, 4, 8), (3, 2, 3)],
)
def test_interleaved_bubble_formula(num_ranks, virtual_stages, num_microbatches):
    # Convention: costs are per stage, so with v stages per rank each costs 1/v of a full rank.
    v = virtual_stages
    schedule = interleaved_1f1b(num_ranks, num_microbatches, v)
    result = simulate(schedule, forward_cost=Fraction(1, v), backward_cost=Fraction(2, v))
    assert result.bubble_fraction == Fraction(num_ranks - 1, v * num_microbatches + num_ranks - 1)
    plain = simulate(one_f_one_b(num_ranks, num_microbatches))
    assert result.bubble_fraction < plain.bubble_fraction


@pytest.mark.parametrize(
    ("num_ranks", "virtual_stages", "num_microbatches"),
    [(4, 2, 8), (2, 3, 4), (3, 2, 3), (4, 1, 8)],
)
def test_interleaved_gpipe_bubble_and_memory(num_ranks, virtual_stages, num_microbatches):
    v = virtual_stages
    schedule = interleaved_gpipe(num_ranks, num_microbatches, v)
    assert schedule.stages_of(1) == tuple(1 + k * num_ranks for k in range(v))
    result = simulate(schedule, forward_cost=Fraction(1, v), backward_cost=Fraction(2, v))
    # the interleaved formula for M >= R: GPipe's bubble divided by about v ...
    assert result.bubble_fraction == Fraction(num_ranks - 1, v * num_microbatches + num_ranks - 1)
    plain = simulate(gpipe(num_ranks, num_microbatches), Fraction(1), Fraction(2))
    assert result.bubble_fraction <= plain.bubble_fraction
    # ... at GPipe's memory: every stage holds all M microbatches until its backwards
    assert result.peak_in_flight == (num_microbatches,) * (num_ranks * v)
    if v == 1:
        assert schedule.actions == gpipe(num_ranks, num_microbatches).actions


@pytest.mark.parametrize(("num_stages", "num_microbatches"), [*SIZES, (3, 3), (5, 7)])
def test_zero_bubble_h1_beats_1f1b_at_the_same_peak(num_stages, num_microbatches):
    zb = simulate(zero_bubble_h1(num_stages, num_microbatches))
    ofb = simulate(one_f_one_b(num_stages, num_microbatches))
    assert zb.bubble_fraction < ofb.bubble_fraction
    # Paper's memory claim: the peak (the first stage's) equals 1F1B's; later stages hold their
    # W passes longer and rise to that same peak (counting activations until W).
    assert zb.peak_in_flight[0] == ofb.peak_in_flight[0] == max(ofb.peak_in_flight)
    assert max(zb.peak_in_flight) == max(ofb.peak_in_flight) == num_stages


@pytest.mark.parametrize(
    ("forward", "backward", "weight"),
    [(1, 2, None), (1, 2, 1), (1, 3, 1), (2, 3, 1), (1, 2, Fraction(1, 2))],
)
@pytest.mark.parametrize(("num_stages", "num_microbatches"), SIZES)
def test_zero_bubble_h1_bubble_is_paper_formula(
    forward, backward, weight, num_stages, num_microbatches
):
    # ZB-H1 idles (S-1)(F + I - W) per rank instead of 1F1B's (S-1)(F + B).
    result = simulate(zero_bubble_h1(num_stages, num_microbatches), forward, backward, weight)
    w = Fraction(backward, 2) if weight is None else weight
    i = backward - w
    expected = num_microbatches * (forward + backward) + (num_stages - 1) * (forward + i - w)
    assert result.makespan == expected


def test_simulation_events_respect_order_and_costs():
    schedule = zero_bubble_h1(3, 4)
    result = simulate(schedule, forward_cost=1, backward_cost=3, weight_cost=1)
    assert len(result.events) == sum(len(row) for row in schedule.actions)
    cost = {"F": 1, "I": 2, "W": 1}
    for rank in range(schedule.num_ranks):
        mine = [e for e in result.events if e.rank == rank]
        assert [Action(e.kind, e.stage, e.microbatch) for e in mine] == list(
            schedule.actions_of(rank)
        )
        assert all(e.end - e.start == cost[e.kind] for e in mine)
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:], strict=False))
    ends = {(e.kind, e.stage, e.microbatch): e.end for e in result.events}
    starts = {(e.kind, e.stage, e.microbatch): e.start for e in result.events}
    assert all(starts["F", s, m] >= ends["F", s - 1, m] for s in (1, 2) for m in range(4))
    assert all(starts["I", s, m] >= ends["I", s + 1, m] for s in (0, 1) for m in range(4))
    assert result.makespan == max(ends.values())


def test_simulate_rejects_bad_costs():
    with pytest.raises(ValueError, match="must be positive"):
        simulate(gpipe(2, 2), forward_cost=0)
    with pytest.raises(ValueError, match="weight_cost must be in"):
        simulate(zero_bubble_h1(2, 2), backward_cost=2, weight_cost=3)


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            [["B0.0", "F0.0"], ["F1.0", "B1.0"]],
            r"rank 0 action B0\.0 waits for F0\.0 \(stage 0, rank 0\), which rank 0 runs only "
            r"later",
        ),
        ([["F0.0", "F0.1", "B0.0"], ["F1.0", "B1.0", "F1.1", "B1.1"]], r"missing action B0\.1"),
        ([["F0.0", "B0.0"], ["B1.0"]], r"missing action F1\.0"),
        ([["F0.0", "I0.0"]], r"missing action W0\.0"),
        ([["F0.0", "B0.0", "W0.0"]], r"B0\.0 and a split backward"),
        (
            [["F0.0", "F0.0", "B0.0"]],
            r"duplicate action F0\.0: rank 0 runs it at positions 0 and 1",
        ),
        (
            [["F0.0", "B0.0", "F1.0"], ["B1.0"]],
            r"stage 1 appears on rank 0 \(F1\.0\) and on rank 1",
        ),
        (
            [["F0.0", "B0.0", "F0.1", "B0.1"], ["F1.1", "B1.1", "F1.0", "B1.0"]],
            r"rank 0 action B0\.0 waits for B1\.0 \(stage 1, rank 1\), which never runs before "
            r"it: rank 1 is stuck at F1\.1, waiting for F0\.1",
        ),
    ],
    ids=[
        "b-before-f",
        "missing-b",
        "missing-f",
        "missing-w",
        "b-and-w",
        "duplicate",
        "two-ranks",
        "cycle",
    ],
)
def test_validation_errors_name_the_action(table, message):
    with pytest.raises(ValueError, match=message):
        custom(table)


def test_deadlock_names_the_chain_and_every_blocked_rank():
    # Ranks 1 and 2 wait on each other; rank 0 waits on rank 1.
    table = [
        ["F0.0", "F0.1", "B0.0", "B0.1"],
        ["F1.0", "B1.0", "F1.1", "B1.1"],
        ["F2.1", "B2.1", "F2.0", "B2.0"],
    ]
    with pytest.raises(ValueError) as info:
        custom(table, name="tangle")
    message = str(info.value)
    assert message.startswith(
        "schedule 'tangle' deadlocks: rank 0 action B0.0 waits for B1.0 (stage 1, rank 1), "
        "which never runs before it: rank 1 is stuck at B1.0, waiting for B2.0."
    )
    assert (
        "Blocked: rank 0 at B0.0 (needs B1.0), rank 1 at B1.0 (needs B2.0), "
        "rank 2 at F2.1 (needs F1.1)." in message
    )


def test_validate_checks_hand_built_schedules():
    wrong_rank = Schedule("bad", 2, 1, 2, (0, 1), [[Action("F", 1, 0)], [Action("B", 1, 0)]])
    with pytest.raises(ValueError, match=r"action F1\.0 is on rank 0, but stage 1 belongs to"):
        validate(wrong_rank)
    out_of_range = Schedule("bad", 1, 1, 1, (0,), [[Action("F", 0, 1), Action("B", 0, 0)]])
    with pytest.raises(ValueError, match=r"names microbatch 1"):
        validate(out_of_range)
    ok = Schedule("ok", 1, 1, 1, [0], [[Action("F", 0, 0), Action("B", 0, 0)]])
    assert validate(ok) is ok
    assert ok.stage_to_rank == (0,)


def test_custom_accepts_actions_strings_and_tuples():
    table = [[Action("F", 0, 0), "F1.0", ("B", 1, 0), "B0.0"]]
    schedule = custom(table, name="mixed")
    assert schedule.name == "mixed"
    assert schedule.num_ranks == 1 and schedule.stages_of(0) == (0, 1)


# ---------------------------------------------------------------------------- CSV and printing


@pytest.mark.parametrize("build", BUILT)
def test_csv_round_trip(build):
    schedule = build()
    text = schedule.to_csv()
    assert text.splitlines()[0].startswith("rank,0,1")
    assert from_csv(text, name=schedule.name) == schedule
    assert Schedule.from_csv(text, name=schedule.name) == schedule


def test_csv_format():
    text = zero_bubble_h1(2, 2).to_csv()
    assert text.splitlines() == [
        "rank,0,1,2,3,4,5",
        "0,F0.0,F0.1,I0.0,W0.0,I0.1,W0.1",
        "1,F1.0,I1.0,F1.1,I1.1,W1.0,W1.1",
    ]
    padded = one_f_one_b(2, 2).to_csv().replace("B1.1", "B1.1,,")
    assert from_csv(padded + "\n\n").actions == one_f_one_b(2, 2).actions


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "header row"),
        ("stage,0\n0,F0.0\n", "header row"),
        ("rank,0,1\n1,F0.0,B0.0\n", "should be rank 0"),
        ("rank,0,1\n0,F0.0,X0.0\n", "cannot read action 'X0.0'"),
    ],
)
def test_from_csv_errors(text, message):
    with pytest.raises(ValueError, match=message):
        from_csv(text)


@pytest.mark.parametrize("build", BUILT)
def test_str_draws_one_row_per_rank(build):
    schedule = build()
    lines = str(schedule).splitlines()
    assert lines[0].startswith(f"{schedule.name}: {schedule.num_stages} stages")
    assert len(lines) == 1 + schedule.num_ranks
    for rank, line in enumerate(lines[1:]):
        assert line.startswith(f"rank {rank}")
        assert all(str(action) in line for action in schedule.actions_of(rank))


def test_str_grid_shows_bubbles_as_blanks():
    assert str(gpipe(2, 2)).splitlines()[1:] == [
        "rank 0 | F0.0 F0.1           B0.0 B0.1",
        "rank 1 |      F1.0 F1.1 B1.0 B1.1",
    ]


def test_str_of_a_schedule_that_cannot_run_still_prints():
    stuck = Schedule("stuck", 1, 1, 1, (0,), [[Action("B", 0, 0), Action("F", 0, 0)]])
    text = str(stuck)
    assert "cannot run as ordered" in text
    assert "rank 0 | B0.0 F0.0" in text


def test_simulate_with_measured_costs_per_kind_and_stage():
    s = schedules.get("1f1b", num_stages=3, num_microbatches=6)
    uniform = {(k, st): c for st in range(3) for k, c in (("F", 1), ("B", 2))}
    assert schedules.simulate(s, action_costs=uniform).makespan == schedules.simulate(s).makespan
    slow_last = {**uniform, ("F", 2): 3, ("B", 2): 6}  # the last stage bounds every microbatch
    assert schedules.simulate(s, action_costs=slow_last).makespan == 6 * 9 + 2 * 3
    with pytest.raises(ValueError, match=r"no cost for \[\('B', 1\)\]"):
        schedules.simulate(s, action_costs={k: v for k, v in uniform.items() if k != ("B", 1)})


def test_simulate_takes_costs_per_kind_with_stage_entries_winning():
    s = schedules.get("1f1b", num_stages=3, num_microbatches=6)
    per_stage = {(k, st): c for st in range(3) for k, c in (("F", 1), ("B", 2))}
    slow_last = {**per_stage, ("F", 2): 3, ("B", 2): 6}
    assert (
        schedules.simulate(s, action_costs={"F": 1, "B": 2, ("F", 2): 3, ("B", 2): 6}).makespan
        == schedules.simulate(s, action_costs=slow_last).makespan
    )
    assert schedules.simulate(s, action_costs={"F": 1, "B": 2}).events == (
        schedules.simulate(s, action_costs=per_stage).events
    )


@pytest.mark.parametrize(
    ("costs", "message"),
    [
        ({"F": 1, "B": 2, ("F", 3): 1}, r"key \('F', 3\) names no action .* 3 stages"),
        ({"F": 1, "X": 2}, r"key 'X' names no action"),
        ({"F": 1, "B": -2}, r"action_costs\['B'\] must be >= 0, got -2"),
    ],
)
def test_simulate_rejects_action_costs_that_name_no_action(costs, message):
    with pytest.raises(ValueError, match=message):
        schedules.simulate(schedules.get("1f1b", 3, 6), action_costs=costs)


# ---------------------------------------------------------------------------- namespaces


def test_mm_schedules_holds_the_engine_names_and_tune():
    import mmnnx as mm

    engine = schedules
    for name in engine.__all__:
        assert getattr(mm.schedules, name) is getattr(engine, name), name
    assert set(mm.schedules.__all__) - set(engine.__all__) == {
        "Candidate",
        "NoCandidateError",
        "PartitionResult",
        "Split",
        "StagePlan",
        "StepTransfers",
        "TuneResult",
        "boundary_bytes",
        "measure_launch_cost",
        "measure_link",
        "measure_transfers",
        "partition",
        "tune",
    }
    assert not hasattr(engine, "tune")  # it runs steps: above the engine


def test_the_schedules_package_imports_only_the_standard_library_and_itself():
    import ast
    import pathlib
    import sys

    folder = pathlib.Path(schedules.__file__).parent
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                assert module.startswith("mmnnx.mpmd.schedules") or (
                    top in sys.stdlib_module_names or top == "__future__"
                ), f"{path.name} imports {module}"
