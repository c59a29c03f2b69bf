"""mm.microbatch's gathered outputs (``reduce="concat"`` / ``"stack"``), and the train step of
Flax's Gemma example (examples/gemma/train.py) pipelined as written: the attention mask built
from the tokens before the loss, per-sample losses and logits returned as aux for an
``nnx.MultiMetric``, and the output head tied to the embedding. Every result is checked against
the same step on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import mmnnx as mm
from tests.models import four_tasks
from tests.oracle import close, trees_close

B, T, VOCAB, DIM = 16, 8, 32, 16


def test_plain_loop_gathers_in_microbatch_order():
    w = jnp.arange(1.0, 4.0)
    x = jnp.arange(24.0).reshape(8, 3)

    def f(w, x):
        return x * w, (x * w).sum()

    f4 = mm.microbatch(f, num=4, reduce=("concat", "stack"))
    rows, per_microbatch = f4(w, x)
    close(rows, x * w)
    close(per_microbatch, (x * w).reshape(4, 2, 3).sum(axis=(1, 2)))
    columns = mm.microbatch(lambda w, x: x * w[0], num=4, dim=1, argnums=1, reduce="concat")
    close(columns(w, x.T), x.T * w[0])  # split along dim 1, gathered along dim 1
    one = mm.microbatch(f, num=1, reduce="stack")
    assert [a.shape for a in one(w, x)] == [(1, 8, 3), (1,)]


@pytest.mark.parametrize(
    ("reduce", "message"),
    [
        ("concat", r"output \[1\] has no dimension 0 to concatenate .*\(shape \(\)\).*'stack'"),
        (("sum", ("mean",)), "the reduce pytree does not match"),
    ],
)
def test_errors(reduce, message):
    f = mm.microbatch(lambda w, x: (x * w, (x * w).sum()), num=2, reduce=reduce)
    with pytest.raises(ValueError, match=message):
        f(2.0, jnp.ones((4, 3)))


def test_an_unknown_reduction_is_named():
    with pytest.raises(ValueError, match="reduce 'max' is not one of .*'concat', 'stack'"):
        mm.microbatch(lambda x: x, num=2, argnums=0, reduce="max")


class GemmaNorm(nnx.Module):
    """examples/gemma/layers.py's RMSNorm: the scale is stored less one."""

    def __init__(self):
        self.scale = nnx.Param(jnp.zeros(DIM))

    def __call__(self, x):
        normed = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)
        return normed * (1 + self.scale[...])


class MaskedBlock(nnx.Module):
    """A pre-norm block reading the attention mask its caller built (as Gemma's blocks do)."""

    def __init__(self, rngs):
        self.norm = GemmaNorm()
        self.qkv = nnx.Linear(DIM, 3 * DIM, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(DIM, DIM, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(DIM, 2 * DIM, rngs=rngs)
        self.down = nnx.Linear(2 * DIM, DIM, rngs=rngs)

    def __call__(self, x, mask):
        b, t, _ = x.shape
        q, k, v = (a.reshape(b, t, 2, DIM // 2) for a in jnp.split(self.qkv(self.norm(x)), 3, -1))
        x = x + self.out(nnx.dot_product_attention(q, k, v, mask=mask).reshape(b, t, DIM))
        return x + self.down(jax.nn.gelu(self.up(x)))


class TiedLM(nnx.Module):
    """Gemma's shape: an embedding, ``layers`` (not ``blocks``), a final norm, and logits from
    the embedding table (``embedder.decode`` there: a head tied to the first stage)."""

    def __init__(self, depth, rngs):
        self.embedder = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.layers = nnx.List([MaskedBlock(rngs) for _ in range(depth)])
        self.final_norm = GemmaNorm()

    def __call__(self, tokens, mask):
        x = self.embedder(tokens)
        for layer in self.layers:
            x = layer(x, mask)
        return self.embedder.attend(self.final_norm(x))


def loss_fn(model, inputs, mask, targets, weights):
    logits = model(inputs, mask)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights
    per_sample = losses.sum(axis=1) / jnp.maximum(weights.sum(axis=1), 1)
    return per_sample.mean(), (per_sample, logits, per_sample.mean())


def train_step(model, optimizer, metrics, batch, *, schedule=None):
    """examples/gemma/train.py's ``train_step``, with the loss's batch passed to it as arguments
    (``mm.microbatch`` splits those)."""
    inputs, targets = batch["inputs"], batch["targets"]
    input_mask = inputs > 0
    weights = input_mask.astype(jnp.float32)
    mask = nnx.combine_masks(
        nnx.make_causal_mask(inputs), nnx.make_attention_mask(input_mask, input_mask)
    )
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    if schedule is not None:
        grad_fn = mm.microbatch(
            grad_fn,
            num=8,
            argnums=(1, 2, 3, 4),
            schedule=schedule,
            virtual_stages=2 if schedule == "zero-bubble-v" else 1,
            reduce=(("mean", ("concat", "concat", "stack")), "mean"),
        )
    (loss, (per_sample, logits, per_microbatch)), grads = grad_fn(
        model, inputs, mask, targets, weights
    )
    optimizer.update(model, grads)
    metrics.update(loss=per_sample, logits=logits, labels=targets)
    return loss, per_sample, logits, per_microbatch


def _metrics():
    return nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))


def _build():
    with nnx.use_eager_sharding(False):
        model = TiedLM(8, nnx.Rngs(0))
    return model


def _batch():
    tokens = np.random.default_rng(0).integers(1, VOCAB, (B, T + 1))
    tokens[: B // 2, T - 2 :] = 0  # padded rows
    return {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


@pytest.fixture(scope="module")
def gemma_one_device():
    """The example's step on one device (under ``nnx.jit``), three steps from ``_build()``:
    each step's results, then the parameters and the metrics after them; computed once for
    both schedules."""
    ref = _build()
    ref_opt = nnx.Optimizer(ref, optax.adamw(3e-3), wrt=nnx.Param)
    ref_metrics = _metrics()
    step = nnx.jit(train_step)
    results = [step(ref, ref_opt, ref_metrics, _batch()) for _ in range(3)]
    return results, nnx.state(ref, nnx.Param), ref_metrics.compute()


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-v"])
def test_the_gemma_example_step_pipelines_as_written(schedule, gemma_one_device):
    batch = _batch()
    order = "v" if schedule == "zero-bubble-v" else "loop"
    v = 2 if schedule == "zero-bubble-v" else 1
    model = _build()
    rules = mm.stage_rules(model, four_tasks(), virtual_stages=v, order=order, report=False)
    model = mm.place(model, rules)
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    metrics = _metrics()
    step = mm.jit(lambda *a: train_step(*a, schedule=schedule))
    wanted, ref_params, ref_metrics = gemma_one_device
    for want in wanted:
        got = step(model, opt, metrics, batch)
        loss, per_sample, logits, per_microbatch = got
        close(loss, want[0])
        close(per_sample, want[1], atol=1e-5)  # row i is example i's, as on one device
        close(logits, want[2], atol=1e-5)
        close(per_microbatch, want[1].reshape(8, 2).mean(axis=1), atol=1e-5)
        assert logits.shape == (B, T, VOCAB) and per_microbatch.shape == (8,)
    trees_close(nnx.state(model, nnx.Param), ref_params)
    for name, value in ref_metrics.items():
        close(metrics.compute()[name], value)
    plan = step.plan(model, opt, metrics, batch)
    stages = [t.name for t in plan.pipeline.stage_tasks]
    if schedule == "zero-bubble-v":
        # the tied head runs in the V's last stage, on the first task's devices
        assert stages == ["t0", "t1", "t2", "t3", "t3:1", "t2:1", "t1:1", "t0:1"]
    else:  # the head reads the embedding table: a fifth stage, back on the first task
        assert stages == ["t0", "t1", "t2", "t3", "t0"]
    # the mask, built before the loss from the tokens, is made by each stage from them: not sent
    assert not [tr for tr in plan.transfers if tr.dtype == jnp.bool_]


def test_stage_rules_find_gemma_s_layers_and_put_what_follows_them_last():
    model = _build()
    tasks = four_tasks()
    rules = mm.stage_rules(model, tasks, report=False)
    assert rules[0][0].startswith("^embedder/|^layers/(0|1)/")
    assert rules[-1][0] == "^layers/(6|7)/|^final_norm/"
    assert mm.stage_rules(model, tasks, blocks="layers", report=False) == rules
    first = mm.stage_rules(model, tasks, last=(), report=False)
    assert "final_norm" in first[0][0]  # last=() : every other attribute on the first task


def _tied_step(schedule, num, virtual_stages=1):
    def step(model, tokens, mask):
        grad_fn = mm.microbatch(
            nnx.value_and_grad(lambda m, t, k: m(t, k).mean()),
            num=num,
            argnums=(1, 2),
            schedule=schedule,
            virtual_stages=virtual_stages,
        )
        return grad_fn(model, tokens, mask)

    return mm.jit(step)


def test_a_tied_head_s_stage_chain_is_named_in_errors():
    tokens = jnp.ones((B, T), jnp.int32)
    mask = nnx.make_causal_mask(tokens)
    model = _build()
    model = mm.place(model, mm.stage_rules(model, four_tasks(), report=False))
    # the message names the Variable that brings the forward pass back to t0, and its reader
    returns = r"t0 -> t1 -> t2 -> t3 -> t0: stage 4 comes back to t0 for 'arg0/embedder/embedding'"
    with pytest.raises(mm.MPMDError, match=rf"\(5\), got 4.*{returns} \(read by `\w+` at "):
        _tied_step("1f1b", 4).plan(model, tokens, mask)
    looped = _build()
    rules = mm.stage_rules(looped, four_tasks(), virtual_stages=2, report=False)
    looped = mm.place(looped, rules)
    # the forward pass comes back to every task for the second half of the layers, and to t0
    # once more for the head: the message names the Variables and their readers' lines
    named = (
        r"does not divide num_stages=9.* -> t3 -> t0: stage 4 comes back to t0 for "
        r"'arg0/layers/4/norm/scale' \(read by `\w+` at .*:\d+.*; 2 more; stage 8 comes back to "
        r"t0 for 'arg0/embedder/embedding'.*tied to the embedding.*order='v'"
    )
    with pytest.raises(mm.MPMDError, match=named):
        _tied_step("interleaved-1f1b", 8, virtual_stages=2).plan(looped, tokens, mask)


def test_tune_runs_a_step_whose_head_is_tied():
    """The forward pass comes back to t0 for the head: five stages on four tasks, which tune
    measures and ranks like any other step (it once rejected every candidate)."""
    tokens = jax.random.randint(jax.random.key(0), (B, T), 1, VOCAB)
    mask = nnx.make_causal_mask(tokens)
    model = _build()
    model = mm.place(model, mm.stage_rules(model, four_tasks(), report=False))
    result = mm.schedules.tune(
        _tied_step("1f1b", 8), model, tokens, mask, schedules=("gpipe", "1f1b")
    )
    assert {c.schedule for c in result.candidates if not c.rejected} == {"gpipe", "1f1b"}
    assert result.best.predicted_seconds > 0
    with pytest.raises(mm.MPMDError, match=r"no candidate can run .*zero-bubble-v \(M=8\)"):
        mm.schedules.tune(_tied_step("1f1b", 8), model, tokens, mask, schedules=("zero-bubble-v",))


class TwoLinear(nnx.Module):
    def __init__(self, rngs):
        self.a, self.b = nnx.Linear(4, 8, rngs=rngs), nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.b(jax.nn.relu(self.a(x)))


def test_a_pipeline_gathers_along_the_split_dimension():
    """Features first, examples along dim 1: each microbatch's columns come back in order."""
    tasks = four_tasks()[:2]
    model = mm.place(TwoLinear(nnx.Rngs(0)), [("^a/", tasks[0]), ("^b/", tasks[1])])
    ref = TwoLinear(nnx.Rngs(0))
    x_t = jax.random.normal(jax.random.key(0), (4, 16))  # (features, examples)

    def loss(m, x_t):
        out = m(x_t.T).T  # (3, examples in this microbatch)
        return (out**2).mean(), out

    grad_fn = nnx.value_and_grad(loss, has_aux=True)
    step = mm.jit(mm.microbatch(grad_fn, num=4, dim=1, reduce=(("mean", "concat"), "mean")))
    (value, out), grads = step(model, x_t)
    (ref_value, ref_out), ref_grads = grad_fn(ref, x_t)
    assert step.plan(model, x_t).pipeline.schedule.num_stages == 2
    close(value, ref_value)
    close(out, ref_out, atol=1e-6)
    trees_close(grads, ref_grads)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_outputs_that_do_not_depend_on_the_microbatch_are_reduced_too(reduce):
    """An aux the microbatched function returns as it is, not computed from the microbatch (a
    Python number, a constant array, an argument that is not split, a Variable's value), is
    summed over the microbatches as the plain loop sums it. Each once failed to plan:
    an `MPMDError` about `mm_microbatch_accumulate` read before it is made, a `KeyError`, or
    `TypeError: unhashable type: 'TypedNdArray'`."""
    tasks = four_tasks()[:2]
    model = mm.place(TwoLinear(nnx.Rngs(0)), [("^a/", tasks[0]), ("^b/", tasks[1])])
    ref = TwoLinear(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (16, 4))
    lr = jnp.float32(0.1)

    def loss(m, x, lr):
        value = (m(x) ** 2).mean()
        aux = {"int": 3, "float": 0.5, "const": jnp.float32(2.0), "arg": lr, "param": m.b.bias[...]}
        return value, aux

    grad_fn = mm.microbatch(nnx.value_and_grad(loss, has_aux=True), num=4, argnums=1, reduce=reduce)
    (value, aux), grads = mm.jit(grad_fn)(model, x, lr)
    (ref_value, ref_aux), ref_grads = grad_fn(ref, x, lr)
    close(value, ref_value)
    trees_close(aux, ref_aux)
    trees_close(grads, ref_grads)


@pytest.mark.parametrize("jitted", [False, True], ids=["loop", "mm.jit"])
def test_an_output_that_is_not_a_number_or_an_array_is_named(jitted):
    # it failed inside mm.jit as a TypeError of JAX's, naming no output
    model = TwoLinear(nnx.Rngs(0))
    if jitted:
        tasks = four_tasks()[:2]
        model = mm.place(model, [("^a/", tasks[0]), ("^b/", tasks[1])])

    def loss(m, x):
        return (m(x) ** 2).mean(), {"tag": "run 1"}

    step = mm.microbatch(loss, num=2)
    with pytest.raises(TypeError, match=r"output \[1\]\['tag'\] is a str, not a number"):
        (mm.jit(step) if jitted else step)(model, jnp.ones((4, 4)))
