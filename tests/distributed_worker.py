"""One process of a multi-process test (started by tests/test_distributed.py via mmnnx launch).

``python -m tests.distributed_worker SCENARIO[,SCENARIO...] OUT_DIR`` (from the repository
root): joins the run, runs each SCENARIO in turn (one start of the processes for several: JAX's
import and start-up are most of a short scenario's time) and, on every process, writes what it
computed (fetched to host) to ``OUT_DIR/SCENARIO/rank{i}.json``. A SCENARIO may carry arguments
after colons: ``back_to_back:gpipe:4``.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import functools
import gc
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import mmnnx as mm

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def readme_model_tasks(devices: list[int] | None = None) -> list[mm.Task]:
    """The README's two tasks: 2 x 2 (data x model) devices each, of ``devices`` (default: all,
    in order)."""
    mesh = mm.MultiMesh(
        axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"), devices=devices
    )
    rules = mm.logical_rules(batch="data", mlp="model", embed=None)
    return [mm.Task(f"stage{i}", mesh=mesh.slice(stage=i), logical_axes=rules) for i in (0, 1)]


def readme_model(devices: list[int] | None = None):
    """The README's two-task model (two tensor-parallel Linear layers, one per stage)."""
    stage0, stage1 = readme_model_tasks(devices)

    def make_model():
        tp = lambda names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)  # noqa: E731
        return nnx.Sequential(
            nnx.Linear(64, 256, kernel_init=tp(("embed", "mlp")), rngs=nnx.Rngs(0)),
            nnx.Linear(256, 64, kernel_init=tp(("mlp", "embed")), rngs=nnx.Rngs(1)),
        )

    return mm.init(make_model, [("layers/0", stage0), ("layers/1", stage1)])


def readme_batch():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 64)), jnp.float32)
    return x, jnp.sin(x)


@scenario
def two_task(steps: int = 3, pipelined: str | None = None):
    """The README's train step (or its pipelined form) for a few steps: losses and parameters."""
    model = readme_model()
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    @mm.jit
    def whole_batch_step(model, opt, x, y):
        loss, grads = nnx.value_and_grad(lambda m, x, y: jnp.mean((m(x) - y) ** 2))(model, x, y)
        opt.update(model, grads)
        return loss

    train_step = whole_batch_step if pipelined is None else _mse_step(pipelined)

    x, y = readme_batch()
    losses = [float(mm.distributed.fetch(train_step(model, opt, x, y))) for _ in range(steps)]
    params = mm.distributed.fetch(nnx.state(model, nnx.Param))
    return {
        "losses": losses,
        "params": {k: np.asarray(v).tolist() for k, v in _flat(params).items()},
        "transfers": len(train_step.plan(model, opt, x, y).transfers),
        "program": str(train_step.plan(model, opt, x, y).program),
        "programs": [
            str(train_step.plan(model, opt, x, y, process=i).program)
            for i in range(jax.process_count())
        ],
    }


def _mse_step(schedule, virtual_stages: int = 1):
    """The README's pipelined train step (4 microbatches, mean squared error) under ``schedule``
    (a name or a table), over ``virtual_stages`` stages a task."""

    @mm.jit
    def train_step(model, opt, x, y):
        grad_fn = mm.microbatch(
            nnx.value_and_grad(lambda m, x, y: jnp.mean((m(x) - y) ** 2)),
            num=4,
            argnums=(1, 2),
            reduce="mean",
            schedule=schedule,
            virtual_stages=virtual_stages,
        )
        loss, grads = grad_fn(model, x, y)
        opt.update(model, grads)
        return loss

    return train_step


@scenario
def dropout_model():
    """Two pipelined steps of an MLP whose Dropout holds its own ``nnx.Rngs`` stream, one layer per
    task: the stream's key (a PRNG-key-typed input, ``key<fry>``) is part of the step every process
    describes before the processes compare their plans (it once raised NumPy's ``TypeError:
    Cannot interpret 'key<fry>' as a data type`` there)."""
    stage0, stage1 = readme_model_tasks()

    def make_model():
        return nnx.Sequential(
            nnx.Linear(64, 128, rngs=nnx.Rngs(0)),
            nnx.Dropout(0.25, rngs=nnx.Rngs(dropout=1)),
            nnx.Linear(128, 64, rngs=nnx.Rngs(1)),
        )

    model = mm.init(make_model, [("layers/[01]/", stage0), ("layers/2/", stage1)])
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    train_step = _mse_step("1f1b")
    x, y = readme_batch()
    losses = [float(mm.distributed.fetch(train_step(model, opt, x, y))) for _ in "12"]
    params = mm.distributed.fetch(nnx.state(model, nnx.Param))
    return {
        "losses": losses,
        "params": {k: np.asarray(v).tolist() for k, v in _flat(params).items()},
    }


@scenario
def pipelined_1f1b():
    return two_task(pipelined="1f1b")


@functools.cache  # the same tasks (and step) on every call, so steps compiled once are reused
def gpt_tasks(stages: int = 2):
    """``stages`` tasks of 8 // stages devices each (data x model), as ``mmnnx train`` makes."""
    per = 8 // stages
    mesh = mm.MultiMesh(
        axis_sizes=(stages, 2, per // 2), axis_names=("stage", "data", "model"), devices=range(8)
    )
    rules = mm.logical_rules(
        batch="data", mlp="model", heads="model", vocab="model", embed=None, seq=None
    )
    return [
        mm.Task(f"stage{i}", mesh=mesh.task_mesh(stage=i), logical_axes=rules)
        for i in range(stages)
    ]


def gpt_model(tasks):
    from mmnnx.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=256, dim=32, depth=4, num_heads=2, max_seq_len=16)

    def factory():
        return GPT(config, rngs=nnx.Rngs(0))

    with nnx.use_eager_sharding(False):
        rules = mm.stage_rules(nnx.eval_shape(factory), tasks)
    return mm.init(factory, rules)


@scenario
def back_to_back(schedule: str = "1f1b", per_task: str | int = 4):
    """Issue 41's GPT over two tasks of ``per_task`` devices each (the first at device 0, the
    second at device 4: with 4 devices a process, one process each), batch over 'data', 8
    microbatches under ``schedule``: 3 steps called back to back with nothing read in between,
    then the losses and parameters."""
    from mmnnx.models import GPT, GPTConfig

    per_task = int(per_task)
    virtual = 2 if schedule.startswith("interleaved") else 1
    rules = mm.logical_rules(batch="data")
    tasks = [
        mm.Task(
            f"t{i}",
            mesh=mm.TaskMesh(devices=range(4 * i, 4 * i + per_task), axis_names=("data",)),
            logical_axes=rules,
        )
        for i in range(2)
    ]
    config = GPTConfig(vocab_size=256, dim=64, depth=4, num_heads=4, max_seq_len=32)
    with nnx.use_eager_sharding(False):
        model = GPT(config, rngs=nnx.Rngs(0))
    model = mm.place(model, mm.stage_rules(model, tasks, virtual_stages=virtual, report=False))
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(0), (32, 33), 0, 256)

    @mm.jit
    def train_step(model, opt, tokens):
        grad_fn = mm.microbatch(
            nnx.value_and_grad(lambda m, t: m.loss(t)),
            num=8,
            reduce="mean",
            schedule=schedule,
            virtual_stages=virtual,
        )
        loss, grads = grad_fn(model, tokens)
        opt.update(model, grads)
        return loss

    losses = [train_step(model, opt, tokens) for _ in range(3)]
    return {
        "losses": [float(x) for x in mm.distributed.fetch(losses)],
        "params": {
            k: v.tolist()
            for k, v in _flat(mm.distributed.fetch(nnx.state(model, nnx.Param))).items()
        },
        "transfers": _transfer_order(train_step),
    }


def _transfer_order(step) -> list[list]:
    """This process's ends of the step's transfers between processes, in the order its runner
    takes them: ``["send" or "receive", kind, stage, microbatch]`` of what each carries."""
    from mmnnx.mpmd.run.emit import Cross

    (executable, _), *_ = step._cache.values()
    return [
        [
            "receive" if s.route.receives else "send",
            s.transfer.kind,
            s.transfer.stage,
            s.transfer.microbatch,
        ]
        for s in executable._steps
        if isinstance(s, Cross) and s.transfer is not None
    ]


@scenario
def tools():
    """tabulate, cached_partial, timeline and memory_profile of the pipelined README step, and
    the links between its tasks (measure_link, measure_transfers)."""
    model = readme_model()
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    train_step = _mse_step("gpipe")
    x, y = readme_batch()
    table = str(mm.tabulate(model, x))
    step = mm.cached_partial(train_step, model, opt)
    losses = [float(mm.distributed.fetch(step(x, y))) for _ in range(2)]
    events = train_step.timeline(model, opt, x, y)
    memory = train_step.memory_profile(model, opt, x, y)
    losses.append(float(mm.distributed.fetch(train_step(model, opt, x, y))))
    made = {(e.rank, e.kind, e.stage, e.microbatch): e.end for e in events if e.kind != "T"}
    moved = [e for e in events if e.kind == "T"]
    link = mm.schedules.measure_link(*readme_model_tasks(), repeats=3)
    measured = mm.schedules.measure_transfers(train_step, model, opt, x, y, repeats=3)
    schedule = train_step.plan(model, opt, x, y).pipeline.schedule
    return {
        "losses": losses,
        "table": table,
        "event_tasks": sorted({e.task for e in events}),
        "events": len(events),
        "memory_tasks": sorted(memory),
        "transfers": sorted([e.source, e.rank, e.carries, e.stage, e.microbatch] for e in moved),
        "lag": max(made[(e.source, e.carries, e.stage, e.microbatch)] - e.start for e in moved),
        "link": [link.latency, link.bandwidth],
        "links": sorted(map(list, measured.links)),
        "nbytes": sorted([k, s, n] for (k, s), n in measured.nbytes.items()),
        "launching": list(measured.processes_of(schedule)),
        "priced": sorted(map(list, measured.transfer_costs(schedule))),
    }


@functools.cache
def _gpt_train_step():
    def loss_fn(m, tokens):
        logits = m(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @mm.jit
    def train_step(model, opt, tokens):
        grad_fn = mm.microbatch(
            nnx.value_and_grad(loss_fn), num=4, argnums=(1,), reduce="mean", schedule="1f1b"
        )
        loss, grads = grad_fn(model, tokens)
        opt.update(model, grads)
        return loss

    return train_step


def _gpt_tokens(seed: int):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 256, size=(8, 17)), jnp.int32)


def checkpoint_save(directory, stages: int = 2) -> dict:
    """Trains the GPT of ``stages`` stages one 1F1B step and saves it into ``directory``."""
    from mmnnx.train import Checkpointer

    model = gpt_model(gpt_tasks(stages))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    loss = float(mm.distributed.fetch(_gpt_train_step()(model, opt, _gpt_tokens(1))))
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, model=model, opt=opt, extra={"loss": loss})
        steps = ckpt.all_steps()
    return {"loss": loss, "steps": steps, "state": _digest(model, opt)}


def checkpoint_restore(directory, stages: int = 2, train: bool = True) -> dict:
    """Restores step 1 of ``directory`` into a GPT of ``stages`` stages (and trains a step)."""
    from mmnnx.train import Checkpointer

    model = gpt_model(gpt_tasks(stages))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    with Checkpointer(directory) as ckpt:
        extra = ckpt.restore(model=model, opt=opt)
    state = _digest(model, opt)
    loss = None
    if train:
        loss = float(mm.distributed.fetch(_gpt_train_step()(model, opt, _gpt_tokens(2))))
    return {"extra": extra, "state": state, "next_loss": loss}


@scenario
def schedules() -> dict:
    """Two steps of a four-layer MLP under every built-in schedule, one task per process (two
    layers each; the interleaved schedules take the layers of the two tasks in turn, ZB-V and
    DualPipeV in a V; DualPipeV also with its overlapped pairs fused): the losses of each."""
    tasks = readme_model_tasks()
    contiguous = [("^layers/[02]/", tasks[0]), ("^layers/[46]/", tasks[1])]  # Linear at 0, 2, ..
    interleaved = [("^layers/[04]/", tasks[0]), ("^layers/[26]/", tasks[1])]
    t0, t1 = tasks  # the V: down the tasks and back up, the second visits on virtual stages
    v = [("^layers/0/", t0), ("^layers/2/", t1), ("^layers/4/", t1.virtual_stage(1)),
         ("^layers/6/", t0.virtual_stage(1))]  # fmt: skip

    from tests.models import tensor_parallel_mlp  # here: some scenarios run this file as a script

    make_model = functools.partial(tensor_parallel_mlp, 4, 64, 128)

    x, y = readme_batch()
    losses = {}
    fused = mm.schedules.dualpipe_v(2, 4, fuse_pairs=True)
    for name in (*mm.schedules.names(), "dualpipev fused pairs"):
        table = fused if name == "dualpipev fused pairs" else name
        in_v = name.startswith(("zero-bubble-v", "dualpipev"))
        virtual = 2 if name.startswith("interleaved") or in_v else 1
        model = mm.init(make_model, v if in_v else interleaved if virtual == 2 else contiguous)
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        train_step = _mse_step(table, virtual)
        losses[name] = [float(mm.distributed.fetch(train_step(model, opt, x, y))) for _ in "12"]
    return {"losses": losses}


@scenario
def scanned_gpt(save: bool = True) -> dict:
    """``GPT(scan_layers=True)`` built by ``mm.init`` with its stacked blocks split over two
    stages, one per process: two 1F1B steps, saved into $SCANNED_OUT and restored; losses and
    every array."""
    from mmnnx.models import GPT, GPTConfig
    from mmnnx.train import Checkpointer

    config = GPTConfig(vocab_size=256, dim=32, depth=4, num_heads=2, max_seq_len=16)

    def factory():
        return GPT(dataclasses.replace(config, scan_layers=True), rngs=nnx.Rngs(0))

    tasks = gpt_tasks(2)
    with nnx.use_eager_sharding(False):
        rules = mm.stage_rules(nnx.eval_shape(factory), tasks, report=False)
    model = mm.init(factory, rules)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = _gpt_train_step()
    losses = [float(mm.distributed.fetch(step(model, opt, _gpt_tokens(i)))) for i in (1, 2)]
    digest = _digest(model, opt)
    if not save:
        return {"losses": losses, "state": digest}
    directory = pathlib.Path(os.environ["SCANNED_OUT"])
    with Checkpointer(directory) as ckpt:
        ckpt.save(2, model=model, opt=opt)
    fresh = mm.init(factory, rules)
    fresh_opt = nnx.Optimizer(fresh, optax.adam(1e-2), wrt=nnx.Param)
    with Checkpointer(directory) as ckpt:
        ckpt.restore(model=fresh, opt=fresh_opt)
    return {"losses": losses, "state": digest, "restored": _digest(fresh, fresh_opt)}


def damaged_newest(directory) -> dict:
    """Saves steps 1, 2, 3, 5 (3 kept), truncates the chunks of step 5's array that process 1
    alone reads, then restores the newest readable step on every process and saves step 4 (which
    deletes step 5): the steps kept, the step each restored, the steps it passed over, and the
    steps kept after step 4."""
    from mmnnx.distributed.gather import together
    from mmnnx.train import Checkpointer

    model = gpt_model(gpt_tasks(2))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    with Checkpointer(directory) as ckpt:
        for step in (1, 2, 3, 5):
            ckpt.save(step, model=model, opt=opt, extra={"step": step})
        kept = ckpt.all_steps()

    def damage() -> None:
        array = pathlib.Path(directory, "5", "arrays", "model", "blocks", "3", "attn", "q")
        for chunk in (array / "kernel").iterdir():
            if not chunk.name.startswith("."):
                chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])

    together("damaging step 5", lambda: damage() if jax.process_index() == 0 else None)
    with Checkpointer(directory) as ckpt:
        resumed = ckpt.restore_newest_readable(model=model, opt=opt)
        ckpt.save(4, model=model, opt=opt, extra={"step": 4})
        after = ckpt.all_steps()
    skipped = [str(s) for s in resumed.skipped]
    return {"kept": kept, "step": resumed.step, "skipped": skipped, "after": after}


@scenario
def checkpoint_roundtrip():
    """A 1F1B GPT step saved into $CKPT_OUT; then $CKPT_IN (saved elsewhere) restored; then a
    step of the GPT on 4 stages (2 tasks a process) saved into $CKPT_OUT4 and restored into 2
    stages, noting which arrays this process read (and whether it holds part of each); then
    :func:`damaged_newest` in $CKPT_OUT/damaged."""
    from mmnnx.train.checkpoint.formats import process_arrays

    saved = checkpoint_save(os.environ["CKPT_OUT"])
    restored = checkpoint_restore(os.environ["CKPT_IN"])
    saved4 = checkpoint_save(os.environ["CKPT_OUT4"], stages=4)
    reads, read = [], process_arrays.read

    def noted(root, item, path, record, target):
        here = target is None or bool(target.addressable_devices)
        reads.append(["/".join((item, *path)), here])
        return read(root, item, path, record, target)

    process_arrays.read = noted
    restored4 = checkpoint_restore(os.environ["CKPT_OUT4"], stages=2, train=False)
    process_arrays.read = read
    return {
        "saved": saved,
        "restored": restored,
        "saved4": saved4,
        "restored4": restored4,
        "reads": reads,
        "damaged": damaged_newest(os.path.join(os.environ["CKPT_OUT"], "damaged")),
    }


@scenario
def killed_during_save():
    """Saves step 1; then a process is killed while step 2 is saved: rank ``KILL_RANK`` (0:
    process 0 once every process has written its arrays, before it commits the step; 1: process
    1 after writing part of its arrays). Writes step 1's state to OUT_DIR/step1.json first."""
    import signal

    from mmnnx.train import Checkpointer
    from mmnnx.train.checkpoint import layout
    from mmnnx.train.checkpoint.formats import process_arrays

    model = gpt_model(gpt_tasks(2))
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = _gpt_train_step()
    directory = os.environ["CKPT_DIR"]
    victim = int(os.environ.get("KILL_RANK", "0"))
    with Checkpointer(directory) as ckpt:
        step(model, opt, _gpt_tokens(1))
        ckpt.save(1, model=model, opt=opt)
        state = _digest(model, opt)
        if jax.process_index() == 0:
            pathlib.Path(sys.argv[2], "step1.json").write_text(json.dumps(state))
        step(model, opt, _gpt_tokens(2))

        def killed(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        if jax.process_index() == victim == 0:
            layout.commit = killed  # the step's rename, once every process has written
        elif jax.process_index() == victim:
            write = process_arrays.write

            def killed_half_way(root, items, me):
                first = dict(list(items.items())[:1])  # the model's arrays, not the optimizer's
                write(root, first, me)
                killed()

            process_arrays.write = killed_half_way
        ckpt.save(2, model=model, opt=opt)
    return {}


def _digest(model, opt) -> dict[str, list]:
    """Every array of the model and optimizer, fetched, as nested lists."""
    state = {"model": nnx.state(model), "opt": nnx.state(opt)}
    state = mm.distributed.fetch(state)
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return {jax.tree_util.keystr(path): np.asarray(v).tolist() for path, v in leaves}


@scenario
def compat_autosharding():
    """multimesh_compat's autosharding example (two tasks of 4 devices, gen-b API)."""
    import multimesh_compat.jax as mj
    from tests.compat.helpers import f, get_input_batch, init_params, make_model, reference

    tm = mj.TaskMesh(devices=(0, 1, 2, 3), axis_names=("x", "y"), axis_sizes=(4, 1))
    rules = (("batch", "x"), ("model", "x"))
    model = make_model(
        mj.task(f, mesh=tm, logical_axes=rules),
        mj.task(f, mesh=tm.place((4, 5, 6, 7)), logical_axes=rules),
    )
    step, init, batch = mj.parallelize(
        model, init_params=init_params, get_input_batch=get_input_batch
    )
    out = np.asarray(mm.distributed.fetch(step(init(), batch())))
    want = np.asarray(reference(init_params(), get_input_batch()))
    return {"out": out.tolist(), "reference": want.tolist()}


@scenario
def killed_peer():
    """Rank 1 is killed (SIGKILL) after the first step; the others are in the second step."""
    import signal

    model = readme_model()

    @mm.jit
    def forward(model, x):
        return jnp.mean(model(x) ** 2)

    x, _ = readme_batch()
    float(mm.distributed.fetch(forward(model, x)))
    if jax.process_index() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(1000):
        float(mm.distributed.fetch(forward(model, x)))
    return {}


@scenario
def error_on_stderr():
    """Process 1 prints an error's traceback on stderr (the process goes on)."""
    if jax.process_index() == 1:
        import traceback

        traceback.print_exception(ValueError("an error still shows"))
    return {}


@scenario
def different_models():
    """Rank 1 builds its second layer wider: every process must refuse the plan."""
    mesh = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"))
    stage0 = mm.Task("stage0", mesh=mesh.slice(stage=0))
    stage1 = mm.Task("stage1", mesh=mesh.slice(stage=1))
    hidden = 32 if jax.process_index() == 0 else 48
    model = mm.init(
        lambda: nnx.Sequential(
            nnx.Linear(8, hidden, rngs=nnx.Rngs(0)), nnx.Linear(hidden, 8, rngs=nnx.Rngs(1))
        ),
        [("layers/0", stage0), ("layers/1", stage1)],
    )

    @mm.jit
    def forward(model, x):
        return jnp.mean(model(x) ** 2)

    try:
        forward(model, jnp.ones((8, 8)))
    except mm.MPMDError as e:
        return {"error": str(e)}
    return {"error": None}


@scenario
def spanning_without_collectives():
    """The README's tasks in a job of 2 processes of 4 devices started without collectives
    between processes, 'stage0' on devices 2-5 (two of each process): the step must say so
    before it runs."""
    model = readme_model([2, 3, 4, 5, 6, 7, 0, 1])
    before = {k: v.tolist() for k, v in _flat(mm.distributed.fetch(nnx.state(model))).items()}

    @mm.jit
    def forward(model, x):
        return jnp.mean(model(x) ** 2)

    try:
        forward(model, readme_batch()[0])
    except mm.MPMDError as e:
        after = {k: v.tolist() for k, v in _flat(mm.distributed.fetch(nnx.state(model))).items()}
        return {"error": str(e), "unchanged": after == before}
    return {"error": None}


@scenario
def fsdp_spanning(steps: int = 2) -> dict:
    """``tests.models.SMALL_GPT`` over 2 stages of 4 devices, every parameter and moment sharded
    over a 4-device ``fsdp`` axis (``mmnnx train --data-axis 4 --fsdp-axis 4``; under 4
    processes of 2 devices each task's axis spans two processes); ``steps`` 1F1B steps: the
    losses, the parameters, the processes of each task and, of each parameter this process
    holds, the bytes one of its devices holds against the whole."""
    from mmnnx.train.generation import run_tasks
    from mmnnx.train.run_model import fsdp_placement, run_placement
    from tests.models import SMALL_GPT, small_gpt

    tasks = run_tasks(2, 4, 1, fsdp_axis=4)
    model = small_gpt()
    mm.place(model, fsdp_placement(run_placement(SMALL_GPT, tasks)))
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    step = _fsdp_step()
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, size=(16, 17)), jnp.int32)
    losses = [float(mm.distributed.fetch(step(model, opt, tokens))) for _ in range(int(steps))]
    params, held = mm.distributed.fetch(nnx.state(model, nnx.Param)), {}
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        array, name = value.get_value(), "/".join(map(str, path))
        if array.addressable_shards:  # a parameter of this process's task
            held[name] = [array.addressable_shards[0].data.nbytes, array.nbytes]
    return {
        "losses": losses,
        "params": {k: v.tolist() for k, v in _flat(params).items()},
        "task_processes": [
            sorted({d.process_index for d in t.jax_mesh.devices.flat}) for t in tasks
        ],
        "held": held,
    }


@functools.cache
def _fsdp_step():
    from tests.models import gpt_step

    return mm.jit(gpt_step("1f1b"))


def _flat(state) -> dict[str, np.ndarray]:
    return {
        "/".join(str(k) for k in path): np.asarray(v.get_value() if hasattr(v, "get_value") else v)
        for path, v in nnx.to_flat_state(state)
    }


def main() -> None:
    names, out = sys.argv[1].split(","), pathlib.Path(sys.argv[2])
    faulthandler.dump_traceback_later(float(os.environ.get("WORKER_TIMEOUT", "600")), exit=True)
    gc.set_threshold(10_000, 10, 10)  # as the test processes (conftest.py): many scenarios a run
    mm.distributed.initialize()
    for name in names:
        scenario_name, *args = name.split(":")
        result = SCENARIOS[scenario_name](*args)
        result["process"] = jax.process_index()
        result["processes"] = jax.process_count()
        (out / name).mkdir(parents=True, exist_ok=True)
        (out / name / f"rank{jax.process_index()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
