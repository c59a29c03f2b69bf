"""``from_pretrained`` / ``save_pretrained`` in two real processes on loopback (started with the
launcher's environment, tests/pretrained_worker.py), one pipeline stage of 2 x 2 devices per
process: what each process reads, the pipelined logits against a float64 reference, what each
process writes, and saves that fail or lose a process half-way; a Qwen3-MoE trained with expert
parallelism against one device. The scenarios share one start of the two processes (the last
one, a process leaving mid-save, ends them), but for a second process 1 killed mid-save."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mmnnx.launcher import launch as launcher
from mmnnx.models import from_pretrained
from mmnnx.models.pretrained.files import CheckpointFiles
from tests.flags import without_device_count
from tests.hf_checkpoints import write_checkpoint
from tests.hf_reference import reference_logits
from tests.oracle import params_close
from tests.pretrained_worker import (
    MOE_BATCH,
    MOE_LR,
    MOE_MICROBATCHES,
    MOE_STEPS,
    TOKENS,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240
LAYERS = 4  # the checkpoint's; stage_rules puts layers 0-1 on process 0, 2-3 on process 1


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_checkpoint(
        tmp_path_factory.mktemp("hf") / "qwen3", architecture="Qwen3ForCausalLM", shards=3
    )


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, XLA_FLAGS=without_device_count(os.environ["XLA_FLAGS"]), **extra)


def _stage_of(name: str) -> int:
    """The process whose stage holds tensor ``name``."""
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) // (LAYERS // 2)
    return 0 if name == "model.embed_tokens.weight" else 1


def _cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    shifted = logits - logits.max(-1, keepdims=True)
    logp = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return float(-np.take_along_axis(logp, targets[..., None], -1).mean())


@dataclasses.dataclass(frozen=True)
class Pair:
    """One start of two processes of tests/pretrained_worker.py: their exit statuses, their
    output, and when process 0 ended (``time.monotonic()``)."""

    returncodes: tuple[int | None, int | None]
    outputs: tuple[str, str]
    ended: float

    def results(self, out, scenario: str) -> list[dict]:
        """What each process wrote of ``scenario`` into ``out``."""
        files = [out / scenario / f"rank{i}.json" for i in (0, 1)]
        assert all(f.exists() for f in files), self.outputs[0][-4000:] + self.outputs[1][-2000:]
        return [json.loads(f.read_text()) for f in files]


def _run_pair(scenarios: list[str], out, leave: str, timeout: float, **env: str) -> Pair:
    """``scenarios`` of tests/pretrained_worker.py, in turn, in one start of two processes with
    the launcher's environment but no launcher (it would stop process 0 itself when process 1
    leaves: process 0 must find out on its own); ``$TARGET`` is ``out/target``."""
    port = launcher.free_port()
    procs, logs = [], [out / f"process{rank}.log" for rank in (0, 1)]
    for rank in (0, 1):
        process_env = launcher.process_env(_env(), rank, 2, port, 4)
        process_env.update(
            MMNNX_HEARTBEAT_TIMEOUT="5", TARGET=str(out / "target"), LEAVE=leave, **env
        )
        with open(logs[rank], "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.pretrained_worker", ",".join(scenarios), out],
                    env=process_env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
            )
    try:
        procs[0].wait(timeout=timeout)
        ended = time.monotonic()
        procs[1].wait(timeout=30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = tuple(log.read_text() for log in logs)
    return Pair((procs[0].returncode, procs[1].returncode), outputs, ended)


@pytest.fixture(scope="module")
def pair(source, moe_source, tmp_path_factory):
    """``load_and_save``, ``train_moe`` and ``save_abandoned`` (process 1 exiting) in one start
    of the two processes: where they wrote, and the ``Pair``."""
    out = tmp_path_factory.mktemp("pair")
    scenarios = ["load_and_save", "train_moe", "save_abandoned"]
    run = _run_pair(scenarios, out, "exit", 2 * TIMEOUT_S, SOURCE=str(source),
                    MOE_SOURCE=str(moe_source))  # fmt: skip
    return out, run


@pytest.fixture(scope="module")
def launched(pair):
    """The ``load_and_save`` scenario: where it wrote, and what each process returned."""
    out, run = pair
    return out / "load_and_save", run.results(out, "load_and_save")


def test_each_process_reads_only_its_own_slices_once(source, launched):
    _, ranks = launched
    files = CheckpointFiles(source)
    for process, rank in enumerate(ranks):
        reads = [(name, tuple(map(tuple, box))) for name, box in rank["reads"]]
        assert len(reads) == len(set(reads)), "a slice read twice"
        names = {name for name, _ in reads}
        assert names == {n for n in files.tensors if _stage_of(n) == process}
        for name in names:  # the model axis (2) splits every matrix: each half read alone
            shape = files.tensors[name].shape
            boxes = [box for n, box in reads if n == name]
            assert len(boxes) == (2 if len(shape) == 2 else 1), (name, boxes)
            covered = np.zeros(shape, np.int32)
            for box in boxes:
                covered[tuple(slice(a, b) for a, b in box)] += 1
            assert (covered == 1).all(), name  # the halves tile the tensor, none overlaps


def test_pipelined_logits_and_loss_equal_the_float64_reference(source, launched):
    _, ranks = launched
    reference = reference_logits(source, TOKENS)
    batch = np.concatenate([TOKENS, TOKENS[:, :1]], axis=1)
    loss = _cross_entropy(reference_logits(source, batch[:, :-1]), batch[:, 1:])
    for rank in ranks:
        logits = np.asarray(rank["logits"])
        assert np.abs(logits - reference).max() <= 1e-5 * np.abs(reference).max()
        np.testing.assert_allclose(rank["loss"], loss, rtol=1e-5)


def test_each_process_writes_its_own_stage_and_the_copy_is_bit_exact(source, launched):
    out, _ = launched
    before, after = CheckpointFiles(source), CheckpointFiles(out / "saved")
    assert sorted(after.tensors) == sorted(before.tensors)
    for name, info in before.tensors.items():
        assert after.tensors[name].dtype == info.dtype
        np.testing.assert_array_equal(after.read(name), before.read(name))
    index = json.loads((out / "saved" / "model.safetensors.index.json").read_text())
    by_process = [{f for n, f in index["weight_map"].items() if _stage_of(n) == p} for p in (0, 1)]
    assert by_process[0] and by_process[1] and not by_process[0] & by_process[1]
    assert (out / "saved" / "config.json").read_text() != ""


def test_a_save_failing_on_one_process_raises_on_both_and_keeps_the_earlier_one(launched):
    # the bit-exact copy above is the first save, read after this second one failed over it
    out, ranks = launched
    for rank in ranks:
        assert rank["error"].startswith(
            f"RuntimeError: save_pretrained {out / 'saved'} (write) failed on process 1: "
            "OSError: disk full writing"
        ), rank["error"]
    assert sorted(p.name for p in out.iterdir()) == ["rank0.json", "rank1.json", "saved"]


@pytest.mark.parametrize("leave", ["exit", "kill"])
def test_a_process_leaving_mid_save_keeps_the_earlier_checkpoint(source, tmp_path, request, leave):
    if leave == "exit":  # the last scenario of the shared start
        out, run = request.getfixturevalue("pair")
    else:
        out, run = tmp_path, _run_pair(["save_abandoned"], tmp_path, "kill", TIMEOUT_S,
                                       SOURCE=str(source))  # fmt: skip
    output = run.outputs[0]
    started = re.search(r"ABANDONED SCENARIO STARTED AT (\S+)", output)
    assert started, output[-3000:]
    assert run.ended - float(started.group(1)) < 120  # loading, two saves and the failure
    assert "WRITTEN ['model-00002-of-00002.safetensors']" in run.outputs[1]
    target = out / "target"
    if leave == "exit":  # process 0 raises, naming process 1, and fails in turn
        assert run.returncodes == (1, 3), output[-3000:]
        assert (
            f"PeerExitedError: save_pretrained {target} (write): process 1 failed while "
            "this process waited for it"
        ) in output, output[-3000:]
        assert not (out / ".target.partial").exists()
    else:  # killed: JAX's coordination service ends process 0 at the heartbeat timeout
        assert run.returncodes[1] == -signal.SIGKILL
        assert run.returncodes[0] != 0 and "heartbeat" in output, output[-3000:]
    before, after = CheckpointFiles(source), CheckpointFiles(target)
    assert sorted(after.tensors) == sorted(before.tensors)
    for name, info in before.tensors.items():
        assert after.tensors[name].dtype == info.dtype == "F32"
        np.testing.assert_array_equal(after.read(name), before.read(name))


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory):
    return write_checkpoint(
        tmp_path_factory.mktemp("hf") / "qwen3-moe", architecture="Qwen3MoeForCausalLM", shards=3
    )


@pytest.fixture(scope="module")
def moe_trained(pair):
    """The ``train_moe`` scenario: where it wrote, and what each process returned."""
    out, run = pair
    return out / "train_moe", run.results(out, "train_moe")


def _one_device_training(source):
    """``MOE_STEPS`` AdamW steps of the checkpoint's model on one device, microbatch by
    microbatch: the losses, the first step's gradients and the model after them."""
    model = from_pretrained(source)
    opt = nnx.Optimizer(model, optax.adamw(MOE_LR), wrt=nnx.Param)
    grad_fn = nnx.jit(nnx.value_and_grad(lambda m, b: m.loss(b)))
    update = nnx.jit(lambda model, opt, grads: opt.update(model, grads))
    # the microbatches' mean in one program (leaf by leaf, eagerly: a compile per shape, 4 s)
    mean = jax.jit(lambda *grads: jax.tree.map(lambda *g: sum(g) / MOE_MICROBATCHES, *grads))
    losses, first = [], None
    for _ in range(MOE_STEPS):
        results = [grad_fn(model, b) for b in jnp.split(MOE_BATCH, MOE_MICROBATCHES)]
        losses.append(np.mean([float(loss) for loss, _ in results]))
        grads = mean(*[g for _, g in results])
        first = first or grads
        update(model, opt, grads)
    return losses, first, model


def test_a_moe_trained_pipelined_with_expert_parallelism_equals_one_device(moe_source, moe_trained):
    out, ranks = moe_trained
    losses, grads, ref = _one_device_training(moe_source)
    for rank in ranks:
        assert rank["experts_per_device"] == [4]  # 8 experts, EP 2
        np.testing.assert_allclose(rank["losses"], losses, rtol=1e-5)
    trained = from_pretrained(out / "trained")  # written by both processes, each its stage
    assert sorted(CheckpointFiles(out / "trained").tensors) == sorted(
        CheckpointFiles(moe_source).tensors
    )
    params_close(trained, ref, grads, steps=MOE_STEPS, lr=MOE_LR)


def test_each_process_reads_its_stages_experts_once_and_whole(moe_source, moe_trained):
    _, ranks = moe_trained
    files = CheckpointFiles(moe_source)
    for process, rank in enumerate(ranks):
        names = [name for name, _ in rank["reads"]]
        assert sorted(names) == sorted(n for n in files.tensors if _stage_of(n) == process)
        for name, box in rank["reads"]:  # no model axis: each expert's tensors read whole
            assert [tuple(b) for b in box] == [(0, n) for n in files.tensors[name].shape], name
