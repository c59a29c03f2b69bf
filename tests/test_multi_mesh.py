import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh

import mmnnx as mm


@pytest.fixture
def mesh():
    return mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))


def test_builds_global_mesh_over_all_devices(mesh):
    assert mesh.shape == {"stage": 2, "data": 2, "model": 2}
    assert mesh.axis_names == ("stage", "data", "model")
    assert mesh.size == 8
    assert [d.id for d in mesh.devices.flat] == list(range(8))
    assert mesh.axis_types == (AxisType.Auto,) * 3  # forwarded from the Mesh
    assert repr(mesh).startswith("MultiMesh(Mesh(")


def test_slice_keeps_sliced_axes_with_size_one(mesh):
    s1 = mesh.slice(stage=1)
    assert isinstance(s1, Mesh)
    assert s1.axis_names == ("stage", "data", "model")
    assert s1.devices.shape == (1, 2, 2)
    assert sorted(d.id for d in s1.devices.flat) == [4, 5, 6, 7]
    s = mesh.slice(stage=0, model=1)
    assert s.devices.shape == (1, 2, 1)
    assert [d.id for d in s.devices.flat] == [1, 3]
    assert mesh.single_slice_ids(stage=0, model=1) == [1, 3]


def test_task_mesh_drops_sliced_axes(mesh):
    tm = mesh.task_mesh(stage=1)
    assert isinstance(tm, mm.TaskMesh)
    assert tm.axis_names == ("data", "model")
    assert tm.devices.tolist() == [[4, 5], [6, 7]]
    assert tm.mesh.devices.shape == (2, 2)


def test_explicit_devices_and_global_mesh():
    mm_ = mm.MultiMesh(axis_sizes=(2, 2), axis_names=("a", "b"), devices=[7, 6, 5, 4])
    assert [d.id for d in mm_.devices.flat] == [7, 6, 5, 4]
    g = Mesh(np.array(jax.devices()).reshape(4, 2), ("s", "x"))
    wrapped = mm.MultiMesh(global_mesh=g)
    assert wrapped.mesh is g
    assert [d.id for d in wrapped.slice(s=3).devices.flat] == [6, 7]
    with pytest.raises(ValueError, match="either global_mesh"):
        mm.MultiMesh(global_mesh=g, axis_sizes=(8,))


def test_context_manager_makes_mesh_ambient(mesh):
    assert mm.current_multimesh() is None
    with mesh as entered:
        assert entered is mesh
        assert mm.current_multimesh() is mesh
        ambient = jax.sharding.get_abstract_mesh()
        assert ambient.axis_names == ("stage", "data", "model")
        assert ambient.axis_sizes == (2, 2, 2)
        # logical names stay metadata until mm.place translates them
        layer = nnx.Linear(
            4,
            8,
            rngs=nnx.Rngs(0),
            kernel_init=nnx.with_partitioning(nnx.initializers.ones, ("embed", "mlp")),
        )
        assert layer.kernel.get_metadata()["out_sharding"] == ("embed", "mlp")
        inner = mm.MultiMesh(axis_sizes=(8,), axis_names=("x",))
        with inner:
            assert mm.current_multimesh() is inner
        assert mm.current_multimesh() is mesh
    assert mm.current_multimesh() is None
    assert jax.sharding.get_abstract_mesh().empty
    assert jnp.ones(2).sum() == 2


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.slice(pipe=0), "unknown axis 'pipe'.*'stage', 'data', 'model'"),
        (lambda m: m.slice(stage=2), "index 2 for axis 'stage' is outside 0..1"),
        (lambda m: m.task_mesh(data=-1), "index -1 for axis 'data'"),
        (lambda m: m.slice(), "name at least one axis"),
    ],
)
def test_slice_errors(mesh, call, match):
    with pytest.raises(ValueError, match=match):
        call(mesh)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(axis_sizes=(2, 2), axis_names=("a", "b")), r"product 4\) do not match the 8"),
        (dict(axis_sizes=(2, 4), axis_names=("a", "a")), "duplicate axis name 'a'"),
        (dict(axis_sizes=(2, 4)), "axis_names are required"),
        (dict(axis_sizes=(4,), axis_names=("a",), devices=range(6, 10)), "device index 8"),
    ],
)
def test_construction_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mm.MultiMesh(**kwargs)
