import pytest
from jax.sharding import PartitionSpec as P

import mmnnx as mm


@pytest.fixture
def tm():
    return mm.TaskMesh(devices=range(4), axis_sizes=(2, 2), axis_names=("data", "model"))


def test_logical_rules_keep_order():
    assert mm.logical_rules(batch="data", mlp="model", embed=None) == (
        ("batch", "data"),
        ("mlp", "model"),
        ("embed", None),
    )
    assert mm.logical_rules(("a", ("data", "model")), b="data") == (
        ("a", ("data", "model")),
        ("b", "data"),
    )


def test_spec_translation(tm):
    t = mm.Task("t", mesh=tm, logical_axes=mm.logical_rules(batch="data", mlp="model", embed=None))
    assert t.spec(("batch", "mlp")) == P("data", "model")
    assert t.spec(("embed", "mlp")) == P(None, "model")
    assert t.spec(("unknown", None)) == P(None, None)  # no rule: replicated
    assert t.spec(()) == P()


def test_device_axis_used_at_most_once(tm):
    t = mm.Task("t", mesh=tm, logical_axes=[("mlp", "model"), ("heads", "model")])
    assert t.spec(("mlp", "mlp")) == P("model", None)
    assert t.spec(("heads", "mlp")) == P(None, "model")  # priority: mlp's rule comes first


def test_lower_priority_rule_used_when_axis_taken(tm):
    t = mm.Task(
        "t",
        mesh=tm,
        logical_axes=[("batch", "data"), ("embed", "data")],
        extra_axes=[("embed", "model")],
    )
    assert t.spec(("batch", "embed")) == P("data", "model")
    assert t.spec(("embed",)) == P("data")
    assert t.rules[-1] == ("embed", "model")


def test_multi_axis_rule(tm):
    t = mm.Task("t", mesh=tm, logical_axes=[("batch", ("data", "model")), ("mlp", "model")])
    assert t.spec(("batch", "mlp")) == P(("data", "model"), None)


def test_task_with_jax_mesh_and_sharding():
    mesh = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "x"))
    t = mm.Task("s1", mesh=mesh.slice(stage=1), logical_axes=[("batch", "x")])
    assert t.axis_names == ("stage", "x")
    sharding = t.sharding(t.spec(("batch",)))
    assert sharding.spec == P("x")
    assert sorted(d.id for d in sharding.device_set) == [4, 5, 6, 7]


def test_equal_and_hashable(tm):
    a = mm.Task("t", mesh=tm, logical_axes=[("a", "data")])
    b = mm.Task("t", mesh=tm, logical_axes=(("a", "data"),))
    assert a == b and hash(a) == hash(b)
    assert a != mm.Task("u", mesh=tm)


def test_logical_rule_naming_missing_axis(tm):
    with pytest.raises(ValueError, match=r"Task 't'.*'mlp' -> 'tensor'.*\('data', 'model'\)"):
        mm.Task("t", mesh=tm, logical_axes=[("mlp", "tensor")])


def test_bad_rule_types(tm):
    with pytest.raises(TypeError, match="not a .logical_name, device_axis. pair"):
        mm.Task("t", mesh=tm, logical_axes=["batch"])
    with pytest.raises(TypeError, match="device axis 3"):
        mm.logical_rules(batch=3)
    with pytest.raises(TypeError, match="mesh must be"):
        mm.Task("t", mesh="devices 0-3")
    with pytest.raises(TypeError, match="logical name 3"):
        mm.Task("t", mesh=tm).spec((3,))
