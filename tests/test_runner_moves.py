"""The runner's moves between devices of one process, decided when a step compiles."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from mmnnx.mpmd._jax import copier


def test_a_copy_to_other_devices_keeps_values_and_lands_there():
    a, b = (SingleDeviceSharding(d) for d in jax.devices()[:2])
    move = copier(a, b, 2, np.float32)
    x = jax.device_put(jnp.arange(6.0).reshape(2, 3), a)
    y = move(x)
    assert y.sharding == b and y.devices() == {jax.devices()[1]}
    np.testing.assert_array_equal(y, x)


def test_reshards_and_typed_keys_are_left_to_device_put():
    devices = np.array(jax.devices()[:4])
    split = NamedSharding(jax.sharding.Mesh(devices, ("x",)), PartitionSpec("x"))
    whole = NamedSharding(jax.sharding.Mesh(devices, ("x",)), PartitionSpec())
    assert copier(split, whole, 1, np.float32) is None  # a reshard
    a, b = (SingleDeviceSharding(d) for d in jax.devices()[:2])
    assert copier(a, b, 0, jax.random.key(0).dtype) is None  # an extended dtype
