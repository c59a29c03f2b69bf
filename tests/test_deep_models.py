"""Deep unrolled models are steered to stacked layers: a warning naming the list."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.deep_models import UNROLLED_BLOCKS_WARN_AT, equal_blocks
from mmnnx.models import GPT, GPTConfig, stage_rules


class Stack(nnx.Module):
    def __init__(self, depth: int, rngs: nnx.Rngs, odd_one: bool = False):
        widths = [4] * depth
        if odd_one:
            widths[0] = 5  # one block of another shape: not all equal
        self.blocks = nnx.List([nnx.Linear(4, w, rngs=rngs) for w in widths])
        self.out = nnx.Linear(4, 1, rngs=rngs)


def test_equal_blocks_counts_lists_of_equal_modules_only():
    assert equal_blocks(Stack(40, nnx.Rngs(0))) == [("blocks", 40)]
    assert equal_blocks(Stack(40, nnx.Rngs(0), odd_one=True)) == [("blocks", 39)]
    assert equal_blocks(Stack(UNROLLED_BLOCKS_WARN_AT, nnx.Rngs(0))) == []


def _gpt(depth: int, scan: bool) -> GPT:
    config = GPTConfig(
        vocab_size=16, dim=8, depth=depth, num_heads=2, max_seq_len=4, scan_layers=scan
    )
    with nnx.use_eager_sharding(False):
        model = GPT(config, rngs=nnx.Rngs(0))
    tasks = [mm.Task(f"s{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(2)]
    return mm.place(model, stage_rules(model, tasks, report=False))


def _first_call(model) -> list[warnings.WarningMessage]:
    @mm.jit
    def loss_of(model, tokens):
        return model.loss(tokens)

    tokens = jnp.zeros((2, 5), jnp.int32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_of(model, tokens)
        loss_of(model, tokens)  # a second call traces nothing and says nothing more
    return [w for w in caught if issubclass(w.category, mm.UnrolledLayersWarning)]


def test_a_step_over_a_deep_unrolled_model_warns_once_naming_the_list_and_scan_layers():
    (warning,) = _first_call(_gpt(UNROLLED_BLOCKS_WARN_AT + 1, scan=False))
    message = str(warning.message)
    assert "mm.jit(loss_of): model.blocks holds 33 equal blocks unrolled" in message
    assert "scan_layers=True" in message and "--scan-layers" in message
    assert warning.filename == __file__  # points at the user's call


@pytest.mark.parametrize("depth,scan", [(UNROLLED_BLOCKS_WARN_AT, False), (40, True)])
def test_no_warning_for_a_shallow_or_a_stacked_model(depth, scan):
    assert _first_call(_gpt(depth, scan)) == []
