import inspect
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import mmnnx as mm
from tests.models import TwoStageMLP, make_mlp

RULES = mm.logical_rules(batch="data", mlp="model", embed=None)


@pytest.fixture
def placed():
    mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
    s0 = mm.Task("stage0", mesh=mesh.slice(stage=0), logical_axes=RULES)
    s1 = mm.Task("stage1", mesh=mesh.slice(stage=1), logical_axes=RULES)
    return mm.place(make_mlp(), [("layers/0", s0), ("layers/1|norm|drop", s1)])


def row(text, first_cell):
    """The cells of the table row whose first cell is ``first_cell``."""
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("│").split("│")]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in\n{text}")


HEADER = ["path", "type", "inputs", "outputs", "shape", "task", "PartitionSpec", "bytes/device"]


def test_columns_and_module_rows(placed):
    text = mm.tabulate(placed, jnp.ones((8, 16)))
    assert row(text, "path") == HEADER
    assert row(text, "(root)")[:4] == ["(root)", "TwoStageMLP", "float32[8,16]", "float32[8,16]"]
    assert row(text, "layers/0")[:4] == ["layers/0", "Linear", "float32[8,16]", "float32[8,32]"]
    assert row(text, "layers/1")[:4] == ["layers/1", "Linear", "float32[8,32]", "float32[8,16]"]
    assert row(text, "norm")[:4] == ["norm", "BatchNorm", "float32[8,16]", "float32[8,16]"]
    # rows follow call order: root, layers/0, layers/1, drop, norm
    order = [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│")]
    modules = [p for p in order if p in ("(root)", "layers/0", "layers/1", "drop", "norm")]
    assert modules == ["(root)", "layers/0", "layers/1", "drop", "norm"]


def test_variable_rows_have_task_spec_and_bytes_per_device(placed):
    text = mm.tabulate(placed, jnp.ones((8, 16)))
    # kernel 16x32 float32 sharded P(None, 'model') over model=2: 16*16*4 bytes per device
    assert row(text, "layers/0/kernel")[4:] == [
        "float32[16,32]",
        "stage0",
        str(P(None, "model")),
        f"{16 * 16 * 4:,} B",
    ]
    assert row(text, "layers/1/kernel")[4:] == [
        "float32[32,16]",
        "stage1",
        str(P("model", None)),
        f"{16 * 16 * 4:,} B",
    ]
    assert row(text, "norm/mean")[1:] == [
        "BatchStat",
        "",
        "",
        "float32[16]",
        "stage1",
        "P()",
        "64 B",
    ]
    assert row(text, "drop/rngs/key")[4:] == ["key<fry>[]", "stage1", "P()", "8 B"]


def test_totals_per_task(placed):
    text = mm.tabulate(placed)
    assert "Totals per task" in text
    # stage0: kernel 512 + bias 32 elements; per device: kernel half + bias replicated
    assert row(text, "stage0")[1:] == ["0-3", "2", "544", "2,176 B", f"{(256 + 32) * 4:,} B"]
    # stage1: kernel 512, bias 16, norm 4x16, rng count (uint32) + key (8 bytes)
    stage1_bytes = (512 + 16 + 64) * 4 + 4 + 8
    per_device = (256 + 16 + 64) * 4 + 4 + 8
    assert row(text, "stage1")[1:] == [
        "4-7",
        "8",
        f"{512 + 16 + 64 + 2:,}",
        f"{stage1_bytes:,} B",
        f"{per_device:,} B",
    ]
    assert row(text, "total")[2:5] == ["10", f"{544 + 594:,}", f"{2176 + stage1_bytes:,} B"]


def test_depth_rolls_up_deeper_variables(placed):
    text = mm.tabulate(placed, jnp.ones((8, 16)), depth=1)
    assert "layers/0/kernel" not in text
    rolled = row(text, "layers/… (4 Variables)")
    assert rolled[4] == "1,072 elements"
    assert rolled[5] == "stage0, stage1"
    assert rolled[7] == f"{(256 + 32) * 4:,} B; {(256 + 16) * 4:,} B"
    assert row(text, "norm/var")[5] == "stage1"


def test_optimizer_state_follows_params(placed):
    opt = nnx.Optimizer(placed, optax.adam(1e-3), wrt=nnx.Param)
    text = mm.tabulate(opt)
    assert row(text, "opt_state/0/mu/layers/1/kernel")[4:] == [
        "float32[32,16]",
        "stage1",
        "P('model', None)",
        "1,024 B",
    ]
    assert row(text, "step")[5] == "(unplaced)"


def test_unplaced_model_and_no_inputs():
    text = mm.tabulate(make_mlp())
    assert row(text, "layers/0/kernel")[4:] == ["float32[16,32]", "(unplaced)", "-", "2,048 B"]
    assert row(text, "(root)")[2:4] == ["-", "-"]


def test_does_not_patch_classes_and_leaves_model_alone(placed):
    call = nnx.Linear.__call__
    kernel = placed.layers[0].kernel.get_value()
    mm.tabulate(placed, jnp.ones((8, 16)))
    assert nnx.Linear.__call__ is call
    assert type(placed.layers[0]) is nnx.Linear
    assert type(placed) is TwoStageMLP
    assert placed.layers[0].kernel.get_value() is kernel
    # a plain forward on one device still works afterwards
    assert make_mlp()(jnp.ones((2, 16))).shape == (2, 16)


def test_html_for_jupyter(placed):
    result = mm.tabulate(placed)
    html = result._repr_html_()
    assert "<html" in html.lower() or "<pre" in html.lower()
    assert "stage0" in html and "P(None, &#x27;model&#x27;)" in html
    assert isinstance(result, str)
    assert not re.search(r"\x1b\[", result)  # plain text when not on a terminal


def test_other_method_and_errors(placed):
    class Wrapper(nnx.Module):
        def __init__(self):
            self.net = make_mlp()

        def loss(self, x):
            return jnp.mean(self.net(x) ** 2)

    text = mm.tabulate(Wrapper(), jnp.ones((4, 16)), method="loss")
    assert row(text, "(root)")[2:4] == ["float32[4,16]", "float32[]"]
    assert row(text, "net")[1] == "TwoStageMLP"
    with pytest.raises(TypeError, match="expected an NNX graph node"):
        mm.tabulate({"w": jnp.ones(3)})
    with pytest.raises(ValueError, match="depth"):
        mm.tabulate(placed, depth=-1)
    with pytest.raises(AttributeError, match="no method 'predict'"):
        mm.tabulate(placed, jnp.ones((2, 16)), method="predict")


def test_every_variable_has_a_row():
    with nnx.use_eager_sharding(False):
        model = TwoStageMLP(rngs=nnx.Rngs(params=0, dropout=1))
    text = mm.tabulate(model, jnp.ones((2, 16)))
    for path, _ in nnx.to_flat_state(nnx.state(model)):
        assert row(text, mm.sharding.path_str(path))


class ScanBlock(nnx.Module):
    """The Block of the ``nnx.scan`` docstring's scan-over-layers example: Linear, Dropout, relu."""

    def __init__(self, features: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(features, features, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x):
        return jax.nn.relu(self.dropout(self.linear(x)))


class ScannedLayers(nnx.Module):
    """Flax's scan-over-layers pattern: a stack of blocks made by ``nnx.vmap`` over split rngs,
    applied by ``nnx.scan`` with the activation as the carry (``nnx.scan`` docstring)."""

    def __init__(self, num_layers: int, features: int, *, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs: nnx.Rngs):
            return ScanBlock(features, rngs=rngs)

        self.blocks = create_block(rngs)
        self.head = nnx.Linear(features, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def forward(block, x):
            return block(x)

        return self.head(forward(self.blocks, x))


def test_scan_over_vmapped_layers():
    model = ScannedLayers(3, 8, rngs=nnx.Rngs(0))
    text = mm.tabulate(model, jnp.ones((4, 8)))
    assert row(text, "(root)")[1:4] == ["ScannedLayers", "float32[4,8]", "float32[4,2]"]
    # the scanned block and its layers are recorded per layer (inside the scan body)
    assert row(text, "blocks")[1:4] == ["ScanBlock", "float32[4,8]", "float32[4,8]"]
    assert row(text, "blocks/linear")[1:4] == ["Linear", "float32[4,8]", "float32[4,8]"]
    assert row(text, "head")[1:4] == ["Linear", "float32[4,8]", "float32[4,2]"]
    # the stacked Variables keep their leading layer axis
    assert row(text, "blocks/linear/kernel")[4:] == ["float32[3,8,8]", "(unplaced)", "-", "768 B"]
    assert row(text, "blocks/linear/bias")[4] == "float32[3,8]"
    assert row(text, "blocks/dropout/rngs/key")[4] == "key<fry>[3]"
    # totals: 3 x (64 + 8) stacked + the stream's stacked count and key (3 + 3) + head 16 + 2
    assert row(text, "total")[2:4] == ["6", f"{3 * (64 + 8) + 3 + 3 + 16 + 2:,}"]


class RematMLP(nnx.Module):
    """Activation checkpointing with ``nnx.remat`` in the lifted-transform style of Flax's NNX
    transforms (the ``nnx.scan`` docstring's ``forward``): a function that takes the submodule as
    an argument and calls it."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.block = ScanBlock(8, rngs=rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.remat
        def body(block, x):
            return block(x)

        return self.head(body(self.block, x))


def test_remat():
    text = mm.tabulate(RematMLP(rngs=nnx.Rngs(0)), jnp.ones((4, 8)))
    assert row(text, "block")[1:4] == ["ScanBlock", "float32[4,8]", "float32[4,8]"]
    assert row(text, "block/linear")[1:4] == ["Linear", "float32[4,8]", "float32[4,8]"]
    assert row(text, "head")[1:4] == ["Linear", "float32[4,8]", "float32[4,2]"]
    assert row(text, "total")[3] == f"{64 + 8 + 16 + 2 + 2:,}"


class EncoderMLP(nnx.Module):
    """A ViT encoder block's MLP as the Flax ViT tutorial writes it (``nnx.Sequential`` of Linear,
    gelu, Dropout), with the dropout rngs given at call time: ``self.mlp(x, rngs=rngs)``."""

    def __init__(self, dim: int, mlp_dim: int, rate: float, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(dim, mlp_dim, rngs=rngs),
            nnx.gelu,
            nnx.Dropout(rate),
            nnx.Linear(mlp_dim, dim, rngs=rngs),
            nnx.Dropout(rate),
        )

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        return x + self.mlp(self.norm(x), rngs=rngs)


def test_sequential_passes_rngs_to_its_layers():
    # nnx.Sequential gives rngs= only to layers whose __call__ signature takes it
    sub = mm.summary._recording_class(nnx.Dropout)
    assert inspect.signature(sub.__call__) == inspect.signature(nnx.Dropout.__call__)
    model = EncoderMLP(8, 16, 0.1, rngs=nnx.Rngs(0))
    text = mm.tabulate(model, jnp.ones((2, 5, 8)), nnx.Rngs(dropout=1))
    # graph nodes among the inputs show as their type, keywords by name
    assert row(text, "(root)")[2] == "float32[2,5,8], Rngs"
    assert row(text, "mlp")[1:4] == ["Sequential", "float32[2,5,8], rngs=Rngs", "float32[2,5,8]"]
    assert row(text, "mlp/layers/0")[1:4] == ["Linear", "float32[2,5,8]", "float32[2,5,16]"]
    for layer, dim in (("mlp/layers/2", 16), ("mlp/layers/4", 8)):
        shape = f"float32[2,5,{dim}]"
        assert row(text, layer)[1:4] == ["Dropout", f"{shape}, rngs=Rngs", shape]


class ConstrainedMLP(nnx.Module):
    """Activations constrained inside ``__call__``, as in the ``DotReluDot`` module of Flax's
    "Scale up on multiple devices" guide, written with ``mm.with_sharding_constraint`` and logical
    names (docs/jit.md)."""

    def __init__(self, net: nnx.Module):
        self.net = net

    def __call__(self, x):
        x = mm.with_sharding_constraint(x, ("batch", None))
        return mm.with_sharding_constraint(self.net(x), P("batch", None))


def test_sharding_constraint_inside_the_model(placed):
    model = ConstrainedMLP(placed)
    text = mm.tabulate(model, jnp.ones((8, 16)))
    assert row(text, "(root)")[1:4] == ["ConstrainedMLP", "float32[8,16]", "float32[8,16]"]
    assert row(text, "net/layers/0")[1:4] == ["Linear", "float32[8,16]", "float32[8,32]"]
    # only tabulate's trace drops the constraint: outside it there is still no mesh in context
    with pytest.raises(RuntimeError, match="mesh"):
        jax.eval_shape(lambda x: mm.with_sharding_constraint(x, P("batch")), jnp.ones(8))
    # and mm.jit still honours it: the batch goes to stage0 sharded over its data axis
    step = mm.jit(lambda m, x: m(x))
    (batch,) = [t for t in step.plan(model, jnp.ones((8, 16))).transfers if t.source is None]
    assert batch.sharding.spec == P("data", None)


class CachedAttention(nnx.Module):
    """A decoding attention layer in the style of Flax's Gemma example: ``__call__(x, segment_pos,
    cache, attn_mask)`` returns ``(new_cache, out)``, the cache a dict of ``k``, ``v`` and
    ``end_index`` updated with ``dynamic_update_slice``; plus a ``deterministic`` dropout flag."""

    def __init__(self, dim: int, heads: int, max_len: int, *, rngs: nnx.Rngs):
        self.heads = heads
        self.pos = nnx.Embed(max_len, dim, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, *, segment_pos, cache=None, attn_mask, deterministic=False):
        b, t, d = x.shape
        x = x + self.pos(segment_pos)
        q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * self.heads, -1), 3, axis=2)
        if cache is not None:
            start = (0, cache["end_index"][0], 0, 0)
            k = jax.lax.dynamic_update_slice(cache["k"], k, start)
            v = jax.lax.dynamic_update_slice(cache["v"], v, start)
            cache = {"k": k, "v": v, "end_index": cache["end_index"] + t}
        logits = jnp.where(attn_mask[:, None], jnp.einsum("bthd,bshd->bhts", q, k), -1e9)
        probs = self.drop(jax.nn.softmax(logits), deterministic=deterministic)
        return cache, self.out(jnp.einsum("bhts,bshd->bthd", probs, v).reshape(b, t, d))


def test_keyword_inputs():
    model = CachedAttention(8, 2, 16, rngs=nnx.Rngs(0))
    cache = {
        "k": jnp.zeros((2, 16, 2, 4)),
        "v": jnp.zeros((2, 16, 2, 4)),
        "end_index": jnp.zeros((2,), jnp.int32),
    }
    text = mm.tabulate(
        model,
        jnp.ones((2, 1, 8)),
        segment_pos=jnp.zeros((2, 1), jnp.int32),
        cache=cache,
        attn_mask=jnp.ones((2, 1, 16), bool),
        deterministic=True,
        depth=1,
        title="decode step",
    )
    assert text.splitlines()[0].strip() == "decode step"
    # keywords go to the model (arrays traced, the flag as it is); depth and title to tabulate
    ins, outs = row(text, "(root)")[2:4]
    assert ins == (
        "float32[2,1,8], segment_pos=int32[2,1], "
        "cache=int32[2], float32[2,16,2,4], float32[2,16,2,4], "
        "attn_mask=bool[2,1,16], deterministic=True"
    )
    assert outs == "int32[2], float32[2,16,2,4], float32[2,16,2,4], float32[2,1,8]"
    assert row(text, "drop")[2] == "float32[2,2,1,16], deterministic=True"
    assert row(text, "pos")[2:4] == ["int32[2,1]", "float32[2,1,8]"]


class Pyramid(nnx.Module):
    """A model whose ``__call__`` takes keywords named like tabulate's own options."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x, *, depth: int, title: str = ""):
        for _ in range(depth):
            x = self.linear(x)
        return x


def test_reserved_keywords_and_bad_keywords():
    model = Pyramid(rngs=nnx.Rngs(0))
    # depth= is tabulate's; the model's depth goes through a callable method
    text = mm.tabulate(model, jnp.ones((2, 4)), method=lambda m, x: m(x, depth=3), depth=0)
    assert row(text, "(root)")[1:4] == ["Pyramid", "float32[2,4]", "float32[2,4]"]
    assert row(text, "(root)/… (2 Variables)")[4] == "20 elements"
    with pytest.raises(TypeError, match=r"Pyramid.__call__\(x, \*, depth.*'depth'.*tabulate's own"):
        mm.tabulate(model, jnp.ones((2, 4)))
    with pytest.raises(TypeError, match=r"Pyramid.__call__.*unexpected keyword argument 'cahce'"):
        mm.tabulate(model, jnp.ones((2, 4)), method=lambda m, x, **kw: m(x, depth=1, **kw), cahce=1)
    with pytest.raises(TypeError, match="method must be a method name or a callable, got 3"):
        mm.tabulate(model, jnp.ones((2, 4)), method=3)
    with pytest.raises(TypeError, match="Sequential.layers is not callable"):
        mm.tabulate(nnx.Sequential(), jnp.ones((2, 4)), method="layers")
