"""Training state is held once: after any number of ``mm.jit`` steps the live arrays are the
model, its optimizer state and the batch, as with ``nnx.jit``; nothing the engine caches keeps
a user's arrays alive."""

import gc
import weakref

import jax
import optax
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.models import stage_rules
from tests.models import SMALL_GPT, full_batch_step, gpt_step, one_device_tasks, small_gpt

pytestmark = pytest.mark.usefixtures("frozen_heap")  # each gc.collect() scans the test's own


class NewArrays:
    """The arrays made since it was created that are still alive (after a garbage collection);
    it holds the older ones, so that no id is reused."""

    def __init__(self):
        gc.collect()
        self.before = {id(a): a for a in jax.live_arrays()}

    def bytes(self) -> int:
        gc.collect()
        return sum(a.nbytes for a in jax.live_arrays() if id(a) not in self.before)


def _state_bytes(*objects) -> int:
    return sum(x.nbytes for o in objects for x in jax.tree.leaves(nnx.state(o)))


def _tokens():
    return jax.random.randint(jax.random.key(0), (16, SMALL_GPT.max_seq_len + 1), 0, 64)


def _placed(num_tasks: int):
    model = small_gpt()
    mm.place(model, stage_rules(model, one_device_tasks(num_tasks), report=False))
    return model, nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)


MODES = {
    "one task": (1, lambda: mm.jit(full_batch_step), False),
    "two tasks": (2, lambda: mm.jit(full_batch_step), False),
    "cached_partial": (2, lambda: mm.jit(full_batch_step), True),
    "pipelined": (4, lambda: mm.jit(gpt_step("1f1b")), False),
}


@pytest.mark.parametrize("mode", MODES)
def test_state_is_held_once_after_several_steps(mode):
    num_tasks, make_step, bound = MODES[mode]
    new = NewArrays()
    tokens = _tokens()
    model, opt = _placed(num_tasks)
    step = make_step()
    run = mm.cached_partial(step, model, opt) if bound else (lambda t: step(model, opt, t))
    for _ in range(4):
        loss = run(tokens)
    float(loss)
    del loss
    held = _state_bytes(model, opt) + tokens.nbytes
    assert new.bytes() <= 1.05 * held, f"{mode}: {new.bytes() / held:.2f}x the state"


def test_a_deleted_models_arrays_are_freed_while_its_step_lives_on():
    new = NewArrays()
    tokens = _tokens()
    model, opt = _placed(4)
    step = mm.jit(gpt_step("1f1b"))
    bound = mm.cached_partial(step, model, opt)
    for _ in range(2):
        bound(tokens)
    assert new.bytes() >= _state_bytes(model, opt)
    refs = [weakref.ref(x) for o in (model, opt) for x in jax.tree.leaves(nnx.state(o))]
    del model, opt, bound
    gc.collect()
    assert step._cache  # the compiled step is still cached
    assert not [r for r in refs if r() is not None]  # and holds none of the state's arrays
    assert new.bytes() <= tokens.nbytes + 1024  # but its own constants (microbatch indices)
