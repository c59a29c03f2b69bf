import importlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mmnnx as mm
from tests.models import TwoStageMLP, make_mlp

RULES = mm.logical_rules(batch="data", mlp="model", embed=None)


@pytest.fixture
def tasks():
    mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
    s0 = mm.Task("stage0", mesh=mesh.task_mesh(stage=0), logical_axes=RULES)
    s1 = mm.Task("stage1", mesh=mesh.task_mesh(stage=1), logical_axes=RULES)
    return s0, s1


def rules_for(s0, s1):
    return [("layers/0", s0), ("layers/1|norm|drop", s1)]


def device_ids(x):
    return sorted(d.id for d in x.devices())


def host(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x)


def snapshot(model):
    return {
        mm.sharding.path_str(p): (host(v.get_value()), v.get_value().sharding)
        for p, v in nnx.to_flat_state(nnx.state(model))
    }


def values(model):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def test_place_moves_every_array_to_its_task(tasks):
    s0, s1 = tasks
    model = mm.place(make_mlp(), rules_for(s0, s1))
    k0 = model.layers[0].kernel.get_value()
    assert device_ids(k0) == [0, 1, 2, 3]
    assert k0.sharding == NamedSharding(s0.jax_mesh, P(None, "model"))
    k1 = model.layers[1].kernel.get_value()
    assert device_ids(k1) == [4, 5, 6, 7]
    assert k1.sharding.spec == P("model", None)
    for var in (model.norm.mean, model.norm.scale, model.drop.rngs.key, model.drop.rngs.count):
        assert device_ids(var.get_value()) == [4, 5, 6, 7]
        assert var.get_value().sharding.spec == P()
    assert mm.placement(model) == {
        "drop/rngs/count": ("stage1", P()),
        "drop/rngs/key": ("stage1", P()),
        "layers/0/bias": ("stage0", P()),
        "layers/0/kernel": ("stage0", P(None, "model")),
        "layers/1/bias": ("stage1", P()),
        "layers/1/kernel": ("stage1", P("model", None)),
        "norm/bias": ("stage1", P()),
        "norm/mean": ("stage1", P()),
        "norm/scale": ("stage1", P()),
        "norm/var": ("stage1", P()),
    }


def test_values_unchanged_by_place(tasks):
    before = values(make_mlp())
    after = values(mm.place(make_mlp(), rules_for(*tasks)))
    assert len(before) == len(after) == 6
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)


def test_metadata_survives_split_merge_state_and_optimizer(tasks):
    s0, s1 = tasks
    model = mm.place(make_mlp(), rules_for(s0, s1))
    graphdef, state = nnx.split(model)
    merged = nnx.merge(graphdef, state)
    assert mm.placement(merged) == mm.placement(model)
    assert mm.task_of(nnx.state(model)["layers"][1]["kernel"]) == s1
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    adam = opt.opt_state[0]
    for moments in (adam.mu, adam.nu):
        m = moments["layers"][1]["kernel"]
        assert mm.task_of(m) == s1
        assert m.get_value().sharding == model.layers[1].kernel.get_value().sharding
        m0 = moments["layers"][0]["kernel"]
        assert m0.get_value().sharding == NamedSharding(s0.jax_mesh, P(None, "model"))
    placed = mm.placement(opt)
    assert placed["opt_state/0/mu/layers/0/kernel"] == ("stage0", P(None, "model"))


def test_explicit_and_callable_specs_first_match_wins(tasks):
    s0, s1 = tasks
    seen = []

    def spec_fn(path, variable):
        seen.append(path)
        return P("data") if variable.get_value().ndim == 1 else P()

    model = mm.place(
        make_mlp(),
        [
            ("layers/0/kernel", s0, P("data", "model")),
            ("layers/0", s1),  # would match layers/0/kernel too, but the first rule wins
            (nnx.PathContains("norm"), s0, spec_fn),
            (nnx.OfType(nnx.RngState), s0),
            (nnx.Param, s1),
        ],
    )
    assert model.layers[0].kernel.get_value().sharding == NamedSharding(
        s0.jax_mesh, P("data", "model")
    )
    assert device_ids(model.layers[0].bias.get_value()) == [4, 5, 6, 7]
    assert model.norm.scale.get_value().sharding.spec == P("data")
    assert "norm/scale" in seen
    assert mm.placement(model)["drop/rngs/key"] == ("stage0", P())
    assert mm.placement(model)["layers/1/kernel"] == ("stage1", P("model", None))


class DotReluDot(nnx.Module):
    """Flax's "Scale up on multiple devices" guide's model, annotated the way that guide writes
    it for explicit sharding: ``kernel_metadata={"out_sharding": P(...)}`` with device axes."""

    def __init__(self, depth: int, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth, depth, kernel_init=init, kernel_metadata={"out_sharding": P(None, "model")},
            use_bias=False, rngs=rngs,
        )  # fmt: skip
        self.w2 = nnx.Param(init(rngs.params(), (depth, depth)), out_sharding=P("model", None))

    def __call__(self, x):
        return jax.nn.relu(self.dot1(x)) @ self.w2


def test_flax_partition_spec_annotations_are_placed_by_axis_or_logical_name(tasks):
    s0, _ = tasks
    with nnx.use_eager_sharding(False):
        model = DotReluDot(16, nnx.Rngs(0))
    placed = mm.place(model, [(".*", s0)])
    assert placed.dot1.kernel.get_value().sharding.spec == P(None, "model")
    assert placed.w2.get_value().sharding.spec == P("model", None)
    # a logical name in the spec goes through the task's rules, as a tuple of names does
    with nnx.use_eager_sharding(False):
        logical = nnx.Linear(8, 16, kernel_metadata={"out_sharding": P("embed", "mlp")},
                             rngs=nnx.Rngs(0))  # fmt: skip
    assert mm.place(logical, [(".*", s0)]).kernel.get_value().sharding.spec == P(None, "model")
    # a name that is neither is named, with the Variable and task, before anything moves
    solo = mm.Task("solo", mesh=mm.TaskMesh(devices=[4]))
    with nnx.use_eager_sharding(False):
        model = DotReluDot(16, nnx.Rngs(0))
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"'dot1/kernel' on task 'solo'.*'model' is neither"):
        mm.place(model, [(".*", solo)])
    assert all(np.array_equal(a, snapshot(model)[k][0]) for k, (a, _) in before.items())


def test_regex_inside_a_tuple_filter(tasks):
    s0, s1 = tasks
    model = mm.place(make_mlp(), [(("layers/0", "norm"), s0), (..., s1)])
    assert mm.placement(model)["norm/var"][0] == "stage0"
    assert mm.placement(model)["layers/1/bias"][0] == "stage1"


def test_with_jax_mesh_slices_as_task_meshes():
    mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
    s0 = mm.Task("s0", mesh=mesh.slice(stage=0), logical_axes=RULES)
    s1 = mm.Task("s1", mesh=mesh.slice(stage=1), logical_axes=RULES)
    model = mm.place(make_mlp(), rules_for(s0, s1))
    assert device_ids(model.layers[1].kernel.get_value()) == [4, 5, 6, 7]
    assert model.layers[1].kernel.get_value().sharding.shard_shape((32, 16)) == (16, 16)


def test_non_strict_leaves_unmatched_alone(tasks):
    s0, _ = tasks
    model = make_mlp()
    bias = model.layers[1].bias.get_value()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mm.place(model, [("layers/0", s0)], strict=False)
    assert model.layers[1].bias.get_value() is bias
    assert "layers/1/bias" not in mm.placement(model)


# -- errors: each names the culprit, and nothing moves --------------------------------------


def assert_untouched(model, before):
    after = snapshot(model)
    assert after.keys() == before.keys()
    for k in before:
        assert after[k][1] == before[k][1], k
        np.testing.assert_array_equal(after[k][0], before[k][0])
    assert mm.placement(model) == {}


@pytest.mark.parametrize(
    "make_rules, error, match",
    [
        (
            lambda s0, s1: [("layers/0", s0)],
            ValueError,
            r"no placement rule matches Variable 'drop/rngs/count'",
        ),
        (
            lambda s0, s1: [("layers/0/kernel", s0, P("pipe")), (".*", s1)],
            ValueError,
            r"'layers/0/kernel' on task 'stage0'.*axis 'pipe'.*\('data', 'model'\)",
        ),
        (
            lambda s0, s1: [("layers/1/bias", s1, P("model", None)), (".*", s0)],
            ValueError,
            r"'layers/1/bias' on task 'stage1': spec P\('model', None\) has 2 entries.*rank 1",
        ),
        (
            lambda s0, s1: [("layers/0/bias", s0, P("data")), (".*", s1)],
            ValueError,
            None,  # 32 is divisible by 2: this rule is valid, see the next case
        ),
        (
            lambda s0, s1: [("norm/scale", s1, P(("data", "model"))), (".*", s0)],
            ValueError,
            None,
        ),
        (
            lambda s0, s1: [("layers/1/kernel", s1, P("model", "model")), (".*", s0)],
            ValueError,
            r"uses axis 'model' for dimensions 0 and 1",
        ),
        (
            lambda s0, s1: [(3, s0)],
            TypeError,
            r"rule 0: filter 3 of type int is not supported",
        ),
        (
            lambda s0, s1: [("layers(", s0)],
            ValueError,
            r"rule 0: invalid regular expression 'layers\('",
        ),
        (
            lambda s0, s1: [(".*", "stage0")],
            TypeError,
            r"rule 0: 'stage0' is not an mm.Task",
        ),
        (
            lambda s0, s1: [(".*", s0, "data")],
            TypeError,
            r"rule 0: spec 'data' is neither",
        ),
        (
            lambda s0, s1: [(".*", s0, lambda p, v: "data")],
            TypeError,
            r"returned 'data', not a PartitionSpec",
        ),
    ],
)
def test_bad_rules(tasks, make_rules, error, match):
    model = make_mlp()
    before = snapshot(model)
    if match is None:
        mm.place(make_mlp(), make_rules(*tasks))  # valid control cases
        return
    with pytest.raises(error, match=match):
        mm.place(model, make_rules(*tasks))
    assert_untouched(model, before)


def test_dimension_not_divisible(tasks):
    s0, s1 = tasks
    with nnx.use_eager_sharding(False):
        model = TwoStageMLP(dim=6, hidden=6, rngs=nnx.Rngs(0))
    before = snapshot(model)
    with pytest.raises(
        ValueError,
        match=r"'layers/0/bias' on task 'stage0': dimension 0 of size 6 is not divisible by "
        r"mesh axes \('data', 'model'\) of total size 4",
    ):
        mm.place(model, [("layers/0/bias", s0, P(("data", "model"))), (".*", s1)])
    assert_untouched(model, before)


def test_a_task_and_its_virtual_stage_may_share_devices(tasks):
    t = tasks[0]
    model = mm.place(make_mlp(), [("layers/0/", t), (".*", t.virtual_stage(1))])
    assert {task for task, _ in mm.placement(model).values()} == {t.name, f"{t.name}:1"}
    other = mm.Task("other", mesh=t.mesh)
    with pytest.raises(ValueError, match=r"overlap: both use device .*virtual_stage, excepted"):
        mm.place(make_mlp(), [("layers/0/", t.virtual_stage(1)), (".*", other)])


def test_overlapping_tasks(tasks):
    s0, _ = tasks
    clash = mm.Task("other", mesh=mm.TaskMesh(devices=[3, 4]))
    model = make_mlp()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"tasks 'stage0' and 'other' overlap: both use device 3"):
        mm.place(model, [("layers/0", s0), (".*", clash)])
    assert_untouched(model, before)


def test_same_name_two_tasks(tasks):
    s0, s1 = tasks
    impostor = mm.Task("stage0", mesh=s1.mesh)
    with pytest.raises(ValueError, match="two different tasks are named 'stage0'"):
        mm.place(make_mlp(), [("layers/0", s0), (".*", impostor)])


def test_device_outside_jax_devices(tasks):
    s0, _ = tasks
    far = mm.Task("far", mesh=mm.TaskMesh(devices=range(8, 12)))
    model = make_mlp()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"task 'far'.*device index 8 is outside jax.devices"):
        mm.place(model, [("layers/0", s0), (".*", far)])
    assert_untouched(model, before)


def test_task_without_mesh():
    with pytest.raises(ValueError, match="needs a name and a mesh"):
        mm.place(make_mlp(), [(".*", mm.Task("floating"))])


def test_rule_matching_nothing_warns(tasks):
    s0, s1 = tasks
    with pytest.warns(UserWarning, match=r"rule 1 \('decoder' -> task 'stage1'\) placed no"):
        mm.place(make_mlp(), [(".*", s0), ("decoder", s1)])


# -- init ---------------------------------------------------------------------------------


def test_init_equals_place_and_creates_on_tasks(tasks):
    s0, s1 = tasks
    rules = rules_for(s0, s1)
    placed = mm.place(make_mlp(3), rules)
    inited = mm.init(lambda: TwoStageMLP(rngs=nnx.Rngs(3)), rules)
    assert mm.placement(inited) == mm.placement(placed)
    a = nnx.to_flat_state(nnx.state(placed))
    b = nnx.to_flat_state(nnx.state(inited))
    for (pa, va), (pb, vb) in zip(a, b, strict=True):
        assert pa == pb
        xa, xb = va.get_value(), vb.get_value()
        assert xa.sharding == xb.sharding, pa
        np.testing.assert_array_equal(host(xa), host(xb), err_msg=str(pa))


_I = nnx.initializers
# what docs/sharding.md says: exact, but for a random draw scaled by a constant (a few ulps)
EXACT = {
    "normal(1.0)": _I.normal(1.0), "uniform(0.01)": _I.uniform(0.01),
    "lecun_normal": _I.lecun_normal(),
    "lecun_uniform": _I.lecun_uniform(), "glorot_normal": _I.glorot_normal(),
    "glorot_uniform": _I.glorot_uniform(), "he_normal": _I.he_normal(),
    "he_uniform": _I.he_uniform(), "xavier_normal": _I.xavier_normal(),
    "kaiming_uniform": _I.kaiming_uniform(), "orthogonal": _I.orthogonal(),
    "constant(0.3)": _I.constant(0.3), "ones": _I.ones, "zeros": _I.zeros,
}  # fmt: skip
SCALED_DRAWS = {  # within a few ulps
    "normal(0.01)": _I.normal(0.01),
    "truncated_normal(0.02)": _I.truncated_normal(0.02),
    "variance_scaling(0.1, fan_avg, normal)": _I.variance_scaling(0.1, "fan_avg", "normal"),
}


@pytest.mark.parametrize("name", [*EXACT, *SCALED_DRAWS])
def test_init_equals_place_for_every_flax_initializer_as_documented(tasks, name):
    init = EXACT.get(name) or SCALED_DRAWS[name]

    def factory():
        return nnx.Linear(64, 128, kernel_init=init, rngs=nnx.Rngs(0))

    rules = [(".*", tasks[0])]
    built = np.asarray(mm.init(factory, rules).kernel.get_value())
    placed = np.asarray(mm.place(factory(), rules).kernel.get_value())
    ulps = np.abs(built.view(np.int32).astype(np.int64) - placed.view(np.int32).astype(np.int64))
    assert ulps.max() <= (0 if name in EXACT else 4), f"{name}: {ulps.max()} ulps"


def test_init_traces_the_factory_once_whatever_the_task_count(tasks):
    s0, s1 = tasks
    calls = []

    def factory():
        calls.append(1)
        return TwoStageMLP(rngs=nnx.Rngs(0))

    model = mm.init(factory, rules_for(s0, s1))
    assert len(calls) == 1  # one trace, replayed per task
    assert model.layers[0].kernel.get_value().sharding.mesh == s0.jax_mesh


def test_init_validates_before_building(tasks):
    s0, _ = tasks
    calls = []

    def factory():
        calls.append(1)
        return TwoStageMLP(rngs=nnx.Rngs(0))

    with pytest.raises(ValueError, match="no placement rule matches"):
        mm.init(factory, [("layers", s0)])
    assert len(calls) == 1  # only the trace ran


def test_init_refuses_a_factory_that_closes_over_an_outer_rngs(tasks):
    s0, s1 = tasks
    rngs = nnx.Rngs(0)

    def factory():
        with nnx.use_eager_sharding(False):
            return TwoStageMLP(rngs=rngs)

    with pytest.raises(
        ValueError,
        match=r"mm.init: the factory changes an nnx.Rngs created outside it; .*build the "
        r"nnx.Rngs inside it, e.g. mm.init\(lambda: Model\(rngs=nnx.Rngs\(0\)\), rules\)",
    ):
        mm.init(factory, rules_for(s0, s1))
    assert int(rngs.params.count.get_value()) == 0  # the outer Rngs was not advanced


def count_compiles(fn):
    """How many XLA programs ``fn()`` compiles (jax.monitoring's backend-compile events)."""
    compiled = []

    def listen(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return len(compiled)


class Tower(nnx.Module):
    """``depth`` equal Linear layers with a shared tied scale derived from another Variable."""

    def __init__(self, depth, width, *, rngs):
        self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])
        self.base = nnx.Param(jax.random.normal(rngs.params(), (width,)))
        self.tied = nnx.Param(self.base.get_value() * 2.0)  # reads another Variable's value


def test_init_compiles_equal_layers_once_and_a_second_build_nothing(tasks, monkeypatch):
    s0, s1 = tasks
    rules = [("layers/[0-3]/", s0), (".*", s1)]
    width = 24  # a width no other test builds, so nothing is compiled yet
    shallow = count_compiles(lambda: mm.init(lambda: Tower(2, width, rngs=nnx.Rngs(0)), rules))
    deep = count_compiles(lambda: mm.init(lambda: Tower(8, width, rngs=nnx.Rngs(1)), rules))
    again = count_compiles(lambda: mm.init(lambda: Tower(8, width, rngs=nnx.Rngs(2)), rules))
    assert shallow > 0
    assert deep <= 1 and again <= 1  # the moves onto the tasks' layouts at most
    # each Variable moved on its own, as when they are larger than the batch of moves
    monkeypatch.setattr(importlib.import_module("mmnnx.sharding.place"), "_UNPLACED_BYTES", 1)
    inited = mm.init(lambda: Tower(8, width, rngs=nnx.Rngs(5)), rules)
    with nnx.use_eager_sharding(False):
        eager = mm.place(Tower(8, width, rngs=nnx.Rngs(5)), rules)
    assert snapshot(inited).keys() == snapshot(eager).keys()
    for path, (value, sharding) in snapshot(eager).items():
        np.testing.assert_array_equal(snapshot(inited)[path][0], value, err_msg=path)
        assert snapshot(inited)[path][1] == sharding, path
    np.testing.assert_allclose(host(inited.tied.get_value()), 2 * host(inited.base.get_value()))


def test_init_runs_a_factory_with_side_effects(tasks, capsys):
    s0, s1 = tasks

    def factory():
        model = TwoStageMLP(rngs=nnx.Rngs(4))
        jax.debug.print("built {n} layers", n=len(model.layers))
        return model

    model = mm.init(factory, rules_for(s0, s1))
    jax.effects_barrier()
    assert "built 2 layers" in capsys.readouterr().out
    for got, want in zip(
        values(model), values(mm.place(make_mlp(4), rules_for(s0, s1))), strict=True
    ):
        np.testing.assert_array_equal(got, want)


def test_init_restores_the_garbage_collector_when_the_factory_fails(tasks):
    import gc  # noqa: PLC0415

    s0, s1 = tasks

    def factory():
        raise RuntimeError("no such layer")

    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="no such layer"):
        mm.init(factory, rules_for(s0, s1))
    assert gc.isenabled()  # paused only while mm.init runs
    gc.disable()
    try:
        mm.init(lambda: TwoStageMLP(rngs=nnx.Rngs(0)), rules_for(s0, s1))
        assert not gc.isenabled()  # a caller's choice is left as it was
    finally:
        gc.enable()


class Cache(nnx.Variable):
    """A Variable type of the user's own."""


# What a module may hold besides its Params (bonsai's Gemma3 keeps ``nnx.data(jnp.ones(...))``);
# each is built by a tiny module next to one Param, with mm.place(factory()) as the reference.
ATTRIBUTES = {
    "nnx.data array": lambda rngs: nnx.data(jnp.arange(4.0) * 2),
    "array attribute": lambda rngs: jnp.ones((2, 2)) / 3,
    "static scalar, string, tuple": lambda rngs: (3, "gelu", (2, 3)),
    "nnx.data list of arrays": lambda rngs: nnx.data([jnp.zeros(2), jnp.arange(3)]),
    "nnx.data dict of arrays": lambda rngs: nnx.data({"cos": jnp.cos(jnp.arange(3.0))}),
    "nnx.data python numbers": lambda rngs: nnx.data([1.5, 2]),
    "numpy array": lambda rngs: np.arange(6.0).reshape(2, 3),
    "Param of a numpy array": lambda rngs: nnx.Param(np.ones((2, 4), np.float32)),
    "custom Variable type": lambda rngs: Cache(jnp.full((4,), 0.5), kind="rope"),
    "BatchStat": lambda rngs: nnx.BatchNorm(4, rngs=rngs),
    "RngState": lambda rngs: nnx.Rngs(5, dropout=6),
    "modules in nnx.List": lambda rngs: nnx.List([nnx.Linear(2, 2, rngs=rngs)]),
    "modules in nnx.Dict": lambda rngs: nnx.Dict(a=nnx.Linear(2, 2, rngs=rngs)),
    "modules in an nnx.data list": lambda rngs: nnx.data([nnx.Linear(2, 2, rngs=rngs)]),
}


class Holder(nnx.Module):
    def __init__(self, *kinds, rngs):
        self.w = nnx.Param(jax.random.normal(rngs.params(), (4, 4)))
        for k, kind in enumerate(kinds):
            setattr(self, f"extra{k}", ATTRIBUTES[kind](rngs))


def leaves(model):
    """Each state leaf: (path, leaf type, value type, host value, sharding or None)."""
    out = []
    for path, leaf in nnx.to_flat_state(nnx.state(model)):
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        sharding = value.sharding if isinstance(value, jax.Array) else None
        out.append((path, type(leaf), type(value), host(jnp.asarray(value)), sharding))
    return out


def assert_init_equals_place(factory, rules, strict=True):
    inited = mm.init(factory, rules, strict=strict)
    with nnx.use_eager_sharding(False):  # as mm.init builds (a Variable records it)
        placed = mm.place(factory(), rules, strict=strict)
    assert nnx.graphdef(inited) == nnx.graphdef(placed)  # static attributes included
    assert mm.placement(inited) == mm.placement(placed)
    for got, want in zip(leaves(inited), leaves(placed), strict=True):
        assert got[:3] == want[:3]
        np.testing.assert_array_equal(got[3], want[3], err_msg=str(want[0]))
        assert got[4] == want[4], want[0]


@pytest.mark.parametrize("kind", list(ATTRIBUTES))
def test_init_takes_every_attribute_flax_allows_equal_to_place(tasks, kind):
    assert_init_equals_place(lambda: Holder(kind, rngs=nnx.Rngs(0)), [(".*", tasks[0])])


def test_init_leaves_what_no_rule_places_as_the_factory_made_it(tasks):
    kinds = ("nnx.data array", "numpy array", "Param of a numpy array", "BatchStat", "RngState")
    assert_init_equals_place(
        lambda: Holder(*kinds, rngs=nnx.Rngs(0)), [("^w$", tasks[0])], strict=False
    )


def test_init_names_a_variable_holding_traced_arrays_in_a_tuple(tasks):
    class Pair(nnx.Module):
        def __init__(self):
            self.pair = nnx.Variable((jnp.ones(2), jnp.zeros(3)))

    with pytest.raises(TypeError, match=r"mm.init: Variable 'pair' holds a tuple of traced arr"):
        mm.init(Pair, [(".*", tasks[0])], strict=False)
