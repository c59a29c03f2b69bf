"""The engine's passes on small graphs built by hand: colouring, levels, cutting, stage
assignment, the backward split, and lowering to per-task programs (no tracing, no compiling)."""

import numpy as np
import pytest
from jax.sharding import PartitionSpec

import mmnnx as mm
from mmnnx.mpmd.ir import Graph, Op
from mmnnx.mpmd.lower.localize import localize
from mmnnx.mpmd.lower.lower import lower
from mmnnx.mpmd.lower.order import check_same_order
from mmnnx.mpmd.lower.pack import pack
from mmnnx.mpmd.lower.program import (
    Constant,
    Output,
    Recv,
    Release,
    Route,
    Run,
    Send,
    StepProgram,
    Zeros,
)
from mmnnx.mpmd.lower.releases import add_releases
from mmnnx.mpmd.plan.colour import colour
from mmnnx.mpmd.plan.cut import Fragment, cut, levels, make_fragment
from mmnnx.mpmd.plan.flow import follow_the_flow
from mmnnx.mpmd.plan.net_cut import Net, NetCut
from mmnnx.mpmd.plan.pipeline import split_backward, stage_fragments
from mmnnx.mpmd.plan.remat import recompute_residuals
from mmnnx.mpmd.plan.stage_levels import join_consumers
from mmnnx.mpmd.primitives import index_p
from mmnnx.mpmd.step_io import StepInput, StepOutput


@pytest.fixture(scope="module")
def tasks():
    return [mm.Task(name, mesh=mm.TaskMesh(devices=[i])) for i, name in enumerate("AB")]


def ins(**placed) -> list[StepInput]:
    """One input record per keyword, in order: its task, or (task, sharding), or None."""
    out = []
    for name, where in placed.items():
        task, sharding = where if isinstance(where, tuple) else (where, None)
        out.append(StepInput(name=name, task=task, sharding=sharding))
    return out


class Builder:
    """Builds an ``ir.Graph`` op by op; every value is a float32 vector of ``size`` elements."""

    def __init__(self):
        self.graph = Graph()

    def value(self, size: int) -> int:
        return self.graph.new_value(((size,), np.dtype("float32"), 4 * size))

    def input(self, size: int = 1) -> int:
        v = self.value(size)
        self.graph.inputs.append(v)
        return v

    def op(self, name, *ins, size=1, backward=False, region=None, group=None) -> int:
        out = self.value(size)
        self.graph.ops.append(
            Op(
                index=len(self.graph.ops),
                primitive=None,
                params={},
                ins=list(ins),
                outs=[out],
                multiple_results=False,
                source=f"test.py:{len(self.graph.ops)} ({name})",
                name=name,
                backward=backward,
                region=region,
                group=group,
            )
        )
        return out

    def outputs(self, *values):
        self.graph.outputs = list(values)
        return self.graph


def two_layer_chain():
    """x -> dot(x, pa) -> tanh -> dot(., pb) -> tanh; pa on A, pb on B."""
    b = Builder()
    x, pa, pb = b.input(64), b.input(8), b.input(8)
    h = b.op("tanh", b.op("dot_general", x, pa, size=64), size=64)
    y = b.op("tanh", b.op("dot_general", h, pb, size=64), size=64)
    return b.outputs(y), (x, pa, pb)


def test_colour_follows_state_and_moves_the_fewest_bytes(tasks):
    a, bt = tasks
    graph, _ = two_layer_chain()
    labels = colour(graph, ins(x=None, pa=a, pb=bt), [StepOutput()], tasks).op_tasks
    assert [t.name for t in labels] == ["A", "A", "B", "B"]


def test_colour_keeps_a_free_op_with_its_heaviest_operand(tasks):
    a, bt = tasks
    b = Builder()
    pa, pb = b.input(1000), b.input(1)
    big, small = b.op("exp", pa, size=1000), b.op("exp", pb, size=1)
    graph = b.outputs(b.op("mul", big, small, size=1000))
    labels = colour(graph, ins(pa=a, pb=bt), [StepOutput()], tasks).op_tasks
    assert [t.name for t in labels] == ["A", "B", "A"]


def test_colour_counts_a_value_once_per_task_that_receives_it(tasks):
    """A block's output read by three ops of the next stage crosses once (256 B) rather than
    the two addends of the residual sum that makes it (512 B); a value returned to the task
    that reads it is sent there once."""
    a, bt = tasks
    b = Builder()
    x, pa, pb = b.input(64), b.input(8), b.input(8)
    h = b.op("dot_general", x, pa, size=64)
    branch = b.op("dot_general", h, pa, size=64)
    y = b.op("add", h, branch, size=64)  # the residual sum: reads no state
    graph = b.outputs(*(b.op("dot_general", y, pb, size=64) for _ in range(3)))
    labels = colour(graph, ins(x=None, pa=a, pb=bt), [StepOutput()] * 3, tasks).op_tasks
    assert [t.name for t in labels] == ["A", "A", "A", "B", "B", "B"]
    producer = graph.producers()
    crossing = {
        (v, labels[op.index])
        for op in graph.ops
        for v in op.ins
        if v in producer and labels[producer[v].index] is not labels[op.index]
    }
    assert crossing == {(y, bt)}
    returned = NetCut.of(tasks, [Net(0, (1, bt), 256)], [a, bt], {0})
    assert returned.crossing() == 256


def test_colour_names_both_variables_of_a_conflict(tasks):
    a, bt = tasks
    b = Builder()
    pa, pb = b.input(4), b.input(4)
    view = b.op("reshape", pa, size=4)  # a view of pa still is pa
    graph = b.outputs(b.op("add", view, pb, size=4))
    with pytest.raises(mm.PlacementConflictError, match="reads pa .*'A'.* and pb .*'B'"):
        colour(graph, ins(pa=a, pb=bt), [StepOutput()], tasks)


def test_colour_region_wins_and_rejects_foreign_state(tasks):
    a, bt = tasks
    b = Builder()
    x, pa = b.input(4), b.input(4)
    graph = b.outputs(b.op("exp", x, size=4, region="B"))
    labels = colour(graph, ins(x=None, pa=a), [StepOutput()], tasks, {"B": bt}).op_tasks
    assert labels[0] is bt
    b = Builder()
    pa = b.input(4)
    graph = b.outputs(b.op("exp", pa, size=4, region="B"))
    with pytest.raises(mm.PlacementConflictError, match="region 'B' but reads pa"):
        colour(graph, ins(pa=a), [StepOutput()], tasks, {"B": bt})


def test_levels_count_task_changes_and_move_free_ops_late(tasks):
    a, bt = tasks
    b = Builder()
    x = b.input()
    u = b.op("exp", x)  # A, depth 0
    v = b.op("exp", u)  # B, depth 1
    seed = b.op("iota")  # reads nothing: joins its consumer's level
    w = b.op("add", v, seed)  # B, depth 1
    graph = b.outputs(b.op("exp", w))  # A, depth 2
    op_tasks = [a, bt, bt, bt, a]
    assert levels(graph, graph.ops, op_tasks) == {0: 0, 1: 1, 2: 1, 3: 1, 4: 2}


def test_cut_groups_by_level_and_task_with_their_inputs_and_outputs(tasks):
    a, bt = tasks
    graph, (x, pa, pb) = two_layer_chain()
    fragments = cut(graph, [a, a, bt, bt], tasks)
    assert [f.name for f in fragments] == ["A#0", "B#0"]
    first, second = fragments
    assert first.in_ids == [x, pa] and first.out_ids == [graph.ops[1].outs[0]]
    assert second.in_ids == [graph.ops[1].outs[0], pb] and second.out_ids == graph.outputs
    assert first.kinds == ("forward",)


def forward_backward_chain():
    """A two-stage forward with its backward, as mm.microbatch's region would trace it:
    f0 = x*pa (A), f1 = f0*pb (B), loss = sum f1 (B); seed, g1 = seed*pb and dpb = seed*f0 (B),
    g0 = g1*pa (A, the cotangent for x is dropped) and dpa = g1*x (A)."""
    b = Builder()
    x, pa, pb = b.input(), b.input(), b.input()
    f0 = b.op("mul", x, pa)
    f1 = b.op("mul", f0, pb)
    loss = b.op("reduce_sum", f1)
    seed = b.op("broadcast_in_dim", backward=True)
    g1 = b.op("mul", seed, pb, backward=True)
    dpb = b.op("mul", seed, f0, backward=True)
    dpa = b.op("mul", g1, x, backward=True)
    return b.outputs(loss, dpa, dpb), (x, pa, pb)


def test_stage_fragments_put_forward_and_backward_on_their_stages(tasks):
    a, bt = tasks
    graph, _ = forward_backward_chain()
    op_tasks = [a, bt, bt, bt, bt, bt, a]
    frags, stage_tasks = stage_fragments(graph, graph.ops, op_tasks, [])
    assert stage_tasks == [a, bt]
    names = {key: [op.name for op in f.ops] for key, f in frags.items()}
    assert names == {
        ("F", 0): ["mul"],
        ("F", 1): ["mul", "reduce_sum"],
        ("B", 1): ["broadcast_in_dim", "mul", "mul"],
        ("B", 0): ["mul"],
    }


def test_join_consumers_returns_new_levels_and_leaves_its_input(tasks):
    a, bt = tasks
    graph, _ = forward_backward_chain()
    op_tasks = [a, bt, bt, bt, bt, bt, a]
    given = levels(graph, graph.ops, op_tasks, inputs_movable=False)
    before = dict(given)
    level, late = join_consumers(graph, graph.ops, op_tasks, given)
    assert given == before  # not mutated
    assert level is not given
    assert late == set()
    assert level[3] >= before[3]  # the seed joins its backward readers' level


def first_stage_on_a_microbatch(sliced: bool):
    """A first stage (A) computing ``h = x * pa`` on its microbatch ``x`` (sliced from the batch
    by the microbatch index outside the region if ``sliced``, else read as it is), whose backward
    reads ``2 * h`` and ``pa``'s transpose; B reads ``h`` and makes the loss. The graph, its
    region, the ops' tasks and the indices of ``2 * h`` and the transpose."""
    b = Builder()
    batch, pa, pb = b.input(), b.input(), b.input()
    if sliced:
        index = b.op("mm_microbatch_index")
        b.graph.ops[-1].primitive = index_p
        x = b.op("dynamic_slice", batch, index)
    else:
        x = batch
    start = len(b.graph.ops)
    h = b.op("mul", x, pa)
    twice, transposed = b.op("mul", h), b.op("transpose", pa)
    loss = b.op("reduce_sum", b.op("mul", h, pb))
    seed = b.op("broadcast_in_dim", backward=True)
    dh = b.op("mul", seed, pb, backward=True)
    grads = b.op("mul", dh, twice, transposed, backward=True), b.op("mul", seed, h, backward=True)
    graph = b.outputs(loss, *grads)
    region = graph.ops[start:]
    a, bt = (mm.Task(name, mesh=mm.TaskMesh(devices=[i])) for i, name in enumerate("AB"))
    op_tasks = [a] * start + [a, a, a, bt, bt, bt, bt, a, bt]
    return graph, region, op_tasks, (start + 1, start + 2)


@pytest.mark.parametrize("sliced", [True, False], ids=["microbatch", "no-microbatch"])
def test_a_first_stage_keeps_its_ops_on_the_microbatch_in_its_forward(sliced):
    """An op only the backward reads runs there (late) if it reads parameters only; one made
    from the microbatch (``2 * h``) stays in the forward, as on a middle stage, where ``h``
    would come from the stage before. Without a microbatch index there is no microbatch, and
    both run in the backward."""
    graph, region, op_tasks, (twice, transposed) = first_stage_on_a_microbatch(sliced)
    raw = levels(graph, region, op_tasks, inputs_movable=False)
    level, late = join_consumers(graph, region, op_tasks, raw)
    assert late == ({transposed} if sliced else {twice, transposed})
    assert twice in late or level[twice] == 0  # in the forward: at its own depth
    frags, _ = stage_fragments(graph, region, op_tasks, [])
    forward = {op.index for op in frags[("F", 0)].ops}
    assert (twice in forward) is sliced and transposed not in forward


def test_a_forward_keeps_an_operand_it_remakes_two_residuals_from(tasks):
    """A forward keeps ``u = exp(x)`` rather than ``2 * u`` and ``u - 1``, both remade by its
    backward; not when they are smaller together than ``u`` (two slices of it)."""
    a, _ = tasks
    for sliced in (False, True):
        b = Builder()
        x = b.input(4)
        u = b.op("exp", x, size=4)
        size, names = (1, ("slice", "slice")) if sliced else (4, ("mul", "sub"))
        r1, r2 = (b.op(name, u, size=size) for name in names)
        grad = b.op("add", r1, r2, size=size, backward=True)
        graph = b.outputs(grad)
        forward = make_fragment(graph, "A/F0", a, graph.ops[:3], ("forward",))
        backward = make_fragment(graph, "A/B0", a, graph.ops[3:], ("backward",))
        stages = recompute_residuals(graph, {("F", 0): forward, ("B", 0): backward})
        if sliced:
            assert stages[("F", 0)].out_ids == [r1, r2] and stages[("B", 0)] is backward
        else:
            assert stages[("F", 0)].out_ids == [u]
            assert [op.name for op in stages[("B", 0)].ops] == ["mul", "sub", "add"]


def test_a_zero_gradient_runs_in_its_tasks_first_forward_stage(tasks):
    """The gradient of a parameter on A that the loss never reads is a zero array made from a
    constant, read by nothing in the region (only the microbatch sum): it runs in A's forward
    stage, not after A's backward pass as a third stage on A (gpt-oss's unused attention
    sinks)."""
    a, bt = tasks
    b = Builder()
    x, pa, pb = b.input(), b.input(), b.input()
    f0 = b.op("mul", x, pa)
    loss = b.op("reduce_sum", b.op("mul", f0, pb))
    seed = b.op("broadcast_in_dim", backward=True)
    g1 = b.op("mul", seed, pb, backward=True)
    dpb = b.op("mul", seed, f0, backward=True)
    dpa = b.op("mul", g1, x, backward=True)
    zero = b.op("broadcast_in_dim")  # no operands, not marked backward: nnx.grad's zeros
    graph = b.outputs(loss, dpa, dpb, zero)
    op_tasks = [a, bt, bt, bt, bt, bt, a, a]
    frags, stage_tasks = stage_fragments(graph, graph.ops, op_tasks, [])
    assert stage_tasks == [a, bt]
    assert [op.index for op in frags[("F", 0)].ops] == [0, 7]


def test_chain_check_names_the_depth_and_tasks(tasks):
    a, bt = tasks
    c = mm.Task("C", mesh=mm.TaskMesh(devices=[2]))
    b = Builder()
    x, pa, pb, pc = b.input(), b.input(), b.input(), b.input()
    h = b.op("mul", x, pa)
    graph = b.outputs(b.op("mul", h, pb), b.op("mul", h, pc))  # two branches: no chain
    with pytest.raises(mm.MPMDError, match="forward pass at depth 1 runs on B, C"):
        stage_fragments(graph, graph.ops, [a, bt, c], [])


def test_a_value_two_later_stages_read_is_a_side_input_of_both(tasks):
    """A's result read by B and by C, whose op joins B's result (a decoder layer's key
    projection of the encoder's output): C's read runs in C's stage, after B's."""
    a, bt = tasks
    c = mm.Task("C", mesh=mm.TaskMesh(devices=[2]))
    b = Builder()
    x, pa, pb, pc = b.input(), b.input(), b.input(), b.input()
    h = b.op("mul", x, pa)
    graph = b.outputs(b.op("add", b.op("mul", h, pb), b.op("mul", h, pc)))
    frags, stage_tasks = stage_fragments(graph, graph.ops, [a, bt, c, c], [])
    assert stage_tasks == [a, bt, c]
    assert [op.index for op in frags[("F", 2)].ops] == [2, 3]


def test_an_attention_over_the_encoder_s_output_runs_with_its_decoder_layer(tasks):
    """A decoder layer on B attends over A's output read directly as keys and values: its
    scores and weighted sum read no placed state, and the colouring (by bytes) left them on A,
    after B's query. They move to B, the layer's own task, so the chain is A, B, C; C's view of
    A's output stays in A's stage and is sent."""
    a, bt = tasks
    c = mm.Task("C", mesh=mm.TaskMesh(devices=[2]))
    b = Builder()
    x, y, pa, pq, po, pc = (b.input() for _ in range(6))
    enc = b.op("mul", x, pa)  # A
    query = b.op("mul", y, pq)  # B, from the decoder's own input
    scores = b.op("mul", query, enc)  # unpinned, coloured on A
    attended = b.op("mul", scores, enc)  # unpinned, coloured on A
    h = b.op("mul", attended, po)  # B
    view = b.op("reshape", enc)  # unpinned, for C's attention: on A
    graph = b.outputs(b.op("mul", b.op("add", h, view), pc))  # C
    op_tasks = [a, bt, a, a, bt, a, c, c]
    moved = follow_the_flow(graph, graph.ops, op_tasks, pinned={0, 1, 4, 7})
    assert [t.name for t in moved] == ["A", "B", "B", "B", "B", "A", "C", "C"]
    frags, stage_tasks = stage_fragments(graph, graph.ops, moved, [])
    assert stage_tasks == [a, bt, c]
    assert [op.index for op in frags[("F", 0)].ops] == [0, 5]


def test_split_backward_separates_the_input_gradient_from_weight_gradients(tasks):
    a, bt = tasks
    graph, _ = forward_backward_chain()
    op_tasks = [a, bt, bt, bt, bt, bt, a]
    frags, _ = stage_fragments(graph, graph.ops, op_tasks, [])
    split = split_backward(graph, frags, op_tasks, frozenset({1}))
    assert [op.name for op in split[("I", 1)].ops] == ["broadcast_in_dim", "mul"]  # seed, g1
    assert [op.index for op in split[("W", 1)].ops] == [5]  # dpb
    assert split[("B", 1)] is frags[("B", 1)]  # kept for unsplit microbatches
    assert ("I", 0) not in split  # stage 0 is not split


def test_lowering_pairs_every_send_with_a_recv_and_releases_after_the_last_read(tasks):
    a, bt = tasks
    graph, (x, pa, pb) = two_layer_chain()
    fragments = cut(graph, [a, a, bt, bt], tasks)
    sharding_a, sharding_b = a.sharding(), bt.sharding()
    lowered, transfers = lower(
        graph,
        list(tasks),
        ins(x=None, pa=(a, sharding_a), pb=(bt, sharding_b)),
        [StepOutput()],
        [(f, None) for f in fragments],
    )
    assert not any(isinstance(act, Release) for act in lowered.actions)  # add_releases does
    program = add_releases(lowered)
    kinds = [type(act).__name__ for act in program.actions]
    assert kinds == ["Recv", "Run", "Release", "Send", "Recv", "Release", "Run", "Release"]
    send, recv = program.actions[3], program.actions[4]
    assert isinstance(send, Send) and isinstance(recv, Recv)
    assert (send.source, send.target, recv.source, recv.target) == (a, bt, a, bt)
    assert recv.from_slot == send.slot
    # a one-device task's results are pinned to it (nothing to choose), so the move's layout is
    # decided when planned, not when compiled
    assert recv.sharding == bt.sharding()
    assert [type(act).__name__ for act in program.program("A")] == [
        "Recv",
        "Run",
        "Release",  # the batch x, read by nothing else
        "Send",
        "Release",  # A's activation, once B has it
    ]
    assert program.actions[2].slots == (program.actions[0].slot,)
    assert [type(act).__name__ for act in program.program("B")] == ["Recv", "Run", "Release"]
    release = program.actions[-1]
    assert isinstance(release, Release) and release.task is bt
    run_a = program.actions[1]
    assert isinstance(run_a, Run) and run_a.fragment is fragments[0]
    assert program.num_programs == 2
    assert [(t.source, t.target.name) for t in transfers] == [(None, "A"), (a, "B")]
    assert "program of 'A' (5 actions)" in str(program)


@pytest.mark.parametrize("split", [True, False])
def test_a_multi_device_tasks_results_are_laid_out_by_the_compiler_unless_nothing_splits(split):
    pairs = [
        mm.Task(name, mesh=mm.TaskMesh(devices=[2 * i, 2 * i + 1])) for i, name in enumerate("CD")
    ]
    graph, _ = two_layer_chain()
    fragments = cut(graph, [pairs[0], pairs[0], pairs[1], pairs[1]], pairs)
    spec = PartitionSpec("x") if split else PartitionSpec()
    program, _ = lower(
        graph,
        pairs,
        ins(x=None, pc=(pairs[0], pairs[0].sharding(spec)), pd=(pairs[1], pairs[1].sharding())),
        [StepOutput()],
        [(f, None) for f in fragments],
    )
    (recv,) = [a for a in program.actions if isinstance(a, Recv) and a.source is pairs[0]]
    if split:
        assert recv.sharding is None  # decided when the sending program is compiled
    else:  # every value whole: pinned replicated, as on one device
        assert recv.sharding == pairs[1].sharding()


def test_make_fragment_outputs_only_what_others_read(tasks):
    a, _ = tasks
    graph, _ = two_layer_chain()
    frag = make_fragment(graph, "f", a, graph.ops[:2], ("forward",))
    assert frag.out_ids == [graph.ops[1].outs[0]]  # the dot's result is used inside only


def _pipelined_program(task):
    """By hand, what lowering makes of two microbatches of a forward F (two small residuals)
    and its backward B (adding two gradients to running sums), then an update U reading the
    sums, on one task."""
    b = Builder()
    x = b.input(4)
    r1, r2, g1, g2, new = (b.value(4) for _ in range(5))
    graph = b.graph
    forward = Fragment("F", task, [], [x], [r1, r2], ("forward",))
    backward = Fragment("B", task, [], [r1, r2], [g1, g2], ("backward",))
    update = Fragment("U", task, [], [g1, g2], [new], ("update",))
    x_slot, sums = 0, (1, 2)
    actions = [Zeros(task, sums, ((4,), (4,)), (np.dtype("float32"),) * 2, (None, None))]
    slot = 3
    for m in range(2):
        outs = (slot, slot + 1)
        actions.append(Run(forward, (x_slot,), outs, m, label=(task.name, "F", 0)))
        actions.append(
            Run(backward, outs, (None, None), m, sums, (0, 1), label=(task.name, "B", 0))
        )
        slot += 2
    actions.append(Run(update, sums, (slot,)))
    program = StepProgram(
        (task,),
        tuple(actions),
        ((x_slot, 0),),
        (Output(slot, new, task),),
        (task.sharding(),) * (slot + 1),
        {s: (task.name, (s - 3) // 2) for s in range(3, slot)},
    )
    return program, graph


def test_pack_makes_buffers_typed_actions_and_fields(tasks):
    a, _ = tasks
    program, graph = _pipelined_program(a)
    packed = pack(program, graph)
    assert packed.num_slots > program.num_slots and program.actions[0].slots == (1, 2)
    (zeros,) = [act for act in packed.actions if isinstance(act, Zeros)]
    assert len(zeros.slots) == 1 and zeros.shapes == ((8,),)
    (sum_buffer,) = zeros.slots
    runs = [act for act in packed.actions if isinstance(act, Run)]
    for forward, backward in zip(runs[:-1:2], runs[1::2], strict=True):
        (residuals,) = forward.packing.packs  # both residuals in one buffer
        assert [m.slot for m in residuals.members] == list(forward.outs)
        assert forward.results == (residuals.slot,)
        assert backward.packing.args == (residuals.slot,)
        assert [r.member.slot for r in backward.packing.reads] == list(forward.outs)
        (total,) = backward.packing.sums
        assert total.slot == sum_buffer and total.positions == (0, 1)
        assert backward.args[:2] == (residuals.slot, sum_buffer)  # then the offsets
        assert backward.results == (sum_buffer,)
    offsets = [act for act in packed.actions if isinstance(act, Constant)]
    assert [c.value for c in offsets] == [0, 4]  # each residual's, put once for every run
    assert runs[-1].packing.args == (sum_buffer,)  # the update slices the sums back
    assert "run B @mb1 (s" in str(packed) and "sums (s" in str(packed)
    unpacked = [
        act for act in pack(program, graph, residual_bytes=0).actions if isinstance(act, Run)
    ]
    assert unpacked[0].packing is None and unpacked[1].packing.sums  # the sums only


def test_add_releases_drops_a_buffer_after_its_last_reader_and_keeps_outputs(tasks):
    a, _ = tasks
    program, graph = _pipelined_program(a)
    released = add_releases(pack(program, graph))
    dropped = [s for act in released.actions if isinstance(act, Release) for s in act.slots]
    runs = [act for act in released.actions if isinstance(act, Run)]
    buffers = [run.packing.packs[0].slot for run in runs[:-1:2]]
    assert set(buffers) <= set(dropped)  # each microbatch's residuals, once read
    assert not {o.slot for o in released.outputs} & set(dropped)  # the sums are the results
    assert 0 not in dropped  # nor a step input
    for buffer in buffers:  # released right after the backward reading it
        (at,) = [
            i
            for i, act in enumerate(released.actions)
            if isinstance(act, Run) and buffer in act.args
        ]
        assert buffer in released.actions[at + 1].slots


def test_localize_keeps_one_process_share_and_routes_what_crosses(tasks):
    a, bt = tasks
    graph, _ = two_layer_chain()
    pairs = [
        mm.Task(name, mesh=mm.TaskMesh(devices=[2 * i, 2 * i + 1])) for i, name in enumerate("CD")
    ]
    split = pairs[0].sharding(PartitionSpec("x"))  # C's results: the compiler's choice

    def lowered_with(pc_layout):
        return lower(
            graph,
            pairs,
            ins(x=None, pc=(pairs[0], pc_layout), pd=(pairs[1], pairs[1].sharding())),
            [StepOutput()],
            [(f, None) for f in cut(graph, [pairs[0]] * 2 + [pairs[1]] * 2, pairs)],
        )[0]

    lowered = lowered_with(split)
    on = {"C": frozenset({0}), "D": frozenset({1})}  # as if each task were another process's
    first = localize(lowered, 0, 2, lambda t: on[t.name])
    second = localize(lowered, 1, 2, lambda t: on[t.name])
    kinds = [type(act).__name__ for act in first.actions]
    # the result is D's: process 0 hands back a placeholder laid out as D's compiler chose
    assert kinds == ["Recv", "Run", "PublishLayout", "Route", "AwaitLayout"]
    route = first.actions[3]
    assert route.sends and not route.receives and route.source is pairs[0]
    kinds = [type(act).__name__ for act in second.actions]
    assert kinds == ["AwaitLayout", "Route", "Run", "PublishLayout"]
    assert second.actions[1].receives and not second.actions[1].sends
    assert second.actions[0].slot == route.from_slot == first.actions[2].slot
    assert first.actions[-1].slot == second.actions[-1].slot == second.outputs[0].slot
    (out,) = first.outputs
    assert not out.here and second.outputs[0].here  # process 0 hands back a placeholder
    assert first.process == 0 and "process 0's share" in str(first)
    assert localize(lowered, 0, 1, lambda t: frozenset({0})).actions == tuple(
        act for act in lowered.actions if not isinstance(act, Release)
    )  # one process holding everything keeps everything
    whole = localize(lowered_with(pairs[0].sharding()), 0, 2, lambda t: on[t.name])
    kinds = [type(act).__name__ for act in whole.actions]
    assert kinds == ["Recv", "Run", "Route"]  # nothing split: every layout known, none sent


def _two_routes():
    """C (devices 0, 1) makes two values that D (devices 2, 3) reads; each task as if it were
    another process's; the shares of processes 0 and 1."""
    b = Builder()
    x, pc, pd = b.input(4), b.input(4), b.input(4)
    u, w = b.op("mul", x, pc, size=4), b.op("add", x, pc, size=4)
    graph = b.outputs(b.op("mul", b.op("add", u, w, size=4), pd, size=4))
    c, d = (mm.Task(n, mesh=mm.TaskMesh(devices=[2 * i, 2 * i + 1])) for i, n in enumerate("CD"))
    lowered, _ = lower(
        graph,
        [c, d],
        ins(x=None, pc=(c, c.sharding()), pd=(d, d.sharding())),
        [StepOutput()],
        [(f, None) for f in cut(graph, [c, c, d, d], [c, d])],
    )
    on = {"C": frozenset({0}), "D": frozenset({1})}
    return [localize(lowered, p, 2, lambda t: on[t.name]) for p in (0, 1)], on


def test_processes_meeting_in_one_order_pass_the_check():
    shares, on = _two_routes()
    check_same_order(shares, lambda t: on[t.name])
    assert sum(isinstance(a, Route) for a in shares[1].actions) == 2


def test_processes_meeting_in_two_orders_are_refused_naming_both_actions():
    shares, on = _two_routes()
    actions = list(shares[1].actions)
    first, second = [i for i, a in enumerate(actions) if isinstance(a, Route)]
    actions[first], actions[second] = actions[second], actions[first]
    swapped = shares[1].replace(actions=tuple(actions))
    with pytest.raises(mm.MPMDError, match="would wait for each other: process 0 meets") as e:
        check_same_order([shares[0], swapped], lambda t: on[t.name])
    for route in (actions[first], actions[second]):  # as process 0 runs them
        assert f"`route v{route.value} s{route.from_slot} 'C' -> s{route.slot} 'D' (send)`" in str(
            e.value
        )
    dropped = shares[1].replace(actions=tuple(a for a in actions if a is not actions[first]))
    with pytest.raises(mm.MPMDError, match="only one of them runs `route"):
        check_same_order([shares[0], dropped], lambda t: on[t.name])
