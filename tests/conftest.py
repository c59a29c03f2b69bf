"""Test set-up: 8 simulated CPU devices, configured before JAX is imported."""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

assert len(jax.devices()) == 8, "tests need 8 simulated CPU devices"


@pytest.fixture
def devices():
    return jax.devices()
