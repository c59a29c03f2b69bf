"""The engine's private helpers on small hand-made inputs (the examples their docstrings held)."""

import pytest

from mmnnx.errors import MPMDError
from mmnnx.mpmd.ir import Graph, Op
from mmnnx.mpmd.plan.cut import Fragment
from mmnnx.mpmd.plan.stage_levels import check_stage_order, settle_on_visits
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
    import jax

    from mmnnx.mpmd.trace.tracing import to_graph

    return to_graph(jax.make_jaxpr(f)(*args))


def _carry_then_matmul(w, xs):
    import jax
    import jax.numpy as jnp

    return jax.lax.scan(lambda c, x: (c + x, jnp.tanh(c) @ w), jnp.zeros(2), xs)


def test_groups_joins_linked_items_transitively():
    from mmnnx.mpmd.trace.control_flow import _groups

    assert _groups(range(5), [(0, 3), (3, 4)]) == [[0, 3, 4], [1], [2]]


def test_scan_first_part_makes_the_carry_from_xs_alone():
    import jax.numpy as jnp

    from mmnnx.mpmd.trace.control_flow import scan_first_part

    graph = _scan_graph(_carry_then_matmul, jnp.ones((2, 2)), jnp.ones((3, 2)))
    assert scan_first_part(graph.ops[-1], [True, False]) == ([True, False], [False, True, True])


def test_split_scan_saves_the_carries_the_matmul_reads():
    import jax.numpy as jnp

    from mmnnx.mpmd.trace.control_flow import split_scan

    graph = _scan_graph(_carry_then_matmul, jnp.ones((2, 2)), jnp.ones((3, 2)))
    first, later = split_scan(graph.ops[-1], [True, False], graph)
    assert [graph.shapes[v] for v in first.outs] == [(2,), (3, 2)]
    assert [graph.shapes[v] for v in later.outs] == [(3, 2)]


def test_scan_remake_remakes_the_weight_cast_from_the_weights():
    import jax
    import jax.numpy as jnp

    from mmnnx.mpmd.trace.control_flow import scan_remake

    def f(ws, c):
        return jax.lax.scan(lambda c, w: (c @ w, w.astype(jnp.bfloat16)), c, ws)

    scan = _scan_graph(f, jnp.ones((3, 2, 2)), jnp.ones(2)).ops[-1]
    remake = scan_remake(scan, [False, True], [False, True], lambda name: True)
    assert remake.outs == scan.outs[1:] and remake.ins == scan.ins[1:]


def test_per_microbatch_follows_the_carry_but_not_the_weight_cast():
    import jax
    import jax.numpy as jnp

    from mmnnx.mpmd.plan.residuals import per_microbatch

    def f(ws, c):
        return jax.lax.scan(lambda c, w: (c @ w, w.astype(jnp.bfloat16)), c, ws)

    graph = _scan_graph(f, jnp.ones((3, 2, 2)), jnp.ones(2))
    varying = per_microbatch(graph, {graph.inputs[1]})
    assert [v in varying for v in graph.ops[-1].outs] == [True, False]


def test_culprit_names_the_first_op_when_no_variable_is_read():
    from mmnnx.mpmd.plan.chain import culprit

    scale = Op(0, None, {}, [5], [6], False, "m.py:8 (Net.__call__)", "mul")
    assert culprit([scale], {}, {9: "arg0/head/kernel"}) == "`mul` at m.py:8 (Net.__call__)"


def test_batch_derived_stops_at_a_weight():
    from mmnnx.mpmd.ir import Const
    from mmnnx.mpmd.plan.pipeline import _batch_derived

    mask = Op(0, None, {}, [7, Const(0)], [8], False, "", "gt")
    scaled = Op(1, None, {}, [8, 3], [9], False, "", "mul")
    assert _batch_derived([mask, scaled], {7}) == {8}


def test_pinned_depths_moves_a_query_projection_beside_what_it_feeds():
    from mmnnx.mpmd.plan.flow import pinned_depths

    enc = Op(0, None, {}, [9, 20], [10], False, "", "dot_general")
    query = Op(1, None, {}, [8, 21], [11], False, "", "dot_general")
    attend = Op(2, None, {}, [11, 10], [12], False, "", "dot_general")
    out = Op(3, None, {}, [12, 22], [13], False, "", "dot_general")
    ops = [enc, query, attend, out]
    depths = pinned_depths(Graph(ops=ops), ops, ["t0", "t1", "t0", "t1"], {0, 1, 3})
    assert depths.sources_of(attend) == {"t1": 1, "t0": 0}
    assert depths.first == {"t0": 0, "t1": 1}


def test_recompute_residuals_of_no_fragments_is_empty():
    from mmnnx.mpmd.plan.remat import recompute_residuals

    assert recompute_residuals(Graph(), {}) == {}


def test_net_cut_moving_an_op_beside_its_readers_stops_its_bytes_crossing():
    from mmnnx.mpmd.plan.net_cut import Net, NetCut

    assert Net(source=0, readers=(1, 2), nbytes=64).readers == (1, 2)
    cut = NetCut.of(["A", "B"], [Net(0, (1, 2), 8)], ["A", "B", "A"], {0})
    assert (cut.crossing(), cut.expand(0), cut.crossing(), cut.tasks_of_ops()) == (
        8,
        True,
        0,
        ("A", "A", "A"),
    )
