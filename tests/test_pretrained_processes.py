"""``from_pretrained`` / ``save_pretrained`` in two real processes on loopback (``mmnnx launch``,
tests/pretrained_worker.py), one pipeline stage of 2 x 2 devices per process: what each process
reads, the pipelined logits against a float64 reference, what each process writes, and saves
that fail or lose a process half-way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mmnnx.launcher import launch as launcher
from mmnnx.models.pretrained.files import CheckpointFiles
from tests.flags import without_device_count
from tests.hf_checkpoints import write_checkpoint
from tests.hf_reference import reference_logits
from tests.pretrained_worker import TOKENS

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


@pytest.fixture(scope="module")
def launched(source, tmp_path_factory):
    """The ``load_and_save`` scenario run once under ``mmnnx launch -n 2``."""
    out = tmp_path_factory.mktemp("launched")
    proc = subprocess.run(
        [sys.executable, "-m", "mmnnx", "launch", "-n", "2", "--devices-per-process", "4",
         "--", sys.executable, "-m", "tests.pretrained_worker", "load_and_save", str(out)],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=_env(SOURCE=str(source)),
        cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in (0, 1)]
    return out, ranks


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
def test_a_process_leaving_mid_save_keeps_the_earlier_checkpoint(source, tmp_path, leave):
    # no launcher (it would stop process 0 itself): process 0 must find out on its own
    target = tmp_path / "target"
    port = launcher.free_port()
    started = time.monotonic()
    procs = []
    for rank in (0, 1):
        env = launcher.process_env(_env(), rank, 2, port, 4)
        env.update(MMNNX_HEARTBEAT_TIMEOUT="5", SOURCE=str(source), TARGET=str(target), LEAVE=leave)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.pretrained_worker", "save_abandoned", str(tmp_path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=ROOT,
            )  # fmt: skip
        )
    try:
        out, _ = procs[0].communicate(timeout=TIMEOUT_S)
        left = procs[1].wait(timeout=30)
        assert time.monotonic() - started < 120  # loading, two saves and the failure
        assert "WRITTEN ['model-00002-of-00002.safetensors']" in procs[1].stdout.read()
        if leave == "exit":  # process 0 raises, naming process 1, and fails in turn
            assert left == 3 and procs[0].returncode == 1, out[-3000:]
            assert (
                f"PeerExitedError: save_pretrained {target} (write): process 1 failed while "
                "this process waited for it"
            ) in out, out[-3000:]
            assert not (tmp_path / ".target.partial").exists()
        else:  # killed: JAX's coordination service ends process 0 at the heartbeat timeout
            assert left == -signal.SIGKILL
            assert procs[0].returncode != 0 and "heartbeat" in out, out[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    before, after = CheckpointFiles(source), CheckpointFiles(target)
    assert sorted(after.tensors) == sorted(before.tensors)
    for name, info in before.tensors.items():
        assert after.tensors[name].dtype == info.dtype == "F32"
        np.testing.assert_array_equal(after.read(name), before.read(name))
