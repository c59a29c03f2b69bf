"""The errors of MULTIMESH_API.md section 5, with multimesh's exception types."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import multimesh_compat.jax as mj
from multimesh_compat.jax.flax import parallelize_step

from .helpers import f, get_input_batch, init_params, make_model


@pytest.fixture(autouse=True)
def _clean():
    mj.clear_tasks()
    yield
    mj.clear_tasks()


def _run(model):
    step, init, batch = mj.parallelize(model, init_params, get_input_batch)
    return step(init(), batch())


def test_init_after_jax_started():  # 5.1
    with pytest.raises(RuntimeError, match="call init before importing jax"):
        mj.init(cpus=2)


def test_constraints_outside_autoshard_are_physical():  # 5.3
    with pytest.raises((ValueError, RuntimeError)):
        jax.jit(lambda x: mj.with_sharding_constraint(x, P("batch")))(jnp.ones(8))
    with (
        pytest.raises(
            Exception, match="axis_resources of length 3 does not match args of length 2"
        ),
        mj.autoshard(),
    ):
        mj.with_sharding_constraint([jnp.ones(2), jnp.ones(2)], [P(), P(), [P()]])


def test_unmapped_names_and_axisless_tasks_replicate():  # 5.4
    devs = np.array(jax.devices())
    no_axes = mj.task(f, devices=list(devs[:4]))
    unmapped = mj.task(f, mesh=mj.TaskMesh(devices=range(4, 8)), logical_axes=[("other", "x")])
    step, init, batch = mj.parallelize(make_model(no_axes, unmapped), init_params, get_input_batch)
    p1, p2 = init()
    assert p1.sharding.is_fully_replicated and {d.id for d in p1.devices()} == {0, 1, 2, 3}
    assert p2.sharding.is_fully_replicated and {d.id for d in p2.devices()} == {4, 5, 6, 7}


def test_gen_a_task_errors():  # 5.5
    devs = np.array(jax.devices())
    mesh = Mesh(devs[:4].reshape(2, 2), ("x", "y"))
    with pytest.raises(ValueError, match="mesh"):
        mj.task(f, mesh=mesh, devices=devs[:4])
    with pytest.raises(ValueError, match="mesh"):
        mj.task(f, mesh=mesh, device_axes=("x", "y"))
    with pytest.raises(ValueError, match="logical_axes"):
        mj.task(f, devices=devs[:4], logical_axes=[("batch", "x")])
    mismatched = mj.task(f, devices=devs[:4].reshape(2, 2), device_axes=("x",))
    with pytest.raises(ValueError, match="device_axes"):  # raised when the task first runs
        _run(make_model(mismatched, f))


def test_register_task_errors():  # 5.6
    with pytest.raises(Exception, match="must specify callback or task to register_task"):
        mj.register_task("layer0")
    mj.register_task("layer0", callback=lambda name, backprop: "devices 0-3")
    with pytest.raises(ValueError, match="not a Task"):
        _run(make_model(scopes=True))
    mj.clear_tasks()
    tm = mj.TaskMesh(devices=range(4))
    mesh = mj.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "x"))
    for bad in (mj.Task(mesh=tm, mesh_slice={"stage": 0}), mj.Task()):
        mesh.register_task("layer0", task=bad)
        with mesh, pytest.raises(ValueError, match="exactly one of mesh and mesh_slice"):
            _run(make_model(scopes=True))
        mesh.tasks.clear()
    loop = mj.Task(mesh_slice={"stage": 0}, loop_dependent_mesh_slice=lambda i: {"x": i})
    mesh.register_task("layer0", task=loop)
    with mesh, pytest.raises(ValueError, match="loop_dependent_mesh_slice"):
        _run(make_model(scopes=True))


def test_gen_a_register_task_errors():  # 5.6, Gen-A
    with pytest.raises(ValueError, match=r"in register_task\(l0\).*device_axes or mesh, not both"):
        mj.register_task("l0", mesh=Mesh(np.array(jax.devices()), ("x",)), device_axes=["x"])
    with pytest.raises(ValueError, match="callback needs dims"):
        mj.register_task("l0", callback=lambda n: [0], device_axes=["x"])
    with pytest.raises(ValueError, match="give mesh, devices or callback"):
        mj.register_task("l0", device_axes=["x"])
    with pytest.raises(ValueError, match="give device_axes or mesh"):
        mj.register_task("l0", devices=[0, 1])
    with pytest.raises(ValueError, match="neither an int nor a jax Device"):
        mj.register_task("l0", devices=["gpu0"], device_axes=["x"])


def test_microbatch_errors():  # 5.7
    g = mj.microbatch(lambda a: a["x"].sum() + a["y"].sum(), dim=0, size=2)
    with pytest.raises(ValueError, match="dimensions not the same across all microbatched tensors"):
        g({"x": jnp.ones(4), "y": jnp.ones(6)})
    with pytest.raises(ValueError, match="custom_schedule"):
        mj.microbatch(f, dim=0, size=2, schedule="gpipe", custom_schedule=[["f"]])
    bad = mj.microbatch(
        lambda x: x.sum(), dim=0, size=2, custom_schedule=[["s0", "s0", "s0_bwd", "s0_bwd"]]
    )
    with pytest.raises(
        ValueError, match="task s0 has 2 microbatches, but there are 3 microbatches"
    ):
        bad(jnp.ones(6))
    typo = mj.microbatch(  # a misspelt name in a row was scheduled as if it were the row's task
        lambda x: x.sum(), dim=0, size=2, custom_schedule=[["s0", "s0", "sX_bwd", "sX_bwd"]]
    )
    with pytest.raises(ValueError, match="custom_schedule row 0 names tasks s0, sX"):
        typo(jnp.ones(4))
    unknown = mj.microbatch(lambda x: x.sum(), dim=0, size=2, schedule="round-robin")
    with pytest.raises(jax.errors.JaxRuntimeError, match="INVALID_ARGUMENT"):
        unknown(jnp.ones(4))


def test_custom_partitioning_needs_a_multimesh():  # 5.10
    double = mj.custom_partitioning(lambda x: 2 * x)
    with pytest.raises(Exception, match="The global mesh context should a MultiMesh"):
        double(jnp.ones(4))
    mesh = Mesh(np.array(jax.devices()), ("x",))
    with jax.set_mesh(mesh), pytest.raises(Exception, match="should a MultiMesh"):
        double(jnp.ones(4))  # a plain jax Mesh is not enough
    with pytest.raises(Exception, match="should a MultiMesh"):
        mj.mjit(double, devices=jax.devices())(jnp.ones(4))  # nor is a program without one


def test_parallelize_errors():  # 5.8
    with pytest.raises(ValueError, match="get_input_batch"):
        mj.parallelize(lambda p, x: p, init_params=init_params)


def test_parallelize_step_errors():  # 5.9
    class Loss(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(x).sum()

    with pytest.raises(ValueError, match="global_batch or local_batch"):
        parallelize_step(Loss(), optax.sgd(0.1), None)
    with pytest.raises(ValueError, match="split evenly"):
        parallelize_step(Loss(), optax.sgd(0.1), None, local_batch=np.ones((6, 3), np.float32))
