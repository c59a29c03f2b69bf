"""Gradient clipping across tasks and bfloat16 compute, against the same step on one device."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.models import GPT, stage_rules
from mmnnx.train import TrainConfig
from mmnnx.train.loop import make_optimizer, make_steps
from tests.models import SMALL_GPT, small_gpt


def _two_tasks() -> list[mm.Task]:
    return [mm.Task(f"s{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(2)]


def _first_moments(opt: nnx.Optimizer) -> list[np.ndarray]:
    """Adam's first moments (``mu``): after one step, ``(1 - b1)`` times the clipped gradient."""
    state = nnx.to_pure_dict(nnx.state(opt, nnx.OptState))
    found = []

    def visit(path, leaf):
        if any(getattr(k, "key", None) == "mu" for k in path):
            found.append(np.asarray(leaf))

    jax.tree_util.tree_map_with_path(visit, state)
    return found


def test_a_clipped_step_over_two_tasks_clips_by_the_norm_of_every_task_s_gradients():
    tokens = jax.random.randint(jax.random.key(0), (4, 17), 0, SMALL_GPT.vocab_size)
    config = TrainConfig(steps=10, microbatches=2, clip_grad_norm=0.05, warmup_steps=0)
    model = mm.place(small_gpt(), stage_rules(small_gpt(), _two_tasks(), report=False))
    opt = nnx.Optimizer(model, make_optimizer(config), wrt=nnx.Param)
    train, _ = make_steps(config)
    ref, unclipped = small_gpt(), small_gpt()
    ref_opt = nnx.Optimizer(ref, make_optimizer(config), wrt=nnx.Param)
    free_config = TrainConfig(steps=10, warmup_steps=0)
    free_opt = nnx.Optimizer(unclipped, make_optimizer(free_config), wrt=nnx.Param)

    @nnx.jit
    def one_device(model, opt, tokens):
        loss, grads = nnx.value_and_grad(lambda m, t: m.loss(t))(model, tokens)
        opt.update(model, grads)
        return loss, optax_global_norm(grads)

    loss = train(model, opt, tokens)
    ref_loss, norm = one_device(ref, ref_opt, tokens)
    one_device(unclipped, free_opt, tokens)
    assert float(norm) > 10 * config.clip_grad_norm  # the clip is active
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    moments, ref_moments = _first_moments(opt), _first_moments(ref_opt)
    assert len(moments) == len(ref_moments) > 0
    for a, b in zip(moments, ref_moments, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-8)
    # the clipped gradients have the global norm clip_grad_norm (their moments 1 - b1 times it)
    total = np.sqrt(sum(float(np.sum(np.square(m))) for m in moments))
    np.testing.assert_allclose(total, 0.1 * config.clip_grad_norm, rtol=1e-4)
    # and differ from the unclipped step's by the one factor clip / norm
    free = _first_moments(free_opt)
    scale = config.clip_grad_norm / float(norm)
    for a, b in zip(moments, free, strict=True):
        np.testing.assert_allclose(a, scale * b, rtol=1e-3, atol=1e-9)


def optax_global_norm(tree):
    import optax  # noqa: PLC0415

    return optax.tree.norm(tree)


def _bf16_gpt() -> GPT:
    config = dataclasses.replace(SMALL_GPT, dtype="bfloat16")
    with nnx.use_eager_sharding(False):
        return GPT(config, rngs=nnx.Rngs(0))


def test_bfloat16_computes_in_bfloat16_keeps_float32_state_and_trains_over_two_tasks():
    tokens = jax.random.randint(jax.random.key(0), (4, 17), 0, SMALL_GPT.vocab_size)
    jaxpr = jax.make_jaxpr(lambda t: _bf16_gpt()(t))(tokens[:, :-1])
    products = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert products and all(e.outvars[0].aval.dtype == jnp.bfloat16 for e in products)
    assert _bf16_gpt()(tokens[:, :-1]).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="GPTConfig.dtype must be 'float32' or 'bfloat16'"):
        dataclasses.replace(SMALL_GPT, dtype="float16")

    config = TrainConfig(steps=12, microbatches=2, learning_rate=1e-2, warmup_steps=0)
    train, _ = make_steps(config)
    losses = {}
    for name, make in (("bf16", _bf16_gpt), ("fp32", small_gpt)):
        model = mm.place(make(), stage_rules(make(), _two_tasks(), report=False))
        opt = nnx.Optimizer(model, make_optimizer(config), wrt=nnx.Param)
        losses[name] = [float(train(model, opt, tokens)) for _ in range(config.steps)]
        state = jax.tree.leaves(nnx.state(model, nnx.Param)) + jax.tree.leaves(
            nnx.state(opt, nnx.OptState)
        )
        assert {x.dtype for x in state if jnp.issubdtype(x.dtype, jnp.floating)} == {
            jnp.dtype(jnp.float32)
        }
    bf16, fp32 = losses["bf16"], losses["fp32"]
    assert bf16[-1] < 0.5 * bf16[0]  # it learns the batch
    np.testing.assert_allclose(bf16, fp32, rtol=0.05)  # the same curve, to bfloat16's precision
    assert bf16 != fp32  # computed otherwise


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"clip_grad_norm": 0.0}, "clip_grad_norm must be > 0 or None, got 0.0"),
        ({"virtual_stages": 0}, "virtual_stages must be >= 1, got 0"),
        ({"virtual_stages": 2, "schedule": "auto"}, "name a schedule for virtual_stages=2"),
        ({"profile_steps": (3, 2)}, r"1 <= first <= last, got \(3, 2\)"),
    ],
)
def test_train_config_refuses_bad_new_fields(fields, reason):
    with pytest.raises(ValueError, match=reason):
        TrainConfig(**fields)


@pytest.mark.parametrize(
    "fields, reason",
    [  # what the flags refuse (--lr nan, --weight-decay -1, ...), refused by the API too
        ({"learning_rate": float("nan")}, "learning_rate must be a finite number > 0, got nan"),
        ({"learning_rate": float("inf")}, "learning_rate must be a finite number > 0, got inf"),
        ({"weight_decay": -0.1}, "weight_decay must be a finite number >= 0, got -0.1"),
        ({"weight_decay": float("nan")}, "weight_decay must be a finite number >= 0, got nan"),
        ({"warmup_steps": -3}, "warmup_steps must be >= 0, got -3"),
        ({"checkpoint_every": 0}, "checkpoint_every must be >= 1, got 0"),  # step % 0 in fit
    ],
)
def test_train_config_refuses_what_its_flags_refuse(fields, reason):
    with pytest.raises(ValueError, match=reason):
        TrainConfig(**fields)
