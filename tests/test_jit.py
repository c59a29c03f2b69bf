"""mm.jit against the same model on one device."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mmnnx as mm
from tests.models import mse as loss_fn
from tests.models import train_step
from tests.oracle import close

INIT = nnx.initializers.lecun_normal()
RULES = mm.logical_rules(batch="data", mlp="model", embed=None)


def tp(names):
    return nnx.with_partitioning(INIT, names)


class MLP4(nnx.Module):
    """Two stages of two tensor-parallel Linear layers each."""

    def __init__(self, rngs):
        self.l0 = nnx.Linear(16, 32, kernel_init=tp(("embed", "mlp")), rngs=rngs)
        self.l1 = nnx.Linear(32, 16, kernel_init=tp(("mlp", "embed")), rngs=rngs)
        self.l2 = nnx.Linear(16, 32, kernel_init=tp(("embed", "mlp")), rngs=rngs)
        self.l3 = nnx.Linear(32, 4, kernel_init=tp(("mlp", "embed")), rngs=rngs)

    def __call__(self, x):
        x = self.l1(jax.nn.relu(self.l0(x)))
        return self.l3(jax.nn.relu(self.l2(x)))


def make(seed=0):
    with nnx.use_eager_sharding(False):
        return MLP4(nnx.Rngs(seed))


@pytest.fixture(scope="module")
def tasks():
    mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
    s0 = mm.Task("stage0", mesh=mesh.task_mesh(stage=0), logical_axes=RULES)
    s1 = mm.Task("stage1", mesh=mesh.task_mesh(stage=1), logical_axes=RULES)
    return s0, s1


@pytest.fixture(scope="module")
def batch():
    x = jax.random.normal(jax.random.key(1), (8, 16))
    y = jax.random.normal(jax.random.key(2), (8, 4))
    return x, y


def two_stage(tasks, seed=0):
    s0, s1 = tasks
    return mm.place(make(seed), [("l0|l1", s0), ("l2|l3", s1)])


def placed_and_reference(tasks, tx):
    """The two-stage model and its optimizer, and the same pair on one device."""
    model = two_stage(tasks)
    ref = make()
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    return model, opt, ref, nnx.Optimizer(ref, tx, wrt=nnx.Param)


def flat(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_forward_matches_one_device(tasks, batch):
    x, _ = batch
    model = two_stage(tasks)
    out = mm.jit(lambda m, x: m(x))(model, x)
    close(out, make()(x))
    assert sorted(d.id for d in out.devices()) == [4, 5, 6, 7]  # outputs stay where computed


def test_value_and_grad_matches_one_device(tasks, batch):
    model = two_stage(tasks)
    loss, grads = mm.jit(nnx.value_and_grad(loss_fn))(model, *batch)
    ref_loss, ref_grads = nnx.value_and_grad(loss_fn)(make(), *batch)
    close(loss, ref_loss)
    for a, b in zip(flat(grads), flat(ref_grads), strict=True):
        close(a, b)
    for name in ("l0", "l1", "l2", "l3"):
        # gradients are computed on, and returned from, their parameter's task and sharding
        grad = grads[name]["kernel"].get_value()
        assert grad.sharding == getattr(model, name).kernel.get_value().sharding


def test_three_adamw_steps_match_and_stay_placed(tasks, batch):
    s0, s1 = tasks
    model, opt, ref, ref_opt = placed_and_reference(tasks, optax.adamw(1e-2))
    step = mm.jit(train_step)
    placement = mm.placement(opt)
    for _ in range(3):
        loss = step(model, opt, *batch)
        ref_loss = train_step(ref, ref_opt, *batch)
        close(loss, ref_loss)
        for a, b in zip(flat(nnx.state(model)), flat(nnx.state(ref)), strict=True):
            close(a, b)
        for a, b in zip(flat(opt.opt_state), flat(ref_opt.opt_state), strict=True):
            close(a, b)
        assert mm.placement(opt) == placement
        for name, task in [("l0", s0), ("l1", s0), ("l2", s1), ("l3", s1)]:
            kernel = getattr(model, name).kernel.get_value()
            assert kernel.sharding == task.sharding(placement[f"opt_state/0/mu/{name}/kernel"][1])
            for moments in (opt.opt_state[0].mu, opt.opt_state[0].nu):
                assert moments[name]["kernel"].get_value().sharding == kernel.sharding
    assert step.trace_count == 1


def test_plan_is_inspectable(tasks, batch):
    model = two_stage(tasks)
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    plan = mm.jit(train_step).plan(model, opt, *batch)
    assert [t.name for t in plan.tasks] == ["stage0", "stage1"]
    assert len(plan.fragments_of("stage0")) >= 1 and len(plan.fragments_of("stage1")) >= 1
    kinds = {k for f in plan.fragments for k in f.kinds}
    assert kinds == {"forward", "backward", "update"}
    # the activation goes forward once and its cotangent comes back once
    big = [(t.source.name, t.target.name) for t in plan.transfers if t.source and t.nbytes >= 512]
    assert sorted(big) == [("stage0", "stage1"), ("stage1", "stage0")]
    assert all(t.source is None or t.nbytes <= 512 for t in plan.transfers)
    text = str(plan)
    assert "task 'stage0'" in text and "stage0 -> stage1: float32[8,16] (512 B)" in text
    assert plan.num_programs == len(plan.fragments)


def test_plan_compiles_nothing_and_shows_each_tasks_program(tasks, batch, monkeypatch):
    from mmnnx.mpmd.run import programs

    compiled = []
    real = programs.lower_fragments
    monkeypatch.setattr(
        programs,
        "lower_fragments",
        lambda *a: compiled.extend(run.fragment.name for run in a[1]) or real(*a),
    )
    model, opt, ref, ref_opt = placed_and_reference(tasks, optax.sgd(0.1))
    step = mm.jit(train_step)
    plan = step.plan(model, opt, *batch)
    assert compiled == []  # planning and lowering compile nothing
    text = str(plan)
    for task in ("stage0", "stage1"):
        actions = plan.program.program(task)
        assert f"program of {task!r} ({len(actions)} actions)" in text
        assert {type(a).__name__ for a in actions} >= {"Run", "Send", "Recv", "Release"}
    runs = [a for a in plan.program.actions if type(a).__name__ == "Run"]
    assert [a.fragment.name for a in runs] == [f.name for f in plan.fragments]
    compiled_plan = step.compile(model, opt, *batch)
    assert compiled_plan.program is plan.program  # what was printed is what runs
    assert step.plan(model, opt, *batch) is compiled_plan
    assert sorted(compiled) == sorted(f.name for f in plan.fragments)
    close(step(model, opt, *batch), train_step(ref, ref_opt, *batch))
    assert len(compiled) == plan.num_programs  # the call compiled nothing more
    assert all(t.sharding is not None for t in compiled_plan.transfers)  # resolved by compiling
    assert any(t.sharding is None for t in plan.transfers)  # the plan itself is left as it was


def test_one_task_is_one_program(batch):
    t = mm.Task(
        "solo",
        mesh=mm.TaskMesh(devices=range(4), axis_sizes=(2, 2), axis_names=("data", "model")),
        logical_axes=RULES,
    )
    model = mm.place(make(), [(".*", t)])
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    plan = mm.jit(train_step).plan(model, opt, *batch)
    assert len(plan.fragments) == 1 and plan.num_programs == 1
    assert all(tr.source is None for tr in plan.transfers)  # only the batch goes in


def test_an_input_already_laid_out_on_its_task_is_not_moved(monkeypatch):
    # a one-device task: its inputs' layout is a NamedSharding on a one-device mesh, while an
    # array made on that device has a SingleDeviceSharding; the same layout under another name
    solo = mm.Task("solo", mesh=mm.TaskMesh(devices=[3]))
    model = mm.place(make(), [(".*", solo)])
    step = mm.jit(lambda m, x: m(x))
    here = jax.device_put(jnp.ones((8, 16)), jax.devices()[3])
    elsewhere = np.ones((8, 16), np.float32)  # on the host
    expected = step(model, here)
    puts = []
    device_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: puts.append(a) or device_put(*a, **k))
    close(step(model, here), expected)
    assert puts == []
    close(step(model, elsewhere), expected)
    assert len(puts) == 1


def test_cyclic_gc_is_paused_while_a_step_is_traced_and_lowered(tasks, batch, monkeypatch):
    """Python's cyclic collector is off while mm.jit traces, plans and lowers a step, and on
    again after, a trace that raises included."""
    import gc

    from mmnnx.mpmd.run import programs

    seen = []
    lower = programs.lower_fragments
    monkeypatch.setattr(
        programs,
        "lower_fragments",
        lambda *a: seen.append(("lower", gc.isenabled())) or lower(*a),
    )

    def forward(m, x):
        seen.append(("trace", gc.isenabled()))
        return m(x)

    assert gc.isenabled()
    mm.jit(forward).compile(two_stage(tasks), batch[0])
    assert gc.isenabled()
    assert ("trace", False) in seen and ("lower", False) in seen
    assert all(not enabled for _, enabled in seen)

    def failing(m, x):
        raise RuntimeError("user error while tracing")

    with pytest.raises(RuntimeError, match="user error while tracing"):
        mm.jit(failing)(two_stage(tasks), batch[0])
    assert gc.isenabled()


def test_cache_and_replan_on_new_shape(tasks, batch):
    model = two_stage(tasks)
    step = mm.jit(lambda m, x: m(x))
    x, _ = batch
    step(model, x)
    step(model, x + 1)
    assert step.trace_count == 1
    step(model, jnp.ones((4, 16)))
    assert step.trace_count == 2
    step(model, jnp.ones((4, 16)))
    assert step.trace_count == 2


def test_with_options_keeps_every_option_and_changes_the_given_ones(tasks, batch):
    from mmnnx.jit import JitOptions

    def flagged_step(model, opt, x, y, n=1, *, flag=False):
        return train_step(model, opt, x, y)

    step = mm.jit(
        flagged_step,
        static_argnums=4,
        static_argnames="flag",
        donate_argnums=(0, 1),
        pack_residuals=False,
        recompute_residuals=False,
        pack_weights=1024,
        share_cores=False,
        gather_weights="data",
    )
    defaults = JitOptions()
    given = [f.name for f in dataclasses.fields(JitOptions) if f.name != "schedule"]
    assert all(getattr(step.options, name) != getattr(defaults, name) for name in given)
    same = step.with_options()
    assert same is not step and same.fun is step.fun and same.options == step.options
    gpipe = step.with_options(schedule="gpipe")
    assert gpipe.options == dataclasses.replace(step.options, schedule="gpipe")
    assert (gpipe.pack_residuals, gpipe.recompute_residuals, gpipe.pack_weights) == (0, False, 1024)
    assert gpipe.with_options(pack_weights=True).options.schedule == "gpipe"
    assert step.options.schedule is None  # the step itself is unchanged
    table = mm.schedules.gpipe(2, 4)
    assert step.with_options(schedule=table).options.schedule is table
    with pytest.raises(ValueError, match="unknown schedule 'gpipee'; valid schedules are gpipe"):
        step.with_options(schedule="gpipee")
    with pytest.raises(TypeError, match="is not a name or a Schedule"):
        step.with_options(schedule=4)
    with pytest.raises(TypeError, match="recompute_residuals must be True or False"):
        step.with_options(recompute_residuals="yes")
    with pytest.raises(TypeError, match="share_cores must be True or False, got 1"):
        mm.jit(share_cores=1)
    with pytest.raises(TypeError, match="no_such_option"):
        step.with_options(no_such_option=1)
    model = two_stage(tasks)
    bound = mm.cached_partial(mm.jit(lambda m, x: m(x)), model)
    again = bound.with_options(schedule="1f1b")
    assert isinstance(again, mm.CachedPartial) and again.cached_args == bound.cached_args
    assert again.fn.options.schedule == "1f1b" and bound.fn.options.schedule is None
    close(again(batch[0]), bound(batch[0]))


@pytest.mark.parametrize(
    "options, match",
    [
        ({"donate_argnums": (7,)}, r"donate_argnums=\(7,\), but only accepts 4 positional ar"),
        ({"static_argnums": 4}, r"static_argnums=\(4,\), but only accepts 4 positional arg"),
        ({"static_argnums": -5}, r"static_argnums=\(-5,\), but only accepts 4 positional ar"),
        ({"static_argnames": "flag"}, r"invalid argnames \['flag'\] in static_argnames; it does"),
        ({"static_argnums": 1, "donate_argnums": (0, 1)}, r"argument 1 in both static_argnums"),
    ],
)
def test_argnums_the_step_does_not_take_are_refused_when_applied(options, match):
    with pytest.raises(ValueError, match=f"^mm.jit: train_step has {match}"):
        mm.jit(train_step, **options)
    with pytest.raises(ValueError, match=match):
        mm.jit(**options)(train_step)  # as a decorator with options


def test_static_arguments_are_static_by_position_or_by_keyword(tasks):
    """As jax.jit: static_argnums names the parameter, static_argnames gives its position."""
    model = two_stage(tasks)

    def step(model, x, n):
        return model(x).sum() + jnp.zeros(n).sum()  # n must be a Python int

    x = jnp.ones((8, 16))
    by_position = mm.jit(step, static_argnums=2)
    assert by_position.static_argnames == ("n",)
    by_name = mm.jit(step, static_argnames="n")
    assert by_name.static_argnums == (2,)
    want = nnx.jit(step, static_argnums=2)(make(), x, 3)
    close(by_position(model, x, n=3), want)
    close(by_name(model, x, 3), want)


def test_python_scalars_are_weakly_typed_as_with_nnx_jit(tasks):
    """A Python float times bf16 activations stays bf16, a Python int plus int8 stays int8."""
    model = two_stage(tasks)

    def step(model, x, scale, shift):
        return model(x).astype(jnp.bfloat16) * scale, jnp.arange(3, dtype=jnp.int8) + shift

    x = jnp.ones((8, 16))
    want = nnx.jit(step)(make(), x, 0.5, 1)
    got = mm.jit(step)(model, x, 0.5, 1)
    assert [a.dtype for a in got] == [a.dtype for a in want] == [jnp.bfloat16, jnp.int8]
    close(got[0].astype(jnp.float32), want[0].astype(jnp.float32), rtol=1e-2, atol=1e-2)
    step = mm.jit(step)
    step(model, x, 0.5, 1)
    step(model, x, np.float32(0.5), 1)  # a NumPy scalar is strongly typed: its own trace
    assert step(model, x, np.float32(0.5), 1)[0].dtype == jnp.float32
    assert step.trace_count == 2


def test_a_returned_input_variable_is_the_callers_own_as_with_nnx_jit(tasks):
    model = two_stage(tasks)

    def step(model, x):
        model.l3.bias[...] += 1.0
        return model.l3.bias, model(x), model

    bias, _, returned = mm.jit(step)(model, jnp.ones((8, 16)))
    assert bias is model.l3.bias  # nnx.jit returns the caller's Variable too
    assert returned.l0.kernel is model.l0.kernel
    close(bias[...], jnp.ones(4))


def test_negative_argnums_count_from_the_end_of_the_signature():
    step = mm.jit(train_step, static_argnums=-1, donate_argnums=(-4, 1))
    assert (step.static_argnums, step.donate_argnums) == ((3,), (0, 1))
    assert mm.jit(lambda *args: args[0], donate_argnums=5).donate_argnums == (5,)  # as jax.jit
    with pytest.raises(ValueError, match=r"donate_argnums=\(-1,\); a negative position counts"):
        mm.jit(lambda *args: args[0], donate_argnums=-1)


# -- mixed state: batch statistics and dropout RNG --------------------------------------------


def test_batchnorm_and_dropout_state_written_back(tasks):
    from tests.models import TwoStageMLP

    def build():
        with nnx.use_eager_sharding(False):
            return TwoStageMLP(rngs=nnx.Rngs(0))

    s0, s1 = tasks
    model = mm.place(build(), [("layers/0", s0), ("layers/1|norm|drop", s1)])
    ref = build()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(3), (8, 16))

    def step(model, opt, x):
        def loss(m):
            return jnp.mean(m(x) ** 2)

        value, grads = nnx.value_and_grad(loss)(model)
        opt.update(model, grads)
        return value

    jstep = mm.jit(step)
    for _ in range(2):
        close(jstep(model, opt, x), step(ref, ref_opt, x))
    close(model.norm.mean.get_value(), ref.norm.mean.get_value())
    close(model.norm.var.get_value(), ref.norm.var.get_value())
    assert int(model.drop.rngs.count.get_value()) == int(ref.drop.rngs.count.get_value()) == 2
    for a, b in zip(
        flat(nnx.state(model, nnx.Param)), flat(nnx.state(ref, nnx.Param)), strict=True
    ):
        close(a, b)
    for var in (model.norm.mean, model.drop.rngs.count):
        assert sorted(d.id for d in var.get_value().devices()) == [4, 5, 6, 7]


# -- errors -----------------------------------------------------------------------------------


def test_state_of_two_tasks_in_one_op(tasks, batch):
    model = two_stage(tasks)
    before = flat(nnx.state(model))

    def tied(m, x):
        return jnp.sum(m.l0.bias[...] + m.l2.bias[...])

    with pytest.raises(mm.PlacementConflictError) as info:
        mm.jit(tied)(model, batch[0])
    message = str(info.value)
    assert "`add`" in message
    assert "l0/bias" in message and "'stage0'" in message
    assert "l2/bias" in message and "'stage1'" in message
    assert "test_jit.py" in message  # the user's source line
    for a, b in zip(before, flat(nnx.state(model)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_non_array_leaves(tasks):
    model = two_stage(tasks)
    step = mm.jit(lambda m, tag: m(jnp.ones((2, 16))))
    with pytest.raises(mm.MPMDError, match=r"leaf 'arg1/tag' is a str, not an array.*static"):
        step(model, {"tag": "x"})
    out = mm.jit(lambda m, n: m(jnp.ones((n, 16))), static_argnums=1)(model, 3)
    assert out.shape == (3, 4)
    scaled = mm.jit(lambda m, x, s: m(x) * s)(model, jnp.ones((2, 16)), 2.0)  # scalars are arrays
    close(scaled, make()(jnp.ones((2, 16))) * 2.0)


def test_structural_side_effect(tasks):
    model = two_stage(tasks)

    def replace(m):
        m.l0.kernel = nnx.Param(m.l0.kernel[...] + 1)
        return m.l0.kernel[...].sum()

    def shrink(m):
        del m.l0.bias
        return m.l0.kernel[...].sum()

    kernel = model.l0.kernel
    for step in (replace, shrink):
        with pytest.raises(mm.SideEffectError, match="changed the structure"):
            mm.jit(step)(model)
    assert model.l0.kernel is kernel and hasattr(model.l0, "bias")

    def grow(m):  # added Variables are carried back, as nnx.jit does (what sow needs)
        m.extra = nnx.Param(m.l0.kernel[...].sum() * jnp.ones(3))
        return m.l0.kernel[...].sum()

    total = mm.jit(grow)(model)
    np.testing.assert_allclose(model.extra.get_value(), total * np.ones(3), rtol=1e-6)


def test_unplaced_model_is_an_error():
    with pytest.raises(mm.MPMDError, match="no argument holds state placed on a task"):
        mm.jit(lambda m, x: m(x))(make(), jnp.ones((2, 16)))


# -- mm.task regions and logical sharding constraints ------------------------------------------


def test_task_region_forces_placement(tasks, batch):
    s0, s1 = tasks
    model = mm.place(make(), [(".*", s0)])
    x, y = batch

    def head_loss(out, y):
        return jnp.mean(jnp.tanh(out - y) ** 2)

    def step(model, x, y):
        def loss(m):
            return mm.task(head_loss, s1)(m(x), y)

        return nnx.value_and_grad(loss)(model)

    loss, grads = mm.jit(step)(model, x, y)
    ref_loss, ref_grads = step(make(), x, y)
    close(loss, ref_loss)
    for a, b in zip(flat(grads), flat(ref_grads), strict=True):
        close(a, b)
    assert sorted(d.id for d in loss.devices()) == [4, 5, 6, 7]
    plan = mm.jit(step).plan(model, x, y)
    (head,) = plan.fragments_of("stage1")
    assert set(head.kinds) == {"forward", "backward"}


def test_task_region_reading_other_tasks_state(tasks, batch):
    s0, s1 = tasks
    model = two_stage(tasks)

    def step(m, x):
        return mm.task(lambda x: m.l2(x), s0)(x).sum()

    with pytest.raises(mm.PlacementConflictError, match=r"region 'stage0'.*l2/.*'stage1'"):
        mm.jit(step)(model, jnp.ones((2, 16)))


def test_logical_constraint_shards_batch_on_first_consumer(tasks, batch):
    s0, _ = tasks
    model = two_stage(tasks)

    def forward(m, x):
        x = mm.with_sharding_constraint(x, ("batch", None))
        return m(x)

    x, _ = batch
    step = mm.jit(forward)
    close(step(model, x), make()(x))
    (inp,) = [t for t in step.plan(model, x).transfers if t.source is None]
    assert inp.target == s0
    assert inp.sharding.spec == jax.sharding.PartitionSpec("data", None)
    assert inp.sharding.mesh == s0.jax_mesh


class ScannedHidden(nnx.Module):
    """MLP4 whose hidden activations go through a ``jax.lax.scan`` of small steps on the first
    stage and a ``jax.checkpoint``-ed block on the second, each constraining its activations
    inside the transformed body (as a scanned or rematerialised transformer block does)."""

    def __init__(self, rngs, constrain=True):
        self.mlp = MLP4(rngs)
        self.constrain = constrain

    def _c(self, h, names):
        return mm.with_sharding_constraint(h, names) if self.constrain else h

    def __call__(self, x):
        m = self.mlp

        def small_step(h, scale):
            return self._c(jnp.tanh(h) * scale, ("batch", "mlp")), None

        h, _ = jax.lax.scan(small_step, m.l0(x), jnp.linspace(0.5, 1.0, 3))
        h = m.l1(jax.nn.relu(h))
        block = jax.checkpoint(lambda h: self._c(jax.nn.relu(m.l2(h)), ("batch", "mlp")))
        return m.l3(block(h))


def test_constraints_inside_scan_and_checkpoint_bodies_apply_on_their_task(tasks, batch):
    s0, s1 = tasks
    with nnx.use_eager_sharding(False):
        model = mm.place(ScannedHidden(nnx.Rngs(0)), [("l0|l1", s0), ("l2|l3", s1)])
        reference = ScannedHidden(nnx.Rngs(0), constrain=False)
    x, y = batch
    step = mm.jit(nnx.value_and_grad(lambda m, x, y: jnp.mean((m(x) - y) ** 2)))
    (loss, grads), (ref_loss, ref_grads) = (
        step(model, x, y),
        nnx.value_and_grad(lambda m, x, y: jnp.mean((m(x) - y) ** 2))(reference, x, y),
    )
    close(loss, ref_loss)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        close(a, b)
    # resolved on the task that runs the body: an axis that does not divide is named there
    narrow = jnp.ones((3, 16))  # 3 rows: the data axis (2) does not divide them
    with pytest.raises(ValueError, match=r"with_sharding_constraint at .* on task 'stage0'"):
        mm.jit(lambda m, x: m(x))(model, narrow)


def test_batch_not_divisible_by_data_axis(tasks):
    model = two_stage(tasks)

    def forward(m, x):
        return m(mm.with_sharding_constraint(x, ("batch", None)))

    with pytest.raises(ValueError, match=r"task 'stage0'.*dimension 0 of size 3.*\('data',\)"):
        mm.jit(forward)(model, jnp.ones((3, 16)))


def test_constraint_outside_jit_is_physical():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    f = jax.jit(
        lambda a: mm.with_sharding_constraint(
            a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
        )
    )
    assert f(jnp.ones(4)).sharding.spec == jax.sharding.PartitionSpec("x")


@pytest.mark.parametrize("bound", [False, True], ids=["mm.jit", "cached_partial"])
def test_donated_state_is_updated_in_place(tasks, batch, bound):
    model, opt, ref, ref_opt = placed_and_reference(tasks, optax.adamw(1e-2))
    step = mm.jit(train_step, donate_argnums=(0, 1))
    run = mm.cached_partial(step, model, opt) if bound else functools.partial(step, model, opt)
    for _ in range(2):
        old_kernel = model.l2.kernel.get_value()
        old_moment = opt.opt_state[0].mu["l0"]["kernel"].get_value()
        close(run(*batch), train_step(ref, ref_opt, *batch))
        assert old_kernel.is_deleted() and old_moment.is_deleted()
    for a, b in zip(flat(nnx.state(model)), flat(nnx.state(ref)), strict=True):
        close(a, b)
    assert not batch[0].is_deleted()  # only the donated arguments are consumed


def test_arrays_on_devices_no_task_owns(tasks):
    s0, _ = tasks
    model = mm.place(make(), [(".*", s0)])
    stray = jax.device_put(jnp.ones((2, 16)), jax.devices()[6])
    with pytest.raises(mm.MPMDError, match=r"devices \[6\] that no task owns.*\[0, 1, 2, 3\]"):
        mm.jit(lambda m, x: m(x))(model, stray)
    moved = two_stage(tasks)
    moved.l0.kernel.set_value(jax.device_put(moved.l0.kernel.get_value(), jax.devices()[7]))
    with pytest.raises(mm.MPMDError, match=r"'.*l0/kernel' is placed on task 'stage0'.*\[7\]"):
        mm.jit(lambda m, x: m(x))(moved, jnp.ones((2, 16)))


def test_optimizer_state_left_behind_by_placing_again_is_refused_then_follows(tasks, batch):
    s0, s1 = tasks
    model, opt, ref, ref_opt = placed_and_reference(tasks, optax.adamw(1e-2))
    step = mm.jit(train_step)
    close(step(model, opt, *batch), train_step(ref, ref_opt, *batch))
    mm.place(model, [("l0", s0), ("l1|l2|l3", s1)])  # l1 moves; its moments stay on stage0
    before = flat(opt.opt_state)
    with pytest.raises(
        mm.MPMDError,
        match=r"optimizer state 'arg1/opt_state/0/mu/l1/bias' is on task 'stage0' but the "
        r"parameter it is kept for, 'arg0/l1/bias', is on task 'stage1' \(4 optimizer .*"
        r"mm.place_optimizer\(opt, model\)",
    ):
        step(model, opt, *batch)
    for a, b in zip(before, flat(opt.opt_state), strict=True):
        np.testing.assert_array_equal(a, b)  # refused before anything moved

    assert mm.place_optimizer(opt, model) is opt
    for moments in (opt.opt_state[0].mu, opt.opt_state[0].nu):
        for name in ("l1", "l2"):
            kernel = getattr(model, name).kernel.get_value()
            assert moments[name]["kernel"].get_value().sharding == kernel.sharding
    param_shapes = {v.shape for v in jax.tree.leaves(nnx.state(model, nnx.Param))}
    crossing = [t.shape for t in step.plan(model, opt, *batch).transfers if t.source is not None]
    assert crossing and not param_shapes & set(crossing)  # only activations cross tasks
    for _ in range(2):
        close(step(model, opt, *batch), train_step(ref, ref_opt, *batch))
    for a, b in zip(flat(nnx.state(model)), flat(nnx.state(ref)), strict=True):
        close(a, b)
    with pytest.raises(ValueError, match="no state of this Optimizer is kept for a Variable"):
        mm.place_optimizer(opt, nnx.Linear(3, 5, rngs=nnx.Rngs(0)))  # not opt's model


def test_place_optimizer_of_an_optimizer_keeping_no_state_per_parameter_succeeds(tasks):
    s0, s1 = tasks
    model = two_stage(tasks)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)  # its state: the step count
    count = opt.step.get_value()
    assert mm.place_optimizer(opt, model) is opt  # not placed again: nothing to move
    mm.place(model, [("l0|l1", s1), ("l2|l3", s0)])
    assert mm.place_optimizer(opt, model) is opt
    assert opt.step.get_value() is count  # not kept per parameter: left where it is
    adam = nnx.Optimizer(nnx.Linear(3, 5, rngs=nnx.Rngs(0)), optax.adam(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match="no state of this Optimizer is kept for a Variable of"):
        mm.place_optimizer(adam, model)  # another model's optimizer


def test_an_mm_jit_step_called_inside_another_is_inlined(tasks, batch):
    model, opt, ref, ref_opt = placed_and_reference(tasks, optax.adamw(1e-2))
    inner = mm.jit(train_step)

    @mm.jit
    def outer(model, opt, x, y):
        return 2 * inner(model, opt, x, y)  # its update is carried back by outer

    for _ in range(2):
        close(outer(model, opt, *batch), 2 * train_step(ref, ref_opt, *batch))
    for a, b in zip(flat(nnx.state(model)), flat(nnx.state(ref)), strict=True):
        close(a, b)
    assert inner.trace_count == 0 and outer.trace_count == 1

    bound = mm.cached_partial(inner, model, opt)
    with pytest.raises(mm.MPMDError, match=r"cached_partial: train_step was called while another"):
        mm.jit(lambda m, x, y: bound(x, y))(model, *batch)
    forward = mm.jit(lambda m, x: m(x))
    with pytest.raises(mm.MPMDError, match=r"<lambda> was called inside a JAX transformation"):
        jax.jit(lambda x: forward(model, x))(batch[0])


def shape_from_array(model, x, n):
    return model(x).sum() + jnp.zeros(n).sum()


def branch_on_array(model, x, n):
    return model(x).sum() if n > 0 else 0.0


@pytest.mark.parametrize(
    "step, error",
    [(shape_from_array, TypeError), (branch_on_array, jax.errors.TracerBoolConversionError)],
)
def test_a_traced_value_needed_as_a_python_value_names_the_step_and_argument(
    tasks, batch, step, error
):
    model = two_stage(tasks)
    x, _ = batch
    with pytest.raises(error) as caught:
        mm.jit(step)(model, x, jnp.array(3))
    assert not isinstance(caught.value, mm.MPMDError)  # JAX's own error, about the user's code
    assert re.search(
        rf"while tracing the function {step.__name__} at .*test_jit.py:\d+ for mm.jit\. .*"
        r"depends on the value of the argument arg2\.",
        str(caught.value),
    ), str(caught.value)
    out = mm.jit(step, static_argnums=2)(model, x, 3)  # the fix the message suggests
    close(out, step(make(), x, 3))


def test_a_step_returning_a_string_names_the_output(tasks, batch):
    model = two_stage(tasks)
    step = mm.jit(lambda m, x: {"loss": m(x).sum(), "tag": "run 1"})
    with pytest.raises(
        mm.MPMDError,
        match=r"<lambda> returned a str at output\['tag'\]; a step must return arrays or "
        "pytrees of arrays",
    ):
        step(model, batch[0])


@pytest.mark.parametrize("donate", [(), (0,)])
def test_a_deleted_parameter_array_is_named(tasks, batch, donate):
    model = two_stage(tasks)
    step = mm.jit(lambda m, x: nnx.value_and_grad(lambda m: m(x).sum())(m), donate_argnums=donate)
    step(model, batch[0])
    model.l2.kernel.get_value().delete()
    others = [v for v in jax.tree.leaves(nnx.state(model)) if not v.is_deleted()]
    with pytest.raises(
        mm.MPMDError, match=r"the array of 'arg0/l2/kernel' was deleted before this call .*donated"
    ):
        step(model, batch[0])
    assert not any(v.is_deleted() for v in others)  # nothing donated either
    model.l2.kernel.set_value(mm.place(make(), [(".*", tasks[1])]).l2.kernel.get_value())
    step(model, batch[0])


def test_ordered_side_effects_are_refused_unordered_ones_run(tasks, capfd):
    from jax.experimental import io_callback

    model = two_stage(tasks)

    def ordered(m, x):
        y = m(x)
        return io_callback(lambda a: a, jax.ShapeDtypeStruct(y.shape, y.dtype), y, ordered=True)

    with pytest.raises(mm.SideEffectError, match=r"io_callback.*test_jit.py.*ordered side effect"):
        mm.jit(ordered)(model, jnp.ones((2, 16)))

    def printed(m, x):
        y = m(x)
        jax.debug.print("sum={s}", s=y.sum())
        return y

    out = mm.jit(printed)(model, jnp.ones((2, 16)))
    jax.block_until_ready(out)
    jax.effects_barrier()
    assert "sum=" in capfd.readouterr().out


def test_tied_weights_stay_one_variable(tasks):
    s0, _ = tasks

    class Tied(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(16, 16, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(16, 16, rngs=nnx.Rngs(1))
            self.b.kernel = self.a.kernel

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    model = mm.place(Tied(), [(".*", s0)])
    ref = Tied()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)

    def step(m, o, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(m)
        o.update(m, grads)
        return loss

    x = jax.random.normal(jax.random.key(0), (4, 16))
    jstep = mm.jit(step)
    for _ in range(2):
        close(jstep(model, opt, x), step(ref, ref_opt, x))
    assert model.a.kernel is model.b.kernel
    close(model.a.kernel.get_value(), ref.a.kernel.get_value())


def test_no_arrays_outlive_the_step(tasks, batch, frozen_heap):
    import gc

    model = two_stage(tasks)
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    step = mm.jit(train_step)
    for _ in range(2):
        jax.block_until_ready(step(model, opt, *batch))
    gc.collect()
    before = len(jax.live_arrays())
    for _ in range(3):
        jax.block_until_ready(step(model, opt, *batch))
    gc.collect()
    assert len(jax.live_arrays()) == before


def test_runs_inside_a_multimesh_context(batch):
    mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
    s0 = mm.Task("stage0", mesh=mesh.slice(stage=0), logical_axes=RULES)
    s1 = mm.Task("stage1", mesh=mesh.slice(stage=1), logical_axes=RULES)
    model = mm.place(make(), [("l0|l1", s0), ("l2|l3", s1)])
    with mesh:
        out = mm.jit(lambda m, x: m(x))(model, batch[0])
    close(out, make()(batch[0]))


def test_resolve_scopes_places_named_scopes_forward_and_backward(tasks, batch):
    s0, s1 = tasks
    x, _ = batch
    w = jax.device_put(jnp.ones((16, 4)), s0.sharding())
    model = mm.place(nnx.Linear(16, 16, rngs=nnx.Rngs(0)), [(".*", s0)])
    seen = []

    def resolver(scope, backward):
        if "head" in mm.mpmd.scope_components(scope):
            seen.append(backward)
            return s1
        return None

    def loss(m, w, x):
        mm.mpmd.resolve_scopes(resolver)
        h = m(x)
        with jax.named_scope("head"):
            return jnp.sum(jnp.tanh(h) ** 2) + 0 * jnp.sum(w)

    step = mm.jit(jax.grad(lambda m, x: loss(m, w, x)))
    grads = step(model, x)
    ref = jax.grad(lambda m, x: jnp.sum(jnp.tanh(m(x)) ** 2))(
        nnx.Linear(16, 16, rngs=nnx.Rngs(0)), x
    )
    close(grads.kernel.get_value(), ref.kernel.get_value())
    assert True in seen and False in seen  # offered the forward and the backward ops
    plan = step.plan(model, x)
    assert [t.name for t in plan.tasks] == ["stage0", "stage1"]
    assert any(f.task == s1 and "backward" in f.kinds for f in plan.fragments)


def test_resolve_scopes_errors():
    with pytest.raises(mm.MPMDError, match="while mm.jit traces a step"):
        mm.mpmd.resolve_scopes(lambda scope, backward: None)
    t = mm.Task("solo", mesh=mm.TaskMesh(devices=[0]))

    model = mm.place(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), [(".*", t)])

    def step(m, x):
        mm.mpmd.resolve_scopes(lambda scope, backward: "stage9")
        return jnp.tanh(m(x))

    with pytest.raises(mm.MPMDError, match="returned 'stage9' for scope"):
        mm.jit(step)(model, jnp.ones((1, 2)))


@pytest.mark.parametrize(
    "tx",
    [
        # gradient accumulation, as in Flax's optimization cookbook
        lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2),
        lambda: optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=2),
    ],
    ids=["MultiSteps", "apply_if_finite"],
)
def test_optimizer_wrappers_with_a_cond_over_every_parameter_run_across_tasks(tasks, batch, tx):
    # the wrapper's lax.cond updates the state of every parameter at once; it is split into one
    # cond per parameter, each on the parameter's task
    model, opt, ref, ref_opt = placed_and_reference(tasks, tx())
    step = mm.jit(train_step)
    for _ in range(4):
        close(step(model, opt, *batch), train_step(ref, ref_opt, *batch))
    for a, b in zip(flat(nnx.state(model)), flat(nnx.state(ref)), strict=True):
        close(a, b, rtol=1e-5, atol=1e-5)
    assert mm.placement(model) == mm.placement(two_stage(tasks))


def test_a_while_loop_over_every_parameter_runs_across_tasks(tasks):
    # a loop with a traced trip count (lax.while_loop) carrying state of two tasks and a step
    # counter: split into one loop per task, each carrying the counter
    s0, s1 = tasks

    class Two(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(4, 4, rngs=rngs)
            self.b = nnx.Linear(4, 4, rngs=rngs)

    def shrink(model, n):
        def body(carry):
            i, a, b = carry
            return i + 1, a * 0.5, b * 0.25

        init = (0, model.a.kernel[...], model.b.kernel[...])
        _, a, b = jax.lax.while_loop(lambda c: c[0] < n, body, init)
        model.a.kernel[...], model.b.kernel[...] = a, b
        return a.sum() + b.sum()

    model = mm.place(Two(nnx.Rngs(0)), [("a", s0), ("b", s1)])
    ref = Two(nnx.Rngs(0))
    step = mm.jit(shrink)
    close(step(model, jnp.int32(3)), shrink(ref, jnp.int32(3)))
    close(model.b.kernel[...], ref.b.kernel[...])
    assert model.a.kernel[...].sharding.device_set == s0.sharding().device_set
    loops = {
        f.task.name
        for f in step.plan(model, jnp.int32(3)).fragments
        for op in f.ops
        if op.name == "while"
    }
    assert loops == {s0.name, s1.name}


def test_plan_of_a_process_the_job_does_not_have_is_refused(tasks, batch):
    model, opt, _, _ = placed_and_reference(tasks, optax.sgd(0.1))
    step = mm.jit(train_step)
    assert step.plan(model, opt, *batch, process=0).program == step.plan(model, opt, *batch).program
    with pytest.raises(ValueError, match=r"plan\(process=1\): this job has 1 process"):
        step.plan(model, opt, *batch, process=1)


def test_donating_an_array_not_in_a_placed_variable_warns_that_it_is_kept(tasks, batch):
    # mm.jit donates only placed Variables' buffers: an array argument was silently kept
    model, opt, ref, ref_opt = placed_and_reference(tasks, optax.adamw(1e-2))
    step = mm.jit(train_step, donate_argnums=(0, 1, 2))
    kept = r"train_step donates the array 'arg2'.*it is kept"
    with pytest.warns(UserWarning, match=kept) as seen:
        close(step(model, opt, *batch), train_step(ref, ref_opt, *batch))
    assert seen[0].filename == __file__  # the user's line
    assert not batch[0].is_deleted() and model.l2.kernel.get_value().is_deleted() is False
