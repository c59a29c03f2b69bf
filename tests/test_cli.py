"""The `mmnnx train` command: bad input exits 2 in one line; a tiny run trains and resumes."""

import json
import os
import subprocess
import sys

import pytest

from mmnnx.cli import main


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["--stages", "3"], "needs 12 devices, but --devices is 8"),
        (["--depth", "1"], "--depth 1 gives fewer blocks than --stages 2"),
        (["--dim", "30"], "--dim 30 is not divisible by --heads 4"),
        (
            ["--heads", "2", "--model-axis", "4", "--data-axis", "1"],
            "not divisible by --model-axis",
        ),
        (["--batch-size", "10"], "--batch-size 10 is not divisible by --microbatches 4"),
        (["--batch-size", "4"], "a microbatch of 1 sequences is not divisible by --data-axis 2"),
        (
            ["--microbatches", "1", "--batch-size", "2", "--stages", "2"],
            "needs at least as many microbatches as stages",
        ),
    ],
)
def test_inconsistent_flags_exit_2_with_one_line(argv, reason, capsys):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mmnnx train: error: ")
    assert reason in err


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--lr", "-1"], "--lr must be > 0"),
        (["--schedule", "zigzag"], "invalid choice: 'zigzag'"),
        (["--dim", "big"], "--dim must be an integer, got 'big'"),
    ],
)
def test_bad_values_exit_2(argv, reason, capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and reason in err


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in [
        "--dim",
        "--depth",
        "--heads",
        "--seq-len",
        "--batch-size",
        "--microbatches",
        "--stages",
        "--data-axis",
        "--model-axis",
        "--schedule",
        "--steps",
        "--lr",
        "--devices",
        "--checkpoint-dir",
        "--resume",
        "--output-dir",
        "--text",
    ]:
        assert flag in out


@pytest.mark.slow
def test_tiny_run_trains_and_resumes(tmp_path):
    out = tmp_path / "run"
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    base = [
        sys.executable,
        "-m",
        "mmnnx",
        "train",
        "--dim",
        "32",
        "--depth",
        "2",
        "--heads",
        "2",
        "--seq-len",
        "16",
        "--batch-size",
        "8",
        "--microbatches",
        "2",
        "--eval-every",
        "4",
        "--text",
        str(text),
        "--output-dir",
        str(out),
    ]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    first = subprocess.run(
        [*base, "--steps", "8"], capture_output=True, text=True, env=env, timeout=600
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert "Totals per task" in first.stdout and "run report" in first.stdout
    for name in ("metrics.jsonl", "loss.png", "timeline.png"):
        assert (out / name).stat().st_size > 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert evals[-1] < 0.8 * 5.6  # well below uniform over 256 bytes
    second = subprocess.run(
        [*base, "--steps", "12", "--resume"], capture_output=True, text=True, env=env, timeout=600
    )
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from step 8" in second.stdout
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 12
    again = subprocess.run(
        [*base, "--steps", "12"], capture_output=True, text=True, env=env, timeout=600
    )
    assert again.returncode == 2
    assert "already holds checkpoints; pass --resume" in again.stderr
