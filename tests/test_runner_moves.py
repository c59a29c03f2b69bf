"""The runner's moves between devices of one process, decided when a step compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import mmnnx as mm
from mmnnx._jax.arrays import copier, move_to
from tests.models import make_mlp, one_device_tasks, train_step


def test_a_copy_to_other_devices_keeps_values_and_lands_there():
    a, b = (SingleDeviceSharding(d) for d in jax.devices()[:2])
    move = copier(a, b, 2, np.float32)
    x = jax.device_put(jnp.arange(6.0).reshape(2, 3), a)
    y = move(x)
    assert y.sharding == b and y.devices() == {jax.devices()[1]}
    np.testing.assert_array_equal(y, x)


def _whole_on(*ids):
    mesh = jax.sharding.Mesh(np.array([jax.devices()[i] for i in ids]), ("x",))
    return NamedSharding(mesh, PartitionSpec())


@pytest.mark.parametrize(
    "source, target",
    [((0,), (2, 3)), ((2, 3), (0,)), ((0, 1), (1, 2)), ((0,), (0, 1)), ((4, 5), (4,))],
    ids=["one to two", "two home", "overlapping", "onto itself and one more", "onto one of its"],
)
def test_a_whole_value_spreads_onto_the_devices_of_another_whole_layout(source, target):
    have = SingleDeviceSharding(jax.devices()[source[0]]) if len(source) == 1 else None
    have = have or _whole_on(*source)
    want = SingleDeviceSharding(jax.devices()[target[0]]) if len(target) == 1 else None
    want = want or _whole_on(*target)
    move = copier(have, want, 2, np.float32)
    assert move is not None
    x = jax.device_put(jnp.arange(6.0).reshape(2, 3), have)
    y = move(x)
    assert y.sharding == want
    assert [s.device.id for s in y.addressable_shards] == list(target)
    for shard in y.addressable_shards:
        np.testing.assert_array_equal(shard.data, x)
    np.testing.assert_array_equal(jax.jit(lambda v: v * 2)(y), x * 2)


def test_reshards_and_typed_keys_are_left_to_device_put():
    devices = np.array(jax.devices()[:4])
    split = NamedSharding(jax.sharding.Mesh(devices, ("x",)), PartitionSpec("x"))
    whole = NamedSharding(jax.sharding.Mesh(devices, ("x",)), PartitionSpec())
    assert copier(split, whole, 1, np.float32) is None  # a reshard
    assert copier(whole, split, 1, np.float32) is None
    a, b = (SingleDeviceSharding(d) for d in jax.devices()[:2])
    assert copier(a, b, 0, jax.random.key(0).dtype) is None  # an extended dtype


def test_move_to_copies_where_it_can_and_falls_back_to_device_put():
    a, b = (SingleDeviceSharding(d) for d in jax.devices()[:2])
    x = jax.device_put(jnp.arange(4.0), a)
    y = move_to(x, b)
    assert y.devices() == {jax.devices()[1]}
    np.testing.assert_array_equal(y, x)
    host = move_to(np.arange(3), b)  # not a jax.Array: jax.device_put
    assert host.devices() == {jax.devices()[1]}
    key = move_to(jax.device_put(jax.random.key(0), a), b)  # extended dtype: jax.device_put
    assert key.devices() == {jax.devices()[1]}


def test_a_step_moves_values_on_no_task_without_device_put(monkeypatch):
    """The batch (on the default device) and the optimizer's step count (on no task) reach and
    leave the last stage by runtime copies, decided once per pair of layouts."""
    tasks = one_device_tasks(2)
    model = mm.place(make_mlp(), [("layers/0", tasks[0]), (".*", tasks[1])])
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    reference = make_mlp()
    reference_opt = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)

    step = train_step  # y is read on the last stage
    x, y = jnp.ones((8, 16)), jnp.zeros((8, 16))
    train = mm.jit(step)
    train(model, opt, x, y)  # plans and compiles
    step(reference, reference_opt, x, y)
    calls = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a) or real(*a, **k))
    loss = train(model, opt, x, y)
    monkeypatch.setattr(jax, "device_put", real)
    np.testing.assert_allclose(loss, step(reference, reference_opt, x, y), rtol=1e-5)
    assert calls == []
    assert opt.step.get_value().devices() == {jax.devices()[0]}  # back where it was


def test_a_step_over_two_device_tasks_moves_the_batch_and_step_count_without_device_put(
    monkeypatch,
):
    """The batch (one device) reaches both stages, replicated over each task's two devices, and
    the optimizer's step count goes there and home by runtime copies: no ``jax.device_put``,
    which for a whole value onto more devices fetches it to the host."""
    tasks = [mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=[2 * i, 2 * i + 1])) for i in range(2)]
    model = mm.place(make_mlp(), [("layers/0", tasks[0]), (".*", tasks[1])])
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    reference = make_mlp()
    reference_opt = nnx.Optimizer(reference, optax.sgd(0.1), wrt=nnx.Param)

    step = train_step
    x = jax.random.normal(jax.random.key(0), (8, 16))
    y = jax.random.normal(jax.random.key(1), (8, 16))
    train = mm.jit(step)
    np.testing.assert_allclose(
        train(model, opt, x, y), step(reference, reference_opt, x, y), rtol=1e-5
    )
    calls = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a) or real(*a, **k))
    losses = [train(model, opt, x, y) for _ in range(2)]
    monkeypatch.setattr(jax, "device_put", real)
    assert calls == []
    for loss in losses:
        np.testing.assert_allclose(loss, step(reference, reference_opt, x, y), rtol=1e-5)
    assert int(opt.step.get_value()) == 3
    assert opt.step.get_value().devices() == {jax.devices()[0]}
