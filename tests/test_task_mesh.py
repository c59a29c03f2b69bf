import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType

import mmnnx as mm


def test_defaults_one_axis_named_x():
    tm = mm.TaskMesh(devices=range(4, 8))
    assert tm.axis_sizes == (4,)
    assert tm.axis_names == ("x",)
    assert tm.size == 4
    assert tm.devices.dtype.kind == "i"
    assert tm.devices.tolist() == [4, 5, 6, 7]


def test_devices_shaped_by_axis_sizes_and_concrete_mesh():
    tm = mm.TaskMesh(devices=[6, 7, 4, 5], axis_sizes=(2, 2), axis_names=("data", "model"))
    assert tm.devices.shape == (2, 2)
    assert tm.devices.tolist() == [[6, 7], [4, 5]]
    mesh = tm.mesh
    assert isinstance(mesh, jax.sharding.Mesh)
    assert mesh.axis_names == ("data", "model")
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert [[d.id for d in row] for row in mesh.devices] == [[6, 7], [4, 5]]
    assert tm.abstract_mesh.axis_sizes == (2, 2)
    assert tm.abstract_mesh.axis_names == ("data", "model")
    assert tm.shape == {"data": 2, "model": 2}


def test_abstract_gives_axes():
    abstract = AbstractMesh((2, 1), ("x", "y"))
    tm = mm.TaskMesh(devices=(0, 1), abstract=abstract)
    assert tm.axis_sizes == (2, 1) and tm.axis_names == ("x", "y")
    assert tm.abstract_mesh is abstract
    with pytest.raises(ValueError, match="disagree"):
        mm.TaskMesh(devices=(0, 1), abstract=abstract, axis_sizes=(1, 2))


def test_place_moves_axes_to_other_devices():
    tm = mm.TaskMesh(devices=range(4), axis_sizes=(2, 2), axis_names=("a", "b"))
    moved = tm.place(range(4, 8))
    assert moved.axis_names == ("a", "b") and moved.axis_sizes == (2, 2)
    assert moved.devices.tolist() == [[4, 5], [6, 7]]


def test_equal_and_hashable_by_value():
    a = mm.TaskMesh(devices=range(4), axis_sizes=(2, 2), axis_names=("a", "b"))
    b = mm.TaskMesh(devices=[0, 1, 2, 3], axis_sizes=(2, 2), axis_names=("a", "b"))
    c = mm.TaskMesh(devices=range(4), axis_sizes=(2, 2), axis_names=("a", "c"))
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert len({a, b, c}) == 2


def test_device_ids_are_read_only():
    tm = mm.TaskMesh(devices=range(2))
    with pytest.raises(ValueError):
        tm.devices[0] = 5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(devices=range(4), axis_sizes=(2, 3), axis_names=("a", "b")), "product 6"),
        (
            dict(devices=range(4), axis_sizes=(2, 2), axis_names=("a", "a")),
            "duplicate axis name 'a'",
        ),
        (dict(devices=range(4), axis_sizes=(2, 2)), "axis_names are required"),
        (dict(devices=range(4), axis_sizes=(4,), axis_names=("a", "b")), "different lengths"),
        (dict(devices=[0, 1, 1]), "device index 1 appears more than once"),
        (dict(devices=[-1, 0]), "device index -1 is negative"),
        (dict(devices=[]), "no devices"),
    ],
)
def test_bad_axes_and_devices(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mm.TaskMesh(**kwargs)


def test_non_int_device_is_type_error():
    with pytest.raises(TypeError, match="'a'"):
        mm.TaskMesh(devices=["a"])


def test_device_index_outside_jax_devices():
    tm = mm.TaskMesh(devices=range(6, 10))
    with pytest.raises(ValueError, match=r"device index 8 is outside jax.devices\(\)"):
        _ = tm.mesh


def test_jax_device_objects_accepted():
    tm = mm.TaskMesh(devices=jax.devices()[2:4])
    assert tm.devices.tolist() == [2, 3]
    assert np.array_equal(tm.mesh.devices, np.array(jax.devices()[2:4]))
