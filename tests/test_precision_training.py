"""bfloat16 parameters trained through float32 master weights (``mmnnx.train.precision``,
``TrainConfig.param_dtype`` / ``optimizer_dtype``, ``--param-dtype`` / ``--optimizer-dtype``),
against all-float32 training, pure bfloat16 training, and the same training pipelined."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.models import GPT, stage_rules
from mmnnx.mpmd.plan.residuals import saved_residuals
from mmnnx.train import Checkpointer, TrainConfig
from mmnnx.train.loop import make_optimizer, make_steps
from tests.models import SMALL_GPT, gpt_step, one_device_tasks, reference_loss_and_grads

BF16, FP32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
TINY = dataclasses.replace(SMALL_GPT, depth=2, dtype="bfloat16")
STEPS = 20
# a learning rate whose AdamW steps (about 3e-4 each) are below half of bfloat16's spacing at
# weights of 0.125 and above (2**-10 there): pure bfloat16 loses many of them
CONFIG = TrainConfig(steps=STEPS, learning_rate=3e-4, warmup_steps=0, microbatches=2)


def start(param_dtype: str, dtype: str = "bfloat16") -> GPT:
    """The tiny GPT with Params in ``param_dtype`` computing in ``dtype``, every run starting
    from the same (bfloat16-exact) values."""
    config = dataclasses.replace(TINY, dtype=dtype)
    with nnx.use_eager_sharding(False):
        model = GPT(dataclasses.replace(config, param_dtype=param_dtype), rngs=nnx.Rngs(0))
        drawn = GPT(dataclasses.replace(config, param_dtype="float32"), rngs=nnx.Rngs(0))
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(drawn, nnx.Param))
    nnx.update(model, jax.tree.map(lambda x: x.astype(param_dtype), rounded))
    return model


@nnx.jit
def one_device_step(model, opt, tokens):
    loss, grads = nnx.value_and_grad(lambda m, t: m.loss(t))(model, tokens)
    opt.update(model, grads)
    return loss


def trained(
    param_dtype: str, dtype: str = "bfloat16", *, masters: bool = False, **config
) -> tuple[list[float], GPT, nnx.Optimizer]:
    """``STEPS`` one-device steps from :func:`start`, through float32 ``masters`` or not (pure
    bfloat16: the optimizer of float32 Params): the losses, the model and its optimizer."""
    model = start(param_dtype, dtype)
    trained_as = param_dtype if masters else "float32"
    config = dataclasses.replace(CONFIG, param_dtype=trained_as, **config)
    opt = nnx.Optimizer(model, make_optimizer(config), wrt=nnx.Param)
    return [float(one_device_step(model, opt, b)) for b in BATCHES], model, opt


BATCHES = jax.random.randint(jax.random.key(0), (STEPS, 8, TINY.max_seq_len + 1), 0, 64)


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x, np.float32) for x in jax.tree.leaves(tree)]


def distance(a, b) -> float:
    return float(np.sqrt(sum(np.sum((x - y) ** 2) for x, y in zip(a, b, strict=True))))


def params(model) -> list[np.ndarray]:
    return leaves(nnx.state(model, nnx.Param))


def masters(opt) -> list[np.ndarray]:
    return leaves(nnx.state(opt, nnx.OptState)["opt_state"]["master"])


def test_bfloat16_params_with_float32_masters_track_float32_where_pure_bfloat16_loses_updates():
    fp32_losses, fp32, _ = trained("float32")
    losses, model, opt = trained("bfloat16", masters=True)
    pure_losses, pure, _ = trained("bfloat16")
    moved = distance(params(fp32), params(start("float32")))  # how far float32 training went

    # the Params are bfloat16, the masters and AdamW's moments float32, each Param its master
    # rounded (bit for bit)
    state = nnx.state(opt, nnx.OptState)["opt_state"]
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {BF16}
    floats = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert {x.dtype for x in floats} == {FP32}
    for param, master in zip(params(model), masters(opt), strict=True):
        np.testing.assert_array_equal(param, master.astype(jnp.bfloat16).astype(np.float32))

    # Tracking: every step's loss within 0.005 of float32's (measured 0.0032: the forward reads
    # weights rounded to bfloat16, 2**-9 relative at most, a loss change of about 1e-3 at these
    # gradients; both runs compute in bfloat16), the masters within 3% of the distance float32
    # training moved (measured 1.06%)
    np.testing.assert_allclose(losses, fp32_losses, atol=0.005)
    assert distance(masters(opt), params(fp32)) < 0.03 * moved
    # Pure bfloat16 rounds updates away: 0.051 worse by step 20, its weights 72% of float32's
    # distance off, and 67% as far from where they started (measured)
    assert pure_losses[-1] > losses[-1] + 0.03
    assert distance(params(pure), params(fp32)) > 0.5 * moved
    assert distance(params(pure), params(start("float32"))) < 0.8 * moved

    # AdamW's moments stored in bfloat16 (computed in float32) track as closely (measured 0.0026)
    narrow_losses, _, narrow_opt = trained("bfloat16", masters=True, optimizer_dtype="bfloat16")
    inner = nnx.state(narrow_opt, nnx.OptState)["opt_state"]["inner"]
    moments = [x for x in jax.tree.leaves(inner) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert moments and {x.dtype for x in moments} == {BF16}
    np.testing.assert_allclose(narrow_losses, fp32_losses, atol=0.005)


def test_pipelined_master_weights_train_as_one_device_and_checkpoint_bit_exact(tmp_path):
    config = dataclasses.replace(CONFIG, param_dtype="bfloat16")
    # computing in float32, the runs differ only in how the gradients are summed (below)
    ref_losses, _, ref_opt = trained("bfloat16", "float32", masters=True)
    model = start("bfloat16", "float32")
    mm.place(model, stage_rules(model, one_device_tasks(2), report=False))
    opt = nnx.Optimizer(model, make_optimizer(config), wrt=nnx.Param)
    train, _ = make_steps(config)
    losses = [float(train(model, opt, b)) for b in BATCHES]
    # The gradients are bfloat16 (the Params' dtype), summed over the 2 microbatches in bfloat16
    # where one device sums the batch inside each reduction: after 20 updates the losses agree
    # to 1e-3 relative (measured 4.4e-5) and the masters to 2% of the distance they moved
    # (measured 0.59%; computing in bfloat16 too, 2.5%, as for float32 Params: bfloat16's own)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-3)
    moved = distance(masters(ref_opt), params(start("float32")))
    assert distance(masters(opt), masters(ref_opt)) < 0.02 * moved
    for param, master in zip(params(model), masters(opt), strict=True):
        np.testing.assert_array_equal(param, master.astype(jnp.bfloat16).astype(np.float32))

    # a checkpoint holds both: the bfloat16 Params and their float32 masters, restored bit-exact
    with Checkpointer(tmp_path / "checkpoints") as checkpoints:
        checkpoints.save(STEPS, model=model, opt=opt)
        restored = start("bfloat16", "float32")
        mm.place(restored, stage_rules(restored, one_device_tasks(2), report=False))
        restored_opt = nnx.Optimizer(restored, make_optimizer(config), wrt=nnx.Param)
        checkpoints.restore(model=restored, opt=restored_opt)
    for a, b in zip(params(restored), params(model), strict=True):
        np.testing.assert_array_equal(a, b)
    saved = leaves(nnx.state(opt, nnx.OptState))
    assert saved and all(
        np.array_equal(a, b)
        for a, b in zip(leaves(nnx.state(restored_opt, nnx.OptState)), saved, strict=True)
    )
    dtypes = {x.dtype for x in jax.tree.leaves(nnx.state(restored_opt, nnx.OptState))}
    assert jnp.dtype(jnp.float32) in dtypes and jnp.dtype(jnp.bfloat16) not in dtypes
    # a run of float32 Params (no masters) cannot take it: the restore names what differs
    with Checkpointer(tmp_path / "checkpoints") as checkpoints:
        other = start("float32")
        other_opt = nnx.Optimizer(other, make_optimizer(CONFIG), wrt=nnx.Param)
        with pytest.raises(mm.train.CheckpointMismatchError):
            checkpoints.restore(model=other, opt=other_opt)


def test_the_flags_reach_the_model_and_optimizer_and_a_resumed_run_may_not_change_them():
    from mmnnx.train.config import MAY_CHANGE_ON_RESUME, RunConfig, train_config
    from mmnnx.train.run_model import build_model, model_config, trainable
    from mmnnx.train.run_record import RunRecord
    from mmnnx.train.tokenizers import ByteTokenizer

    flags = {"dim": 32, "depth": 1, "heads": 2, "model_axis": 1, "param_dtype": "bfloat16"}
    run = RunConfig.of({**flags, "optimizer_dtype": "bfloat16"})
    config = train_config(run)
    assert (config.param_dtype, config.optimizer_dtype) == ("bfloat16", "bfloat16")
    model = build_model(run, model_config(run, 64))
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {
        jnp.dtype(jnp.bfloat16)
    }
    # LoRA: the frozen base in bfloat16, the adapters float32, trained without masters
    lora = RunConfig.of({**flags, "lora_rank": 2, "lora_targets": ("q",)})
    assert train_config(lora).param_dtype == "float32"
    model = build_model(lora, model_config(lora, 64))
    base = nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))
    adapters = nnx.state(model, trainable(lora))
    assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}

    # recorded with each checkpoint; a resumed run giving another is refused, naming both
    assert not {"param_dtype", "optimizer_dtype"} & set(MAY_CHANGE_ON_RESUME)
    record = RunRecord.of(run.options(), ByteTokenizer())
    changed = record.mismatch({**run.options(), "param_dtype": "float32"})
    assert changed.as_flags() == ("--param-dtype float32", "--param-dtype bfloat16")
    changed = record.mismatch({**run.options(), "optimizer_dtype": "float32"})
    assert changed.as_flags() == ("--optimizer-dtype float32", "--optimizer-dtype bfloat16")

    # fit refuses bfloat16 Params trained as float32 (their updates would round away)
    refused = r"trained Variable blocks/0/attn/k/kernel is bfloat16, not TrainConfig.param_dtype"
    with pytest.raises(ValueError, match=refused):
        mm.train.fit(build_model(run, model_config(run, 64)), None, TrainConfig())
    with pytest.raises(ValueError, match="optimizer_dtype must be one of float32, bfloat16"):
        TrainConfig(optimizer_dtype="float16")
    with pytest.raises(ValueError, match="master_weights: update needs the parameters"):
        mm.train.master_weights(optax.sgd(0.1)).update({"w": jnp.ones(1)}, None)


def residuals(step, *args) -> dict:
    """Per stage of ``step``'s plan for ``args`` (traced and lowered, nothing compiled): the
    residuals its forward saves per microbatch (``SavedResiduals``)."""
    step.plan(*args)
    ((executable, _),) = step._cache.values()
    return saved_residuals(executable.graph, executable.plan.pipeline)


def test_no_forward_saves_a_weight_or_its_cast_for_each_microbatch():
    """Item 2 of issue 72: with float32 Params computing in bfloat16, the forward of a stage
    casts each weight; its backward reads the cast. Saved with the forward's residuals, it
    would be held once per microbatch in flight. The engine remakes casts (and broadcasts) of
    weights in the backward instead: the unrolled blocks' by its residual recomputation, the
    casts of weights stacked for ``nnx.scan`` by a scan of the casts alone."""
    tokens = jax.random.randint(jax.random.key(1), (8, TINY.max_seq_len + 1), 0, 64)
    held, stepped = {}, {}
    for name, scan, recompute in (
        ("unrolled", False, True),
        ("scanned", True, True),
        ("scanned, every residual kept", True, False),
    ):
        with nnx.use_eager_sharding(False):
            model = GPT(dataclasses.replace(TINY, scan_layers=scan), rngs=nnx.Rngs(0))
            ref = GPT(dataclasses.replace(TINY, scan_layers=scan), rngs=nnx.Rngs(0))
        mm.place(model, stage_rules(model, one_device_tasks(2), report=False))
        opt = nnx.Optimizer(model, optax.sgd(1.0), wrt=nnx.Param)  # a step subtracts the grads
        step = mm.jit(gpt_step("1f1b"), recompute_residuals=recompute)
        held[name] = residuals(step, model, opt, tokens)
        if scan:  # one step each: the backward remaking the casts computes the same gradients
            ref_loss, _ = reference_loss_and_grads(ref, tokens)
            np.testing.assert_allclose(float(step(model, opt, tokens)), ref_loss, rtol=2**-8)
            stepped[name] = params(model)
    for a, b in zip(*stepped.values(), strict=True):
        np.testing.assert_array_equal(a, b)  # bit for bit
    for name in ("unrolled", "scanned"):
        assert all(not r.invariant for r in held[name].values()), (name, held[name])
    # the same test finds them when they are kept: the bfloat16 casts of every layer's
    # matrices, stacked (one layer a stage), and the norms' float32 scales broadcast
    for saved in held["scanned, every residual kept"].values():
        weights = saved.invariant
        stacked = [s for s, d in weights if d == "bfloat16" and s[:1] == (TINY.depth // 2,)]
        assert len(stacked) == 6, weights  # q, k, v, out, up, down (and the head's on stage 1)
        # a fifth of what each microbatch's forward saves (its 2 x 16 tokens are few beside a
        # layer's weights): measured in benchmarks/residual_weights.py
        total = sum(np.prod(s) * jnp.dtype(d).itemsize for s, d in weights)
        assert total > 0.15 * saved.nbytes
