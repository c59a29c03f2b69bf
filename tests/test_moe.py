"""The mixture of experts: MoE against a float64 NumPy layer written from Qwen3-MoE's formulas
(routing, experts, Hugging Face's load-balancing loss), capacity drops, expert parallelism by
all_to_all (one layer, and a GPT pipelined over 2 tasks of `expert x data` meshes under 1F1B,
ZB-H1 and DualPipeV) against one device, the router metrics out of nnx.capture, the FLOPs
stage_rules counts, and the errors."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.extend import core as jax_core

import mmnnx as mm
from mmnnx.models import GPT, GPTConfig, stage_rules
from mmnnx.models.stages import _matmul_params
from mmnnx.modules import MoE, MoEConfig
from mmnnx.modules.moe import METRICS
from mmnnx.train.loop import TrainConfig, loss_and_grads
from mmnnx.train.router_metrics import router_metrics
from tests.oracle import params_close

DIM, HIDDEN, EXPERTS, K = 16, 24, 8, 2
RULES = mm.logical_rules(batch="data", expert="expert")


def f64(x):
    return np.asarray(x, np.float64)


def ref_route(logits, k, norm):
    """Qwen3MoeSparseMoeBlock: softmax in float32 over all experts, top-k, renormalised."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, idx, -1)
    return (w / w.sum(-1, keepdims=True) if norm else w), idx, p


def ref_moe(x, moe, norm=True, capacity=None):
    """The layer token by token, expert by expert; with ``capacity``, an expert's assignments
    after its first ``capacity`` in token order (token 0's choices, then token 1's) add
    nothing. Returns the output, the chosen experts, and the dropped (token, slot) pairs."""
    wr, g, u, d = (f64(v[...]) for v in (moe.router.kernel, *_experts(moe)))
    w, idx, _ = ref_route(x @ wr, moe.top_k, norm)
    y, taken, dropped = np.zeros_like(x), np.zeros(wr.shape[1], int), set()
    for n in range(x.shape[0]):
        for j in range(moe.top_k):
            e = idx[n, j]
            taken[e] += 1
            if capacity is not None and taken[e] > capacity:
                dropped.add((n, j))
                continue
            a = x[n] @ g[e]
            y[n] += w[n, j] * ((a / (1 + np.exp(-a)) * (x[n] @ u[e])) @ d[e])
    return y, idx, dropped


def hf_load_balancing_loss(gate_logits, num_experts, top_k):
    """transformers' load_balancing_loss_func (no attention mask), in float64: every layer's
    router logits concatenated, then E * sum(mean(one_hot(top-k)) * mean(softmax))."""
    concatenated = np.concatenate(gate_logits, axis=0)
    _, selected, weights = ref_route(concatenated, top_k, False)
    expert_mask = np.eye(num_experts)[selected]  # (tokens, k, E)
    tokens_per_expert = expert_mask.mean(0)
    router_prob_per_expert = weights.mean(0)
    return (tokens_per_expert * router_prob_per_expert[None]).sum() * num_experts


def _experts(moe):
    return moe.experts.gate, moe.experts.up, moe.experts.down


def make_moe(seed=0, **kw):
    with nnx.use_eager_sharding(False):
        return MoE(DIM, MoEConfig(HIDDEN, EXPERTS, K, **kw), rngs=nnx.Rngs(seed))


def tokens(shape=(3, 5), seed=1):
    return jax.random.normal(jax.random.key(seed), (*shape, DIM))


# jitted: eager, each operation of the layer's forward compiled on its own took seconds
forward = nnx.jit(lambda m, x: m.forward(x))


@pytest.mark.parametrize("norm", [True, False], ids=["renormalised", "raw"])
def test_moe_equals_qwen3_moe_formulas_in_float64(norm):
    moe = make_moe(norm_topk_prob=norm)
    x = tokens()
    y, stats = forward(moe, x)
    flat = f64(x).reshape(-1, DIM)
    want, idx, _ = ref_moe(flat, moe, norm)
    np.testing.assert_allclose(f64(y).reshape(-1, DIM), want, rtol=1e-5, atol=1e-5)
    logits = flat @ f64(moe.router.kernel[...])
    np.testing.assert_allclose(
        float(stats.aux_loss), hf_load_balancing_loss([logits], EXPERTS, K), rtol=1e-5
    )
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(float(stats.z_loss), np.mean(lse**2), rtol=1e-5)
    counts = np.bincount(idx.ravel(), minlength=EXPERTS)
    assert stats.tokens_per_expert.tolist() == counts.tolist() and int(stats.dropped.sum()) == 0


def test_capacity_drops_late_assignments_and_reports_them():
    moe = make_moe(capacity_factor=0.5)
    x = tokens((4, 6))
    y, stats = forward(moe, x)
    flat = f64(x).reshape(-1, DIM)
    limit = math.ceil(0.5 * 24 * K / EXPERTS)
    want, idx, dropped = ref_moe(flat, moe, capacity=limit)
    assert dropped  # the test needs some
    np.testing.assert_allclose(f64(y).reshape(-1, DIM), want, rtol=1e-5, atol=1e-5)
    per_expert = np.bincount([idx[n, j] for n, j in dropped], minlength=EXPERTS)
    assert stats.dropped.tolist() == per_expert.tolist()
    assert (
        stats.tokens_per_expert.tolist()
        == np.minimum(np.bincount(idx.ravel(), minlength=EXPERTS), limit).tolist()
    )


def ep_task(second_axis="data", **rules):
    mesh = mm.TaskMesh(devices=range(4), axis_sizes=(2, 2), axis_names=("expert", second_axis))
    return mm.Task("ep", mesh=mesh, logical_axes=rules or RULES)


@pytest.mark.parametrize(
    "capacity_factor, task",
    [
        (None, ep_task()),
        (0.5, ep_task()),
        (None, ep_task("model", expert="expert", mlp="model")),  # hidden split: a psum
    ],
    ids=["dropless", "capacity", "hidden-split"],
)
def test_expert_parallel_layer_equals_one_device_and_exchanges_by_all_to_all(capacity_factor, task):
    moe = make_moe(capacity_factor=capacity_factor)
    placed = mm.place(make_moe(capacity_factor=capacity_factor), [(".*", task)])
    x = tokens((3, 5))  # 15 tokens: padded to a multiple of the token shards

    def loss(m, x):
        y, stats = m.forward(x)
        return (y**2).sum() + stats.aux_loss, (y, stats.dropped)

    grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
    (_, (y, dropped)), grads = grad(moe, x)
    (_, (ep_y, ep_dropped)), ep_grads = grad(placed, x)
    np.testing.assert_allclose(ep_y, y, rtol=1e-5, atol=1e-6)
    assert ep_dropped.tolist() == dropped.tolist()
    for a, b in zip(jax.tree.leaves(ep_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())

    def hlo(m):
        return jax.jit(lambda m, x: m(x)).lower(m, x).compile().as_text()

    assert "all-to-all" in hlo(placed) and "all-to-all" not in hlo(moe)
    split = 4 if "model" in task.axis_names else 2  # experts, and hidden over "model"
    for weight in _experts(placed):
        shards = weight[...].addressable_shards
        assert {s.data.shape[0] for s in shards} == {EXPERTS // 2}
        assert {s.data.nbytes for s in shards} == {weight[...].nbytes // split}


def dp_task(*names, **rules):
    mesh = mm.TaskMesh(devices=range(4), axis_sizes=(4 // len(names),) * len(names),
                       axis_names=names)  # fmt: skip
    return mm.Task("dp", mesh=mesh, logical_axes=rules)


@pytest.mark.parametrize(
    "task",
    [dp_task("data", batch="data"), dp_task("data", "model", batch="data", mlp="model")],
    ids=["data", "data-and-hidden-split"],
)
def test_replicated_experts_run_each_device_s_own_tokens_without_gathering_them(task):
    moe, placed = make_moe(), mm.place(make_moe(), [(".*", task)])
    x = tokens((4, 5))  # split over "data", as a step's batch
    x = jax.device_put(x, jax.sharding.NamedSharding(task.jax_mesh, jax.P("data")))

    def loss(m, x):
        y, stats = m.forward(x)
        return (y**2).sum() + stats.aux_loss, y

    grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
    (_, y), grads = grad(moe, x)
    (_, dp_y), dp_grads = grad(placed, x)
    np.testing.assert_allclose(dp_y, y, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(dp_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
    hlo = jax.jit(lambda m, x: m(x)).lower(placed, x).compile().as_text()
    # the assignments (tokens x k) sorted per device: no gather of every token's row ids
    assert not re.search(r"s32\[\d+\]\S* all-gather", hlo) and "all-to-all" not in hlo
    assert {s.data.shape[0] for s in placed.experts.gate[...].addressable_shards} == {EXPERTS}


# --------------------------------------------------------------------- a MoE GPT, pipelined

CONFIG = GPTConfig(
    vocab_size=64,
    dim=32,
    depth=4,
    num_heads=4,
    max_seq_len=16,
    experts=8,
    experts_per_token=2,
    expert_hidden=32,
    moe_every=2,  # layers 1 and 3: one on each task, on the way down and back up a V too
    router_aux_loss_coef=0.01,
    router_z_loss_coef=0.001,
)
BATCH = jax.random.randint(jax.random.key(0), (8, 9), 0, 64)
MICROBATCHES, LR = 4, 3e-3


def gpt(**changes):
    with nnx.use_eager_sharding(False):
        return GPT(dataclasses.replace(CONFIG, **changes), rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def stage_tasks():
    mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "expert", "data"))
    return [mm.Task(f"s{i}", mesh=mesh.slice(stage=i), logical_axes=RULES) for i in range(2)]


def loss_and_metrics(model, batch):
    """The loss, and what the MoE layers sow (nnx.capture), as a training step takes them."""
    return nnx.capture(lambda m, b: m.loss(b), nnx.Intermediate)(model, batch)


def train_step(schedule, virtual_stages):
    def step(model, opt, batch):
        grad_fn = mm.microbatch(
            nnx.value_and_grad(loss_and_metrics, has_aux=True),
            num=MICROBATCHES,
            reduce=(("mean", "stack"), "mean"),
            schedule=schedule,
            virtual_stages=virtual_stages,
        )
        (loss, metrics), grads = grad_fn(model, batch)
        opt.update(model, grads)
        return loss, grads, metrics

    return step


@pytest.fixture(scope="module")
def one_device():
    """Two AdamW steps on one device, microbatch by microbatch (one compiled microbatch):
    the losses, the first step's gradients and metrics, and the model after both steps."""
    model = gpt()
    opt = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)
    grad_fn = nnx.jit(nnx.value_and_grad(loss_and_metrics, has_aux=True))
    update = nnx.jit(lambda model, opt, grads: opt.update(model, grads))

    @jax.jit  # eager, each leaf's sum and stack compiled on its own
    def joined(results):
        grads = jax.tree.map(lambda *g: sum(g) / MICROBATCHES, *[g for _, g in results])
        return grads, jax.tree.map(lambda *m: jnp.stack(m), *[m for (_, m), _ in results])

    losses, first = [], None
    for _ in range(2):
        results = [grad_fn(model, b) for b in jnp.split(BATCH, MICROBATCHES)]
        losses.append(np.mean([loss for (loss, _), _ in results]))
        grads, metrics = joined(results)
        first = first or (grads, metrics)
        update(model, opt, grads)
    return losses, *first, model


def all_to_alls(eqns) -> int:
    """How many all_to_all equations ``eqns`` (a fragment's ops) hold, at any depth."""
    return sum(
        (e.primitive.name == "all_to_all")
        + sum(all_to_alls(j.eqns) for j in jax_core.jaxprs_in_params(e.params))
        for e in eqns
    )


def close_to_scale(a, b):
    """Equal to 1e-5 of ``b``'s largest element (an embedding gradient sums many rounded
    terms: its small elements carry the large ones' rounding)."""
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def trees_close_to_scale(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        close_to_scale(x, y)


@pytest.mark.parametrize("schedule", ["1f1b", "zero-bubble-h1", "dualpipev"])
def test_moe_gpt_pipelined_with_expert_parallelism_equals_one_device(
    stage_tasks, one_device, schedule
):
    v = 2 if schedule == "dualpipev" else 1
    model = gpt()
    order = "v" if v > 1 else "loop"
    model = mm.place(
        model, stage_rules(model, stage_tasks, report=False, virtual_stages=v, order=order)
    )
    opt = nnx.Optimizer(model, optax.adamw(LR), wrt=nnx.Param)
    step = mm.jit(train_step(schedule, v))
    ref_losses, ref_grads, ref_metrics, ref = one_device
    loss, grads, metrics = step(model, opt, BATCH)
    close_to_scale(loss, ref_losses[0])
    trees_close_to_scale(grads, ref_grads)
    got, want = nnx.to_flat_state(metrics), nnx.to_flat_state(ref_metrics)
    assert [p for p, _ in got] == [p for p, _ in want]
    assert {(*p[:3], p[-1]) for p, _ in got} == {
        ("blocks", i, "mlp", name) for i in (1, 3) for name in METRICS
    }
    for (_, a), (_, b) in zip(got, want, strict=True):  # (one per microbatch, stacked,)
        np.testing.assert_allclose(a.get_value(), b.get_value(), rtol=1e-5, atol=1e-6)
    assert not nnx.state(model, nnx.Intermediate)  # captured: nothing sown onto the model
    loss, _, _ = step(model, opt, BATCH)
    close_to_scale(loss, ref_losses[1])
    params_close(model, ref, ref_grads, steps=2, lr=LR)

    plan = step.plan(model, opt, BATCH)
    assert plan.pipeline is not None and not plan.unrolled
    for task in stage_tasks:  # each task's stages (virtual ones too) exchange tokens inside it
        assert all_to_alls([op for f in plan.fragments if f.task.home == task for op in f.ops])
    gate = model.blocks[1].mlp.experts.gate[...]
    assert {s.data.shape[0] for s in gate.addressable_shards} == {EXPERTS // 2}


def test_scanned_moe_layers_stacked_over_two_tasks_equal_one_device(stage_tasks):
    model = gpt(scan_layers=True, depth=2, moe_every=1)
    model = mm.place(model, stage_rules(model, stage_tasks, report=False))
    ref = gpt(scan_layers=True, depth=2, moe_every=1)
    assert mm.stack_of(model.blocks.mlp.experts.gate).name == "s0+s1"
    grad_fn = nnx.value_and_grad(lambda m, b: m.loss(b))
    step = mm.jit(grad_fn)
    loss, grads = step(model, BATCH)
    ref_loss, ref_grads = nnx.jit(grad_fn)(ref, BATCH)
    close_to_scale(loss, ref_loss)
    trees_close_to_scale(grads, ref_grads)
    plan = step.plan(model, BATCH)  # the plan the call ran (traced once)
    for task in stage_tasks:
        assert all_to_alls([op for f in plan.fragments_of(task) for op in f.ops]) > 0
    shards = model.blocks.mlp.experts.gate[...].addressable_shards
    assert {s.data.shape[:2] for s in shards} == {(1, EXPERTS // 2)}  # (layer, expert) chunks


def test_scanned_moe_metrics_of_every_microbatch_join_across_the_split_stack(stage_tasks):
    """The train loop's step with router metrics (``loss_and_grads(metrics=True)``: each
    microbatch's captured per-layer values stacked) on layers split over two tasks under 1F1B:
    the per-layer values a scan computed on each task are joined, as one device computes them
    (``mmnnx train --experts N --scan-layers`` stopped here, needing their whole)."""
    model = gpt(scan_layers=True, depth=2, moe_every=1)
    model = mm.place(model, stage_rules(model, stage_tasks, report=False))
    ref = gpt(scan_layers=True, depth=2, moe_every=1)
    grad_fn = loss_and_grads(TrainConfig(microbatches=2, schedule="1f1b"), metrics=True)
    (loss, sown), grads = mm.jit(grad_fn)(model, BATCH)
    (ref_loss, ref_sown), ref_grads = nnx.jit(grad_fn)(ref, BATCH)
    close_to_scale(loss, ref_loss)
    trees_close_to_scale(grads, ref_grads)
    trees_close_to_scale(sown, ref_sown)
    tokens = router_metrics(sown, microbatched=True).tokens_per_expert
    assert tokens == router_metrics(ref_sown, microbatched=True).tokens_per_expert
    assert sum(tokens) == BATCH.shape[0] * (BATCH.shape[1] - 1) * K  # per layer, averaged
    with pytest.raises(mm.MPMDError, match="gate.*not the Variable.s own layers"):
        mm.jit(lambda m: m.blocks.mlp.experts.gate[...].T).plan(model)  # a Variable's layers


def test_gpt_loss_adds_the_routers_losses_pooled_over_layers_as_transformers_does():
    config = dataclasses.replace(CONFIG, router_z_loss_coef=0.01)
    model = gpt(router_z_loss_coef=0.01)
    assert [type(b.mlp).__name__ for b in model.blocks] == ["MLP", "MoE", "MLP", "MoE"]

    @nnx.jit  # eager, each operation compiled on its own took seconds
    def routed_and_logits(model, batch):
        """Each MoE layer's router input, the logits, and ``GPT.loss``."""
        x, routed = model.embed(batch[:, :-1]), []
        for block in model.blocks:
            if isinstance(block.mlp, MoE):
                routed.append(block.norm2(x + block.attn(block.norm1(x))).reshape(-1, config.dim))
            x = block(x)
        return routed, model.head(model.norm(x)), model.loss(batch)

    routed, logits, loss = routed_and_logits(model, BATCH)
    moes = [block.mlp for block in model.blocks if isinstance(block.mlp, MoE)]
    gate_logits = [f64(h) @ f64(m.router.kernel[...]) for h, m in zip(routed, moes, strict=True)]
    logits = f64(logits)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, np.asarray(BATCH[:, 1:])[..., None], -1).mean()
    aux = hf_load_balancing_loss(gate_logits, config.experts, config.experts_per_token)
    z = np.mean([np.log(np.exp(g).sum(-1)) ** 2 for g in gate_logits])
    want = nll + config.router_aux_loss_coef * aux + config.router_z_loss_coef * z
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)


def test_stage_rules_count_the_flops_of_k_of_e_experts():
    block = gpt().blocks[1]
    params = sum(x.size for x in jax.tree.leaves(nnx.state(block, nnx.Param)))
    experts = sum(x.size for x in jax.tree.leaves(nnx.state(block.mlp.experts, nnx.Param)))
    assert _matmul_params(block) == params - experts + experts * K // EXPERTS
    model, tasks = gpt(), [mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(2)]
    dense = gpt(experts=0, gated_mlp=True, mlp_hidden=K * CONFIG.expert_hidden, mlp_bias=False)
    router = CONFIG.dim * CONFIG.experts  # a MoE block: a dense block of k experts + its router
    assert _matmul_params(model.blocks[1]) == _matmul_params(dense.blocks[1]) + router
    assert stage_rules(model, tasks, by="flops", report=False) == stage_rules(
        model, tasks, report=False
    )


def test_bad_moe_arguments_are_refused_before_anything_is_built():
    for kw, match in [
        (dict(top_k=9), r"MoEConfig.top_k must be an int in 1..num_experts \(8\), got 9"),
        (dict(top_k=0), r"top_k must be an int in 1..num_experts \(8\), got 0"),
        (dict(capacity_factor=0.0), r"capacity_factor must be None \(dropless\) or a finite"),
        (dict(capacity_factor=-1), r"capacity_factor must be None"),
    ]:
        with pytest.raises(ValueError, match=match):
            MoEConfig(HIDDEN, EXPERTS, kw.pop("top_k", K), **kw)
    for changes, match in [
        (dict(experts_per_token=9), r"GPTConfig: MoEConfig.top_k must be an int in 1..num_"),
        (dict(capacity_factor=0), r"GPTConfig: MoEConfig.capacity_factor"),
        (dict(dense_layers=(4,)), r"dense_layers must be a tuple of layer indices in 0..3"),
        (dict(scan_layers=True, depth=2), r"some layers are MoE and some dense and no run"),
        (dict(router_aux_loss_coef=-0.1), r"router_aux_loss_coef must be a finite number >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(CONFIG, **changes)


def test_experts_not_divisible_by_the_expert_axis_are_refused_at_placement():
    with nnx.use_eager_sharding(False):
        moe = MoE(DIM, MoEConfig(HIDDEN, 3, 2), rngs=nnx.Rngs(0))
    before = moe.experts.gate[...]
    with pytest.raises(ValueError, match=r"'experts/down' on task 'ep'.*dimension 0 of size 3 is "
                       r"not divisible by mesh axes \('expert',\)"):  # fmt: skip
        mm.place(moe, [(".*", ep_task())])
    assert moe.experts.gate[...] is before  # untouched
