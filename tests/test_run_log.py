"""What `mmnnx train` reports as it goes: plain lines without a terminal, evaluation losses as
they come, TensorBoard event files (read back) and a jax.profiler trace; wandb is not imported
unless asked for (tests/test_wandb.py)."""

import io
import json
import os
import re
import struct
import subprocess
import sys

from rich.console import Console
from tensorboardX.proto import event_pb2

from mmnnx.train.run_log import RunLog
from tests.flags import without_device_count

TINY = "--dim 32 --depth 2 --heads 2 --seq-len 16 --batch-size 4 --microbatches 2 --stages 2"
TINY += " --data-axis 1 --model-axis 1 --devices 2"


def read_scalars(directory) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``directory``: tag -> [(step, value)], read from
    the TFRecord framing (length, its CRC, the Event protobuf, its CRC)."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        for event in _events(path):
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def _events(path) -> list:
    """The Event protobufs of one event file, in order."""
    data, at, events = path.read_bytes(), 0, []
    while at < len(data):
        (length,) = struct.unpack("<Q", data[at : at + 8])
        events.append(event_pb2.Event.FromString(data[at + 12 : at + 12 + length]))
        at += 12 + length + 4
    return events


def test_without_a_terminal_it_prints_a_line_per_interval_and_evaluation_and_writes_events(
    tmp_path,
):
    text, out = tmp_path / "text.txt", tmp_path / "run"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    # steps 4-5 traced: after the evaluation at step 3 and the timed step 3 (--timeline-step's
    # default), whose compiles a trace of steps 2-3 recorded (30 MB, 4 s more CPU than this)
    flags = f"{TINY} --steps 6 --eval-every 3 --log-every 2 --profile-steps 4:5"
    env = dict(os.environ, XLA_FLAGS=without_device_count(os.environ["XLA_FLAGS"]))
    run = subprocess.run(  # stdout a pipe, as under nohup, SLURM or CI; imports on stderr
        [sys.executable, "-X", "importtime", "-m", "mmnnx", "train", *flags.split()]
        + ["--text", str(text)]
        + ["--output-dir", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = re.findall(r"^step (\d+)/6 (loss|eval_loss) (\S+)(.*)$", run.stdout, re.MULTILINE)
    assert [(int(s), kind) for s, kind, _, _ in lines] == [
        (0, "eval_loss"),
        (2, "loss"),
        (3, "eval_loss"),
        (4, "loss"),
        (6, "loss"),
        (6, "eval_loss"),
    ]  # in order, as they came
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in rows}
    for step, kind, value, rest in lines:
        assert float(value) == round(by_step[int(step)][kind], 4)
        if kind == "loss":
            tps, lr = re.fullmatch(r" tokens/s (\S+) lr (\S+)", rest).groups()
            assert float(lr) == float(f"{by_step[int(step)]['learning_rate']:.2e}")
            assert float(tps.replace(",", "")) > 0
    assert " tok/s" not in run.stdout  # no progress bar drawn into the pipe
    imported = re.findall(r"^import time:.*\|\s*(\S+)$", run.stderr, re.MULTILINE)
    assert "tensorboardX" in imported and "wandb" not in imported  # slow: only with --wandb

    scalars = read_scalars(out / "tensorboard")
    assert set(scalars) == {"loss", "eval_loss", "learning_rate", "tokens_per_sec"}
    for tag, key in (("loss", "loss"), ("learning_rate", "learning_rate")):
        assert [s for s, _ in scalars[tag]] == [2, 4, 6]
        for step, value in scalars[tag]:
            assert abs(value - by_step[step][key]) <= 1e-6 * abs(by_step[step][key])
    assert [s for s, _ in scalars["eval_loss"]] == [0, 3, 6]
    for step, value in scalars["eval_loss"]:
        assert abs(value - by_step[step]["eval_loss"]) <= 1e-6 * by_step[step]["eval_loss"]
    assert [s for s, _ in scalars["tokens_per_sec"]] == [2, 4, 6]
    assert list((out / "profile").rglob("*.xplane.pb"))  # the jax.profiler trace


def test_on_a_terminal_the_bar_shows_training_and_evaluations_print_as_they_come(tmp_path):
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    with RunLog(console, tmp_path, total_steps=4, tensorboard=False) as log:
        assert not log.plain
        log.train(2, loss=1.5, tokens_per_s=10.0, learning_rate=1e-3)
        log.evaluation(2, 1.25)
    assert console.file.getvalue().splitlines() == ["step 2/4 eval_loss 1.2500"]
    assert not (tmp_path / "tensorboard").exists() and not (tmp_path / "profile").exists()


def test_a_resumed_run_s_events_replace_those_beyond_its_step(tmp_path):
    with RunLog(Console(file=io.StringIO()), tmp_path, total_steps=4) as log:
        for step in (0, 2, 4):
            log.evaluation(step, float(step))
    with RunLog(Console(file=io.StringIO()), tmp_path, total_steps=4, first_step=2) as log:
        log.evaluation(2, -1.0)  # the step resumed from: written by the first run
        log.evaluation(4, 40.0)
    scalars = read_scalars(tmp_path / "tensorboard")
    # both files keep their events; the second starts with a purge of steps > 2 (TensorBoard
    # drops the first run's step 4), and the step resumed from is not written twice
    assert scalars["eval_loss"] == [(0, 0.0), (2, 2.0), (4, 4.0), (4, 40.0)]
    second = (tmp_path / "tensorboard").glob("*.from-step-2")
    assert (3, event_pb2.SessionLog.START) in _session_logs(next(second))


def _session_logs(path) -> list[tuple[int, int]]:
    """``(step, status)`` of the SessionLog events of one event file (a purge is a START)."""
    return [(e.step, e.session_log.status) for e in _events(path) if e.HasField("session_log")]
