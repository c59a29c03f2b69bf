"""The schedule registry, and schedules chosen by their actions, not their names: a built-in
schedule read back from CSV (named "custom") and hand-written I/W tables pipeline like the
built-ins."""

import jax
import numpy as np
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx.cli import parse_args
from multimesh_compat.jax import SCHEDULES as COMPAT_SCHEDULES
from tests.models import four_tasks, placed_gpt, reference_loss_and_grads, tiny_gpt
from tests.oracle import close, trees_close

M = 4


gpt = tiny_gpt
placed = placed_gpt


@pytest.fixture(scope="module")
def tasks():
    return four_tasks()


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(0), (M, 9), 0, 32)


def grads_with(schedule, model, tokens, virtual_stages=1):
    step = mm.jit(
        mm.microbatch(
            nnx.value_and_grad(lambda m, t: m.loss(t)),
            num=M,
            reduce="mean",
            schedule=schedule,
            virtual_stages=virtual_stages,
        )
    )
    return step(model, tokens), step.plan(model, tokens)


@pytest.mark.parametrize(
    "name, depth, virtual_stages",
    # GPipe's plain table runs against one device in test_pipeline; these interleave F and B
    [("1f1b", 4, 1), ("zero-bubble-h1", 4, 1), ("interleaved-1f1b", 8, 2)],
)
def test_builtin_schedule_read_back_from_csv_gives_the_same_gradients(
    tasks, tokens, name, depth, virtual_stages
):
    builtin = mm.schedules.get(name, depth, M, virtual_stages)
    from_csv = mm.schedules.from_csv(builtin.to_csv())  # named "custom"
    assert from_csv.name == "custom" and from_csv.actions == builtin.actions
    model = placed(tasks, depth)
    (loss, grads), plan = grads_with(name, model, tokens, virtual_stages)
    (csv_loss, csv_grads), csv_plan = grads_with(from_csv, model, tokens)
    np.testing.assert_array_equal(np.asarray(csv_loss), np.asarray(loss))
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), csv_grads, grads
    )
    assert [f.name for f in csv_plan.fragments] == [f.name for f in plan.fragments]
    split = {f.name.split("/")[1][0] for f in plan.fragments if "/" in f.name}
    assert ("I" in split) == builtin.splits_backward


# Hand-written: each stage runs W right after its I (not ZB-H1's deferred order), and stage 0
# keeps an unsplit B, so one table mixes B and I/W.
HAND_WRITTEN = [
    ["F0.0", "F0.1", "F0.2", "B0.0", "F0.3", "B0.1", "B0.2", "B0.3"],
    [
        "F1.0",
        "F1.1",
        "I1.0",
        "W1.0",
        "F1.2",
        "I1.1",
        "W1.1",
        "F1.3",
        "I1.2",
        "W1.2",
        "I1.3",
        "W1.3",
    ],
    [
        "F2.0",
        "I2.0",
        "F2.1",
        "I2.1",
        "W2.0",
        "F2.2",
        "I2.2",
        "W2.1",
        "F2.3",
        "I2.3",
        "W2.2",
        "W2.3",
    ],
    [
        "F3.0",
        "I3.0",
        "W3.0",
        "F3.1",
        "I3.1",
        "W3.1",
        "F3.2",
        "I3.2",
        "W3.2",
        "F3.3",
        "I3.3",
        "W3.3",
    ],
]


def test_hand_written_split_backward_table_matches_one_device(tasks, tokens):
    schedule = mm.schedules.custom(HAND_WRITTEN, name="mine")
    assert schedule.split_stages == {1, 2, 3}
    model = placed(tasks, 4)
    (loss, grads), plan = grads_with(schedule, model, tokens)
    ref_loss, ref_grads = reference_loss_and_grads(gpt(4), tokens)
    close(loss, ref_loss)
    trees_close(grads, ref_grads)
    # a stage cut around a core (share_cores) names its parts "I3.core" and so on
    kinds = {f.name.split("/")[1].split(".")[0] for f in plan.fragments if "/" in f.name}
    assert {"B0", "I1", "W1", "I3", "W3"} <= kinds
    assert not {"B1", "B2", "B3"} & kinds


def test_register_makes_a_name_usable_everywhere(tasks, tokens):
    def reversed_backwards(num_stages, num_microbatches, virtual_stages):
        rows = [
            [f"F{s}.{m}" for m in range(num_microbatches)]
            + [f"B{s}.{m}" for m in reversed(range(num_microbatches))]
            for s in range(num_stages)
        ]
        return mm.schedules.custom(rows, name="reversed-backwards")

    mm.schedules.register("reversed-backwards", reversed_backwards)
    try:
        assert "reversed-backwards" in mm.schedules.names()
        assert COMPAT_SCHEDULES["reversed-backwards"] == "reversed-backwards"
        assert parse_args(["train", "--schedule", "reversed-backwards"]).schedule.startswith("rev")
        with pytest.raises(ValueError, match="already registered"):
            mm.schedules.register("reversed-backwards", reversed_backwards)
        model = placed(tasks, 4)
        (loss, grads), plan = grads_with("reversed-backwards", model, tokens)
        assert plan.pipeline.schedule.name == "reversed-backwards"
        ref_loss, ref_grads = reference_loss_and_grads(gpt(4), tokens)
        close(loss, ref_loss)
        trees_close(grads, ref_grads)
    finally:
        mm.schedules.unregister("reversed-backwards")
    assert "reversed-backwards" not in mm.schedules.names()
    assert "reversed-backwards" not in COMPAT_SCHEDULES
    with pytest.raises(ValueError, match="unknown schedule 'reversed-backwards'"):
        mm.microbatch(lambda x: x, num=2, schedule="reversed-backwards")


def test_builder_that_breaks_its_contract_is_named():
    mm.schedules.register("wrong-size", lambda s, m, v: mm.schedules.gpipe(s + 1, m))
    mm.schedules.register("not-a-schedule", lambda s, m, v: [["F0.0"]])
    try:
        with pytest.raises(ValueError, match="'wrong-size' was asked for 2 stages"):
            mm.schedules.get("wrong-size", 2, 2)
        with pytest.raises(TypeError, match="'not-a-schedule' returned"):
            mm.schedules.get("not-a-schedule", 2, 2)
    finally:
        mm.schedules.unregister("wrong-size")
        mm.schedules.unregister("not-a-schedule")


@pytest.mark.parametrize(
    "builder",
    [lambda s, m: None, lambda s, m, v, extra: None, lambda *, stages, m, v: None, lambda: None],
)
def test_a_builder_with_the_wrong_signature_is_refused_at_register_naming_it(builder):
    with pytest.raises(
        TypeError,
        match=r"the builder of schedule 'bad-shape' must take \(num_stages, num_microbatches, "
        r"virtual_stages\) positionally, and optionally costs=; <lambda>\(",
    ):
        mm.schedules.register("bad-shape", builder)
    assert "bad-shape" not in mm.schedules.names()


def test_builders_taking_defaults_varargs_or_costs_are_accepted():
    for builder in (
        lambda s, m, v=1: mm.schedules.gpipe(s, m),
        lambda *args: mm.schedules.gpipe(*args[:2]),
        lambda s, m, v, costs=None: mm.schedules.gpipe(s, m),
    ):
        mm.schedules.register("fine", builder)
        mm.schedules.unregister("fine")


def test_compat_aliases_point_into_the_registry():
    for alias, target in COMPAT_SCHEDULES.items():
        assert target == "custom" or target in mm.schedules.names(), alias
    assert COMPAT_SCHEDULES["fill-drain"] == "gpipe"
    assert COMPAT_SCHEDULES["zero-bubble-h1"] == "zero-bubble-h1"
