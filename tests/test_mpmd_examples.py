"""The engine's private helpers on small hand-made inputs (the examples their docstrings held)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmnnx.errors import MPMDError
from mmnnx.mpmd.engine import PlanningOptions, build_step, inside_step, trace
from mmnnx.mpmd.ir import Const, Graph, Op
from mmnnx.mpmd.plan.chain import culprit, describe
from mmnnx.mpmd.plan.cut import Fragment
from mmnnx.mpmd.plan.flow import pinned_depths
from mmnnx.mpmd.plan.net_cut import Net, NetCut
from mmnnx.mpmd.plan.pipeline import _batch_derived
from mmnnx.mpmd.plan.remat import recompute_residuals
from mmnnx.mpmd.plan.residuals import per_microbatch
from mmnnx.mpmd.plan.stage_levels import check_stage_order, settle_on_visits
from mmnnx.mpmd.schedules import (
    Action,
    Event,
    Link,
    Schedule,
    custom,
    get,
    gpipe,
    interleaved_1f1b,
    interleaved_zero_bubble,
    measured_costs,
    one_f_one_b,
    simulate,
    transfer_costs,
    zero_bubble_h1,
)
from mmnnx.mpmd.schedules.ir import check_action_key
from mmnnx.mpmd.schedules.placement import Placement
from mmnnx.mpmd.schedules.registry import registered
from mmnnx.mpmd.step_io import StepInput, StepOutput, check_homes
from mmnnx.mpmd.trace.annotations import with_sharding_constraint
from mmnnx.mpmd.trace.callbacks import CallbackFailures
from mmnnx.mpmd.trace.constraints import abstract_mesh_of
from mmnnx.mpmd.trace.control_flow import _groups, scan_first_part, scan_remake, split_scan
from mmnnx.mpmd.trace.trace_state import shapes_only
from mmnnx.mpmd.trace.trace_step import check_outputs, trace_step
from mmnnx.mpmd.trace.tracing import to_graph
from mmnnx.sharding import Task, TaskMesh

ENC = Op(0, None, {}, [9], [10], False, "", "tanh")
LAYER0 = Op(1, None, {}, [10], [11], False, "", "dot_general")
KEY1 = Op(2, None, {}, [10], [12], False, "", "dot_general")
LAYER1 = Op(3, None, {}, [11, 12], [13], False, "", "dot_general")


def test_settle_on_visits_moves_a_key_projection_to_its_tasks_depth():
    ops = [ENC, LAYER0, KEY1, LAYER1]
    graph = Graph(ops=ops, inputs=[9], outputs=[13])
    settled = settle_on_visits(graph, ops, ["t0", "t1", "t2", "t2"], {0: 0, 1: 1, 2: 1, 3: 2})
    assert settled == {0: 0, 1: 1, 2: 2, 3: 2}


def test_settle_on_visits_moves_an_unread_op_to_its_tasks_next_visit():
    metric = Op(4, None, {}, [10], [14], False, "", "mul")
    graph = Graph(ops=[ENC, LAYER0, KEY1, LAYER1, metric], inputs=[9], outputs=[13, 14])
    tasks = ["t0", "t1", "t2", "t2", "t2"]
    assert settle_on_visits(graph, graph.ops, tasks, {0: 0, 1: 1, 2: 1, 3: 2, 4: 1})[4] == 2


def test_settle_on_visits_returns_a_moved_view_to_its_tasks_depth():
    view = Op(2, None, {}, [10], [12], False, "", "reshape")
    ops = [ENC, LAYER0, view, LAYER1]
    graph = Graph(ops=ops, inputs=[9], outputs=[13])
    raw = {0: 0, 1: 1, 2: 0, 3: 2}
    assert settle_on_visits(graph, ops, ["t0", "t1", "t0", "t2"], {**raw, 2: 1}, raw)[2] == 0


def test_check_stage_order_refuses_a_backward_reading_a_later_backward():
    t1, t2 = Task("t1", mesh=TaskMesh(devices=[0])), Task("t2", mesh=TaskMesh(devices=[1]))
    dq = Op(0, None, {}, [5], [6], False, "model.py:7", "dot_general", backward=True)
    grad = Op(1, None, {}, [6], [7], False, "model.py:9", "transpose", backward=True)
    b1 = Fragment("t1/B1", t1, [dq], [5], [6], ("backward",))
    b2 = Fragment("t2/B2", t2, [grad], [6], [7], ("backward",))
    with pytest.raises(MPMDError) as raised:
        check_stage_order(Graph(ops=[dq, grad]), {("B", 1): b1, ("B", 2): b2}, [t1, t1, t2])
    assert str(raised.value).startswith(
        "mm.jit: `transpose` at model.py:9 (the backward pass of stage 2, on task 't2') reads "
        "the result of `dot_general` at model.py:7 (the backward pass of stage 1, on task 't1'), "
    )


def _scan_graph(f, *args):
    return to_graph(jax.make_jaxpr(f)(*args))


def _carry_then_matmul(w, xs):
    return jax.lax.scan(lambda c, x: (c + x, jnp.tanh(c) @ w), jnp.zeros(2), xs)


def test_groups_joins_linked_items_transitively():
    assert _groups(range(5), [(0, 3), (3, 4)]) == [[0, 3, 4], [1], [2]]


def test_scan_first_part_makes_the_carry_from_xs_alone():
    graph = _scan_graph(_carry_then_matmul, jnp.ones((2, 2)), jnp.ones((3, 2)))
    assert scan_first_part(graph.ops[-1], [True, False]) == ([True, False], [False, True, True])


def test_split_scan_saves_the_carries_the_matmul_reads():
    graph = _scan_graph(_carry_then_matmul, jnp.ones((2, 2)), jnp.ones((3, 2)))
    first, later = split_scan(graph.ops[-1], [True, False], graph)
    assert [graph.shapes[v] for v in first.outs] == [(2,), (3, 2)]
    assert [graph.shapes[v] for v in later.outs] == [(3, 2)]


def test_scan_remake_remakes_the_weight_cast_from_the_weights():
    def f(ws, c):
        return jax.lax.scan(lambda c, w: (c @ w, w.astype(jnp.bfloat16)), c, ws)

    scan = _scan_graph(f, jnp.ones((3, 2, 2)), jnp.ones(2)).ops[-1]
    remake = scan_remake(scan, [False, True], [False, True], lambda name: True)
    assert remake.outs == scan.outs[1:] and remake.ins == scan.ins[1:]


def test_per_microbatch_follows_the_carry_but_not_the_weight_cast():
    def f(ws, c):
        return jax.lax.scan(lambda c, w: (c @ w, w.astype(jnp.bfloat16)), c, ws)

    graph = _scan_graph(f, jnp.ones((3, 2, 2)), jnp.ones(2))
    varying = per_microbatch(graph, {graph.inputs[1]})
    assert [v in varying for v in graph.ops[-1].outs] == [True, False]


def test_culprit_names_the_first_op_when_no_variable_is_read():
    scale = Op(0, None, {}, [5], [6], False, "m.py:8 (Net.__call__)", "mul")
    assert culprit([scale], {}, {9: "arg0/head/kernel"}) == "`mul` at m.py:8 (Net.__call__)"


def test_batch_derived_stops_at_a_weight():
    mask = Op(0, None, {}, [7, Const(0)], [8], False, "", "gt")
    scaled = Op(1, None, {}, [8, 3], [9], False, "", "mul")
    assert _batch_derived([mask, scaled], {7}) == {8}


def test_pinned_depths_moves_a_query_projection_beside_what_it_feeds():
    enc = Op(0, None, {}, [9, 20], [10], False, "", "dot_general")
    query = Op(1, None, {}, [8, 21], [11], False, "", "dot_general")
    attend = Op(2, None, {}, [11, 10], [12], False, "", "dot_general")
    out = Op(3, None, {}, [12, 22], [13], False, "", "dot_general")
    ops = [enc, query, attend, out]
    depths = pinned_depths(Graph(ops=ops), ops, ["t0", "t1", "t0", "t1"], {0, 1, 3})
    assert depths.sources_of(attend) == {"t1": 1, "t0": 0}
    assert depths.first == {"t0": 0, "t1": 1}


def test_recompute_residuals_of_no_fragments_is_empty():
    assert recompute_residuals(Graph(), {}) == {}


def test_net_cut_moving_an_op_beside_its_readers_stops_its_bytes_crossing():
    assert Net(source=0, readers=(1, 2), nbytes=64).readers == (1, 2)
    cut = NetCut.of(["A", "B"], [Net(0, (1, 2), 8)], ["A", "B", "A"], {0})
    assert (cut.crossing(), cut.expand(0), cut.crossing(), cut.tasks_of_ops()) == (
        8,
        True,
        0,
        ("A", "A", "A"),
    )


def test_planning_options_read_false_packing_as_no_bytes():
    assert PlanningOptions(residual_bytes=False, schedule="gpipe").residual_bytes == 0


def test_build_step_plans_a_one_task_step_without_compiling():
    s0 = Task("s0", mesh=TaskMesh(devices=[0]))
    w = StepInput(name="w", task=s0, shape=(2,), dtype="f4", sharding=s0.sharding())
    traced = trace(lambda w: (w * 2, ()), [w], lambda shape: [StepOutput()], name_as=_step)
    built = build_step(traced, [w], PlanningOptions())
    assert built.num_outputs == 1
    assert [t.name for t in built.executable.plan.tasks] == ["s0"]
    graph = traced.step.graph  # planned on a copy, which planning may change freely
    copy = graph.copy()
    copy.ops.pop()
    copy.new_value(((3,), np.dtype("f4"), 12))
    copy.specs[0] = "changed"
    assert [len(graph.ops), len(graph.shapes), graph.specs] == [1, 2, {}]


def _step():
    """The name a traced step is given in errors."""


def test_inside_step_is_false_outside_a_trace():
    assert inside_step() is False


def test_trace_step_and_check_outputs():
    traced = trace_step(
        lambda x: x * 2, [StepInput(name="x", shape=(2,), dtype="f4")], name_as=_step
    )
    assert [op.primitive.name for op in traced.graph.ops] == ["mul"]
    assert traced.out_shape.shape == (2,)
    check_outputs({"loss": np.float32(1.0), "n": 3}, "step")
    with pytest.raises(Exception, match="step"):
        check_outputs({"name": "a string"}, "step")


def test_check_homes_of_unplaced_inputs_is_no_devices():
    assert check_homes([StepInput(name="x", shape=(2,), dtype="float32")]) == set()


def test_callback_failures_are_taken_once():
    failures = CallbackFailures()
    failures.record(ValueError("bad batch"))
    assert [str(e) for e in failures.take()] == ["bad batch"]
    assert failures.take() == []


def test_abstract_mesh_of_a_task_keeps_its_axes():
    mesh = TaskMesh(devices=range(4), axis_sizes=(2, 2), axis_names=("data", "model"))
    assert dict(abstract_mesh_of([Task("t", mesh=mesh).jax_mesh]).shape) == {"data": 2, "model": 2}


def test_shapes_only_lets_a_sharding_constraint_pass_without_a_mesh():
    with shapes_only():
        out = jax.eval_shape(lambda x: with_sharding_constraint(x, ("batch",)), jnp.ones(4))
    assert out.shape == (4,)


def test_registered_placement_and_costs_and_action_keys():
    entry = registered("zero-bubble-v")
    assert (entry.placement, entry.takes_costs) == (Placement.V_SHAPED, True)
    assert repr(entry.placement) == "<Placement two stages per rank in a V>"
    assert (Placement.V_SHAPED.order(2), Placement.V_SHAPED.order(3)) == ("v", None)
    assert Placement.V_SHAPED.runs == "2"
    check_action_key(gpipe(2, 2), ("B", 1), "action_costs")
    with pytest.raises(ValueError, match="action_costs key"):
        check_action_key(gpipe(2, 2), ("B", 2), "action_costs")


def test_simulate_zero_bubble_transfers_and_launches():
    assert simulate(gpipe(2, 4)).events[0] == Event(
        rank=0, kind="F", stage=0, microbatch=0, start=0, end=1
    )
    assert simulate(zero_bubble_h1(4, 8)).makespan == 27.0
    assert simulate(one_f_one_b(2, 2), transfer_costs={"F": 0.5, "B": 0.5}).makespan == 10.0
    assert simulate(one_f_one_b(2, 2), launch_cost=0.5).makespan == 9.5  # F0.0's launch


def test_measured_costs_mean():
    events = [Event(0, "F", 0, 0, 0.0, 1.0), Event(0, "F", 0, 1, 1.0, 4.0)]
    assert measured_costs([*events, Event(0, "F", 0, 2, 4.0, 6.0)], average="mean") == {
        ("F", 0): 2.0
    }


def test_schedule_records_csv_and_custom_tables():
    assert Action.parse(" I3.12 ") == Action("I", 3, 12)
    schedule = gpipe(2, 2)
    assert schedule.stage_to_rank == (0, 1)
    assert [str(a) for a in schedule.actions_of(1)] == ["F1.0", "F1.1", "B1.0", "B1.1"]
    read = Schedule.from_csv("rank,0,1\n0,F0.0,B0.0\n")
    assert (read.num_stages, read.num_microbatches, read.num_ranks) == (1, 1, 1)
    assert custom([["F0.0", "F0.1+B0.0", "B0.1"]]).overlapped == ((1,),)
    with pytest.raises(ValueError, match="missing action W0.0: I0.0 is present"):
        custom([["F0.0", "I0.0"]])


def test_links_transfer_costs_and_registry_examples():
    assert round(Link(latency=20e-6, bandwidth=1e9).seconds(1_000_000), 6) == 0.00102
    schedule = one_f_one_b(2, 4)
    costs = transfer_costs(schedule, {(0, 1): Link(0.25, 4.0)}, {"F": 1, "B": 3})
    assert simulate(schedule, transfer_costs=costs).makespan == 18.0
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'; valid names: 'gpipe'"):
        get("pipedream", 4, 8)
    zb = simulate(interleaved_zero_bubble(4, 8, 2), 0.5, 1)
    plain = simulate(interleaved_1f1b(4, 8, 2), 0.5, 1)
    assert max(zb.peak_in_flight) <= max(plain.peak_in_flight)


def test_describe_names_the_variable_that_brings_the_chain_back():
    t0, t1 = types.SimpleNamespace(name="t0"), types.SimpleNamespace(name="t1")
    embed = Op(0, None, {}, [5, 9], [6], False, "m.py:3", "gather")
    layer = Op(1, None, {}, [6, 8], [7], False, "m.py:4", "dot_general")
    table = Op(2, None, {}, [9], [10], False, "m.py:5", "transpose")
    head = Op(3, None, {}, [7, 10], [11], False, "m.py:5", "dot_general")
    producer = {6: embed, 7: layer, 10: table, 11: head}
    names = {9: "arg0/embed/embedding", 8: "arg0/layer/kernel"}
    assert describe([t0, t1, t0], [[embed], [layer], [table, head]], producer, names) == (
        "the forward pass runs on t0 -> t1 -> t0: stage 2 comes back to t0 for "
        "'arg0/embed/embedding' (read by `transpose` at m.py:5)"
    )


def test_step_records_unplaced_inputs_and_homed_outputs():
    s0 = Task("s0", mesh=TaskMesh(devices=[0]))
    x = StepInput(name="x", shape=(8, 2), dtype="float32")
    w = StepInput(name="w", task=s0, shape=(2, 4), dtype="float32")
    assert [i.name for i in (x, w) if i.task is None] == ["x"]
    assert StepOutput(home=s0).task.name == "s0"
