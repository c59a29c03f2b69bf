"""Stacked (scanned) layers split over tasks: a rule naming a list of tasks, against one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import mmnnx as mm
from mmnnx._jax.scan import scan_counts
from mmnnx.models import GPT, GPTConfig, stage_rules
from tests.models import chunked_layers, four_tasks, one_device_tasks
from tests.oracle import close, params_close, trees_close

CONFIG = dict(vocab_size=64, dim=32, depth=8, num_heads=2, max_seq_len=16)


@pytest.fixture(scope="module")
def tasks():
    return four_tasks()


def gpt(scan_layers: bool) -> GPT:
    with nnx.use_eager_sharding(False):
        return GPT(GPTConfig(**CONFIG, scan_layers=scan_layers), rngs=nnx.Rngs(0))


def unscanned_copy(scanned: GPT) -> GPT:
    """The same model with its blocks in an ``nnx.List``, holding the scanned layers' values."""
    model = gpt(scan_layers=False)
    stacked = jax.tree.map(np.asarray, nnx.state(scanned.blocks))  # sliced on the host
    for i, block in enumerate(model.blocks):
        nnx.update(block, jax.tree.map(lambda x, i=i: jnp.asarray(x[i]), stacked))
    for name in ("embed", "norm", "head"):
        nnx.update(getattr(model, name), nnx.state(getattr(scanned, name)))
    return model


def train_step(schedule: str | None):
    def loss_fn(model, tokens):
        return model.loss(tokens)

    def step(model, opt, tokens):
        grad_fn = nnx.value_and_grad(loss_fn)
        if schedule is not None:
            grad_fn = mm.microbatch(grad_fn, num=4, reduce="mean", schedule=schedule)
        loss, grads = grad_fn(model, tokens)
        opt.update(model, grads)
        return loss, grads

    return step


@pytest.mark.parametrize("schedule", ["1f1b"])
def test_scanned_gpt_split_over_four_tasks_equals_the_unscanned_model(tasks, schedule):
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, CONFIG["vocab_size"])
    scanned = gpt(scan_layers=True)
    ref = unscanned_copy(scanned)
    model = mm.place(scanned, stage_rules(scanned, tasks, report=False))
    kernel = model.blocks.mlp.up.kernel
    assert mm.stack_of(kernel).tasks == tuple(tasks)
    assert kernel.get_value().sharding.spec == P("mm_stack", None, "model")
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, optax.adamw(1e-3), wrt=nnx.Param)
    step = mm.jit(train_step(schedule))
    plan = step.plan(model, opt, tokens)
    assert (plan.pipeline is not None) == (schedule is not None) and not plan.unrolled
    scans = {f.task.name for f in plan.fragments if any(op.name == "scan" for op in f.ops)}
    assert scans == {t.name for t in tasks}  # each task scans its own chunk
    # JAX hoists the position tables and the causal mask out of the scan; each stage makes its
    # own: between tasks travel only activations, cotangents and scalars
    moved = {(t.shape, str(t.dtype)) for t in plan.transfers if t.source is not None}
    assert moved == {((2, 16, CONFIG["dim"]), "float32"), ((), "float32")}
    ref_step = nnx.jit(train_step(schedule))
    first_grads = None
    for _ in range(3):
        loss, grads = step(model, opt, tokens)
        ref_loss, ref_grads = ref_step(ref, ref_opt, tokens)
        close(loss, ref_loss)
        first_grads = first_grads or ref_grads
        stacked = jax.tree.map(np.asarray, nnx.state(grads["blocks"]))  # sliced on the host
        for i in range(CONFIG["depth"]):
            trees_close(jax.tree.map(lambda x, i=i: x[i], stacked), ref_grads["blocks"][i])
    assert kernel.get_value().sharding.spec == P("mm_stack", None, "model")  # still split
    assert kernel.get_value().sharding.mesh.devices.shape == (4, 2)
    params_close(unscanned_copy(model), ref, first_grads, steps=3, lr=1e-3)


class ScannedMLP(nnx.Module):
    """Layers built with ``nnx.vmap`` and applied with ``nnx.scan``, as Flax's "Scan over
    layers" guide (flax docs, nnx/guides/transforms) writes them."""

    def __init__(self, depth: int, dim: int, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs: nnx.Rngs):
            return nnx.Linear(dim, dim, rngs=rngs)

        self.blocks = create_block(rngs)
        self.head = nnx.Linear(dim, 1, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return x + jnp.tanh(block(x))

        return self.head(forward(x, self.blocks))


def mlp_step(schedule):
    def step(model, opt, x):
        grad_fn = nnx.value_and_grad(lambda m, x: (m(x) ** 2).mean())
        if schedule is not None:
            grad_fn = mm.microbatch(grad_fn, num=4, reduce="mean", schedule=schedule)
        loss, grads = grad_fn(model, x)
        opt.update(model, grads)
        return loss

    return step


@pytest.mark.parametrize("schedule", ["gpipe", "zero-bubble-h1"])
def test_flax_scan_over_layers_pipelines_on_two_tasks(tasks, schedule):
    x = jax.random.normal(jax.random.key(2), (8, 16))
    ref = ScannedMLP(6, 16, nnx.Rngs(0))
    model = mm.place(ScannedMLP(6, 16, nnx.Rngs(0)), [("blocks", tasks[:2]), ("head", tasks[1])])
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    step, ref_step = mm.jit(mlp_step(schedule)), nnx.jit(mlp_step(schedule))
    for _ in range(3):
        close(step(model, opt, x), ref_step(ref, ref_opt, x))
    trees_close(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param))
    moments = opt.opt_state[0].mu["blocks"]["kernel"].get_value()
    assert moments.sharding == model.blocks.kernel.get_value().sharding  # state follows


class DropoutBlock(nnx.Module):
    def __init__(self, dim: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, x):
        return x + self.dropout(jnp.tanh(self.linear(x)))


class ScannedDropoutMLP(nnx.Module):
    """Stacked layers with Dropout, each layer drawing from its own split ``nnx.Rngs`` stream
    inside ``nnx.scan``, as Flax's "Scan over layers" guide splits them."""

    def __init__(self, depth: int, dim: int, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs: nnx.Rngs):
            return DropoutBlock(dim, rngs)

        self.blocks = create_block(rngs)
        self.head = nnx.Linear(dim, 1, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return self.head(forward(x, self.blocks))


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h1"])
def test_dropout_in_scanned_layers_draws_the_unrolled_loop_s_keys(tasks, schedule):
    """Each layer's RNG count advances inside the scan that also carries the activations:
    the count's advance per microbatch is read off the scan's count loop alone."""
    x = jax.random.normal(jax.random.key(2), (8, 16))
    ref = ScannedDropoutMLP(4, 16, nnx.Rngs(0, dropout=1))
    model = ScannedDropoutMLP(4, 16, nnx.Rngs(0, dropout=1))
    model = mm.place(model, [("blocks", tasks[:2]), ("head", tasks[1])])

    def step(model, x):
        loss_fn = nnx.value_and_grad(lambda m, x: (m(x) ** 2).mean())
        return mm.microbatch(loss_fn, num=4, reduce="mean", schedule=schedule)(model, x)

    ref_step = nnx.jit(step)
    for _ in range(2):
        loss, grads = mm.jit(step)(model, x)
        ref_loss, ref_grads = ref_step(ref, x)
        close(loss, ref_loss)
        trees_close(grads, ref_grads)
    counts = nnx.state(model, nnx.RngCount)
    trees_close(counts, nnx.state(ref, nnx.RngCount))
    assert np.asarray(counts["blocks"]["dropout"]["rngs"]["count"]).tolist() == [8] * 4


def test_a_global_norm_clip_reduces_over_the_chunks(tasks):
    x = jax.random.normal(jax.random.key(3), (8, 16))
    tx = optax.chain(optax.clip_by_global_norm(0.01), optax.sgd(0.5))
    ref = ScannedMLP(4, 16, nnx.Rngs(0))
    model = mm.place(ScannedMLP(4, 16, nnx.Rngs(0)), [("blocks", tasks), ("head", tasks[3])])
    opt, ref_opt = (nnx.Optimizer(m, tx, wrt=nnx.Param) for m in (model, ref))
    step, ref_step = mm.jit(mlp_step(None)), nnx.jit(mlp_step(None))
    for _ in range(2):
        close(step(model, opt, x), ref_step(ref, ref_opt, x))
    trees_close(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param))


def test_a_step_takes_the_chunks_it_joined_and_cuts_a_new_value_again(tasks, monkeypatch):
    x = jax.random.normal(jax.random.key(4), (8, 16))
    ref = ScannedMLP(4, 16, nnx.Rngs(0))
    model = mm.place(ScannedMLP(4, 16, nnx.Rngs(0)), [("blocks", tasks), ("head", tasks[3])])
    opt, ref_opt = (nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param) for m in (model, ref))
    step = mm.cached_partial(mm.jit(mlp_step("1f1b")), model, opt)
    ref_step = nnx.jit(mlp_step("1f1b"))
    close(step(x), ref_step(ref, ref_opt, x))
    cuts = []
    split = mm.TaskStack.split
    monkeypatch.setattr(mm.TaskStack, "split", lambda *a: cuts.append(a[1]) or split(*a))
    close(step(x), ref_step(ref, ref_opt, x))
    assert cuts == []  # every stacked input is a result the previous step joined
    new_kernel = model.blocks.kernel.get_value() * 0.5  # a value no step made: cut again
    model.blocks.kernel.set_value(new_kernel)
    ref.blocks.kernel.set_value(ref.blocks.kernel.get_value() * 0.5)
    close(step(x), ref_step(ref, ref_opt, x))
    assert [c is new_kernel for c in cuts] == [True]
    trees_close(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param))


def test_chunks_kept_for_a_joined_array_go_with_it(tasks):
    model = mm.place(ScannedMLP(4, 16, nnx.Rngs(0)), [("blocks", tasks), ("head", tasks[3])])
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    step = mm.jit(mlp_step(None))
    step(model, opt, jnp.ones((8, 16)))
    (expansion,) = [built.expansion for _, (built, *_) in step._cache.values()]
    assert len(expansion._joined) == sum(home is not None for home in expansion.outputs) == 2
    nnx.update(model, jax.tree.map(jnp.copy, nnx.state(model)))  # the joined arrays are dropped
    assert expansion._joined == {}


def test_arrays_rebuilt_from_their_shards_equal_jax_s_own(tasks):
    from mmnnx._jax.arrays import array_from_shards, shards_by_device

    stack = mm.stack_of(
        mm.place(
            ScannedMLP(4, 16, nnx.Rngs(0)), [("blocks", tasks), ("head", tasks[3])]
        ).blocks.kernel
    )
    sharding = stack.sharding(P(None, None, "model"))
    x = jax.device_put(jnp.arange(4 * 16 * 16.0).reshape(4, 16, 16), sharding)
    by_device = shards_by_device(x)
    assert by_device == {s.device: s.data for s in x.addressable_shards}
    rebuilt = array_from_shards(x.shape, sharding, dict(reversed(by_device.items())))
    ref = jax.make_array_from_single_device_arrays(x.shape, sharding, list(by_device.values()))
    assert rebuilt.sharding == ref.sharding and rebuilt.aval == ref.aval
    np.testing.assert_array_equal(np.asarray(rebuilt), np.asarray(x))
    devices = [s.device for s in x.addressable_shards]
    assert [s.device for s in rebuilt.addressable_shards] == devices


def test_bad_stacks_are_refused_before_anything_moves(tasks):
    model = ScannedMLP(6, 16, nnx.Rngs(0))
    before = model.blocks.kernel.get_value()
    with pytest.raises(ValueError, match=r"'blocks/bias'.*6 layers.*4 tasks 't0\+t1\+t2\+t3'"):
        mm.place(model, [("blocks", tasks), ("head", tasks[3])])
    with pytest.raises(ValueError, match=r"'blocks/kernel'.*leading layer axis over 'model'"):
        mm.place(model, [("blocks/kernel", tasks[:2], P("model")), (".*", tasks[2])])
    solo = mm.Task("solo", mesh=mm.TaskMesh(devices=[6]))
    with pytest.raises(ValueError, match=r"tasks 't0' and 'solo' cannot share stacked"):
        mm.place(model, [("blocks", [tasks[0], solo]), ("head", tasks[1])])
    v_order = [tasks[0], tasks[1], tasks[1].virtual_stage(1), tasks[0].virtual_stage(1)]
    with pytest.raises(ValueError, match=r"tasks 't1' and 't1:1' cannot share .* device 2"):
        mm.place(ScannedMLP(4, 16, nnx.Rngs(0)), [("^blocks", v_order), ("head", tasks[0])])
    assert model.blocks.kernel.get_value() is before and mm.stack_of(model.blocks.kernel) is None


def test_an_op_needing_the_whole_stack_names_the_variable(tasks):
    model = mm.place(ScannedMLP(4, 16, nnx.Rngs(0)), [("blocks", tasks), ("head", tasks[3])])

    @mm.jit
    def first_layer_norm(model):
        return jnp.abs(model.blocks.kernel[...][0]).sum()

    with pytest.raises(mm.MPMDError, match=r"stacked Variable 'arg0/blocks/kernel'.*split over"):
        first_layer_norm(model)


def test_tabulate_and_placement_show_the_stack(tasks):
    model = mm.place(ScannedMLP(4, 16, nnx.Rngs(0)), [("blocks", tasks), ("head", tasks[3])])
    assert mm.placement(model)["blocks/kernel"] == ("t0+t1+t2+t3", P())
    text = str(mm.tabulate(model, jnp.ones((2, 16))))
    assert "t0+t1+t2+t3" in text and "(unplaced)" not in text
    totals = text[text.index("Totals per task") :]
    kernel_chunk = 16 * 16 * 4  # one layer of float32 weights per task
    bias_chunk = 16 * 4
    row = next(line for line in totals.splitlines() if " t0 " in line)
    assert f"{kernel_chunk + bias_chunk:,} B" in row


def test_stage_rules_split_stacked_blocks_evenly(tasks):
    model = gpt(scan_layers=True)
    rules = stage_rules(model, tasks, report=False)
    assert rules[-1] == ("^blocks/", tasks)
    assert [task.name for _, task in rules[:-1]] == ["t0", "t3"]
    with pytest.raises(ValueError, match="8 stacked blocks cannot be split evenly over 3"):
        stage_rules(model, tasks[:3], report=False)


def test_init_builds_a_stack_on_its_tasks(tasks):
    rules = [("^blocks/", tasks), ("^embed/", tasks[0]), ("^norm/|^head/", tasks[3])]
    model = mm.init(lambda: GPT(GPTConfig(**CONFIG, scan_layers=True), rngs=nnx.Rngs(0)), rules)
    ref = gpt(scan_layers=True)
    kernel = model.blocks.attn.q.kernel.get_value()
    assert kernel.sharding == mm.stack_of(model.blocks.attn.q.kernel).sharding(
        P(None, None, "model")
    )
    np.testing.assert_array_equal(np.asarray(kernel), np.asarray(ref.blocks.attn.q.kernel[...]))


def test_a_stack_saves_and_restores_onto_other_stacks_and_one_task(tasks, tmp_path):
    x = jax.random.normal(jax.random.key(4), (8, 16))
    model = mm.place(ScannedMLP(4, 16, nnx.Rngs(0)), [("blocks", tasks), ("head", tasks[3])])
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = mm.jit(mlp_step(None))
    step(model, opt, x)
    with mm.train.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, model=model, opt=opt)
    expected = float(step(model, opt, x))
    for rules in (
        [("blocks", tasks[2:]), ("head", tasks[3])],
        [(".*", tasks[1])],
    ):
        fresh = mm.place(ScannedMLP(4, 16, nnx.Rngs(1)), rules)
        fresh_opt = nnx.Optimizer(fresh, optax.adam(1e-2), wrt=nnx.Param)
        layout = fresh.blocks.kernel.get_value().sharding
        with mm.train.Checkpointer(tmp_path) as ckpt:
            ckpt.restore(model=fresh, opt=fresh_opt)
        assert fresh.blocks.kernel.get_value().sharding == layout  # the current placement
        close(mm.jit(mlp_step(None))(fresh, fresh_opt, x), expected)


def _scans(fragment) -> list:
    return [op for op in fragment.ops if op.name == "scan"]


def _result_shapes(ops) -> set:
    """The shapes of the scans' results (the scanned ones stacked along their length)."""
    shapes = set()
    for op in ops:
        (_, num_carry), length = scan_counts(op.params), op.params["length"]
        for i, aval in enumerate(op.params["jaxpr"].out_avals):
            shapes.add(aval.shape if i < num_carry else (length, *aval.shape))
    return shapes


def test_zero_bubble_runs_a_scanned_backward_as_an_input_and_a_weight_gradient_scan(tasks):
    """The backward of ``nnx.scan`` layers is one scan; a zero-bubble stage runs it as two: I
    carries the cotangent down the layers and saves what the weight gradients read, W makes
    those from the saved values later (oracle: the parametrized test above)."""
    x = jax.random.normal(jax.random.key(2), (8, 16))
    model = mm.place(ScannedMLP(6, 16, nnx.Rngs(0)), [("blocks", tasks[:2]), ("head", tasks[1])])
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    stages = mm.jit(mlp_step("zero-bubble-h1")).plan(model, opt, x).pipeline.stages
    kernel_grads = (3, 16, 16)  # one task's three layers
    for stage in (0, 1):
        assert kernel_grads in _result_shapes(_scans(stages["W", stage]))
        assert kernel_grads in _result_shapes(_scans(stages["B", stage]))
    assert _scans(stages["I", 1]) and kernel_grads not in _result_shapes(_scans(stages["I", 1]))


class Chunked(nnx.Module):
    """A layer whose custom backward scans chunks, as ``benchmarks/pipeline.py``'s stages do:
    a matmul (``weight`` of shape (8, 8)) or an elementwise scaling (shape (8,))."""

    def __init__(self, seed: int, shape: tuple[int, ...]):
        noise = jax.random.normal(jax.random.key(seed), shape)
        self.w = nnx.Param((jnp.eye(8) if len(shape) == 2 else 1.0) + 0.1 * noise)

    def __call__(self, h):
        return chunked_layers([self.w[...]], h)


class TwoChunked(nnx.Module):
    def __init__(self, shape: tuple[int, ...]):
        self.a, self.b = Chunked(0, shape), Chunked(1, shape)

    def __call__(self, x):
        return self.b(self.a(x))


@pytest.mark.parametrize("shape", [(8, 8), (8,)], ids=["matmul", "elementwise"])
def test_zero_bubble_splits_a_chunk_scan_when_its_weight_gradient_is_a_matmul(shape):
    """A custom backward that scans chunks and sums the weight gradient in the carry. For a
    matmul, stage 1's I scan makes the input gradient alone and its W scan the weight gradient
    from what I saved; for an elementwise weight, saving its operands would cost more than the
    product and sum it defers, so I runs the scan whole. Loss and gradients equal one
    device's either way."""
    a, b = one_device_tasks(2)
    x = jax.random.normal(jax.random.key(3), (16, 8))
    model = mm.place(TwoChunked(shape), [("^a/", a), ("^b/", b)])
    loss_fn = nnx.value_and_grad(lambda m, x: jnp.mean(m(x) ** 2))
    step = mm.jit(mm.microbatch(loss_fn, num=4, reduce="mean", schedule="zero-bubble-h1"))
    stages = step.plan(model, x).pipeline.stages
    split = len(shape) == 2
    assert (shape in _result_shapes(_scans(stages["I", 1]))) != split
    w_scans = _scans(stages["W", 1]) if ("W", 1) in stages else []
    assert bool(w_scans) == split and (not split or shape in _result_shapes(w_scans))
    loss, grads = step(model, x)
    ref_loss, ref_grads = loss_fn(TwoChunked(shape), x)
    close(loss, ref_loss)
    trees_close(nnx.state(grads), nnx.state(ref_grads))
