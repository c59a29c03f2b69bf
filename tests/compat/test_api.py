"""multimesh.jax behaviour on this layer: placements, both API generations, numerics."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import mmnnx as mm
import multimesh_compat.jax as mj
from multimesh_compat.jax.flax import parallelize_step
from multimesh_compat.jax.flax import task as flax_task

from .helpers import (
    AXIS_MAP,
    MLPBlock,
    blocks,
    device_ids,
    f,
    get_input_batch,
    host,
    init_params,
    make_model,
    mlp_loss,
    reference,
    unbox,
)

ROWS_0_3 = [(((2 * i, 2 * i + 2), (0, 8)), [i]) for i in range(4)]
COLS_4_7 = [(((0, 8), (2 * i, 2 * i + 2)), [4 + i]) for i in range(4)]


@pytest.fixture(autouse=True)
def _clean():
    mj.clear_tasks()
    yield
    mj.clear_tasks()


def _gen_a_layers():
    devs = np.array(jax.devices())
    kw = dict(device_axes=("x", "y"), logical_axes=(("batch", "x"), ("model", "x")))
    return (
        mj.task(f, devices=devs[0:4].reshape(4, 1), **kw),
        mj.task(f, devices=devs[4:8].reshape(4, 1), **kw),
    )


def _gen_b_layers():
    tm = mj.TaskMesh(devices=(0, 1, 2, 3), axis_names=("x", "y"), axis_sizes=(4, 1))
    rules = (("batch", "x"), ("model", "x"))
    return mj.task(f, mesh=tm, logical_axes=rules), mj.task(
        f, mesh=tm.place((4, 5, 6, 7)), logical_axes=rules
    )


@pytest.mark.parametrize("layers", [_gen_a_layers, _gen_b_layers], ids=["gen-a", "gen-b"])
def test_mpmd_autosharding(layers):
    model = make_model(*layers())
    step, init, batch = mj.parallelize(
        model, init_params=init_params, get_input_batch=get_input_batch
    )
    p1, p2 = init()
    x = batch()
    assert blocks(p1) == ROWS_0_3  # param 1: 4 row blocks on devices 0-3
    assert blocks(p2) == COLS_4_7  # param 2: 4 column blocks on devices 4-7
    assert blocks(x) == ROWS_0_3  # the batch follows its first consumer, layer 1
    out = step((p1, p2), x)
    assert device_ids(out) == [4, 5, 6, 7]
    np.testing.assert_allclose(out, reference(init_params(), get_input_batch()), rtol=1e-5)
    # a batch sharded over all 8 devices is resharded onto layer 1's devices
    mesh = Mesh(np.array(jax.devices()), ("x",))
    wide = jax.device_put(get_input_batch(), NamedSharding(mesh, P("x", None)))
    step2, init2 = mj.parallelize(model, init_params, initial_batch=wide)
    np.testing.assert_allclose(step2(init2(), wide), out, rtol=1e-5)


def test_spmd_without_task_replicates_and_with_task_shards():
    model = make_model()
    step, init, batch = mj.parallelize(
        model, init_params=init_params, get_input_batch=get_input_batch
    )
    for a in (*init(), batch()):
        assert a.sharding.spec == P() or a.sharding.is_fully_replicated
        assert device_ids(a) == list(range(8))
    mm_model = mj.task(
        model,
        devices=np.array(jax.devices()),
        device_axes=("x",),
        logical_axes=(("batch", "x"), ("model", "x")),
    )
    step, init, batch = mj.parallelize(mm_model, init_params, get_input_batch)
    (p1, p2), x = init(), batch()
    assert (x.sharding.spec, p1.sharding.spec, p2.sharding.spec) == (
        P("x", None),
        P("x", None),
        P(None, "x"),
    )
    np.testing.assert_allclose(step((p1, p2), x), reference(init_params(), x), rtol=1e-5)


def test_multimesh_context_register_task_callback():
    gm = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("stage", "batch", "model"))
    mesh = mj.MultiMesh(global_mesh=gm)
    seen = []

    def callback(name, backprop):
        seen.append((name, backprop))
        n = int(re.match(r"layer(\d+)", name).group(1))
        return mj.Task(name=f"layer{n}_{'bwd' if backprop else 'fwd'}", mesh_slice={"stage": n})

    mesh.register_task("layer\\d+", callback=callback)
    with mesh:
        assert mj.flag("autoshard")
        step, init, batch = mj.parallelize(
            make_model(scopes=True), init_params=init_params, get_input_batch=get_input_batch
        )
        p1, p2 = init()
        out = step((p1, p2), batch())
    assert not mj.flag("autoshard")
    assert blocks(p1) == [(((0, 4), (0, 8)), [0, 2]), (((4, 8), (0, 8)), [1, 3])]
    assert blocks(p2) == [(((0, 8), (0, 4)), [4, 6]), (((0, 8), (4, 8)), [5, 7])]
    assert sorted(seen) == [("layer0", False), ("layer1", False)]
    np.testing.assert_allclose(out, reference(init_params(), get_input_batch()), rtol=1e-5)


def test_named_scope_backprop_flag_and_gradients():
    seen = []

    def callback(name, backprop):
        seen.append((name, backprop))
        i = int(name[-1])
        return mj.Task(name=f"{name}_{backprop}", mesh=mj.TaskMesh(devices=range(4 * i, 4 * i + 4)))

    mj.register_task(r"layer\d", callback=callback)
    grad = jax.value_and_grad(lambda p, x: make_model(scopes=True)(p, x).sum())
    step, init, batch = mj.parallelize(grad, init_params, get_input_batch)
    params = init()
    loss, grads = step(params, batch())
    assert sorted(set(seen)) == [
        ("layer0", False),
        ("layer0", True),
        ("layer1", False),
        ("layer1", True),
    ]
    ref_loss, ref_grads = jax.value_and_grad(lambda p, x: reference(p, x).sum())(
        init_params(), get_input_batch()
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5)
    assert device_ids(grads[0]) == [0, 1, 2, 3] and device_ids(grads[1]) == [4, 5, 6, 7]


class _ExplicitPipeline(nn.Module):
    gen_a: bool = False

    @nn.compact
    def __call__(self, x):
        devs = np.array(jax.devices())
        for i in range(2):
            if self.gen_a:
                mesh = Mesh(devs[4 * i : 4 * i + 4].reshape(4, 1), ("x", "y"))
            else:
                mesh = mj.TaskMesh(
                    devices=range(4 * i, 4 * i + 4), axis_names=("x", "y"), axis_sizes=(4, 1)
                )
            block = flax_task(MLPBlock, mesh=mesh, name=f"layer_{i}", logical_axes=AXIS_MAP)
            x = block()(x)
        return (x * x).sum()


class _ImplicitPipeline(nn.Module):
    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = MLPBlock(name=f"layer_{i}", use_jax_lax=True)(x)
        return (x * x).sum()


def _check_pipeline_step(model, path):
    x = jnp.arange(16)
    mesh = Mesh(np.array(jax.devices()).reshape(8, 1), ("x", "y"))
    step, state, mesh, prepare = parallelize_step(
        model=model, optimizer=optax.sgd(0.02), mesh=mesh, local_batch=x
    )
    layers = unbox([path(state.params, i) for i in range(2)])
    kernel0, bias0 = layers[0]
    kernel1, bias1 = layers[1]
    assert blocks(kernel0) == [(((4 * i, 4 * i + 4), (0, 4)), [i]) for i in range(4)]
    assert bias0.sharding.is_fully_replicated and device_ids(bias0) == [0, 1, 2, 3]
    assert blocks(kernel1) == [(((i, i + 1), (0, 4)), [4 + i]) for i in range(4)]
    assert bias1.sharding.is_fully_replicated and device_ids(bias1) == [4, 5, 6, 7]
    before = [(np.asarray(k), np.asarray(b)) for k, b in host(layers)]
    loss, new_state = step(state, prepare(x))
    ref_loss, ref_grads = jax.value_and_grad(mlp_loss)(before, np.arange(16))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    after = host([path(new_state.params, i) for i in range(2)])
    for (k0, b0), (k1, b1), (gk, gb) in zip(before, after, ref_grads, strict=True):
        np.testing.assert_allclose(k1, k0 - 0.02 * gk, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b1, b0 - 0.02 * gb, rtol=1e-5, atol=1e-6)
    assert int(new_state.step) == 1
    # a second step runs from the new state (same shardings, no re-trace)
    step(new_state, prepare(x))
    return loss


@pytest.mark.parametrize("gen_a", [False, True], ids=["gen-b", "gen-a"])
def test_flax_explicit_task_pipeline(gen_a):
    def path(params, i):
        p = params["params"][f"Task[MLPBlock]_{i}"]["mod"]["params"]["Dense_0"]
        return p["kernel"], p["bias"]

    _check_pipeline_step(_ExplicitPipeline(gen_a=gen_a), path)


@pytest.mark.parametrize("gen", ["gen-b", "gen-a", "callback"])
def test_flax_implicit_tasks(gen):
    tm = mj.TaskMesh(devices=(0, 1, 2, 3), axis_names=("x", "y"), axis_sizes=(4, 1))
    if gen == "gen-b":
        mj.register_task("layer_0", task=mj.Task(mesh=tm, logical_axes=AXIS_MAP))
        mj.register_task(
            "layer_1", task=mj.Task(mesh=tm.place((4, 5, 6, 7)), logical_axes=AXIS_MAP)
        )
    elif gen == "gen-a":
        for i in range(2):
            mj.register_task(
                f"layer_{i}",
                devices=list(range(4 * i, 4 * i + 4)),
                device_axes=["x", "y"],
                dims=[4, 1],
                logical_axes=list(AXIS_MAP),
            )
    else:

        def factory(name):
            i = int(name.split("_")[1])
            return list(range(4 * i, 4 * i + 4))

        mj.register_task(
            r"(layer_\d+)",
            callback=factory,
            device_axes=["x", "y"],
            dims=[4, 1],
            logical_axes=list(AXIS_MAP),
        )

    def path(params, i):
        p = params["params"][f"layer_{i}"]["Dense_0"]
        return p["kernel"], p["bias"]

    _check_pipeline_step(_ImplicitPipeline(), path)


def _pipeline_loss():
    rules = [("batch", "x")]
    s0 = mj.task(
        lambda w, x: jnp.tanh(x @ w),
        name="s0",
        mesh=mj.TaskMesh(devices=range(4)),
        logical_axes=rules,
    )
    s1 = mj.task(
        lambda w, h: ((h @ w) ** 2).sum(),
        name="s1",
        mesh=mj.TaskMesh(devices=range(4, 8)),
        logical_axes=rules,
    )
    return lambda p, x: s1(p["w1"], s0(p["w0"], x))


def _plain_loss(p, x):
    return ((jnp.tanh(x @ p["w0"]) @ p["w1"]) ** 2).sum()


PARAMS = {"w0": jnp.linspace(-1, 1, 30).reshape(6, 5), "w1": jnp.linspace(-1, 1, 15).reshape(5, 3)}
BATCH = jnp.linspace(-2, 2, 18 * 6).reshape(18, 6)


@pytest.mark.parametrize("schedule", [None, *mj.SCHEDULES.keys()])
def test_microbatch_pipeline_schedules(schedule):
    loss = _pipeline_loss()
    kw = {}
    if schedule in ("zero-bubble-v", "dualpipev"):  # mmnnx's, for a V placement of its own
        step = mj.microbatch(jax.value_and_grad(loss), dim=0, size=4, argnum=1, schedule=schedule)
        with pytest.raises(mm.MPMDError, match=f"{schedule} places two stages per rank in a V"):
            mj.mjit(step, devices=jax.devices())(PARAMS, BATCH)
        return
    if schedule and schedule.startswith("interleaved"):  # without interleave=v > 1
        step = mj.microbatch(jax.value_and_grad(loss), dim=0, size=4, argnum=1, schedule=schedule)
        with pytest.raises(mm.MPMDError, match=f"{schedule} with virtual_stages=1 would run"):
            mj.mjit(step, devices=jax.devices())(PARAMS, BATCH)
        return
    if schedule == "custom":
        kw["custom_schedule"] = [
            ["s0", "s0", "s0", "s0", "s0_bwd", "s0_bwd", "s0_bwd", "s0_bwd"],
            ["s1", "s1_bwd", "s1", "s1_bwd", "s1", "s1_bwd", "s1", "s1_bwd"],
        ]

    def step(params, x):
        return mj.microbatch(
            jax.value_and_grad(loss), dim=0, size=4, argnum=1, schedule=schedule, **kw
        )(params, x)

    run = mj.mjit(step, devices=jax.devices())
    value, grads = run(PARAMS, BATCH)
    # 18 rows in microbatches of 4: four microbatches, rows 16-17 dropped; outputs summed
    ref_value, ref_grads = jax.value_and_grad(_plain_loss)(PARAMS, BATCH[:16])
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for k in PARAMS:
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6)
    assert device_ids(grads["w0"]) == [0, 1, 2, 3] and device_ids(grads["w1"]) == [4, 5, 6, 7]
    plan = run.plan(PARAMS, BATCH)
    assert plan.pipeline is not None and plan.pipeline.schedule.num_microbatches == 4


def test_microbatch_sums_outside_programs_and_single_microbatch():
    f = mj.microbatch(lambda x, w: (x * w).mean(keepdims=True), dim=0, size=2)
    x = jnp.arange(7.0)
    np.testing.assert_allclose(f(x, 1.0), [0.5 + 2.5 + 4.5])  # a sum of means; row 6 dropped
    calls = []
    g = mj.microbatch(lambda x: calls.append(x.shape) or x.sum(), dim=0, size=4)
    assert float(g(jnp.ones(5))) == 4.0 and calls == [(4,)]  # one microbatch: called directly


def test_hello_world_mjit():
    devs = np.array(jax.devices()[:2])
    mesh = Mesh(devs, ("x",))
    sharding = NamedSharding(mesh, P("x"))
    mm_f = mj.task(lambda x: (jnp.cos(x), jnp.sin(x)), devices=devs[0:1])
    mm_g = mj.task(lambda x, y: x * x + y * y, devices=devs[1:2])
    mm_c = mj.mjit(lambda x: mm_g(*mm_f(x)), devices=devs, in_shardings=(sharding,))
    x = mj.mjit(jnp.arange, devices=devs, out_shardings=sharding, static_argnums=0)(8)
    assert device_ids(x) == [0, 1] and x.sharding.spec == P("x")  # not replicated
    np.testing.assert_array_equal(x, np.arange(8))
    result = mm_c(x.astype(jnp.float32))
    assert result.devices() == {jax.devices()[1]}
    np.testing.assert_allclose(result, np.ones(8), rtol=1e-6)


def test_constraint_on_a_value_made_from_no_input_is_kept():
    # a program (or a task's part of one) reading no input used to return it replicated
    tm = mj.TaskMesh(devices=(4, 5, 6, 7), axis_names=("x",), axis_sizes=(4,))
    make = mj.task(
        lambda: mj.with_sharding_constraint(jnp.arange(8.0), P("batch")),
        name="const",
        mesh=tm,
        logical_axes=[("batch", "x")],
    )
    out = mj.mjit(lambda: make(), devices=jax.devices())()
    assert device_ids(out) == [4, 5, 6, 7] and out.sharding.spec == P("x")
    np.testing.assert_array_equal(out, np.arange(8.0))


def test_context_flags_and_ignore_transforms():
    assert not mj.flag("autoshard") and mj.flag("enable_fast_path")
    with mj.context(
        autoshard=True,
        enable_recomputation=False,
        enable_task_fusion=False,
        only_fuse_loop_tasks=True,
        enable_fast_path=False,
    ):
        assert mj.flag("autoshard") and not mj.flag("enable_recomputation")
        assert mj.flag("only_fuse_loop_tasks") and not mj.flag("enable_task_fusion")
        with mj.enable_fast_path():
            assert mj.flag("enable_fast_path")
        assert not mj.flag("enable_fast_path")
    assert not mj.flag("autoshard") and mj.flag("enable_recomputation")
    with mj.ignore_transforms():
        assert mj.task(f, devices=jax.devices()[:1]) is f
        assert mj.microbatch(f, dim=0, size=1) is f
        assert flax_task(nn.Dense) is nn.Dense
        with pytest.raises((ValueError, RuntimeError)):  # physical semantics: no axis "batch"
            mj.with_sharding_constraint(jnp.ones(4), P("batch"))
    with mj.autoshard():
        assert mj.with_sharding_constraint(jnp.ones(4), P("batch")).shape == (4,)


def test_init_before_jax():
    mj.init(cpus=8)  # JAX already runs with 8 CPU devices: nothing to do
    with pytest.raises(RuntimeError, match="before importing jax"):
        mj.init(cpus=4)
    with pytest.raises(KeyError):
        mj.init(debug="loud")


def test_classes_are_mmnnx_classes():
    import mmnnx as mm

    assert mj.TaskMesh is mm.TaskMesh
    # multimesh's Task is mmnnx's plus the fields only multimesh programs use
    assert issubclass(mj.Task, mm.Task) and issubclass(mj.MultiMesh, mm.MultiMesh)
    assert not {"mesh_slice", "split_backprop", "loop_dependent_mesh_slice"} & {
        f.name for f in dataclasses.fields(mm.Task)
    }
    assert mj.Task("a", mesh_slice={"s": 0}) != mj.Task("a", mesh_slice={"s": 1})
    tm = mj.TaskMesh(devices=range(4, 8), axis_sizes=(2, 2), axis_names=("a", "b"))
    assert tm.abstract_mesh.axis_names == ("a", "b")
    assert isinstance(tm.mesh, Mesh)  # concrete here; multimesh's .mesh is an AbstractMesh


def _closure_loss(p, x):
    """Stage functions close over the parameters; the loss is reduced outside the last task."""
    rules = [("batch", "x")]
    s0 = mj.task(
        lambda x: jnp.tanh(x @ p["w0"]),
        name="s0",
        mesh=mj.TaskMesh(devices=range(4)),
        logical_axes=rules,
    )
    s1 = mj.task(
        lambda h: h @ p["w1"],
        name="s1",
        mesh=mj.TaskMesh(devices=range(4, 8)),
        logical_axes=rules,
    )
    return s1(s0(x)).sum() / 1e6


def _scoped_loss(p, x):
    with jax.named_scope("layer0"):
        h = jnp.tanh(x @ p["w0"])
    with jax.named_scope("layer1"):
        h = h @ p["w1"]
    return h.sum() / 1e6


def _plain_scaled_loss(p, x):
    return (jnp.tanh(x @ p["w0"]) @ p["w1"]).sum() / 1e6


def _check_grads(value, grads, batch):
    ref_value, ref_grads = jax.value_and_grad(_plain_scaled_loss)(PARAMS, batch)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for k in PARAMS:
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-5, atol=1e-12)


def _stages(plan):
    assert plan.pipeline is not None
    return [t.name for t in plan.pipeline.stage_tasks], plan.pipeline.schedule.num_microbatches


@pytest.mark.parametrize("schedule", [None, "1f1b"])
def test_microbatch_pipelines_closures_and_outside_reduction(schedule):
    def step(params, x):
        return mj.microbatch(
            jax.value_and_grad(_closure_loss), dim=0, size=4, argnum=1, schedule=schedule
        )(params, x)

    run = mj.mjit(step, devices=jax.devices())
    value, grads = run(PARAMS, BATCH)
    _check_grads(value, grads, BATCH[:16])
    assert device_ids(grads["w0"]) == [0, 1, 2, 3] and device_ids(grads["w1"]) == [4, 5, 6, 7]
    assert _stages(run.plan(PARAMS, BATCH)) == (["s0", "s1"], 4)


def test_microbatch_pipelines_parallelize_with_bare_batch_input():
    step = lambda p, x: mj.microbatch(jax.value_and_grad(_closure_loss), dim=0, size=4, argnum=1)(
        p, x
    )
    compiled, params, batch = mj.parallelize(step, lambda: PARAMS, lambda: BATCH[:16])
    value, grads = compiled(params(), batch())
    _check_grads(value, grads, BATCH[:16])
    assert _stages(compiled.plan) == (["s0", "s1"], 4)


def test_microbatch_pipelines_name_scoped_tasks():
    global_mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("stage", "batch", "model"))
    multi = mj.MultiMesh(global_mesh=global_mesh)

    def callback(name, backprop):  # the mpmd-multimesh tutorial's callback
        n = int(re.fullmatch(r"layer(\d+)", name).group(1))
        return mj.Task(name=f"layer{n}_{'bwd' if backprop else 'fwd'}", mesh_slice={"stage": n})

    multi.register_task(r"layer\d+", callback=callback)
    with multi:
        run = mj.mjit(
            lambda p, x: mj.microbatch(
                jax.value_and_grad(_scoped_loss), dim=0, size=4, argnum=1, schedule="1f1b"
            )(p, x),
            devices=jax.devices(),
        )
        value, grads = run(PARAMS, BATCH)
        plan = run.plan(PARAMS, BATCH)
    _check_grads(value, grads, BATCH[:16])
    # each backward task is merged into its forward task (same submesh): two stages
    assert _stages(plan) == (["layer0_fwd", "layer1_fwd"], 4)
    assert device_ids(grads["w0"]) == [0, 1, 2, 3] and device_ids(grads["w1"]) == [4, 5, 6, 7]


def test_custom_partitioning_runs_on_the_task_submesh():
    from jax._src import mesh as mesh_lib

    traced, partitioned = [], []
    double = mj.custom_partitioning(
        lambda x: traced.append(mesh_lib.thread_resources.env.physical_mesh) or 2 * x
    )

    def partition(mesh, arg_shapes, result_shape):
        partitioned.append(sorted(d.id for d in mesh.devices.flat))
        spec = arg_shapes[0].sharding
        return mesh, lambda x: 2 * x, spec, (spec,)

    double.def_partition(
        partition=partition,
        infer_sharding_from_operands=lambda mesh, args, result: args[0].sharding,
        sharding_rule="i j -> i j",
    )
    global_mesh = Mesh(np.array(jax.devices()).reshape(2, 2, 2), ("stage", "batch", "model"))
    multi = mj.MultiMesh(global_mesh=global_mesh)
    multi.register_task(
        r"layer\d+", callback=lambda n, bp: mj.Task(name=n, mesh_slice={"stage": int(n[-1])})
    )

    def model(p, x):
        with jax.named_scope("layer0"):
            h = x @ p
        with jax.named_scope("layer1"):
            return double(mj.with_sharding_constraint(h, P("batch", None)))

    x = jnp.arange(64.0).reshape(8, 8)
    with multi:
        out = mj.mjit(model, devices=jax.devices())(jnp.eye(8), x)
    np.testing.assert_allclose(out, 2 * x)
    assert device_ids(out) == [4, 5, 6, 7]
    # traced under MultiMesh.slice(stage=1), partitioned on that submesh
    assert traced and all(m == multi.slice(stage=1) for m in traced)
    assert partitioned and all(d == [4, 5, 6, 7] for d in partitioned)


@pytest.mark.parametrize(
    "schedule, expected", [("gpipe", "interleaved-gpipe"), ("1f1b", "interleaved-1f1b")]
)
def test_microbatch_interleave_runs_two_stages_per_task(schedule, expected):
    p = {f"w{i}": jnp.linspace(-1, 1, 36).reshape(6, 6) * (0.5 + i / 4) for i in range(4)}
    rules = [("batch", "x")]
    meshes = [mj.TaskMesh(devices=range(4)), mj.TaskMesh(devices=range(4, 8))]

    def loss(p, x):
        for i in range(4):  # stages s0, s1, s0, s1: two per task
            layer = lambda h, w=p[f"w{i}"]: jnp.tanh(h @ w)  # noqa: E731
            x = mj.task(layer, name=f"s{i % 2}", mesh=meshes[i % 2], logical_axes=rules)(x)
        return (x**2).sum()

    def plain(p, x):
        for i in range(4):
            x = jnp.tanh(x @ p[f"w{i}"])
        return (x**2).sum()

    step = lambda p, x: mj.microbatch(  # noqa: E731
        jax.value_and_grad(loss), dim=0, size=4, argnum=1, schedule=schedule, interleave=2
    )(p, x)
    run = mj.mjit(step, devices=jax.devices())
    value, grads = run(p, BATCH[:16])
    ref_value, ref_grads = jax.value_and_grad(plain)(p, BATCH[:16])
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for k in p:
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6)
    pipeline = run.plan(p, BATCH[:16]).pipeline
    assert pipeline.schedule.name == expected
    assert [t.name for t in pipeline.stage_tasks] == ["s0", "s1", "s0", "s1"]
