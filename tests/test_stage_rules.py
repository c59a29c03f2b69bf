"""stage_rules: minimax-balanced contiguous stages, anchored rules, the report, the errors."""

import dataclasses
import itertools
import re
import warnings

import jax
import numpy as np
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx._nnx import variables_of
from mmnnx.models import GPT, GPTConfig, stage_rules
from mmnnx.modules import Linear

BASE = GPTConfig(vocab_size=16, dim=32, depth=8, num_heads=2, max_seq_len=8)


def make(**changes):
    with nnx.use_eager_sharding(False):
        return GPT(dataclasses.replace(BASE, **changes), rngs=nnx.Rngs(0))


def tasks(k):
    return [mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(k)]


def size(node):
    return sum(x.size for x in jax.tree.leaves(nnx.state(node, nnx.Param)))


def rule_of(rules, path):
    """Index of the single rule matching ``path`` (asserts exactly one matches)."""
    hits = [i for i, (regex, _) in enumerate(rules) if re.search(regex, path)]
    assert len(hits) == 1, (path, hits, rules)
    return hits[0]


def split_of(rules, model):
    """Blocks per stage, read back from the rules; every Variable matched by exactly one rule."""
    owner = {}
    for path, _ in variables_of(model):
        p = "/".join(map(str, path))
        owner[p] = rule_of(rules, p)
    per_block = []
    for i in range(len(model.blocks)):
        (stage,) = {o for p, o in owner.items() if p.startswith(f"blocks/{i}/")}
        per_block.append(stage)
    assert per_block == sorted(per_block)  # contiguous, in task order
    return [per_block.count(s) for s in range(len(rules))]


def brute_force_minimax(costs, k, first, last):
    n, best = len(costs), None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        stages = [sum(costs[a:b]) for a, b in itertools.pairwise(bounds)]
        stages[0] += first
        stages[-1] += last
        best = max(stages) if best is None else min(best, max(stages))
    return best


def stage_costs(sizes, costs, first, last):
    out, start = [], 0
    for s in sizes:
        out.append(sum(costs[start : start + s]))
        start += s
    out[0] += first
    out[-1] += last
    return out


def flops_costs(model, tokens, seq):
    """Independent FLOP model: 2*params*tokens (+ 4*seq*dim*tokens per block), lookups free."""
    dim, vocab = model.config.dim, model.config.vocab_size
    blocks = [2 * size(b) * tokens + 4 * seq * dim * tokens for b in model.blocks]
    head = (
        2 * dim * vocab * tokens if model.config.tie_embeddings else 2 * size(model.head) * tokens
    )
    first = head if model.config.tie_embeddings else 0
    last = 2 * size(model.norm) * tokens + (0 if model.config.tie_embeddings else head)
    return blocks, first, last


@pytest.mark.parametrize("k", [2, 4])
def test_equal_blocks_when_embedding_and_head_are_small(k):
    model = make()
    rules = stage_rules(model, tasks(k), report=False)
    assert len(rules) == k and [t.name for _, t in rules] == [f"t{i}" for i in range(k)]
    assert split_of(rules, model) == [8 // k] * k


@pytest.mark.parametrize("k", [2, 3, 4, 5])
@pytest.mark.parametrize("vocab", [16, 2048])
@pytest.mark.parametrize("by", ["params", "flops"])
def test_split_is_minimax_optimal(k, vocab, by):
    model = make(vocab_size=vocab, gated_mlp=True)
    rules = stage_rules(model, tasks(k), by=by, report=False)
    sizes = split_of(rules, model)
    if by == "params":
        costs = [size(b) for b in model.blocks]
        first, last = size(model.embed), size(model.norm) + size(model.head)
    else:
        costs, first, last = flops_costs(model, tokens=8, seq=8)
    assert max(stage_costs(sizes, costs, first, last)) == brute_force_minimax(costs, k, first, last)


def test_flops_put_fewer_blocks_on_the_stage_with_a_big_head():
    model = make(vocab_size=4096)  # head: 131k params; a block: ~12.6k
    by_params = split_of(stage_rules(model, tasks(2), report=False), model)
    by_flops = split_of(stage_rules(model, tasks(2), by="flops", report=False), model)
    assert by_params == [4, 4]  # the embedding and the head weigh the same in parameters
    assert by_flops[-1] < by_params[-1]  # the lookup is free, the head matmul is not
    assert by_flops[0] > by_flops[-1]
    # more tokens scale every term alike: the same split
    assert (
        split_of(
            stage_rules(model, tasks(2), by="flops", tokens_per_step=4096, report=False), model
        )
        == by_flops
    )


def test_tied_head_counts_on_the_first_task():
    model = make(vocab_size=4096, tie_embeddings=True)
    rules = stage_rules(model, tasks(2), by="flops", report=False)
    assert not re.search("head", rules[-1][0])
    sizes = split_of(rules, model)
    assert sizes[0] < sizes[1]  # embed.attend runs where the table lives
    costs, first, last = flops_costs(model, tokens=8, seq=8)
    assert max(stage_costs(sizes, costs, first, last)) == brute_force_minimax(costs, 2, first, last)


def test_strict_placement_and_anchoring():
    model = make(depth=12)
    ts = [
        mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=[2 * i, 2 * i + 1], axis_names=("model",)))
        for i in range(4)
    ]
    rules = stage_rules(model, ts, report=False)
    assert rules[0][0].startswith("^embed/|^blocks/(0|1|2)/")
    assert rules[-1][0].endswith("|^norm/|^head/")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rule that places nothing would warn
        mm.place(model, rules, strict=True)
    placement = mm.placement(model)
    task = {path: name for path, (name, _) in placement.items()}
    assert task["embed/embedding"] == "t0"
    assert task["norm/scale"] == task["head/kernel"] == "t3"
    assert task["blocks/0/norm1/scale"] == "t0"  # ^norm/ does not catch blocks/0/norm1
    assert task["blocks/1/attn/q/kernel"] == "t0"  # blocks/1/ does not catch blocks/10/
    assert task["blocks/10/attn/q/kernel"] == task["blocks/11/mlp/up/bias"] == "t3"
    assert [task[f"blocks/{i}/norm2/scale"] for i in range(12)] == [f"t{i // 3}" for i in range(12)]


class Stack(nnx.Module):
    """Not a GPT: a stem, blocks, an output layer and stray top-level state."""

    def __init__(self, rngs):
        self.stem = Linear(4, 8, rngs=rngs)
        self.blocks = nnx.List([Linear(8, 8, rngs=rngs) for _ in range(10)])
        self.bias = nnx.Param(jax.numpy.zeros(8))  # a Variable directly on the model
        self.out = Linear(8, 2, rngs=rngs)
        self.extra = nnx.List([Linear(2, 2, rngs=rngs)])

    def __call__(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.extra[0](self.out(x + self.bias[...]))


def test_any_module_with_blocks():
    with nnx.use_eager_sharding(False):
        model = Stack(nnx.Rngs(0))
    rules = stage_rules(model, tasks(3), last=("out",), report=False)
    assert split_of(rules, model) in ([4, 3, 3], [3, 4, 3], [3, 3, 4])
    assert rule_of(rules, "stem/kernel") == rule_of(rules, "bias") == 0
    assert rule_of(rules, "extra/0/kernel") == 0  # other top-level attributes: first task
    assert rule_of(rules, "out/kernel") == 2
    assert "^bias$" in rules[0][0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mm.place(model, rules, strict=True)
    with pytest.raises(ValueError, match="seq_len"):
        stage_rules(model, tasks(2), by="flops", report=False)
    for kwargs in (dict(seq_len=16), dict(tokens_per_step=64)):  # no attention: seq unused
        assert len(stage_rules(model, tasks(2), by="flops", report=False, **kwargs)) == 2


def test_the_layers_are_found_without_the_name_blocks():
    """nnx.Sequential keeps its layers in ``layers``: cut as blocks, nothing before or after."""
    with nnx.use_eager_sharding(False):
        seq = nnx.Sequential(*[Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(6)])
    rules = stage_rules(seq, tasks(3), report=False)
    assert [r for r, _ in rules] == ["^layers/(0|1)/", "^layers/(2|3)/", "^layers/(4|5)/"]
    placed = mm.place(seq, rules, strict=True)
    x = jax.numpy.ones((4, 4))
    loss = lambda m, x: (m(x) ** 2).mean()  # noqa: E731
    step = mm.jit(mm.microbatch(nnx.value_and_grad(loss), num=4, reduce="mean"))
    with nnx.use_eager_sharding(False):
        ref = nnx.Sequential(*[Linear(4, 4, rngs=nnx.Rngs(i)) for i in range(6)])
    (value, grads), (ref_value, ref_grads) = (
        step(placed, x),
        nnx.jit(nnx.value_and_grad(loss))(ref, x),  # eager: op by op
    )
    np.testing.assert_allclose(value, ref_value, rtol=1e-6)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert step.plan(placed, x).pipeline.schedule.num_stages == 3

    class TwoLists(nnx.Module):
        def __init__(self, rngs):
            self.encoder = nnx.List([Linear(4, 4, rngs=rngs)])
            self.decoder = nnx.List([Linear(4, 4, rngs=rngs)])

    with nnx.use_eager_sharding(False):
        two = TwoLists(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"several lists of modules \(encoder, decoder\).*blocks="):
        stage_rules(two, tasks(2), report=False)


def test_report(capsys):
    model = make()
    stage_rules(model, tasks(2))
    out = capsys.readouterr().out
    for column in ("task", "blocks", "params", "share %", "FLOPs", "imbalance"):
        assert column in out
    assert "0-3 + embed" in out and "4-7 + norm, head" in out
    assert "balanced by params" in out
    stage_rules(model, tasks(2), report=False)
    assert capsys.readouterr().out == ""


def test_errors():
    model = make(depth=2)
    with pytest.raises(ValueError, match=r"2 block\(s\) cannot fill 3 tasks"):
        stage_rules(model, tasks(3), report=False)
    with pytest.raises(ValueError, match="unknown by='bytes'"):
        stage_rules(model, tasks(2), by="bytes", report=False)
    with nnx.use_eager_sharding(False):
        linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        stack = Stack(nnx.Rngs(0))
    with pytest.raises(ValueError, match="no attribute 'blocks'.*nnx.List of modules.*blocks="):
        stage_rules(linear, tasks(2), report=False)
    with pytest.raises(ValueError, match="Stack has no attribute 'layers' \\(blocks=\\)"):
        stage_rules(stack, tasks(2), blocks="layers", report=False)
    with pytest.raises(ValueError, match=r"Stack.stem \(one stacked module\) do not share"):
        stage_rules(stack, tasks(2), blocks="stem", report=False)
    with pytest.raises(ValueError, match="no tasks"):
        stage_rules(model, [], report=False)
    with pytest.raises(TypeError, match="not an mm.Task"):
        stage_rules(model, ["t0"], report=False)


def test_virtual_stages_loop_and_v():
    model, ts = make(depth=8), tasks(4)
    loop = stage_rules(model, ts, virtual_stages=2, report=False)
    assert [t.name for _, t in loop] == ["t0", "t1", "t2", "t3"] * 2
    v = stage_rules(model, ts, virtual_stages=2, order="v", report=False)
    assert [t.name for _, t in v] == ["t0", "t1", "t2", "t3", "t3:1", "t2:1", "t1:1", "t0:1"]
    assert [t.home.name for _, t in v] == ["t0", "t1", "t2", "t3", "t3", "t2", "t1", "t0"]
    assert rule_of(v, "blocks/4/attn") == 4 and rule_of(v, "head/kernel") == 7
    placed = mm.place(make(depth=8), v)  # a task and its virtual stage may share devices
    assert mm.placement(placed)["blocks/4/mlp/up/kernel"][0] == "t3:1"
    assert placed.head.kernel.get_value().devices() == {jax.devices()[0]}


def test_one_task_looped_virtual_stages_are_distinct_stages_and_match_one_device():
    # a looped placement over one task (one GPU, say) would put its stages on the same task,
    # merged into one stage: each is a virtual stage of it instead
    loop = stage_rules(make(depth=8), tasks(1), virtual_stages=4, report=False)
    assert [t.name for _, t in loop] == ["t0", "t0:1", "t0:2", "t0:3"]
    tokens = jax.random.randint(jax.random.key(1), (8, BASE.max_seq_len + 1), 0, BASE.vocab_size)
    loss = lambda m, t: m.loss(t)  # noqa: E731
    step = mm.jit(
        mm.microbatch(
            nnx.value_and_grad(loss), num=4, reduce="mean", schedule="interleaved-1f1b",
            virtual_stages=4,
        )
    )  # fmt: skip
    model = mm.place(make(depth=8), loop)
    (value, grads), (ref_value, ref_grads) = (
        step(model, tokens),
        nnx.jit(nnx.value_and_grad(loss))(make(depth=8), tokens),  # eager: op by op
    )
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert step.plan(model, tokens).pipeline.schedule.num_stages == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(virtual_stages=3, order="v"), r"order='v' places two stages per task.*got 3"),
        (dict(virtual_stages=2, order="zigzag"), r"unknown order='zigzag'"),
        (dict(virtual_stages=0), r"virtual_stages must be an int >= 1"),
        (dict(virtual_stages=4), r"8 block\(s\) cannot fill 16 stages \(4 per task\)"),
    ],
)
def test_virtual_stage_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        stage_rules(make(depth=8), tasks(4), report=False, **kwargs)


def test_virtual_stages_need_a_list_of_blocks():
    with pytest.raises(ValueError, match="virtual_stages=2 needs the blocks as a list"):
        stage_rules(make(depth=8, scan_layers=True), tasks(2), virtual_stages=2, report=False)


VOCAB, DIM = 16, 8


class Block(nnx.Module):
    """A residual block holding a list of its own (two summed "experts"), so the layers are not
    the only list of modules in the model: auto-detection must pick the shallower one."""

    def __init__(self, rngs):
        self.norm = nnx.RMSNorm(DIM, rngs=rngs)  # ^model/norm/ must not catch it
        self.experts = nnx.List([nnx.Linear(DIM, DIM, rngs=rngs) for _ in range(2)])

    def __call__(self, x):
        h = self.norm(x)
        return x + sum(jax.numpy.tanh(e(h)) for e in self.experts)


class Decoder(nnx.Module):
    def __init__(self, rngs, depth, stacked):
        self.embed_tokens = nnx.Embed(VOCAB, DIM, rngs=rngs)
        if stacked:
            self.layers = nnx.split_rngs(splits=depth)(nnx.vmap(Block, in_axes=0))(rngs)
        else:
            self.layers = nnx.List([Block(rngs) for _ in range(depth)])
        self.norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.stacked = stacked

    def __call__(self, tokens):
        x = self.embed_tokens(tokens)
        if self.stacked:
            scan = nnx.scan(lambda x, block: block(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            x = scan(x, self.layers)
        else:
            for block in self.layers:
                x = block(x)
        return self.norm(x)


class CausalLM(nnx.Module):
    """Shaped as Hugging Face's: ``model.embed_tokens``, ``model.layers``, ``model.norm``,
    then a top-level ``lm_head``."""

    def __init__(self, rngs, depth=4, stacked=False):
        self.model = Decoder(rngs, depth, stacked)
        self.lm_head = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        return self.lm_head(self.model(tokens))


def placed_tasks(model):
    """Each Variable's task name, mm.place having been strict and every rule having placed some."""
    return {path: name for path, (name, _) in mm.placement(model).items()}


BY_PATH = {
    "dotted": "model.layers",
    "slashed": "model/layers",
    "filter": lambda path, node: path[-1:] == ("layers",),
    "auto": None,
}


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("blocks", BY_PATH.values(), ids=BY_PATH.keys())
def test_nested_layers_are_cut_by_path_filter_or_found(k, blocks):
    model = CausalLM(nnx.Rngs(0))
    rules = stage_rules(model, tasks(k), blocks=blocks, report=False)
    if k == 2:
        assert [r for r, _ in rules] == [
            "^model/embed_tokens/|^model/layers/(0|1)/",
            "^model/layers/(2|3)/|^model/norm/|^lm_head/",
        ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a rule that places nothing would warn
        task = placed_tasks(mm.place(model, rules, strict=True))
    assert task["model/embed_tokens/embedding"] == "t0"
    assert task["model/norm/scale"] == task["lm_head/kernel"] == f"t{k - 1}"
    for i in range(4):  # one layer per task over 4, two over 2: the head and table weigh alike
        want = f"t{i * k // 4}"
        assert task[f"model/layers/{i}/norm/scale"] == want
        assert task[f"model/layers/{i}/experts/1/kernel"] == want


def test_nested_stacked_layers_are_split_over_the_tasks():
    model = CausalLM(nnx.Rngs(0), stacked=True)
    for blocks in ("model.layers", "model/layers", BY_PATH["filter"]):
        rules = stage_rules(model, tasks(4), blocks=blocks, report=False)
        assert [(r, t if isinstance(t, mm.Task) else tuple(t)) for r, t in rules] == [
            ("^model/embed_tokens/", tasks(4)[0]),
            ("^model/norm/|^lm_head/", tasks(4)[3]),
            ("^model/layers/", tuple(tasks(4))),
        ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        task = placed_tasks(mm.place(model, rules, strict=True))
    assert task["model/embed_tokens/embedding"] == "t0"
    assert task["model/norm/scale"] == task["lm_head/kernel"] == "t3"
    assert task["model/layers/norm/scale"] == task["model/layers/experts/0/kernel"] == "t0+t1+t2+t3"


def test_nested_layers_report_and_costs(capsys):
    model = CausalLM(nnx.Rngs(0))
    stage_rules(model, tasks(2), by="flops", seq_len=4)
    out = capsys.readouterr().out
    assert "0-1 + model/embed_tokens" in out and "2-3 + model/norm, lm_head" in out
    per_layer = size(model.model.layers[0])
    first = per_layer * 2 + size(model.model.embed_tokens)
    last = per_layer * 2 + size(model.model.norm) + size(model.lm_head)
    assert f"{first:,}" in out and f"{last:,}" in out


def test_a_pipelined_step_of_nested_layers_matches_one_device():
    tokens = jax.random.randint(jax.random.key(1), (8, 4), 0, VOCAB)
    loss = lambda m, t: (m(t) ** 2).mean()  # noqa: E731
    model = CausalLM(nnx.Rngs(0))
    model = mm.place(model, stage_rules(model, tasks(2), blocks="model.layers", report=False))
    step = mm.jit(mm.microbatch(nnx.value_and_grad(loss), num=4, reduce="mean"))
    (value, grads), (ref_value, ref_grads) = (
        step(model, tokens),
        nnx.jit(nnx.value_and_grad(loss))(CausalLM(nnx.Rngs(0)), tokens),  # eager: op by op
    )
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    assert step.plan(model, tokens).pipeline.schedule.num_stages == 2


class TwoNestedLists(nnx.Module):
    def __init__(self, rngs):
        self.model = nnx.Dict(
            encoder=nnx.List([nnx.Linear(2, 2, rngs=rngs)]),
            decoder=nnx.List([nnx.Linear(2, 2, rngs=rngs)]),
            scale=nnx.Param(jax.numpy.ones(2)),  # a Variable next to the lists
        )


@pytest.mark.parametrize(
    ("blocks", "message"),
    [
        (
            "model.layer",
            r"CausalLM.model has no attribute 'layer' \(blocks=\) on the path "
            r"'model.layer'; its attributes are embed_tokens, layers, norm, stacked",
        ),
        ("decoder/layers", r"CausalLM has no attribute 'decoder'.*are model, lm_head"),
        ("model.layers.7", r"CausalLM.model.layers has no attribute '7'.*are 0, 1, 2, 3"),
        ("model/norm/scale", r"CausalLM.model.norm.scale does not hold layers.*got Param"),
        ("model", r"CausalLM.model \(one stacked module\) do not share one leading layer axis"),
        (lambda p, n: False, r"blocks= filter matches 0 modules of CausalLM \(none\)"),
        (
            lambda p, n: "layers" in p,  # the list, and 4 x (a block, its norm, list, 2 experts)
            r"filter matches 21 modules of CausalLM \(model/layers, model/layers/0, "
            r"model/layers/0/norm, .*\(15 more\)\); it must select the one",
        ),
    ],
)
def test_nested_layers_errors(blocks, message):
    with pytest.raises(ValueError, match=message):
        stage_rules(CausalLM(nnx.Rngs(0)), tasks(2), blocks=blocks, report=False)


def test_nested_auto_detection_errors():
    with pytest.raises(TypeError, match="blocks= takes a path .* got int"):
        stage_rules(CausalLM(nnx.Rngs(0)), tasks(2), blocks=3, report=False)
    two = TwoNestedLists(nnx.Rngs(0))
    with pytest.raises(
        ValueError,
        match=r"several lists of modules \(model/encoder, model/decoder\).*"
        r"blocks='model/encoder'",
    ):
        stage_rules(two, tasks(2), report=False)
    rules = stage_rules(two, tasks(1), blocks="model.decoder", report=False)
    assert rules == [("^model/encoder/|^model/scale$|^model/decoder/0/", tasks(1)[0])]
    mm.place(two, rules, strict=True)
    rules = stage_rules(two, tasks(1), blocks="model.decoder", last=("scale",), report=False)
    assert rules == [("^model/encoder/|^model/decoder/0/|^model/scale$", tasks(1)[0])]
