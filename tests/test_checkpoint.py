"""mmnnx.train.Checkpointer: Orbax checkpoints of task-placed NNX state."""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from flax import nnx

import mmnnx as mm
from mmnnx.cli import main
from mmnnx.train import Checkpointer, checkpoint
from mmnnx.train.checkpoint import layout
from mmnnx.train.checkpoint.formats import orbax_tree
from tests.checkpoint_worker import arrays, build, digest, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "checkpoint_worker.py")


def variables(**nodes) -> dict[str, nnx.Variable]:
    return {
        "/".join((name, *map(str, path))): var
        for name, node in nodes.items()
        for path, var in nnx.iter_graph(node)
        if isinstance(var, nnx.Variable)
    }


def shardings(**nodes) -> dict[str, jax.sharding.Sharding]:
    return {path: var.get_value().sharding for path, var in variables(**nodes).items()}


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for path in a:
        assert a[path].dtype == b[path].dtype, path
        np.testing.assert_array_equal(a[path], b[path], err_msg=path)


def run_worker(*args: str, stderr=subprocess.PIPE) -> subprocess.Popen:
    """``tests/checkpoint_worker.py`` in a fresh process, 8 CPU devices set before jax loads."""
    env = dict(os.environ)  # 8 devices and the tests' compile flags
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.Popen(
        [sys.executable, WORKER, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 120) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


# -- round trips across placements -------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "target"), [("two", "two"), ("two", "four"), ("two", "one"), ("one", "two")]
)
def test_round_trip_into_the_current_placement(tmp_path, source, target):
    model, opt = build(source, seed=0)
    train(model, opt, 2)
    saved = arrays(model=model, opt=opt)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(2, model=model, opt=opt, extra={"data": {"position": 16}, "seed": 0})

    fresh, fresh_opt = build(target, seed=1)
    before = variables(model=fresh, opt=fresh_opt)
    placement, where = mm.placement(fresh_opt), shardings(model=fresh, opt=fresh_opt)
    with Checkpointer(tmp_path) as ckpt:
        extra = ckpt.restore(model=fresh, opt=fresh_opt)

    assert extra == {"data": {"position": 16}, "seed": 0}
    assert_same(arrays(model=fresh, opt=fresh_opt), saved)  # bit-exact, moments and step too
    assert int(fresh_opt.step.get_value()) == 2
    assert int(fresh_opt.opt_state[0].count.get_value()) == 2
    assert shardings(model=fresh, opt=fresh_opt) == where  # the current placement, per leaf
    assert mm.placement(fresh_opt) == placement  # metadata kept: the same Variable objects
    assert variables(model=fresh, opt=fresh_opt) == before
    key = fresh.drop.rngs.key.get_value()
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    assert jax.random.key_impl(key) == jax.random.key_impl(model.drop.rngs.key.get_value())
    # the restored state trains on like the saved one
    np.testing.assert_allclose(train(fresh, fresh_opt, 1), train(model, opt, 1), rtol=1e-5)


def test_steps_retention_and_restore_by_step(tmp_path):
    model, opt = build("two")
    states = {}
    reader = Checkpointer(tmp_path)
    with Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        assert ckpt.latest_step() is None and ckpt.all_steps() == []
        for step in (1, 2, 3):
            train(model, opt, 1)
            states[step] = arrays(model=model)
            ckpt.save(step, model=model, extra={"step": step})
        assert ckpt.all_steps() == [2, 3] and ckpt.latest_step() == 3
        assert reader.all_steps() == [2, 3] and reader.latest_step() == 3  # read from disk
        reader.close()
        with pytest.raises(ValueError, match="step 3 already exists"):
            ckpt.save(3, model=model)
        with pytest.raises(TypeError, match="JSON"):
            ckpt.save(4, model=model, extra={"bad": object()})
        assert ckpt.all_steps() == [2, 3]
        assert ckpt.restore(2, model=model) == {"step": 2}
        assert_same(arrays(model=model), states[2])
        with pytest.raises(FileNotFoundError, match=r"step 1 .*steps saved: \[2, 3\]"):
            ckpt.restore(1, model=model)
    assert sorted(os.listdir(tmp_path)) == [".mmnnx-writer.lock", "2", "3"]
    # a model-only restore ignores saved optimizer state; asking for it when none was saved fails
    with Checkpointer(tmp_path) as ckpt, pytest.raises(ValueError, match=r"no optimizer state"):
        ckpt.restore(model=model, opt=opt)


def test_no_checkpoint(tmp_path):
    model, _ = build("one")
    with (
        Checkpointer(tmp_path / "empty") as ckpt,
        pytest.raises(FileNotFoundError, match=f"no checkpoint in {tmp_path / 'empty'}"),
    ):
        ckpt.restore(model=model)


# -- each array written from its own task's devices --------------------------------------------


@pytest.mark.parametrize("use_ocdbt", [True, False])
def test_each_array_written_shard_by_shard_from_its_task(tmp_path, use_ocdbt):
    model, opt = build("two")
    train(model, opt, 1)
    before = variables(model=model, opt=opt)
    values = {path: var.get_value() for path, var in before.items()}
    where = shardings(model=model, opt=opt)
    with Checkpointer(tmp_path, use_ocdbt=use_ocdbt) as ckpt:
        ckpt.save(1, model=model, opt=opt)
    # saving moves nothing: the same arrays, with the same shardings
    assert shardings(model=model, opt=opt) == where
    assert all(var.get_value() is values[p] for p, var in variables(model=model, opt=opt).items())

    for item in ("model", "opt"):
        item_dir = tmp_path / "1" / item
        if use_ocdbt:  # one database per item: list its keys
            kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item_dir}/"}).result()
            keys = {k.decode() for k in kv.list().result()}
            read = lambda key, kv=kv: kv.read(key).result().value
        else:  # one Zarr directory per array
            keys = {
                os.path.relpath(os.path.join(d, f), item_dir)
                for d, _, files in os.walk(item_dir)
                for f in files
            }
            read = lambda key, item_dir=item_dir: (item_dir / key).read_bytes()
        recorded = {
            base64.b64decode(k).decode(): json.loads(v)
            for k, v in json.loads((item_dir / "_sharding").read_text()).items()
        }
        for path, value in values.items():
            if not path.startswith(item + "/"):
                continue
            name = path.split("/", 1)[1].replace("/", ".")
            zarray = json.loads(read(f"{name}/.zarray"))
            chunks = {k for k in keys if k.startswith(name + "/") and not k.endswith(".zarray")}
            if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
                value = jax.random.key_data(value)
            shape, shard = value.shape, value.sharding.shard_shape(value.shape)
            assert zarray["shape"] == list(shape), path
            # every chunk lies inside one device's shard: written per shard, never as one block
            assert all(s % c == 0 for s, c in zip(shard, zarray["chunks"], strict=True)), path
            assert len(chunks) == math.prod(
                -(-s // c) for s, c in zip(shape, zarray["chunks"], strict=True)
            ), path
            # and Orbax recorded the array's own task devices and spec
            if recorded[name]["sharding_type"] == "SingleDeviceSharding":
                # state on no task (the optimizer's step count) stays on its one device
                (device,) = value.sharding.device_set
                assert recorded[name]["device_str"] == f"{device.platform}:{device.id}", path
                continue
            mesh = recorded[name]["device_mesh"]["mesh"]
            ids = [d["id"] for d in np.ravel(np.asarray(mesh, dtype=object))]
            assert sorted(ids) == sorted(d.id for d in value.sharding.device_set), path
    replicated = values["model/layers/0/bias"]  # on 4 devices, written as 4 replica slices
    assert len(replicated.sharding.device_set) == 4


# -- atomicity -----------------------------------------------------------------------------------


def _fail_before_commit(monkeypatch):
    def boom(path):
        assert path.name == "2.orbax-checkpoint-tmp", path
        assert (path / "model" / "_METADATA").is_file()  # all is written but the rename
        raise OSError("disk full (simulated) just before the commit")

    monkeypatch.setattr(layout, "fsync_tree", boom)
    return OSError, "just before the commit"


def _fail_while_writing(monkeypatch):
    async def boom(self, directory, *args, **kwargs):
        raise RuntimeError("write failed (simulated) while writing the JSON items")

    monkeypatch.setattr(ocp.JsonCheckpointHandler, "async_save", boom)
    return RuntimeError, "while writing"


@pytest.mark.parametrize("fail", [_fail_before_commit, _fail_while_writing])
def test_interrupted_save_keeps_previous_step(tmp_path, monkeypatch, fail):
    model, opt = build("two")
    train(model, opt, 1)
    step1 = arrays(model=model, opt=opt)
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, model=model, opt=opt, extra={"step": 1})
    train(model, opt, 1)
    with monkeypatch.context() as patch:
        error, message = fail(patch)
        with pytest.raises(error, match=message):
            ckpt.save(2, model=model, opt=opt, extra={"step": 2})
    assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
    assert not (tmp_path / "2").exists() and (tmp_path / "2.orbax-checkpoint-tmp").is_dir()

    fresh, fresh_opt = build("two", seed=1)
    assert ckpt.restore(model=fresh, opt=fresh_opt) == {"step": 1}
    assert_same(arrays(model=fresh, opt=fresh_opt), step1)
    ckpt.save(2, model=model, opt=opt)  # the same step saves fine afterwards
    assert ckpt.all_steps() == [1, 2]
    ckpt.close()
    with Checkpointer(tmp_path) as again:
        assert again.all_steps() == [1, 2]
    # the retried save removed the failed one's temporary directory
    assert sorted(os.listdir(tmp_path)) == [".mmnnx-writer.lock", "1", "2"]


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """A fresh process that trained 3 steps, saved step 3, and was SIGKILLed saving step 4."""
    directory = tmp_path_factory.mktemp("killed")
    with open(directory.parent / "killed-worker.log", "w+") as log:
        proc = run_worker("kill", str(directory), "3", stderr=log)
        watchdog = threading.Timer(300, proc.kill)  # never hang the suite on a stuck worker
        watchdog.start()
        try:
            first, line = proc.stdout.readline(), proc.stdout.readline()
            listed = sorted(os.listdir(directory))  # taken while the worker waits to commit
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log.seek(0)
        assert line.startswith("COMMITTING"), first + line + log.read()[-3000:]
    assert proc.returncode == -signal.SIGKILL
    return directory, json.loads(first), listed


def test_killed_process_keeps_previous_step(killed_run):
    directory, saved, listed = killed_run
    # killed mid-save, all data written (the lock file stays: the lock died with the process)
    assert listed == [".mmnnx-writer.lock", "3", "4.orbax-checkpoint-tmp"]
    assert (directory / "4.orbax-checkpoint-tmp" / "model" / "_METADATA").is_file()
    with Checkpointer(directory) as ckpt:
        assert ckpt.latest_step() == 3 and ckpt.all_steps() == [3]
        fresh, fresh_opt = build("two", seed=1)
        assert ckpt.restore(model=fresh, opt=fresh_opt) == {"step": 3, "seed": 0}
        assert digest(model=fresh, opt=fresh_opt) == saved["digest"]  # bit-exact
    # a reader leaves the interrupted save alone: it might be another process's save in progress
    assert sorted(os.listdir(directory)) == [".mmnnx-writer.lock", "3", "4.orbax-checkpoint-tmp"]


def test_next_save_removes_an_abandoned_save(killed_run, tmp_path):
    directory, _, _ = killed_run
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    with Checkpointer(copy) as ckpt:
        model, opt = build("two", seed=1)
        ckpt.restore(model=model, opt=opt)
        # the killed writer's lock died with it: taken over, naming it
        with pytest.warns(UserWarning, match=r"took over the writer lock .* from process \d+ on"):
            ckpt.save(4, model=model, opt=opt)  # holds the writer lock: no other save runs
        assert ckpt.all_steps() == [3, 4]
    assert sorted(os.listdir(copy)) == [".mmnnx-writer.lock", "3", "4"]


def test_one_writer_per_directory_the_second_is_refused_naming_the_first(tmp_path):
    first, second = Checkpointer(tmp_path), Checkpointer(tmp_path)
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    other = nnx.Linear(2, 3, rngs=nnx.Rngs(1))
    first.save(1, model=model)
    message = rf"being written by another Checkpointer \(process {os.getpid()} on host .*, since"
    with pytest.raises(mm.train.CheckpointDirectoryBusyError, match=message):
        second.save(2, model=other)  # refused before it looks at what is there
    with pytest.raises(mm.train.CheckpointDirectoryBusyError):
        second.claim()
    first.save(2, model=model)
    assert first.all_steps() == [1, 2]
    first.close()  # releases it: the second may write now, and takes over from no one
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second.save(3, model=other)
    fresh = nnx.Linear(2, 3, rngs=nnx.Rngs(2))
    second.restore(2, model=fresh)
    np.testing.assert_array_equal(fresh.kernel.get_value(), model.kernel.get_value())
    second.close()


def test_a_checkpointer_dropped_without_close_leaves_the_directory_to_the_next(tmp_path):
    # a notebook cell `ckpt = Checkpointer(d); ckpt.save(...)` run twice: the first Checkpointer,
    # in a reference cycle, kept the lock's file open for the rest of the process, so every
    # later save here raised CheckpointDirectoryBusyError naming this very process
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, model=model)
    ckpt = Checkpointer(tmp_path)  # the first one is dropped, not closed
    ckpt.save(2, model=model)
    with pytest.raises(checkpoint.CheckpointDirectoryBusyError, match=f"process {os.getpid()}"):
        Checkpointer(tmp_path).save(3, model=model)  # a live writer is still refused
    ckpt.close()
    assert Checkpointer(tmp_path).all_steps() == [1, 2]


def test_mmnnx_train_on_a_directory_another_writer_holds_exits_2_naming_it(tmp_path, capsys):
    """A second ``mmnnx train`` on the output directory of a running run (before its first
    checkpoint) is refused before it writes anything: the running run's config.toml and
    tokenizer/ stay its own (before: overwritten, then refused at the lock). In this process (a
    process start costs seconds): the lock refuses another Checkpointer of this process as of
    another one (another process:
    test_two_writer_processes_one_is_refused_and_readers_never_break_the_others_saves)."""
    out = tmp_path / "out"
    mm.train.BPETokenizer.train(["the cat sat on the mat. " * 20], 260).save(out / "tokenizer")
    (out / "config.toml").write_text('[model]\ndim = 32\n[training]\ntokenizer = "bpe"\n')
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with Checkpointer(out / "checkpoints") as holder:
        holder.claim()  # as the running run's fit holds it
        argv = ["train", "--output-dir", str(out), "--steps", "2", "--dim", "16", "--depth",
                "2", "--heads", "2", "--seq-len", "8", "--batch-size", "8"]  # fmt: skip
        status = main(argv)
    err = capsys.readouterr().err
    assert status == 2, err[-3000:]
    assert f"being written by another Checkpointer (process {os.getpid()}" in err
    assert "Traceback" not in err and err.count("\n") == 1, err
    after = {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and ".mmnnx" not in p.name}
    assert after == before  # no data/ either


def test_mmnnx_train_under_launch_on_a_directory_another_writer_holds_exits_2_naming_it(tmp_path):
    """The same under ``mmnnx launch -n 2``: every process gets the busy error itself (before: a
    RuntimeError of the collective claim wrapping it, a traceback, exit 1)."""
    out = tmp_path / "out"
    train = [sys.executable, "-m", "mmnnx", "train", "--output-dir", str(out), "--steps", "2",
             "--dim", "16", "--depth", "2", "--heads", "2", "--seq-len", "8", "--batch-size", "8",
             "--data-axis", "1", "--model-axis", "1", "--no-tensorboard"]  # fmt: skip
    command = [sys.executable, "-m", "mmnnx", "launch", "-n", "2", "--", *train]
    env = {**os.environ, "PYTHONPATH": ROOT}
    with Checkpointer(out / "checkpoints") as holder:
        holder.claim()  # a running run's
        proc = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert f"being written by another Checkpointer (process {os.getpid()}" in output, output
    assert "Traceback" not in output, output[-3000:]
    assert (
        "rank 0 failed first (exit code 2)" in output
        or "rank 1 failed first (exit code 2)" in output
    )


def test_two_writer_processes_one_is_refused_and_readers_never_break_the_others_saves(tmp_path):
    """Two processes start saving 12 steps of 16 MB into one directory while two readers (threads
    of this process) keep opening it and asking for the latest step. One writer is refused,
    naming the other (before: both reported every save successful and every step held one
    writer's model); the other's saves all succeed (before: opening a Checkpointer removed the
    writer's temporary directory, and its save failed with NOT_FOUND, at step 1 already). One
    scenario: each process start costs seconds, and the readers spin as long as the saves take."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    stop, counts = threading.Event(), [0, 0]

    def read(reader: int) -> None:
        while not stop.is_set():
            with Checkpointer(directory) as ckpt:
                ckpt.latest_step()
            counts[reader] += 1

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(2)]
    for reader in readers:
        reader.start()
    writers = [run_worker("write", str(directory), "12") for _ in range(2)]
    outcomes = []
    try:
        for proc in writers:
            out, err = proc.communicate(timeout=240)
            outcomes.append((proc.returncode, out, err))
    finally:
        stop.set()
        for reader in readers:
            reader.join(timeout=60)
    refused = [err for code, _, err in outcomes if code != 0]
    assert len(refused) == 1, outcomes
    assert "CheckpointDirectoryBusyError" in refused[0] and "process " in refused[0]
    (saved,) = [out for code, out, _ in outcomes if code == 0]
    assert json.loads(saved.strip().splitlines()[-1]) == {}  # all 12 saves done
    assert all(n > 0 for n in counts)
    with Checkpointer(directory) as ckpt:
        assert ckpt.all_steps() == [11, 12]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_max_to_keep_must_be_a_positive_int_or_none(tmp_path, bad):
    with pytest.raises(ValueError, match=r"max_to_keep must be a positive int .* got "):
        Checkpointer(tmp_path / "c", max_to_keep=bad)
    assert not (tmp_path / "c").exists()  # refused before anything was created


def test_max_to_keep_none_keeps_every_step(tmp_path):
    with Checkpointer(tmp_path / "all", max_to_keep=None) as ckpt:
        for step in range(5):
            ckpt.save(step, model=nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
        assert ckpt.all_steps() == [0, 1, 2, 3, 4]


# -- mismatched checkpoints -----------------------------------------------------------------------


def _wider(model, opt):
    return build("one", hidden=64)


def _extra_variable(model, opt):
    model.layers[0].scale = nnx.Param(jnp.ones(3))
    return model, opt


def _missing_variable(model, opt):
    del model.drop
    return model, opt


def _other_dtype(model, opt):
    bias = model.layers[1].bias
    bias.set_value(bias.get_value().astype(jnp.bfloat16))
    return model, opt


def _other_key_impl(model, opt):
    model.drop.rngs.key.set_value(jax.random.key(0, impl="unsafe_rbg"))
    return model, opt


def _clipped(model, opt):  # the optimizer's state gains clipping's (empty) state
    return model, nnx.Optimizer(
        model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)), wrt=nnx.Param
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            _clipped,
            r"the optimizer's state has another structure than the saved one: 'opt/opt_state/"
            r"1/0/count' is in the model but missing from the checkpoint \(and \d+ more "
            r"mismatches, all in it\); was the optimizer changed \(e\.g\. gradient clipping",
        ),
        (_wider, r"'model/layers/0/bias' has shape \(32,\) in the checkpoint but \(64,\) in the"),
        (_extra_variable, r"'model/layers/0/scale' is in the model but missing from the checkp"),
        (_missing_variable, r"'model/drop/rngs/count' is in the checkpoint but not in the model"),
        (_other_dtype, r"'model/layers/1/bias' has dtype float32 in the checkpoint but bfloat16"),
        (_other_key_impl, r"'model/drop/rngs/key' has shape \(2,\) in the checkpoint but \(4,\)"),
    ],
)
def test_mismatched_checkpoint_leaves_model_untouched(tmp_path, change, message):
    model, opt = build("one")
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(3, model=model, opt=opt)
    other, other_opt = change(*build("one", seed=1))
    before = {p: v.get_value() for p, v in variables(model=other, opt=other_opt).items()}
    values = arrays(model=other, opt=other_opt)
    with (
        Checkpointer(tmp_path) as ckpt,
        pytest.raises(ValueError, match=r"^checkpoint step 3: " + message),
    ):
        ckpt.restore(model=other, opt=other_opt)
    after = variables(model=other, opt=other_opt)
    assert all(after[p].get_value() is before[p] for p in before)
    assert_same(arrays(model=other, opt=other_opt), values)


def test_rng_key_implementation_is_checked(tmp_path):
    def module(impl):
        return nnx.Dropout(0.5, rngs=nnx.Rngs(jax.random.key(0, impl=impl)))

    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, model=module("rbg"))
        with pytest.raises(ValueError, match=r"'model/rngs/key' holds RNG keys of impl rbg in"):
            ckpt.restore(model=module("unsafe_rbg"))
        target = module("rbg")
        ckpt.restore(model=target)
        assert str(jax.random.key_impl(target.rngs.key.get_value())) == "rbg"


# -- exact resume in fresh processes --------------------------------------------------------------


def test_resume_in_a_fresh_process_matches_straight_training(killed_run, tmp_path):
    directory, saved, _ = killed_run
    resumed = finish(run_worker("resume", str(directory), "2", str(tmp_path / "resumed.npz")))
    assert resumed["extra"] == {"step": 3, "seed": 0}  # the last complete step, not the killed one

    model, opt = build("two", seed=0)
    straight = train(model, opt, 5)
    np.testing.assert_allclose(saved["losses"] + resumed["losses"], straight, rtol=1e-6)
    state = dict(np.load(tmp_path / "resumed.npz"))
    expected = arrays(model=model, opt=opt)
    assert state.keys() == expected.keys()
    for path, value in expected.items():
        np.testing.assert_allclose(state[path], value, rtol=1e-6, atol=0, err_msg=path)


def test_incomplete_step_directories_are_skipped(tmp_path):
    model, opt = build("one")
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, model=model, opt=opt, extra={"step": 1})
    (tmp_path / "5").mkdir()  # empty
    (tmp_path / "6" / "model").mkdir(parents=True)  # partial: no metadata
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
        assert ckpt.incomplete_steps() == [5, 6]
        assert ckpt.restore(model=model, opt=opt) == {"step": 1}


def _data_file(step_dir):
    return max((step_dir / "model" / "d").iterdir(), key=lambda p: p.stat().st_size)


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _zero(path):
    path.write_bytes(b"\0" * path.stat().st_size)


@pytest.mark.parametrize(
    "damage, culprit",
    [
        (lambda d: _truncate(_data_file(d)), lambda d: _data_file(d)),
        (lambda d: _zero(_data_file(d)), lambda d: _data_file(d)),
        (lambda d: (d / "model" / "manifest.ocdbt").unlink(), lambda d: d / "model/manifest.ocdbt"),
        (lambda d: _truncate(d / "model" / "_METADATA"), lambda d: d / "model" / "_METADATA"),
    ],
    ids=["truncated-data", "zeroed-data", "deleted-manifest", "truncated-metadata"],
)
def test_damaged_checkpoint_names_step_and_file(tmp_path, damage, culprit):
    model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, model=model)
    damage(tmp_path / "1")
    fresh = nnx.Linear(64, 64, rngs=nnx.Rngs(1))
    before = arrays(model=fresh)
    with Checkpointer(tmp_path) as ckpt, pytest.raises(checkpoint.CheckpointCorruptError) as caught:
        ckpt.restore(model=fresh)
    error = caught.value
    assert error.step == 1 and error.directory == os.fspath(tmp_path / "1")
    assert error.file == os.fspath(culprit(tmp_path / "1"))
    assert f"checkpoint step 1 in {tmp_path / '1'} is damaged: file {error.file}" in str(error)
    assert_same(arrays(model=fresh), before)  # nothing written


@pytest.mark.parametrize("bad", [2.5, "2", True, -1])
def test_restore_of_a_step_that_is_not_an_int_is_refused_before_anything_is_read(tmp_path, bad):
    # before: restore(2.5) restored step 2 and restore(True) step 1, without a word
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, model=model, extra={"step": step})
        fresh = nnx.Linear(2, 2, rngs=nnx.Rngs(1))
        before = arrays(model=fresh)
        with pytest.raises(ValueError, match=f"step must be a non-negative int, not {bad!r}"):
            ckpt.restore(bad, model=fresh)
        with pytest.raises(ValueError, match="step must be a non-negative int"):
            ckpt.read_extra(bad)
        assert_same(arrays(model=fresh), before)
        assert ckpt.restore(np.int64(2), model=fresh) == {"step": 2}


@pytest.mark.parametrize("lost", ["opt", "opt/_METADATA"])
def test_a_saved_optimizer_state_that_was_lost_is_damage_not_a_mismatch(tmp_path, lost):
    # before: CheckpointMismatchError "no optimizer state ('opt') was saved", and a restore of
    # the latest step stopped there instead of passing over the damaged step to the one before
    model = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, model=model, opt=opt, extra={"step": 1})
        saved = arrays(model=model, opt=opt)
        model.bias.set_value(model.bias.get_value() + 1)
        ckpt.save(2, model=model, opt=opt, extra={"step": 2})
    lost_path = tmp_path / "2" / lost
    shutil.rmtree(lost_path) if lost_path.is_dir() else lost_path.unlink()
    fresh = nnx.Linear(4, 4, rngs=nnx.Rngs(1))
    fresh_opt = nnx.Optimizer(fresh, optax.adam(0.1), wrt=nnx.Param)
    before = arrays(model=fresh, opt=fresh_opt)
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(checkpoint.CheckpointCorruptError) as caught:
            ckpt.restore(2, model=fresh, opt=fresh_opt)
        assert caught.value.step == 2 and caught.value.file == os.fspath(tmp_path / "2" / "opt")
        assert_same(arrays(model=fresh, opt=fresh_opt), before)  # nothing written
        assert ckpt.restore(2, model=fresh) == {"step": 2}  # the model alone still reads
        with pytest.warns(UserWarning, match=r"restored checkpoint step 1 .* skipped step 2"):
            assert ckpt.restore(model=fresh, opt=fresh_opt) == {"step": 1}
    assert_same(arrays(model=fresh, opt=fresh_opt), saved)


def test_a_format_that_deletes_old_steps_itself_keeps_the_newest_max_to_keep(tmp_path):
    # what the several-process format does after a commit (Orbax's manager does it for one
    # process); it once kept only the newest step while fewer than max_to_keep were saved
    for step in range(1, 6):
        (tmp_path / str(step)).mkdir()
    layout.remove_unkept(tmp_path, [1, 2], 3)
    assert sorted(os.listdir(tmp_path)) == ["1", "2", "3", "4", "5"]
    layout.remove_unkept(tmp_path, [1, 2, 3, 4, 5], None)
    assert sorted(os.listdir(tmp_path)) == ["1", "2", "3", "4", "5"]
    layout.remove_unkept(tmp_path, [1, 2, 3, 4, 5], 3)
    assert sorted(os.listdir(tmp_path)) == ["3", "4", "5"]


def test_a_save_after_a_rollback_deletes_the_abandoned_newer_steps(tmp_path, monkeypatch):
    # a run restored step 20 while 30 was on disk, then saved 21, 22: 30 was kept (as one of the
    # newest) and a later restore of the latest step silently continued the abandoned run
    # (tests/test_distributed.py checks the several-process format)
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    with Checkpointer(tmp_path, max_to_keep=3) as ckpt:
        for step in (10, 20, 30):
            ckpt.save(step, model=model, extra={"step": step})
        ckpt.restore(20, model=model)
        with monkeypatch.context() as patch:  # a save that fails deletes nothing
            patch.setattr(layout, "fsync_tree", lambda *_, **__: 1 / 0)
            with pytest.raises(ZeroDivisionError):
                ckpt.save(21, model=model, extra={"step": 21})
        assert ckpt.all_steps() == [10, 20, 30]
        with pytest.warns(UserWarning, match=r"step 21 .* deleted the newer steps \[30\]"):
            ckpt.save(21, model=model, extra={"step": 21})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ckpt.save(22, model=model, extra={"step": 22})
        assert ckpt.all_steps() == [20, 21, 22]
        assert ckpt.restore(model=model) == {"step": 22}


def test_reads_in_flight_when_one_fails_end_before_orbax_closes_their_loop(tmp_path, stray_errors):
    # Orbax 0.12.8 runs a restore in a loop of its own and closes it as soon as one read fails;
    # a TensorStore read still in flight then completed into the closed loop ("RuntimeError:
    # Event loop is closed" on stderr, one traceback per read)
    promise, in_flight = ts.Promise.new()

    async def reads():
        async def fails():
            raise ValueError("OUT_OF_RANGE: a truncated file")

        await asyncio.gather(fails(), in_flight)

    def orbax_restore():  # as orbax.checkpoint._src.asyncio_utils.run_sync runs it
        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(reads())
        finally:
            loop.close()

    done = threading.Timer(0.2, promise.set_result, [0])
    done.start()
    with pytest.raises(checkpoint.CheckpointCorruptError, match="OUT_OF_RANGE: a truncated file"):
        orbax_tree._read(3, tmp_path, orbax_restore)
    assert in_flight.done()  # the loop closed once the read in flight had ended
    done.join()
    gc.collect()
    assert stray_errors == []


def test_data_that_reads_back_different_is_caught_by_its_checksum(tmp_path, monkeypatch):
    model = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, model=model)
        meta = json.loads((tmp_path / "1" / "mmnnx" / "metadata").read_text())
        assert {"model/kernel", "model/bias"} <= meta["variables"].keys()
        assert all(isinstance(v["checksum"], int) for v in meta["variables"].values())
        # one flipped bit in the kernel as read back (a silent storage error)
        real_restore = ckpt._orbax._manager.restore

        def flipped(step, args):
            out = real_restore(step, args=args)
            if "model" in out:
                kernel = out["model"]["kernel"]
                bits = jax.lax.bitcast_convert_type(kernel, jnp.uint32)
                out["model"]["kernel"] = jax.lax.bitcast_convert_type(
                    bits.at[3, 5].set(bits[3, 5] ^ 1), jnp.float32
                )
            return out

        monkeypatch.setattr(ckpt._orbax._manager, "restore", flipped)
        fresh = nnx.Linear(8, 8, rngs=nnx.Rngs(1))
        before = arrays(model=fresh)
        with pytest.raises(checkpoint.CheckpointCorruptError, match=r"'model/kernel' reads back"):
            ckpt.restore(model=fresh)
        assert_same(arrays(model=fresh), before)


def test_restore_newest_readable_passes_over_damaged_and_incomplete_steps(tmp_path):
    model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    with Checkpointer(tmp_path) as ckpt:
        for step in (2, 4, 6):
            model.bias.set_value(jnp.full((64,), float(step)))
            ckpt.save(step, model=model, extra={"step": step})
    _truncate(_data_file(tmp_path / "6"))
    (tmp_path / "8" / "model").mkdir(parents=True)  # no step metadata
    fresh = nnx.Linear(64, 64, rngs=nnx.Rngs(1))
    with Checkpointer(tmp_path) as ckpt:
        resumed = ckpt.restore_newest_readable(model=fresh)
        assert resumed.step == 4 and resumed.extra == {"step": 4}
        assert [str(s) for s in resumed.skipped] == [
            "skipped step 8: incomplete (no metadata)",
            f"skipped step 6: damaged ({_data_file(tmp_path / '6')} cannot be read)",
        ]
        np.testing.assert_array_equal(fresh.bias.get_value(), np.full((64,), 4.0))
        # a run resumed from step 4 saves steps 6 and 8 again: the unreadable ones go aside
        assert ckpt.set_aside([s.step for s in resumed.skipped]) == ["8.unreadable", "6.unreadable"]
        assert ckpt.all_steps() == [2, 4] and ckpt.incomplete_steps() == []
        ckpt.save(6, model=model, extra={"step": 6})
        assert ckpt.latest_step() == 6 and (tmp_path / "6.unreadable" / "model").is_dir()


def test_no_readable_step_names_the_directory_and_every_step(tmp_path):
    model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(FileNotFoundError, match="no checkpoint in"):
            ckpt.restore_newest_readable(model=model)
        ckpt.save(1, model=model)
    (tmp_path / "1" / "model" / "manifest.ocdbt").unlink()
    (tmp_path / "3").mkdir()
    fresh = nnx.Linear(64, 64, rngs=nnx.Rngs(1))
    before = arrays(model=fresh)
    with Checkpointer(tmp_path) as ckpt, pytest.raises(mm.train.NoReadableCheckpointError) as e:
        ckpt.restore_newest_readable(model=fresh)
    assert e.value.directory == os.fspath(tmp_path)
    assert str(e.value) == (
        f"no readable checkpoint in {tmp_path}: skipped step 3: incomplete (no metadata); "
        f"skipped step 1: damaged ({tmp_path / '1' / 'model' / 'manifest.ocdbt'} cannot be read)"
    )
    assert_same(arrays(model=fresh), before)


# -- what a resume depends on is checked like the arrays ----------------------------------------


def _two_steps(directory) -> tuple[nnx.Linear, list]:
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    saved = []
    with Checkpointer(directory) as ckpt:
        for step in (3, 4):
            model.kernel.set_value(model.kernel.get_value() + 1)
            ckpt.save(step, model=model, extra={"step": step, "data": {"position": 10 * step}})
            saved.append(np.array(model.kernel.get_value()))
    return model, saved


@pytest.mark.parametrize("damage", ["changed", "deleted", "no orbax metadata"])
def test_a_damaged_resume_state_falls_back_to_the_newest_whole_step(tmp_path, damage):
    _, saved = _two_steps(tmp_path)
    step4 = tmp_path / "4"
    if damage == "changed":  # another valid position: before, a resume silently used it
        (step4 / "extra" / "metadata").write_text(json.dumps({"step": 4, "data": {"position": 7}}))
    elif damage == "deleted":  # before: KeyError 'data' in the resume
        shutil.rmtree(step4 / "extra")
    else:  # before: restore() said "no checkpoint"
        (step4 / "_CHECKPOINT_METADATA").unlink()
    with Checkpointer(tmp_path) as ckpt:
        if damage != "no orbax metadata":
            fresh = nnx.Linear(2, 3, rngs=nnx.Rngs(5))
            untouched = np.array(fresh.kernel.get_value())
            with pytest.raises(checkpoint.CheckpointCorruptError, match="checkpoint step 4"):
                ckpt.restore(4, model=fresh)
            np.testing.assert_array_equal(fresh.kernel.get_value(), untouched)
        fresh = nnx.Linear(2, 3, rngs=nnx.Rngs(5))
        with pytest.warns(UserWarning, match=r"restored checkpoint step 3 .* skipped step 4"):
            extra = ckpt.restore(model=fresh)
        assert extra == {"step": 3, "data": {"position": 30}}
        np.testing.assert_array_equal(fresh.kernel.get_value(), saved[0])
        resumed = ckpt.restore_newest_readable(model=fresh)
        assert resumed.step == 3 and [s.step for s in resumed.skipped] == [4]


def test_restore_never_says_no_checkpoint_when_steps_are_there_but_unreadable(tmp_path):
    _two_steps(tmp_path)
    for step in ("3", "4"):
        (tmp_path / step / "_CHECKPOINT_METADATA").unlink()
    with (
        Checkpointer(tmp_path) as ckpt,
        pytest.raises(checkpoint.NoReadableCheckpointError) as caught,
    ):
        ckpt.restore(model=nnx.Linear(2, 3, rngs=nnx.Rngs(5)))
    assert "no checkpoint in" not in str(caught.value)
    assert "step 4" in str(caught.value) and "step 3" in str(caught.value)
