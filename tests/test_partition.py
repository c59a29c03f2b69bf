"""mm.schedules.partition: the split of a model's layers planned from measured pieces."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import mmnnx as mm
from mmnnx.models import GPT, GPTConfig, split_rules
from mmnnx.partition import plan as plan_module
from mmnnx.partition import search as search_module
from mmnnx.partition.measure import Timing
from mmnnx.partition.search import Option, Profile, evaluate, search, splits


def two_tasks():
    return [mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(2)]


def loss(model, batch):
    return model.loss(batch)


def test_a_large_vocabulary_head_gets_fewer_layers_and_the_rules_train_as_one_device():
    config = GPTConfig(vocab_size=8192, dim=32, depth=4, num_heads=2, max_seq_len=16)
    with nnx.use_eager_sharding(False):
        model = GPT(config, rngs=nnx.Rngs(0))
    before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]
    batch = jax.random.randint(jax.random.key(0), (8, 17), 0, config.vocab_size)
    result = mm.schedules.partition(
        model, loss, batch, two_tasks(), optimizer=optax.adam(1e-3), schedules="1f1b",
        microbatches=2, repeats=2, report=False,
    )  # fmt: skip
    after = [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]
    assert all((a == b).all() for a, b in zip(before, after, strict=True))  # left as it was
    assert result.sizes[1] < result.sizes[0]  # the head (8192-way) weighs like several blocks
    assert (result.schedule, result.num_microbatches, result.virtual_stages) == ("1f1b", 2, 1)
    last = result.stages[-1]
    assert last.groups == ("head + loss",) and last.forward > result.stages[0].forward / 4
    assert result.equal is not None and result.equal.sizes == (2, 2)
    assert result.equal.predicted_seconds > result.predicted_seconds
    text = str(result)
    assert "head + loss" in text and "chosen" in text and "equal split" in text
    sizes = "/".join(map(str, result.sizes))
    assert repr(result).startswith(f"PartitionResult(GPT.blocks as {sizes}, 1f1b, M=2, V=1, ")
    (first, t0), (second, t1) = result.rules
    assert (t0.name, t1.name) == ("t0", "t1")
    assert first.startswith("^embed/|^blocks/") and "^head/" in second and "^norm/" in second

    # the planned rules run the step as one device does
    with nnx.use_eager_sharding(False):
        reference = GPT(config, rngs=nnx.Rngs(0))
    placed = mm.place(model, result.rules)
    grad_fn = mm.microbatch(
        nnx.value_and_grad(loss),
        num=result.num_microbatches,
        reduce="mean",
        schedule=result.best.table,
    )
    got, grads = mm.jit(grad_fn)(placed, batch)
    want, want_grads = nnx.value_and_grad(loss)(reference, batch)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for (p, g), (_, w) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6,
                                   err_msg=str(p))  # fmt: skip

    # a budget nothing fits names the smallest that would
    smallest = min(c.peak_bytes for c in result.candidates if c.peak_bytes is not None)
    with pytest.raises(mm.schedules.NoCandidateError, match=f"would fit is {smallest:,} B"):
        plan_module._choose(result.candidates, smallest - 1)
    best, marked = plan_module._choose(result.candidates, smallest)
    assert best.peak_bytes == smallest
    assert all(c.rejected.startswith("over the budget") for c in marked if c.peak_bytes > smallest)


def timing(work: float, *, out: int = 4096, state: int = 1000) -> Timing:
    """A piece whose forward takes ``work`` seconds and its backward twice that."""
    return Timing(
        forward=work, backward=2 * work, input_grad=work, weight_grad=work, held_bytes=out,
        output_bytes=out, state_bytes=state, optimizer_bytes=2 * state,
    )  # fmt: skip


def unequal_profile(widths, tasks):
    pieces = [timing(0.1), *(timing(w) for w in widths), timing(0.5)]
    link = mm.schedules.Link(latency=1e-3, bandwidth=1e9)
    return Profile(
        tasks=tuple(tasks),
        rows=8,
        timings={(t.name, rows): pieces for t in tasks for rows in (1, 2, 4, 8)},
        links={(a.name, b.name): link for a in tasks for b in tasks if a is not b},
    )


def test_unequal_layers_get_the_split_the_exhaustive_search_finds(monkeypatch):
    """Layers of unequal cost (wide, then narrow): the search's split is the fastest of all
    splits on the simulator, by trying them all and, past EXHAUSTIVE, by the minimax split
    improved one boundary at a time."""
    tasks = [mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(3)]
    profile = unequal_profile([4.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0], tasks)
    options = [Option(schedule=name, virtual_stages=1, order="loop") for name in ("1f1b", "gpipe")]
    every = [evaluate(s, o, m, profile) for o in options for m in (4, 8) for s in splits(9, 3)]
    fastest = min(c.predicted_seconds for c in every)
    found = search(options, (4, 8), profile)
    assert found[0].predicted_seconds == fastest
    assert found[0].sizes not in ((3, 3, 3),)  # the equal split puts both wide layers on t0
    monkeypatch.setattr(search_module, "EXHAUSTIVE", 0)
    climbed = search(options, (4, 8), profile)
    assert climbed[0].predicted_seconds <= 1.05 * fastest
    assert len(climbed) < len(every)  # not every split was simulated


def test_a_head_that_outweighs_a_stage_gets_the_last_stage_alone(monkeypatch):
    """A head and loss costing as much as all four layers: the last stage holds them and no
    layer (by the exhaustive search and by the climb), reported as "head + loss" alone; where
    the model has no head to hold, every stage keeps a layer."""
    tasks = two_tasks()
    heavy = dataclasses.replace(unequal_profile([1.0] * 4, tasks), ends=(True, True))
    last = heavy.timings[("t0", 8)]
    heavy.timings.update({k: [*last[:-1], timing(4.0)] for k in heavy.timings})
    options = [Option(schedule="1f1b", virtual_stages=1, order="loop")]
    best = search(options, (4,), heavy)[0]
    assert best.sizes == (4, 0)
    assert best.stages[-1].layers == "head + loss" and best.stages[0].layers == "0-3 + embedding"
    assert "head + loss" in str(best.stages[-1].layers)
    monkeypatch.setattr(search_module, "EXHAUSTIVE", 0)
    assert search(options, (4,), heavy)[0].sizes == (4, 0)
    closed = dataclasses.replace(heavy, ends=(False, False))
    assert min(c.sizes[-1] for c in search(options, (4,), closed)) == 1
    assert list(splits(2, 3, ends=(True, True))) == [(0, 1, 1), (0, 2, 0), (1, 1, 0)]


@pytest.mark.parametrize("sizes", [(4, 0), (0, 4)])
def test_a_stage_holding_only_the_head_or_only_the_embedding_trains_as_one_device(sizes):
    config = GPTConfig(vocab_size=256, dim=32, depth=4, num_heads=2, max_seq_len=16)

    def gpt():
        with nnx.use_eager_sharding(False):
            return GPT(config, rngs=nnx.Rngs(0))

    rules = split_rules(gpt(), two_tasks(), list(sizes))
    alone = "^norm/|^head/" if sizes[1] == 0 else "^embed/"
    assert alone in [regex for regex, _ in rules]
    batch = jax.random.randint(jax.random.key(1), (8, 17), 0, config.vocab_size)
    grad_fn = mm.microbatch(nnx.value_and_grad(loss), num=4, reduce="mean", schedule="1f1b")
    got, grads = mm.jit(grad_fn)(mm.place(gpt(), rules), batch)
    want, want_grads = nnx.jit(nnx.value_and_grad(loss))(gpt(), batch)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for (p, g), (_, w) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6,
                                   err_msg=str(p))  # fmt: skip
    with pytest.raises(ValueError, match="the first or the last none"):
        split_rules(gpt(), [*two_tasks(), mm.Task("t2", mesh=mm.TaskMesh(devices=[2]))], [4, 0, 0])


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(tasks=[]), "partition: no tasks given"),
        (dict(schedules="1f1c"), "unknown schedule '1f1c'"),
        (dict(schedules="interleaved-1f1b"), "no schedule of \\['interleaved-1f1b'\\] runs"),
        (dict(microbatches=3), "3 microbatches do not divide the batch of 8"),
        (dict(microbatches=()), "microbatches= is empty"),
        (dict(virtual_stages=0), "virtual_stages must be ints >= 1, got 0"),
        (dict(virtual_stages=3), "4 block\\(s\\) cannot fill 6 stages \\(3 per task\\)"),
        (dict(memory_budget=-1), "memory_budget must be positive"),
        (dict(memory_budget="lots"), "expected a number of bytes"),
        (dict(batch=(jnp.zeros((8, 9)), jnp.zeros((4, 9)))), "one leading \\(batch\\) axis"),
        (dict(config=dict(tie_embeddings=True)), "config.tie_embeddings"),
        (dict(config=dict(scan_layers=True)), "one stacked module"),
        (dict(blocks="layers"), "GPT has no attribute 'layers' \\(blocks=\\)"),
        (dict(loss_fn=lambda m, b: m.head(m.embed(b)).mean()), "calls the layers of GPT.blocks"),
        (dict(spec=P("tp", None)), "'tp' is neither a device axis of task 't0'"),
    ],
)
def test_bad_input_is_refused_before_anything_is_measured(monkeypatch, change, message):
    def measure(*args, **kwargs):
        raise AssertionError("measured")

    monkeypatch.setattr(plan_module, "measure", measure)
    monkeypatch.setattr(plan_module, "launch_seconds", measure)  # a launch's cost: measured too
    config = GPTConfig(vocab_size=64, dim=16, depth=4, num_heads=2, max_seq_len=8)
    config = dataclasses.replace(config, **change.pop("config", {}))
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    if "spec" in change:  # the embedding annotated with an axis the tasks do not have
        model.embed.embedding.set_metadata(out_sharding=change.pop("spec"))
    arguments = dict(loss_fn=loss, batch=jnp.zeros((8, 9), jnp.int32), tasks=two_tasks())
    arguments.update(change)
    with pytest.raises(ValueError, match=message):
        mm.schedules.partition(model, report=False, **arguments)


class Wide(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(16, width, rngs=rngs)
        self.down = nnx.Linear(width, 16, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


def test_a_sequential_model_of_unequal_layers_puts_its_widest_layers_apart():
    """An nnx.Sequential of residual MLPs, two wide ones last, called with __call__ by a loss
    of the user's: the planner finds the layers (the Sequential's), times the two kinds once
    each, and does not put both wide ones on one stage."""
    with nnx.use_eager_sharding(False):
        model = nnx.Sequential(*(Wide(w, rngs=nnx.Rngs(i)) for i, w in
                                 enumerate((16, 16, 16, 16, 2048, 2048))))  # fmt: skip
    result = mm.schedules.partition(
        model, lambda m, x: jnp.mean(m(x) ** 2), jnp.ones((64, 16)), two_tasks(),
        schedules="1f1b", microbatches=2, repeats=5, report=False,
    )  # fmt: skip
    assert result.sizes[1] == 1 and result.layers == "Sequential.layers"
    assert result.rules[1][0] == "^layers/5/"


def test_outside_models_are_planned_and_their_rules_place_every_parameter():
    """Models the project did not write: bonsai's gpt-oss (tests/outside; every layer holds its
    config, an unhashable dataclass, in its static state: alike layers are found by equality)
    and the ViT of Flax's tutorial (its blocks an ``nnx.Sequential``, which passes ``rngs``
    only to layers whose signature names it: its Dropout draws from the ``rngs`` the loss
    passes). tests/test_gpt_oss_pipeline.py and tests/test_flax_examples.py train both placed
    over tasks as one device does."""
    from tests.outside import bonsai_gpt_oss as gpt_oss
    from tests.test_flax_examples import ViT, vit_batch, vit_losses_and_logits

    config = gpt_oss.tiny_config(layers=4, experts=4)
    tokens = jax.random.randint(jax.random.key(1), (4, 7), 0, config.vocab_size)

    def gpt_oss_loss(model, tokens):
        logits = gpt_oss.logits(model, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    options = dict(schedules="1f1b", microbatches=2, repeats=1, report=False)
    model = gpt_oss.tiny_gpt_oss(config)
    result = mm.schedules.partition(model, gpt_oss_loss, tokens, two_tasks(), **options)
    assert result.layers == "GptOssForCausalLM.model.layers" and sum(result.sizes) == 4
    assert_placed_on_both(mm.place(model, result.rules))

    def vit_loss(model, batch):
        return vit_losses_and_logits(model, *batch, rngs=nnx.Rngs(3))[0]

    vit = ViT(nnx.Rngs(1))
    result = mm.schedules.partition(vit, vit_loss, vit_batch(), two_tasks(), **options)
    assert result.layers == "ViT.encoder.layers" and sum(result.sizes) == 4
    assert_placed_on_both(mm.place(vit, result.rules))


def assert_placed_on_both(model) -> None:
    """Every parameter of ``model`` is on one device, of the two tasks', both used."""
    devices = [v.devices() for v in jax.tree.leaves(nnx.state(model, nnx.Param))]
    assert set().union(*devices) == set(jax.devices()[:2]) and all(len(d) == 1 for d in devices)
