"""Residual packing (``mm.jit(pack_residuals=...)``): on one-device tasks a forward returns the
values only its task's later programs read as one flat buffer per dtype; the step's results and
memory profile are those of the same model on one device. By default the residuals of at most
``mm.PACK_RESIDUAL_BYTES`` are packed; ``True`` packs all, ``False`` none."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import mmnnx as mm
from mmnnx.models import GPT, stage_rules
from mmnnx.mpmd.lower.pack import _whole, block_of
from mmnnx.mpmd.lower.program import Run, Zeros
from tests.models import (
    SMALL_GPT,
    gpt_step,
    loss_and_grads_steps,
    microbatched_train_step,
    mse,
    one_device_tasks,
    reference_loss_and_grads,
    reference_step,
    small_gpt,
    tensor_parallel_mlp,
)
from tests.oracle import close, params_close, trees_close
from tests.plans import launches_of, packed_buffers, packing_of


def _gpt_on_four_devices(seed: int):
    """Tokens, the small GPT placed over 4 one-device tasks with its AdamW, the same on one
    device, and the reference gradients of a first step."""
    tokens = jax.random.randint(jax.random.key(seed), (16, SMALL_GPT.max_seq_len + 1), 0, 64)
    model, ref = small_gpt(), small_gpt()
    mm.place(model, stage_rules(model, one_device_tasks(4), report=False))
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, optax.adamw(3e-3), wrt=nnx.Param)
    _, ref_grads = reference_loss_and_grads(small_gpt(), tokens)
    return tokens, model, opt, ref, ref_opt, ref_grads


@pytest.fixture(scope="module")
def two_tasks():
    """``two_tasks(depth=4, **options)``: the small GPT of ``depth`` blocks on two one-device
    tasks trained three AdamW steps on ``_tokens()`` by ``mm.jit(gpt_step("1f1b"), **options)``,
    each loss checked against the same step on one device and the parameters after them:
    the step, its losses and its executable. Trained once per depth and options for every test
    of this module that reads them (each such test once trained its own alike)."""
    trained = {}

    def train(depth=4, **options):
        key = (depth, tuple(sorted(options.items())))
        if key not in trained:
            tokens = _tokens()
            config = dataclasses.replace(SMALL_GPT, depth=depth)
            with nnx.use_eager_sharding(False):
                model, ref, first = (GPT(config, rngs=nnx.Rngs(0)) for _ in range(3))
            mm.place(model, stage_rules(model, one_device_tasks(2), report=False))
            opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
            ref_opt = nnx.Optimizer(ref, optax.adamw(3e-3), wrt=nnx.Param)
            step = mm.jit(gpt_step("1f1b"), **options)
            losses = [step(model, opt, tokens) for _ in range(3)]
            for loss in losses:
                close(loss, reference_step(ref, ref_opt, tokens))
            _, ref_grads = reference_loss_and_grads(first, tokens)
            params_close(model, ref, ref_grads, steps=3, lr=3e-3)
            (executable, _), *_ = step._cache.values()
            trained[key] = step, losses, executable
        return trained[key]

    return train


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h1"])
def test_packed_residuals_train_like_one_device(schedule):
    tokens, model, opt, ref, ref_opt, ref_grads = _gpt_on_four_devices(seed=0)
    step = mm.jit(gpt_step(schedule), pack_residuals=True)
    for _ in range(3):
        close(step(model, opt, tokens), reference_step(ref, ref_opt, tokens))
    params_close(model, ref, ref_grads, steps=3, lr=3e-3)

    (executable, _), *_ = step._cache.values()
    program = executable.plan.program
    packing = packed_buffers(program)
    forwards = [  # a part before a core (share_cores) passes the core its input alone
        (i, a)
        for i, a in enumerate(program.actions)
        if isinstance(a, Run)
        and a.label is not None
        and a.label[1] == "F"
        and not a.fragment.name.endswith(".before")
    ]
    assert forwards and all(i in packing.by_run for i, _ in forwards)
    for i, run in forwards:
        for packed in packing.by_run[i]:
            assert len(packed.members) >= 2
            readers = [
                a for a in program.actions if isinstance(a, Run) and packed.members[0].slot in a.ins
            ]
            # read by the backward programs of the same stage and microbatch only
            assert readers and all(
                r.task == run.task and r.microbatch == run.microbatch and r.label[1] in "BIW"
                for r in readers
            )
    # every microbatch of a stage's pass runs one compiled program (packing keys no slot)
    programs = {}
    for kind in "FBIW":
        for launch in launches_of(executable, kind):
            programs.setdefault(launch.labels[0][0], set()).add(id(launch.program))
    assert {label[1] for label in programs} >= {"F", "B" if schedule == "1f1b" else "W"}
    assert all(len(p) == 1 for p in programs.values())
    # the packed buffers count as the microbatch's activations, as their members did
    memory = step.memory_profile(model, opt, tokens)
    activation_bytes = {
        task.name: max(
            sum(
                np.dtype(executable.graph.dtypes[v]).itemsize
                * int(np.prod(executable.graph.shapes[v]))
                for a in program.actions
                if isinstance(a, Run) and a.task == task and a.microbatch == 0
                for v, s in zip(a.fragment.out_ids, a.outs, strict=True)
                if s in packing.of_member
            ),
            1,
        )
        for task in executable.tasks
    }
    for task in executable.tasks:
        assert memory[task.name][0] >= activation_bytes[task.name]


def test_fused_pairs_with_packed_residuals_on_one_device_tasks():
    # DualPipeV with its overlapped pairs fused, on a V over two one-device tasks: a fused
    # program both reads packed residuals and returns packed ones
    tokens = jax.random.randint(jax.random.key(1), (16, SMALL_GPT.max_seq_len + 1), 0, 64)
    tasks = one_device_tasks(2)
    model, ref = small_gpt(), small_gpt()
    mm.place(model, stage_rules(model, tasks, virtual_stages=2, order="v", report=False))
    schedule = mm.schedules.dualpipe_v(2, 4, fuse_pairs=True)

    def grads_of(model, tokens):
        return mm.microbatch(
            nnx.value_and_grad(lambda m, t: m.loss(t)),
            num=4,
            reduce="mean",
            schedule=schedule,
            virtual_stages=2,
        )(model, tokens)

    step = mm.jit(grads_of, pack_residuals=True)
    loss, grads = step(model, tokens)
    ref_loss, ref_grads = reference_loss_and_grads(ref, tokens)
    close(loss, ref_loss)
    trees_close(grads, ref_grads)
    (executable, _), *_ = step._cache.values()
    program = executable.plan.program
    packing = packed_buffers(program)
    fused = [i for i, a in enumerate(program.actions) if isinstance(a, Run) and a.fused]
    assert fused and packing.by_run
    assert any(i in packing.by_run or i + 1 in packing.by_run for i in fused)


def launches(executable, kind):
    """The number of arrays each launch of a ``kind`` (F, B, I, W) pass returns."""
    return [len(step.results) for step in launches_of(executable, kind)]


def test_residuals_are_not_packed_when_asked_running_sums_are(two_tasks):
    step, _, executable = two_tasks(pack_residuals=False)
    assert step.pack_residuals == 0
    program = executable.plan.program
    forwards = [a for a in program.actions if isinstance(a, Run) and a.label and a.label[1] == "F"]
    # every forward returns its residuals one array each (and the last its loss's sum)
    assert sorted(launches(executable, "F")) == sorted(
        sum(s is not None for s in a.outs) + len(a.sums) for a in forwards
    )
    # a backward returns its input gradient and one buffer for all its gradient sums (the
    # last stage has no input gradient to send)
    backwards = [a for a in program.actions if isinstance(a, Run) and a.label and a.label[1] == "B"]
    assert all(len(a.sums) >= 10 for a in backwards)
    assert set(launches(executable, "B")) == {1, 2}


def residual_sizes(executable):
    """For each forward Run: the bytes of each residual it packs, and of each it returns alone
    that only its own task's later programs read (what packing could have taken)."""
    program, graph = executable.plan.program, executable.graph
    packing = packed_buffers(program)
    readers = {}
    for a in program.actions:
        if isinstance(a, Run):
            for s in a.ins:
                readers.setdefault(s, []).append(a)
    sizes = []
    for i, run in enumerate(program.actions):
        if not (isinstance(run, Run) and run.label and run.label[1] == "F"):
            continue
        packed = {m for pk in packing.by_run.get(i, ()) for m in (x.slot for x in pk.members)}
        size = {
            s: int(np.prod(graph.shapes[v])) * np.dtype(graph.dtypes[v]).itemsize
            for s, v in zip(run.outs, run.fragment.out_ids, strict=True)
            if s is not None
        }
        alone = [
            size[s]
            for s in size
            if s not in packed
            and readers.get(s)
            and all(r.task == run.task and r.label and r.label[1] in "BIW" for r in readers[s])
        ]
        sizes.append(([size[s] for s in packed], alone))
    return sizes


def test_by_default_the_small_residuals_are_packed_and_a_bound_keeps_large_ones_apart(two_tasks):
    for options, bound in (({}, mm.PACK_RESIDUAL_BYTES), ({"pack_residuals": 1024}, 1024)):
        step, _, executable = two_tasks(**options)
        assert step.pack_residuals == bound
        sizes = residual_sizes(executable)
        assert sizes and all(packed for packed, _ in sizes)
        for packed, alone in sizes:
            assert max(packed) <= bound
            assert all(size > bound for size in alone)
        if bound == 1024:  # this GPT has residuals on both sides of 1 KiB
            assert all(alone for _, alone in sizes)


def test_whole_values_on_multi_device_tasks_travel_packed():
    # the GPT on two-device tasks holds every parameter whole (replicated) and splits nothing:
    # each backward adds its gradients to one buffer per dtype instead of returning one array
    # per parameter; each forward returns its residuals packed and every result is pinned
    # replicated, as on one device; each block's weights travel as one buffer
    tokens = jax.random.randint(jax.random.key(0), (16, SMALL_GPT.max_seq_len + 1), 0, 64)
    tasks = [mm.Task(f"p{i}", mesh=mm.TaskMesh(devices=[2 * i, 2 * i + 1])) for i in range(2)]
    model, ref = small_gpt(), small_gpt()
    mm.place(model, stage_rules(model, tasks, report=False))
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, optax.adamw(3e-3), wrt=nnx.Param)
    step = mm.jit(gpt_step("1f1b"))
    for _ in range(3):
        close(step(model, opt, tokens), reference_step(ref, ref_opt, tokens))
    _, ref_grads = reference_loss_and_grads(small_gpt(), tokens)
    params_close(model, ref, ref_grads, steps=3, lr=3e-3)
    (executable, _), *_ = step._cache.values()
    packing = packed_buffers(executable.plan.program)
    assert {pk.dtype for pk in packing.buffers if not pk.positions} == {np.dtype("float32")}
    assert max(launches(executable, "B")) <= 2  # its input's gradient and the packed sums
    assert packing.by_run and max(launches(executable, "F")) <= 2  # activation, residuals
    assert set(packing.weights) == set(tasks)
    assert _pinned_whole(executable.plan.program)


def _pinned_whole(program) -> bool:
    """Whether every result of every Run of ``program`` is pinned whole on its task."""
    layouts = [s for a in program.actions if isinstance(a, Run) for s in a.out_shardings]
    return bool(layouts) and all(s is not None and s.is_fully_replicated for s in layouts)


class _TwoLayers(nnx.Module):
    def __init__(self, names):
        init = nnx.with_partitioning(nnx.initializers.lecun_normal(), names)
        self.a = nnx.Linear(8, 8, kernel_init=init, rngs=nnx.Rngs(0))
        self.b = nnx.Linear(8, 8, kernel_init=init, rngs=nnx.Rngs(1))


@pytest.mark.parametrize(
    "kernel, constraint, whole",
    [
        ((None, "embed"), None, True),
        ((None, "mlp"), None, False),  # kernels split over each task's two devices
        ((None, "embed"), ("batch", "mlp"), False),  # a constraint splitting an activation
        ((None, "embed"), ("batch", "embed"), True),  # a constraint naming no device axis
    ],
)
def test_results_are_pinned_whole_only_where_the_step_splits_nothing(kernel, constraint, whole):
    # a fragment's results are the compiler's choice on a multi-device task, unless nothing in
    # the step can split them: its inputs whole, no constraint naming a device axis
    rules = mm.logical_rules(embed=None, mlp="x")
    tasks = [
        mm.Task(f"w{i}", mesh=mm.TaskMesh(devices=[2 * i, 2 * i + 1]), logical_axes=rules)
        for i in range(2)
    ]
    with nnx.use_eager_sharding(False):
        model = _TwoLayers(kernel)
    mm.place(model, [("^a/", tasks[0]), ("^b/", tasks[1])])

    @mm.jit
    def forward(model, x):
        h = model.a(x)
        if constraint is not None:
            h = mm.with_sharding_constraint(h, constraint)
        return model.b(jnp.tanh(h))

    assert _pinned_whole(forward.plan(model, jnp.ones((4, 8))).program) == whole


def test_tensor_parallel_stages_pack_their_whole_running_sums_and_train_like_one_device():
    # the kernels are split over each stage's two devices, and so are their gradients' running
    # sums (a sum takes its parameter's layout: mpmd/lower/sum_layouts.py), which travel alone;
    # the biases' sums are whole and travel packed
    rules = mm.logical_rules(embed=None, mlp="model")
    tasks = [
        mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=[2 * i, 2 * i + 1], axis_names=("model",)),
                logical_axes=rules)
        for i in range(2)
    ]  # fmt: skip
    with nnx.use_eager_sharding(False):
        model, ref = tensor_parallel_mlp(4, 16, 32), tensor_parallel_mlp(4, 16, 32)
    mm.place(model, [("^layers/(0|2)/", tasks[0]), ("^layers/(4|6)/", tasks[1])])
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    x, y = (jax.random.normal(jax.random.key(k), (8, 16)) for k in (0, 1))

    step = mm.jit(microbatched_train_step())
    ref_step = loss_and_grads_steps(mse, "1f1b", 4)[1]  # the step on one device, nnx.jit
    first = None  # the first step's gradients
    for _ in range(3):
        value, grads = ref_step(ref, ref_opt, x, y)
        first = grads if first is None else first
        close(step(model, opt, x, y), value)
    params_close(model, ref, first, steps=3, lr=1e-2)
    (executable, _), *_ = step._cache.values()
    program = executable.plan.program
    packing = packed_buffers(program)
    assert model.layers[4].kernel.get_value().sharding.spec == P(None, "model")
    buffers = {b.slot for made in packing.by_zeros.values() for b in made}
    sums = [a for a in program.actions if isinstance(a, Zeros)]
    assert sums and buffers
    split = [s.spec for zeros in sums for s in zeros.shardings if not s.is_fully_replicated]
    assert sorted(map(str, split)) == sorted(map(str, [P(None, "model"), P("model", None)] * 2))
    # every whole running sum packed, but a lone one: no other of its dtype has the same adders
    groups = [
        (zeros.dtypes[k], tuple(i for i, r in enumerate(program.actions) if slot in _sums_of(r)))
        for zeros in sums
        for k, slot in enumerate(zeros.slots)
        if zeros.shardings[k].is_fully_replicated
    ]
    assert len(set(groups)) == len(groups)


def _sums_of(action) -> tuple[int, ...]:
    """The running sums (slots) a Run adds to."""
    if not isinstance(action, Run):
        return ()
    if action.packing is None:
        return action.sums
    return tuple(s.slot for s in action.packing.sums)


def test_only_values_whole_on_every_device_of_a_task_may_travel_packed():
    two = mm.Task("two", mesh=mm.TaskMesh(devices=[0, 1], axis_names=("x",)))
    one = mm.Task("one", mesh=mm.TaskMesh(devices=[2]))
    assert _whole(two.sharding(), two) and _whole(two.sharding(P(None, None)), two)
    assert not _whole(two.sharding(P("x")), two)  # split: each device holds half
    assert not _whole(None, two)  # decided when the program compiles
    assert _whole(None, one) and _whole(one.sharding(), one)


@pytest.mark.parametrize(
    "option, what", [("pack_residuals", "residual"), ("pack_weights", "weight")]
)
@pytest.mark.parametrize("value", ["yes", -1, 1.5, None])
def test_a_packing_bound_must_be_a_bool_or_a_number_of_bytes(option, what, value):
    with pytest.raises(
        TypeError,
        match=rf"mm.jit: {option} must be True, False or a number of bytes \(the largest "
        rf"{what} packed; default 65536\), got {re.escape(repr(value))}",
    ):
        mm.jit(gpt_step("1f1b"), **{option: value})


@pytest.mark.parametrize("bound", [False, True], ids=["mm.jit", "cached_partial"])
def test_donated_state_trains_like_one_device_when_gradient_sums_are_packed(bound):
    # the update programs read each task's gradient sums as one buffer and donate the model and
    # optimizer state: only the arguments those are passed as are donated (an earlier version
    # donated by the fragment's input positions, consuming the packed offsets of the next step)
    tokens, model, opt, ref, ref_opt, ref_grads = _gpt_on_four_devices(seed=1)
    step = mm.jit(gpt_step("1f1b"), donate_argnums=(0, 1))
    run = mm.cached_partial(step, model, opt) if bound else lambda t: step(model, opt, t)
    for _ in range(3):
        old_embedding = model.embed.embedding.get_value()
        close(run(tokens), reference_step(ref, ref_opt, tokens))
        assert old_embedding.is_deleted()
    params_close(model, ref, ref_grads, steps=3, lr=3e-3)
    (executable, _), *_ = step._cache.values()
    assert packed_buffers(executable.plan.program).by_zeros  # sums were packed


def test_a_gathered_output_keeps_a_sum_of_its_own():
    """Logits gathered with ``reduce="concat"`` are summed in a buffer of their own: packed with
    the gradients, every microbatch would add the whole ``(M, ...)`` buffer instead of writing
    its rows (measured: 116 ms against 1.3 ms per microbatch for a 128 MiB buffer)."""
    tokens = jax.random.randint(jax.random.key(0), (16, SMALL_GPT.max_seq_len + 1), 0, 64)
    model, ref = small_gpt(), small_gpt()
    mm.place(model, stage_rules(model, one_device_tasks(2), report=False))

    def loss_fn(model, tokens):
        logits = model(tokens[:, :-1])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        return losses.mean(), (logits, losses.mean(axis=1))

    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    step = mm.jit(mm.microbatch(grad_fn, num=4, reduce=(("mean", ("concat", "concat")), "mean")))
    (loss, (logits, per_sample)), grads = step(model, tokens)
    (ref_loss, (ref_logits, ref_per_sample)), ref_grads = nnx.jit(grad_fn)(ref, tokens)
    close(loss, ref_loss)
    close(logits, ref_logits, atol=1e-5)
    close(per_sample, ref_per_sample)
    trees_close(grads, ref_grads)
    (executable, _), *_ = step._cache.values()
    program, graph = executable.plan.program, executable.graph
    packing = packed_buffers(program)
    gathered = {
        slot
        for a in program.actions
        if isinstance(a, Run)
        for slot, p in zip(a.sums, a.summed, strict=True)
        if graph.shapes[a.fragment.out_ids[p]][:1] == (4,)  # the (M, ...) buffers
    }
    assert len(gathered) == 2
    assert not gathered & set(packing.of_member)
    assert packing.by_zeros  # the gradients' sums still travel packed


def arguments(executable, kind):
    """The number of arrays each launch of a ``kind`` (F, B, I, W) pass takes."""
    return [len(step.args) for step in launches_of(executable, kind)]


def test_each_blocks_weights_travel_as_one_buffer_laid_out_alike_and_train_like_one_device(
    two_tasks,
):
    # two blocks per one-device stage; the update reads the weights themselves
    packed, losses, packed_step = two_tasks()  # the default bound
    assert packed.pack_weights == mm.PACK_WEIGHT_BYTES
    _, unpacked_losses, unpacked_step = two_tasks(pack_weights=False)
    trees_close(losses, unpacked_losses)

    packing, names = packing_of(packed_step)
    assert len(packing.weights) == 2 and not packing_of(unpacked_step)[0].weights
    layouts = set()
    for buffers in packing.weights.values():
        assert len(buffers) == 2  # one per block
        for packed in buffers:
            where = [block_of(names[m]) for m in (x.slot for x in packed.members)]
            assert len({block for block, _ in where}) == 1
            layouts.add(
                tuple(
                    (inside, m.offset, m.shape)
                    for (_, inside), m in zip(where, packed.members, strict=True)
                )
            )
    assert len(layouts) == 1  # every block's buffer laid out alike
    members = sum(len(p.members) for b in packing.weights.values() for p in b)
    fewer = sum(arguments(unpacked_step, "F")) - sum(arguments(packed_step, "F"))
    per_stage = members - sum(len(b) for b in packing.weights.values())
    assert fewer == per_stage * len(arguments(packed_step, "F")) // 2  # two stages


def _residual_buffers(executable):
    """Each one-device forward's packed residuals, by fragment (the same in every microbatch)."""
    packing, _ = packing_of(executable)
    actions = executable.plan.program.actions
    return {
        actions[i].fragment.name: buffers
        for i, buffers in packing.by_run.items()
        if actions[i].label[1] == "F"
    }


def test_a_blocks_residuals_are_sliced_from_one_base_at_distances_shared_by_every_block(
    two_tasks,
):
    # 2 and 4 blocks per one-device stage: each block's residuals lie one after the other, laid
    # out alike, so a backward takes one offset per block (the distances fixed in the program),
    # not one per member
    backward, buffers_per_stage, head_offsets = {}, {}, {}
    for depth in (4, 8):
        _, _, executable = two_tasks(depth)
        packing, _ = packing_of(executable)
        actions = executable.plan.program.actions
        residuals = [buffers for i, buffers in packing.by_run.items() if actions[i].label[1] == "F"]
        assert residuals
        for (packed,) in residuals:
            assert len(packed.bases) == depth // 2  # one per block
            ends = [*packed.bases[1:], packed.size]
            layouts = {
                tuple((m.offset - base, m.shape) for m in packed.members if base <= m.offset < end)
                for base, end in zip(packed.bases, ends, strict=True)
            }
            assert len(layouts) == 1  # every block laid out alike
            assert len(next(iter(layouts))) > 5  # a block's residuals
        offsets = {a.label[0]: len(a.packing.offsets) for a in actions
                   if getattr(a, "label", None) and a.label[1] == "B" and a.packing}  # fmt: skip
        assert offsets["d0"] == depth // 2  # a base per block: the distances are in the program
        head_offsets[depth] = offsets["d1"] - depth // 2  # the head's residuals: their own
        backward[depth] = sorted(set(arguments(executable, "B")))
        buffers_per_stage[depth] = sorted(len(b) for b in packing.weights.values())
    # per stage, two more blocks add their weights' buffers and two bases, nothing per residual
    more_weights = [b - a for a, b in zip(buffers_per_stage[4], buffers_per_stage[8], strict=True)]
    assert more_weights == [2, 2]
    assert [b - a for a, b in zip(backward[4], backward[8], strict=True)] == [4, 4]
    assert head_offsets[4] == head_offsets[8]


class _NormMLP(nnx.Module):
    def __init__(self, dim, rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.up, self.down = (
            nnx.Linear(dim, 2 * dim, rngs=rngs),
            nnx.Linear(2 * dim, dim, rngs=rngs),
        )

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class _Gated(nnx.Module):
    def __init__(self, dim, rngs):
        self.gate, self.value = nnx.Linear(dim, dim, rngs=rngs), nnx.Linear(dim, dim, rngs=rngs)

    def __call__(self, x):
        return x + jax.nn.sigmoid(self.gate(x)) * jnp.tanh(self.value(x))


class _Mixed(nnx.Module):
    """Blocks of two kinds, alternating: the blocks of a stage are not laid out alike."""

    def __init__(self, rngs):
        self.blocks = nnx.List([(_NormMLP, _Gated)[i % 2](8, rngs) for i in range(6)])

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_blocks_of_different_kinds_pack_their_residuals_and_train_like_one_device():
    x = jax.random.normal(jax.random.key(1), (16, 8))
    with nnx.use_eager_sharding(False):
        model, ref = _Mixed(nnx.Rngs(0)), _Mixed(nnx.Rngs(0))
    mm.place(model, stage_rules(model, one_device_tasks(2), report=False))
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, optax.adamw(3e-3), wrt=nnx.Param)

    def loss_fn(m, x):
        return (m(x) ** 2).mean()

    @mm.jit
    def step(model, opt, x):
        grad_fn = mm.microbatch(nnx.value_and_grad(loss_fn), num=4, reduce="mean", schedule="1f1b")
        loss, grads = grad_fn(model, x)
        opt.update(model, grads)
        return loss

    @nnx.jit  # the same step on one device
    def ref_step(model, opt, x):
        loss, grads = nnx.value_and_grad(loss_fn)(model, x)
        opt.update(model, grads)
        return loss, grads

    first = None  # the first step's gradients
    for _ in range(3):
        loss, grads = ref_step(ref, ref_opt, x)
        first = grads if first is None else first
        close(step(model, opt, x), loss)
    params_close(model, ref, first, steps=3, lr=3e-3)
    (executable, _), *_ = step._cache.values()
    packing, _ = packing_of(executable)
    actions = executable.plan.program.actions
    bases = [
        len(packed.bases)
        for i, buffers in packing.by_run.items()
        if actions[i].label[1] == "F"
        for packed in buffers
    ]
    assert bases == [3] * 8  # each stage's three blocks, one base each, in every microbatch


def test_a_weight_above_the_bound_travels_alone():
    tokens = _tokens()
    model = small_gpt()
    mm.place(model, stage_rules(model, one_device_tasks(2), report=False))
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    step = mm.jit(gpt_step("1f1b"), pack_weights=512)
    step(model, opt, tokens)
    (executable, _), *_ = step._cache.values()
    packing, names = packing_of(executable)
    graph, program = executable.graph, executable.plan.program
    sizes = {slot: graph.nbytes[graph.inputs[leaf]] for slot, leaf in program.inputs}
    packed = {m for b in packing.weights.values() for p in b for m in (x.slot for x in p.members)}
    assert packed and all(sizes[m] <= 512 for m in packed)
    assert any(sizes[s] > 512 and block_of(names[s]) for s in sizes)  # some stayed apart


def _tokens():
    return jax.random.randint(jax.random.key(0), (16, SMALL_GPT.max_seq_len + 1), 0, 64)
