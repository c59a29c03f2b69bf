"""Pipelined steps (mm.microbatch inside mm.jit) against the full batch on one device."""

import functools
import json
import os
import pathlib
import subprocess
import sys
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import mmnnx as mm
from mmnnx._jax.compile import SharedCompiles
from mmnnx.mpmd.lower.program import PackWeights, Zeros
from mmnnx.timeline import timeline_rows
from tests.flags import COMPILE_FLAGS
from tests.models import (
    Block,
    TinyGPT,
    chunked_layers,
    four_stage_rules,
    four_tasks,
    microbatched_train_step,
    one_device_tasks,
    placed_gpt,
    tensor_parallel_mlp,
    tiny_gpt,
    train_step,
)
from tests.oracle import close, params_close, trees_close

M = 8


gpt = tiny_gpt


@pytest.fixture(scope="module")
def tasks():
    return four_tasks()


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(0), (M, 9), 0, 32)


placed = placed_gpt


def loss_fn(model, tokens):
    return model.loss(tokens)


def pipelined_step(schedule, virtual_stages=1, num=M):
    def step(model, opt, tokens):
        grad_fn = mm.microbatch(
            nnx.value_and_grad(loss_fn),
            num=num,
            reduce="mean",
            schedule=schedule,
            virtual_stages=virtual_stages,
        )
        loss, grads = grad_fn(model, tokens)
        opt.update(model, grads)
        return loss

    return step


reference_loss_and_grads = nnx.jit(nnx.value_and_grad(loss_fn))
"""The loss and gradients on one device, under ``nnx.jit`` (op by op, each op of a GPT's
backward compiles apart: seconds per model)."""


@nnx.jit
def reference_step(model, opt, tokens):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    opt.update(model, grads)
    return loss


class OneDevice(NamedTuple):
    """AdamW steps of the full batch on one device: each step's loss, the model after each
    step, and the first step's gradients (``params_close``'s noise)."""

    losses: list
    after: list
    grads: nnx.State


@pytest.fixture(scope="module")
def one_device(tokens):
    """``one_device(depth)``: three reference steps of ``gpt(depth)``, computed once per depth
    for every test of this module that checks a pipelined step against them."""

    @functools.cache
    def run(depth: int) -> OneDevice:
        ref = gpt(depth)
        opt = nnx.Optimizer(ref, optax.adamw(3e-3), wrt=nnx.Param)
        _, grads = reference_loss_and_grads(gpt(depth), tokens)
        losses, after = [], []
        for _ in range(3):
            losses.append(reference_step(ref, opt, tokens))
            after.append(nnx.clone(ref))
        return OneDevice(losses, after, grads)

    return run


# a user's table: 1F1B's, written to CSV and read back
CUSTOM = mm.schedules.from_csv(mm.schedules.one_f_one_b(4, M).to_csv(), name="custom")


@pytest.mark.parametrize(
    "schedule, depth, virtual_stages",
    [
        ("gpipe", 4, 1),
        ("1f1b", 4, 1),
        ("zero-bubble-h1", 4, 1),
        ("interleaved-1f1b", 8, 2),
        ("interleaved-gpipe", 8, 2),
        ("zero-bubble-h2", 4, 1),
        ("interleaved-zero-bubble", 8, 2),
        (CUSTOM, 4, 1),
    ],
    ids=[
        "gpipe",
        "1f1b",
        "zero-bubble-h1",
        "interleaved-1f1b",
        "interleaved-gpipe",
        "zero-bubble-h2",
        "interleaved-zero-bubble",
        "custom",
    ],
)
def test_schedules_match_full_batch_on_one_device(
    tasks, tokens, one_device, schedule, depth, virtual_stages
):
    model = placed(tasks, depth)
    lr = 3e-3
    opt = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)
    ref = one_device(depth)
    placement = mm.placement(opt)
    step = mm.jit(pipelined_step(schedule, virtual_stages))
    for ref_loss in ref.losses:
        close(step(model, opt, tokens), ref_loss)
    params_close(model, ref.after[2], ref.grads, steps=3, lr=lr)
    assert mm.placement(opt) == placement
    plan = step.plan(model, opt, tokens)
    name = schedule if isinstance(schedule, str) else "custom"
    assert plan.pipeline.schedule.name == name
    assert [t.name for t in plan.pipeline.stage_tasks] == [f"t{i % 4}" for i in range(depth)]
    assert step.trace_count == 1
    # AdamW's moment decay (b1 * mu) needs nothing from the loop: it runs in each task's update
    # program after it, not in a program of its own before it holding its results meanwhile
    assert not plan.pipeline.pre and all("#pre" not in f.name for f in plan.fragments)


@pytest.mark.parametrize(
    "schedule, fuse_pairs",
    [("zero-bubble-v", False), ("dualpipev", False), ("dualpipev", True)],
    ids=["zero-bubble-v", "dualpipev", "dualpipev-fused-pairs"],
)
def test_v_schedules_run_the_v_placement_and_match_one_device(
    tasks, tokens, one_device, schedule, fuse_pairs
):
    # stage_rules' V: t0 t1 t2 t3 t3:1 t2:1 t1:1 t0:1, the embedding and the head on t0's devices
    rules = mm.stage_rules(gpt(8), tasks, virtual_stages=2, order="v", report=False)
    model = mm.place(gpt(8), rules)
    lr = 3e-3
    opt = nnx.Optimizer(model, optax.adamw(lr), wrt=nnx.Param)
    ref = one_device(8)
    table = mm.schedules.dualpipe_v(4, M, fuse_pairs=True) if fuse_pairs else schedule
    step = mm.jit(pipelined_step(table, virtual_stages=2))
    for ref_loss in ref.losses:
        close(step(model, opt, tokens), ref_loss)
    params_close(model, ref.after[2], ref.grads, steps=3, lr=lr)
    pipeline = step.plan(model, opt, tokens).pipeline
    assert [t.name for t in pipeline.stage_tasks] == [
        *("t0", "t1", "t2", "t3"),
        *("t3:1", "t2:1", "t1:1", "t0:1"),
    ]
    assert pipeline.schedule.stage_to_rank == (0, 1, 2, 3, 3, 2, 1, 0)
    assert pipeline.schedule.name == schedule
    head = model.head.kernel.get_value().sharding.device_set
    assert head == model.embed.embedding.get_value().sharding.device_set
    assert step.trace_count == 1
    # fused overlapped pairs run as one program each: the plan fuses every pair, and a
    # timeline times the pair's two actions as one span
    pairs = [p for r in range(4) for p in pipeline.schedule.pairs_of(r)]
    assert bool(pairs) == fuse_pairs
    program = step.plan(model, opt, tokens).program
    fused = [a for a in program.actions if getattr(a, "fused", False)]
    assert len(fused) == len(pairs)
    events = step.timeline(model, opt, tokens)
    assert all(e.launched == e.start for e in events)  # each action alone: it starts at launch
    # a virtual stage's actions ran on its task's devices
    assert {(e.task, e.rank) for e in events} == {
        *((f"t{i}", f"t{i}") for i in range(4)),
        *((f"t{i}:1", f"t{i}") for i in range(4)),
    }
    # drawn one row per rank: a virtual stage's boxes in its task's row, labelled by stage
    rows = timeline_rows(events)
    assert list(rows) == ["t0", "t1", "t2", "t3"]
    assert {e.stage for e in rows["t0"] if e.kind != "T"} == {0, 7}
    figure = mm.plot_timeline(events)
    assert len(figure.axes[0].patches) == len(events)
    together = [e for e in events if e.fused]
    assert len(together) == 2 * len(pairs)
    spans = {(e.start, e.end) for e in together}
    assert len(spans) == len(pairs)
    # each kind of pair measured whole, its two actions in the order the pair runs them
    pair_costs = mm.schedules.measured_pair_costs(events)
    assert set(pair_costs) == {((a.kind, a.stage), (b.kind, b.stage)) for a, b in pairs}
    assert all(cost > 0 for cost in pair_costs.values())


@pytest.mark.parametrize(
    "order, schedule, fix",
    [
        ("loop", "zero-bubble-v", r"ranks 0, 1, 2, 3, 3, 2, 1, 0; mm.stage_rules\(model, tasks, "
         r"virtual_stages=2, order='v'\)"),
        ("v", "interleaved-1f1b", r"ranks 0, 1, 2, 3, 0, 1, 2, 3; .*order='loop', the default"),
    ],
)  # fmt: skip
def test_a_schedule_on_the_other_placement_says_which_one_it_needs(
    tasks, tokens, order, schedule, fix
):
    model = mm.place(
        gpt(8), mm.stage_rules(gpt(8), tasks, virtual_stages=2, order=order, report=False)
    )
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    before = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    with pytest.raises(mm.MPMDError, match=rf"schedule {schedule!r} runs stages.*{fix}"):
        mm.jit(pipelined_step(schedule, virtual_stages=2))(model, opt, tokens)
    trees_close(nnx.state(model, nnx.Param), before)


@pytest.fixture
def no_compilation_cache():
    """Every program compiled, none read from the run's compilation cache or the process's (JAX
    decides once per process whether it uses its cache: reset, it decides again)."""
    from jax._src import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    mm.clear_caches()
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", was)
    compilation_cache.reset_cache()


def test_equal_stages_compile_once_and_train_like_one_device(
    tasks, tokens, one_device, monkeypatch, no_compilation_cache
):
    """Blocks 1 and 2 are alike and their tasks hold nothing else: stage 2's forward, backward,
    running sums and update are stage 1's programs on other devices, lowered once (moved, not
    traced again) and loaded, not compiled; each task's running sums start from one program."""
    from jax._src import compiler

    ref = one_device(4)

    compiled = []  # by the threads that compile a step's programs
    real = compiler.backend_compile_and_load

    def counted(*args, **kwargs):
        compiled.append(threading.current_thread().name.startswith("mmnnx-compile"))
        return real(*args, **kwargs)

    monkeypatch.setattr(compiler, "backend_compile_and_load", counted)
    submitted, tables = [], []
    share = SharedCompiles.submit
    monkeypatch.setattr(
        SharedCompiles,
        "submit",
        lambda self, low, pool: (
            submitted.append(1) or tables.append(self) or share(self, low, pool)
        ),
    )
    from mmnnx.mpmd.run import programs

    traced = []  # fragment programs traced and lowered
    lower = programs.lower_fragments
    monkeypatch.setattr(programs, "lower_fragments", lambda *a: traced.append(1) or lower(*a))
    model = placed(tasks)
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    step = mm.jit(pipelined_step("1f1b"))
    plan = step.compile(model, opt, tokens)
    assert plan.num_loaded >= 3  # stage 2's forward, backward and update
    assert f"; {plan.num_loaded} loaded from an equal one compiled for other devices" in str(plan)
    loaded = len(tables[0].loaded)  # the step's programs and the runner's own zero fills
    assert loaded >= 4 and sum(compiled) == len(submitted) - loaded  # loaded: not compiled
    assert plan.num_loaded <= min(loaded, plan.num_programs)
    assert len(traced) == plan.num_lowered <= plan.num_programs - 3  # stage 2's: moved
    assert f"; {plan.num_lowered} lowered" in str(plan)
    starts = [a.task.name for a in plan.program.actions if isinstance(a, Zeros | PackWeights)]
    assert starts and sorted(starts) == sorted(set(starts))  # one per task, zeros folded in
    for ref_loss in ref.losses[:2]:
        close(step(model, opt, tokens), ref_loss)
    params_close(model, ref.after[1], ref.grads, steps=2, lr=3e-3)


def test_edge_stages_run_the_middle_stages_programs_and_train_like_one_device(
    tokens, one_device, no_compilation_cache
):
    """``share_cores`` (``mm.jit``'s default) on four one-device stages: the first and last
    stages' forwards and backwards, and their updates, run cores alike the middle stages'
    programs (the blocks' kernels not compiled again for them), with the embedding, the head,
    the loss and the embedding's update as parts of their own; the first stage's forward makes
    the residuals a middle stage's forward returns (its norms' derivative pieces), which its
    backward made before. ``share_cores=False`` cuts nothing. Both train like one device; a
    timeline has one event per action, its parts' together."""
    from mmnnx.mpmd.lower.alike import AlikeKeys
    from mmnnx.mpmd.lower.program import Run

    tasks = one_device_tasks(4)
    ref = one_device(4)
    model = mm.place(tiny_gpt(4), four_stage_rules(tasks))
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    step = mm.jit(pipelined_step("1f1b"))
    off = step.with_options(share_cores=False).plan(model, opt, tokens)
    assert not off.pipeline.parts and not any("." in f.name for f in off.fragments)
    plan = step.compile(model, opt, tokens)
    names = {f.name for f in plan.fragments}
    cores = {"d0/F0.core", "d0/B0.core", "d3/F3.core", "d3/B3.core", "d0#post0.core"}
    assert cores | {"d0/F0.before", "d3/F3.after"} <= names
    (executable, _), *_ = step._cache.values()
    keys, runs = AlikeKeys(executable.graph), {}
    for run in plan.program.actions:
        if isinstance(run, Run) and run.microbatch in (0, None):
            args = [plan.program.shardings[s] for s in run.args]
            runs[run.fragment.name] = keys.program([run], [args])
    pairs = [("d0/F0.core", "d1/F1"), ("d0/B0.core", "d1/B1")]
    for core, middle in [*pairs, ("d3/F3.core", "d1/F1"), ("d3/B3.core", "d1/B1")]:
        assert runs[core] is not None and runs[core] == runs[middle]
    assert runs["d3#post0.core"] == runs["d1#post0"]  # d0's packs its embedding with its block
    assert plan.num_loaded >= 8  # stage 2's and the cores' programs: loaded, not compiled
    labels = [(run.label, run.microbatch) for run in plan.program.actions if isinstance(run, Run)]
    assert (("d3", "F", 3, 1), 0) in labels  # the head's part of the last forward
    for ref_loss in ref.losses[:2]:
        close(step(model, opt, tokens), ref_loss)
    params_close(model, ref.after[1], ref.grads, steps=2, lr=3e-3)
    events = [e for e in step.timeline(model, opt, tokens) if e.kind != "T"]
    actions = sorted((e.kind, e.stage, e.microbatch) for e in events)
    assert actions == sorted((k, stage, m) for k in "FB" for stage in range(4) for m in range(M))


def test_a_later_step_takes_the_programs_an_earlier_one_compiled(tasks, tokens, monkeypatch):
    """A second ``mm.jit`` of the same step (as a notebook cell run again makes) lowers and
    compiles nothing: it takes the first's programs and trains alike; under another matmul
    precision (JAX's trace context) it lowers its own; after ``mm.clear_caches`` so does it."""
    from jax._src import compiler

    from mmnnx.mpmd.run import programs

    traced, compiled = [], []
    lower, real = programs.lower_fragments, compiler.backend_compile_and_load
    monkeypatch.setattr(programs, "lower_fragments", lambda *a: traced.append(1) or lower(*a))
    monkeypatch.setattr(
        compiler,
        "backend_compile_and_load",
        lambda *a, **k: compiled.append(1) or real(*a, **k),
    )
    mm.clear_caches()

    def compiled_step():
        model = placed(tasks)
        opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
        step = mm.jit(pipelined_step("1f1b"))
        plan = step.compile(model, opt, tokens)
        return plan, [float(step(model, opt, tokens)) for _ in range(2)], (model, opt)

    first, first_losses, _ = compiled_step()
    lowered = len(traced)  # (XLA may still answer from JAX's caches: compiles not counted)
    assert lowered == first.num_lowered > 0 and not first.num_reused
    traced.clear(), compiled.clear()
    second, second_losses, (model, opt) = compiled_step()
    assert traced == [] and compiled == [] and second.num_lowered == 0
    assert second.num_reused == first.num_programs
    assert f"; {second.num_reused} compiled by an earlier step" in str(second)
    assert second_losses == first_losses
    with jax.default_matmul_precision("highest"):
        mm.jit(pipelined_step("1f1b")).compile(model, opt, tokens)
    assert len(traced) == lowered
    traced.clear()
    mm.clear_caches()
    assert not mm.jit(pipelined_step("1f1b")).compile(model, opt, tokens).num_reused
    assert len(traced) == lowered


def test_loading_an_equal_program_replaces_no_jax_function(no_compilation_cache):
    """An equal program on other devices is loaded by an explicit call path: JAX's compile
    functions are the same objects before and after, and the loaded program computes on its
    own devices."""
    from jax._src import compiler
    from jax._src.interpreters import pxla

    jax_functions = (
        compiler.compile_or_get_cached,
        compiler.backend_compile_and_load,
        pxla.UnloadedMeshExecutable.from_hlo,
    )
    shared = SharedCompiles()
    outs = []
    for device in jax.devices()[:2]:
        on = jax.sharding.SingleDeviceSharding(device)
        compiled = shared.compile(jax.jit(lambda x: x * 3, in_shardings=on).lower(jnp.float32(0)))
        outs.append(compiled(jax.device_put(jnp.float32(2), on)))
    assert len(shared.loaded) == 1
    assert [float(o) for o in outs] == [6.0, 6.0]
    assert outs[1].devices() == {jax.devices()[1]}
    after = (
        compiler.compile_or_get_cached,
        compiler.backend_compile_and_load,
        pxla.UnloadedMeshExecutable.from_hlo,
    )
    assert all(a is b for a, b in zip(after, jax_functions, strict=True))


def test_a_program_waiting_for_an_equal_one_leaves_its_compile_thread_free(
    no_compilation_cache,
):
    """With two compile threads, A compiling, B equal to A (other device) and C distinct: B
    waits for A without a thread, so C compiles meanwhile. A's compile here finishes only once
    C's has, and fails after 20 s if B holds the second thread."""
    import concurrent.futures

    # programs no other test compiles: the run's persistent cache, once read in this process,
    # answers even with the cache switched off, and a first read from it is not handed on
    def lowered(fn, device):
        on = jax.sharding.SingleDeviceSharding(device)
        return jax.jit(fn, in_shardings=on).lower(jnp.zeros((3, 7), jnp.float32))

    first, equal = (lowered(lambda x: x * 3.5, d) for d in jax.devices()[:2])
    other = lowered(lambda x: x - 1.25, jax.devices()[0])
    other_compiled = threading.Event()
    compile_first, compile_other = first.compile, other.compile

    def compile_first_once_other_is():
        if not other_compiled.wait(20):
            raise AssertionError("C did not compile while A did: B held the other thread")
        return compile_first()

    def compile_other_and_tell():
        out = compile_other()
        other_compiled.set()
        return out

    first.compile, other.compile = compile_first_once_other_is, compile_other_and_tell
    shared = SharedCompiles()
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = [shared.submit(low, pool) for low in (first, equal, other)]
        programs = [f.result(timeout=30) for f in futures]
    assert len(shared.loaded) == 1
    outs = [
        p(jax.device_put(jnp.full((3, 7), 2.0), jax.sharding.SingleDeviceSharding(d)))
        for p, d in zip(programs, [*jax.devices()[:2], jax.devices()[0]], strict=True)
    ]
    assert [float(o[0, 0]) for o in outs] == [7.0, 7.0, 0.75]
    assert outs[1].devices() == {jax.devices()[1]}


_EQUAL_STAGES_IN_A_PROCESS = """
import json, threading
import jax, optax
from flax import nnx
from jax._src import compiler
import mmnnx as mm
from tests.models import tensor_parallel_mlp

compiled = []
real = compiler.backend_compile_and_load
def counted(*args, **kwargs):
    compiled.append(threading.current_thread().name.startswith("mmnnx-compile"))
    return real(*args, **kwargs)
compiler.backend_compile_and_load = counted
tasks = [mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(4)]
with nnx.use_eager_sharding(False):
    model = tensor_parallel_mlp(8, 16, 32)
mm.place(model, [(f"layers/{4 * i}/|layers/{4 * i + 2}/", t) for i, t in enumerate(tasks)])
opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
x = jax.random.normal(jax.random.key(0), (8, 16))
@mm.jit
def step(model, opt, x):
    grad_fn = mm.microbatch(
        nnx.value_and_grad(lambda m, x: (m(x) ** 2).mean()), num=4, reduce="mean", schedule="1f1b"
    )
    loss, grads = grad_fn(model, x)
    opt.update(model, grads)
    return loss
plan = step.compile(model, opt, x)
losses = [float(step(model, opt, x)) for _ in range(2)]
print(json.dumps({"compiled": sum(compiled), "loaded": plan.num_loaded, "losses": losses}))
"""


def test_a_loaded_program_is_written_to_the_persistent_cache_for_the_next_process(tmp_path):
    """With JAX's persistent compilation cache on, the programs loaded from an equal one are
    written to it too: a second process compiles nothing (before, it compiled the loaded ones:
    the first's cache entry is read, and one read from the cache does not serialize whole)."""
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {COMPILE_FLAGS}",
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    }
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", _EQUAL_STAGES_IN_A_PROCESS],
            env=env,
            cwd=pathlib.Path(__file__).parent.parent,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["loaded"] >= 4 and first["compiled"] > 0
    assert second["compiled"] == 0
    assert second["losses"] == first["losses"]


def test_a_program_loaded_onto_devices_in_another_order_trains_like_one_device(
    no_compilation_cache,
):
    """Four equal tensor-parallel stages on submeshes listing their devices in different orders
    ([0, 1], [3, 2], ...): the loaded programs take each submesh's own order."""
    rules = mm.logical_rules(embed=None, mlp="model")
    orders = [[0, 1], [3, 2], [4, 5], [7, 6]]
    tasks = [
        mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=d, axis_names=("model",)), logical_axes=rules)
        for i, d in enumerate(orders)
    ]

    def mlp():
        with nnx.use_eager_sharding(False):
            return tensor_parallel_mlp(8, 16, 32)

    x, y = (jax.random.normal(jax.random.key(k), (8, 16)) for k in (0, 1))
    model = mm.place(mlp(), [(f"^layers/({4 * i}|{4 * i + 2})/", t) for i, t in enumerate(tasks)])
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    ref = mlp()
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    pipelined = mm.jit(microbatched_train_step())
    for _ in range(3):
        close(pipelined(model, opt, x, y), nnx.jit(train_step)(ref, ref_opt, x, y))
    trees_close(nnx.state(model, nnx.Param), nnx.state(ref, nnx.Param))
    assert pipelined.plan(model, opt, x, y).num_loaded >= 3  # F, B and update of t1..t3
    kernel = model.layers[6].kernel.get_value()
    assert [d.id for d in kernel.sharding.mesh.devices.flat] == [3, 2]


def test_the_schedule_option_replaces_the_microbatch_schedule_when_planned(tasks, tokens):
    model = placed(tasks)
    opt = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    step = mm.jit(pipelined_step("1f1b", num=4), recompute_residuals=False)

    def last_stage(step):
        pipeline = step.plan(model, opt, tokens).pipeline
        runs = [(f.name[3], m) for f, m in pipeline.order if m is not None and f.name[:3] == "t3/"]
        actions = [run for i, run in enumerate(runs) if i == 0 or runs[i - 1] != run]  # not parts
        return pipeline.schedule, "".join(kind for kind, _ in actions)

    assert last_stage(step) == (mm.schedules.one_f_one_b(4, 4), "FBFBFBFB")
    gpipe = step.with_options(schedule="gpipe")
    assert last_stage(gpipe) == (mm.schedules.gpipe(4, 4), "FFFFBBBB")
    assert last_stage(step.with_options(schedule=mm.schedules.gpipe(4, 4)))[1] == "FFFFBBBB"
    assert not gpipe.options.recompute_residuals  # the user's options, besides the schedule
    assert last_stage(step)[0].name == "1f1b"  # the step itself plans as before
    assert step.trace_count == 1 and gpipe.trace_count == 0  # gpipe planned step's trace
    again = step.with_options(schedule="1f1b")  # step's trace, planned under its own options
    assert str(again.plan(model, opt, tokens)) == str(step.plan(model, opt, tokens))
    donating = step.with_options(donate_argnums=1)
    donating.plan(model, opt, tokens)
    assert again.trace_count == 0 and donating.trace_count == 1  # donation: traced again


def test_interleaved_eight_stages_on_four_tasks(tasks, tokens, one_device):
    model = placed(tasks, depth=8)
    grads_step = mm.jit(
        mm.microbatch(
            nnx.value_and_grad(loss_fn),
            num=M,
            reduce="mean",
            schedule="interleaved-1f1b",
            virtual_stages=2,
        )
    )
    loss, grads = grads_step(model, tokens)
    close(loss, one_device(8).losses[0])
    trees_close(grads, one_device(8).grads)
    pipeline = grads_step.plan(model, tokens).pipeline
    assert [t.name for t in pipeline.stage_tasks] == [f"t{i % 4}" for i in range(8)]
    assert pipeline.schedule.num_ranks == 4


class SideInputBlock(Block):
    """``tests.models.Block`` taking its attention mask and a position table from the caller."""

    def __call__(self, x, mask, positions):
        b, t, d = x.shape
        x = x + positions
        q, k, v = jax.numpy.split(self.qkv(self.norm1(x)), 3, axis=-1)
        q, k, v = (a.reshape(b, t, self.heads, d // self.heads) for a in (q, k, v))
        attn = nnx.dot_product_attention(q, k, v, mask=mask).reshape(b, t, d)
        x = x + self.out(attn)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class SideInputGPT(TinyGPT):
    """The Gemma example's pattern: the attention mask (causal and padding, from the tokens) and
    a sinusoidal position table (from constants) are built once in ``__call__`` and read by every
    block, so by every pipeline stage."""

    def __init__(self, rngs):
        super().__init__(rngs=rngs)
        self.blocks = nnx.List([SideInputBlock(16, 2, rngs=rngs) for _ in range(4)])

    def __call__(self, tokens):
        mask = nnx.combine_masks(
            nnx.make_causal_mask(tokens), nnx.make_attention_mask(tokens != 0, tokens != 0)
        )
        t = tokens.shape[1]
        angle = jax.numpy.arange(t)[:, None] / 10000 ** (jax.numpy.arange(16)[None, :] / 16)
        positions = jax.numpy.where(jax.numpy.arange(16) % 2 == 0, jax.numpy.sin(angle),
                                    jax.numpy.cos(angle))  # fmt: skip
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask, positions)
        return self.head(self.norm(x))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble-h1"])
def test_side_inputs_built_in_the_step_are_recomputed_in_each_stage(tasks, schedule):
    with nnx.use_eager_sharding(False):
        model, ref = SideInputGPT(nnx.Rngs(0)), SideInputGPT(nnx.Rngs(0))
    model = mm.place(model, four_stage_rules(tasks))
    tokens = jax.random.randint(jax.random.key(3), (M, 9), 0, 32)  # some 0s: padding
    step = mm.jit(
        mm.microbatch(nnx.value_and_grad(loss_fn), num=M // 2, reduce="mean", schedule=schedule)
    )
    (loss, grads), (ref_loss, ref_grads) = (
        step(model, tokens),
        reference_loss_and_grads(ref, tokens),
    )
    close(loss, ref_loss)
    trees_close(grads, ref_grads)
    plan = step.plan(model, tokens)
    assert [t.name for t in plan.pipeline.stage_tasks] == ["t0", "t1", "t2", "t3"]
    # values cross between neighbouring stages only, and neither the mask nor the table is sent
    between = [tr for tr in plan.transfers if tr.source is not None]
    assert {abs(int(tr.source.name[1]) - int(tr.target.name[1])) for tr in between} == {1}
    assert not [tr for tr in between if tr.dtype == bool or tuple(tr.shape) == (8, 16)]
    # one activation forward and one cotangent back per boundary: a block's output, which the
    # next block reads in several ops, not the two addends of the residual sum that makes it
    assert sorted((tr.source.name, tr.target.name) for tr in between) == sorted(
        (f"t{i + d}", f"t{i + 1 - d}") for i in range(3) for d in (0, 1)
    )


class SkipNet(nnx.Module):
    """A UNet's shape on four stages: the decoder at stage 2 adds the features of its encoder
    twin at stage 0 (an additive skip over a stage), the last stage concatenates the input."""

    def __init__(self, rngs):
        self.enc1 = nnx.Linear(8, 16, rngs=rngs)
        self.enc2 = nnx.Linear(16, 16, rngs=rngs)
        self.dec2 = nnx.Linear(16, 16, rngs=rngs)
        self.dec1 = nnx.Linear(24, 8, rngs=rngs)

    def __call__(self, x):
        h1 = jax.nn.relu(self.enc1(x))
        h2 = jax.nn.relu(self.enc2(h1))
        d2 = jax.nn.relu(self.dec2(h2)) + h1
        return self.dec1(jax.numpy.concatenate([d2, x], axis=-1))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_skip_connections_cross_stages_directly(tasks, schedule):
    model = mm.place(
        SkipNet(nnx.Rngs(0)),
        [("enc1", tasks[0]), ("enc2", tasks[1]), ("dec2", tasks[2]), ("dec1", tasks[3])],
    )
    ref = SkipNet(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (M, 8))

    def mse(m, x):
        return jax.numpy.mean((m(x) - x) ** 2)

    step = mm.jit(mm.microbatch(nnx.value_and_grad(mse), num=4, reduce="mean", schedule=schedule))
    (loss, grads), (ref_loss, ref_grads) = step(model, x), nnx.jit(nnx.value_and_grad(mse))(ref, x)
    close(loss, ref_loss)
    trees_close(grads, ref_grads)
    plan = step.plan(model, x)
    assert [t.name for t in plan.pipeline.stage_tasks] == ["t0", "t1", "t2", "t3"]
    # a value crosses straight from its producer's stage to its reader's, over the stage between
    hops = {
        abs(int(tr.source.name[1]) - int(tr.target.name[1])) for tr in plan.transfers if tr.source
    }
    assert hops == {1, 2}


class UnreadStage(nnx.Module):
    """A layer holding a parameter its forward pass never reads, as bonsai's gpt-oss attention
    holds ``sinks`` and Gemma 4's layers that share keys and values hold a ``kv_einsum``."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 8, rngs=rngs)
        self.unread = nnx.Param(jnp.ones((3,)))

    def __call__(self, x):
        return jnp.tanh(self.linear(x))


def test_unread_parameters_get_zero_gradients_on_their_task_and_add_no_stage(tasks):
    def build():
        return nnx.Sequential(*(UnreadStage(nnx.Rngs(i)) for i in range(3)))

    # the last one on t3, which holds nothing the loss reads
    homes = [tasks[0], tasks[1], tasks[3]]
    rules = [("layers/2/unread", tasks[3]), *((f"layers/{i}/", tasks[i]) for i in range(3))]
    model = mm.place(build(), rules)
    ref = build()
    x = jax.random.normal(jax.random.key(0), (M, 8))

    def mse(m, x):
        return jnp.mean((m(x) - x) ** 2)

    step = mm.jit(mm.microbatch(nnx.value_and_grad(mse), num=4, reduce="mean", schedule="1f1b"))
    (loss, grads), (ref_loss, ref_grads) = step(model, x), nnx.jit(nnx.value_and_grad(mse))(ref, x)
    close(loss, ref_loss)
    trees_close(grads, ref_grads)
    for i in range(3):  # zero, as under nnx.jit, and on the parameter's task
        unread = grads.layers[i].unread[...]
        assert not unread.any()
        assert unread.devices() == set(homes[i].jax_mesh.devices.flat)
    plan = step.plan(model, x)
    assert [t.name for t in plan.pipeline.stage_tasks] == ["t0", "t1", "t2"]


def test_compiled_programs_do_not_depend_on_microbatch_count(tasks):
    tokens = jax.random.randint(jax.random.key(1), (16, 9), 0, 32)
    counts = []
    for num in (4, 8, 16):
        model = placed(tasks)
        step = mm.jit(mm.microbatch(nnx.value_and_grad(loss_fn), num=num, reduce="mean"))
        counts.append(step.plan(model, tokens).num_programs)
    assert counts[0] == counts[1] == counts[2]


@pytest.mark.parametrize("schedule, expected", [("1f1b", "<= 4"), ("gpipe", "== 8")])
def test_live_activations_follow_the_schedule(tasks, tokens, schedule, expected):
    model = placed(tasks)
    step = mm.jit(
        mm.microbatch(nnx.value_and_grad(loss_fn), num=M, reduce="mean", schedule=schedule)
    )
    memory = step.memory_profile(model, tokens)
    peak_microbatches = memory["t0"][1]
    assert eval(f"{peak_microbatches} {expected}"), memory
    simulated = mm.schedules.simulate(step.plan(model, tokens).pipeline.schedule)
    assert peak_microbatches <= simulated.peak_in_flight[0]


def test_timeline_covers_every_action_and_transfer_once(tasks, tokens):
    model = placed(tasks)
    step = mm.jit(mm.microbatch(nnx.value_and_grad(loss_fn), num=M, reduce="mean"))
    events = step.timeline(model, tokens)
    actions = [e for e in events if e.kind != "T"]
    pipeline = step.plan(model, tokens).pipeline
    schedule = pipeline.schedule
    # an action cut around a core (share_cores) starts with its part before the core, which
    # may run before a transfer its core reads arrives (the first stage's backward remakes
    # the embedded tokens)
    early = {
        (kind, stage)
        for frag, _ in pipeline.order
        if frag.name.endswith(".before")
        for _, kind, stage, _ in [pipeline.parts[id(frag)]]
    }
    rank = [f"t{r}" for r in schedule.stage_to_rank]
    expected = sorted(
        (f"t{schedule.stage_to_rank[a.stage]}", a.kind, a.stage, a.microbatch)
        for r in range(schedule.num_ranks)
        for a in schedule.actions_of(r)
    )
    assert sorted((e.task, e.kind, e.stage, e.microbatch) for e in actions) == expected
    assert all(e.end >= e.start >= 0 for e in events)
    # each result crossing to another rank is a transfer of its own, after its producer ended
    # and before its reader started (each runs alone); the ones transfer_costs prices
    sending = mm.schedules.transfer_costs(
        schedule,
        {(a, b): mm.schedules.Link(0, 1) for a in range(4) for b in range(a)},
        {}.fromkeys("FBIW", 0),
    )
    transfers = [e for e in events if e.kind == "T"]
    assert {(e.carries, e.stage, e.microbatch) for e in transfers} == {
        (kind, stage, m) for kind, stage in sending for m in range(M)
    }
    at = {(e.kind, e.stage, e.microbatch): e for e in actions}
    for t in transfers:
        reader = at[(t.carries, t.stage + (1 if t.carries == "F" else -1), t.microbatch)]
        made = at[(t.carries, t.stage, t.microbatch)]
        assert (t.source, t.rank) == (rank[t.stage], reader.rank)
        assert made.end <= t.start <= t.end
        assert t.end <= (reader.end if (reader.kind, reader.stage) in early else reader.start)
    figure = mm.plot_timeline(events)
    assert len(figure.axes[0].patches) == len(events)  # a box per action, a bar per transfer


def test_errors(tasks, tokens):
    model = placed(tasks)
    few = mm.jit(mm.microbatch(nnx.value_and_grad(loss_fn), num=2, reduce="mean"))
    with pytest.raises(mm.MPMDError, match=r"1f1b needs at least as many microbatches as stages"):
        few(model, tokens)
    odd = mm.jit(
        mm.microbatch(
            nnx.value_and_grad(loss_fn),
            num=M,
            reduce="mean",
            schedule="interleaved-1f1b",
            virtual_stages=3,
        )
    )
    with pytest.raises(mm.MPMDError, match="virtual_stages"):
        odd(model, tokens)
    custom = mm.schedules.gpipe(2, M)
    wrong = mm.jit(mm.microbatch(nnx.value_and_grad(loss_fn), num=M, schedule=custom))
    with pytest.raises(mm.MPMDError, match="schedule 'gpipe' passed to mm.microbatch is for 2 s"):
        wrong(model, tokens)
    plain = mm.jit(
        mm.microbatch(nnx.value_and_grad(loss_fn), num=M, schedule="interleaved-1f1b")
    )  # virtual_stages=1: not silently 1F1B
    with pytest.raises(mm.MPMDError, match="interleaved-1f1b with virtual_stages=1 would run"):
        plain(model, tokens)
    single = mm.jit(
        mm.microbatch(
            nnx.value_and_grad(loss_fn), num=1, schedule="zero-bubble-v", virtual_stages=2
        )
    )
    with pytest.warns(UserWarning, match="one microbatch is not pipelined.*'zero-bubble-v'"):
        assert single.plan(model, tokens).pipeline is None


def test_plain_jax_regions_with_a_loss_reduced_after_the_last_stage():
    """mm.task regions over unplaced parameters (the multimesh style), loss reduced outside."""
    import jax.numpy as jnp

    t0 = mm.Task("a", mesh=mm.TaskMesh(devices=range(4)))
    t1 = mm.Task("b", mesh=mm.TaskMesh(devices=range(4, 8)))

    def loss(p, x):
        h = mm.task(lambda x: jnp.tanh(x @ p["w0"]), t0)(x)
        return mm.task(lambda h: h @ p["w1"], t1)(h).sum() / 1e3

    p = {"w0": jnp.ones((8, 8)) * 0.1, "w1": jnp.full((8, 8), 0.2)}
    x = jax.random.normal(jax.random.key(0), (16, 8))
    step = mm.jit(mm.microbatch(jax.value_and_grad(loss), num=4, argnums=1))
    value, grads = step(p, x)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(loss))(p, x)
    close(value, ref_value)
    for name in ("w0", "w1"):
        close(grads[name], ref_grads[name])
    assert [t.name for t in step.plan(p, x).pipeline.stage_tasks] == ["a", "b"]


class _Quarter(nnx.Module):
    def __init__(self, seed):
        key = jax.random.key(seed)
        self.w = nnx.List([nnx.Param(1 + 0.1 * jax.random.normal(k, (8,))) for k in
                           jax.random.split(key, 2)])  # fmt: skip

    def __call__(self, h):
        return chunked_layers([w[...] for w in self.w], h)


class _Quarters(nnx.Module):
    def __init__(self):
        self.q = nnx.List([_Quarter(i) for i in range(4)])

    def __call__(self, x):
        for quarter in self.q:
            x = quarter(x)
        return x


@pytest.mark.parametrize(
    "schedule, order", [("interleaved-zero-bubble", "loop"), ("zero-bubble-v", "v")]
)
def test_split_backward_keeps_values_a_task_s_other_stage_reads_on_the_critical_path(
    tasks, schedule, order
):
    # Two stages on one task whose backward passes share a value (the benchmark's chunk-scan
    # custom_vjp): it must run in the input-gradient program, which the other stage waits for.
    t0, t1 = tasks[0], tasks[1]
    homes = (
        [t0, t1, t0, t1] if order == "loop" else [t0, t1, t1.virtual_stage(1), t0.virtual_stage(1)]
    )
    model = mm.place(_Quarters(), [(f"^q/{i}/", t) for i, t in enumerate(homes)])
    x = jax.random.normal(jax.random.key(1), (16, 8))
    loss = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731
    step = mm.jit(
        mm.microbatch(
            nnx.value_and_grad(loss), num=4, reduce="mean", schedule=schedule, virtual_stages=2
        )  # fmt: skip
    )
    value, grads = step(model, x)
    ref_value, ref_grads = nnx.jit(nnx.value_and_grad(loss))(_Quarters(), x)
    close(value, ref_value)
    trees_close(grads, ref_grads)


def test_each_stage_boundary_carries_one_activation_and_one_cotangent():
    """The library GPT's blocks begin with an RMSNorm whose parameter-free part (mean square,
    rsqrt, the division) reads only the previous stage's output: it runs on the next stage,
    so one activation crosses each boundary forward and one cotangent back, not the norm's
    intermediates (which once tripled the bytes sent)."""
    from mmnnx.models import GPT, GPTConfig, stage_rules  # noqa: PLC0415

    config = GPTConfig(vocab_size=32, dim=16, depth=4, num_heads=2, max_seq_len=8)
    with nnx.use_eager_sharding(False):
        model, ref = GPT(config, rngs=nnx.Rngs(0)), GPT(config, rngs=nnx.Rngs(0))
    stages = one_device_tasks(4)
    model = mm.place(model, stage_rules(model, stages, report=False))
    tokens = jax.random.randint(jax.random.key(0), (M, 9), 0, 32)
    step = mm.jit(mm.microbatch(nnx.value_and_grad(loss_fn), num=4, reduce="mean"))
    (loss, grads), (ref_loss, ref_grads) = (
        step(model, tokens),
        reference_loss_and_grads(ref, tokens),
    )
    close(loss, ref_loss)
    trees_close(grads, ref_grads)
    between = sorted(
        (t.source.name, t.target.name, tuple(t.shape))
        for t in step.plan(model, tokens).transfers
        if t.source is not None and t.shape
    )
    activation = (M // 4, 8, 16)
    forward = [(f"d{i}", f"d{i + 1}", activation) for i in range(3)]
    backward = [(f"d{i + 1}", f"d{i}", activation) for i in range(3)]
    assert between == sorted(forward + backward)
