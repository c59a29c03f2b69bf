"""Launching a step's programs without JAX's per-argument checks, once a checked call has found
every argument laid out as its program expects (``mmnnx/_jax/launch.py: DirectLaunch``)."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import mmnnx as mm
from mmnnx._jax.arrays import launchable_as
from mmnnx.models import stage_rules
from mmnnx.mpmd.run.runner import Executable
from tests.models import (
    SMALL_GPT,
    gpt_step,
    one_device_tasks,
    reference_loss_and_grads,
    reference_step,
    small_gpt,
)
from tests.oracle import close, params_close


@pytest.fixture
def checked_calls(monkeypatch):
    """Counts the programs launched through JAX's own (checked) call."""
    calls = []
    checked = jax.stages.Compiled.__call__

    def counting(self, *args, **kwargs):
        calls.append(self)
        return checked(self, *args, **kwargs)

    monkeypatch.setattr(jax.stages.Compiled, "__call__", counting)
    return calls


def _gpt_on(tasks, schedule="1f1b"):
    model, ref = small_gpt(), small_gpt()
    mm.place(model, stage_rules(model, tasks, report=False))
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    ref_opt = nnx.Optimizer(ref, optax.adamw(3e-3), wrt=nnx.Param)
    return model, opt, ref, ref_opt, mm.jit(gpt_step(schedule))


def _tokens(seed=0):
    return jax.random.randint(jax.random.key(seed), (16, SMALL_GPT.max_seq_len + 1), 0, 64)


def _num_programs(step) -> int:
    (executable, _), *_ = step._cache.values()
    return sum(type(a).__name__ in ("Run", "Zeros") for a in executable.plan.program.actions)


def test_after_one_checked_call_every_program_is_launched_directly(checked_calls, monkeypatch):
    # ... and every step replayed as that call ran it (DirectSteps), none interpreted again
    interpreted = []
    interpret = Executable._interpret

    def counting(self, *args, **kwargs):
        interpreted.append(self)
        return interpret(self, *args, **kwargs)

    monkeypatch.setattr(Executable, "_interpret", counting)
    model, opt, ref, ref_opt, step = _gpt_on(one_device_tasks(4))
    tokens = _tokens()
    _, ref_grads = reference_loss_and_grads(small_gpt(), tokens)
    close(step(model, opt, tokens), reference_step(ref, ref_opt, tokens))
    assert len(checked_calls) >= _num_programs(step)  # the first call checks every argument
    checked_calls.clear()
    for _ in range(2):
        close(step(model, opt, tokens), reference_step(ref, ref_opt, tokens))
    assert checked_calls == []
    assert len(interpreted) == 1
    params_close(model, ref, ref_grads, steps=3, lr=3e-3)


def test_an_input_laid_out_otherwise_is_checked_again(checked_calls):
    # The batch is a free input (it goes wherever its readers are): the same step is fed it on
    # one device, over two devices, as a NumPy array, then on one device again.
    tasks = [mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=[2 * i, 2 * i + 1])) for i in range(2)]
    model, opt, ref, ref_opt, step = _gpt_on(tasks, schedule="gpipe")
    pair = NamedSharding(Mesh(np.array(jax.devices()[2:4]), ("x",)), PartitionSpec("x"))
    tokens = [_tokens(seed) for seed in range(5)]
    batches = [
        jax.device_put(tokens[0], jax.devices()[0]),
        jax.device_put(tokens[1], jax.devices()[0]),
        jax.device_put(tokens[2], pair),
        np.asarray(tokens[3]),
        jax.device_put(tokens[4], jax.devices()[0]),
    ]
    checked_per_call = []
    for batch, t in zip(batches, tokens, strict=True):
        checked_calls.clear()
        close(step(model, opt, batch), reference_step(ref, ref_opt, t))
        checked_per_call.append(len(checked_calls))
    launched = _num_programs(step)
    assert checked_per_call[0] >= launched and checked_per_call[1] == 0
    assert checked_per_call[2] >= launched and checked_per_call[3] >= launched
    assert checked_per_call[4] >= launched  # laid out as before the NumPy call: checked once


def test_with_debug_nans_every_program_goes_through_jax(checked_calls):
    # JAX's own call checks each result for NaN under jax_debug_nans; a direct launch would not
    model, opt, ref, ref_opt, step = _gpt_on(one_device_tasks(2))
    tokens = _tokens()
    close(step(model, opt, tokens), reference_step(ref, ref_opt, tokens))
    with jax.debug_nans(True):
        checked_calls.clear()
        close(step(model, opt, tokens), reference_step(ref, ref_opt, tokens))
    assert len(checked_calls) >= _num_programs(step)


def test_launchable_as_needs_the_same_slices_on_the_same_devices_in_the_same_order():
    a, b = jax.devices()[:2]
    pair = Mesh(np.array([a, b]), ("x",))
    swapped = Mesh(np.array([b, a]), ("x",))
    x = jax.device_put(np.ones((4, 2), np.float32), NamedSharding(pair, PartitionSpec("x")))
    assert launchable_as(x, NamedSharding(pair, PartitionSpec("x")))
    assert not launchable_as(x, NamedSharding(swapped, PartitionSpec("x")))
    assert not launchable_as(x, NamedSharding(pair, PartitionSpec()))
    assert not launchable_as(np.ones((4, 2), np.float32), x.sharding)
    one = jax.device_put(np.ones(3), a)
    assert launchable_as(one, NamedSharding(Mesh(np.array([a]), ("x",)), PartitionSpec()))
    assert not launchable_as(one, jax.sharding.SingleDeviceSharding(b))
