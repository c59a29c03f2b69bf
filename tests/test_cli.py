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
        (["--dim", "30", "--heads", "2"], "heads of 15 dimensions; rotary position embeddings"),
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
        (["--lr", "-1"], "--lr must be a finite number > 0, got '-1'"),
        (["--schedule", "zigzag"], "invalid choice: 'zigzag'"),
        (["--dim", "big"], "--dim must be an integer, got 'big'"),
        (["--lr", "nan"], "--lr must be a finite number > 0, got 'nan'"),
        (["--lr", "inf"], "--lr must be a finite number > 0, got 'inf'"),
        (["--seed", "-1"], "--seed must be >= 0, got -1"),
        (["--checkpoint-every", "0"], "--checkpoint-every must be >= 1"),
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
        "--checkpoint-every",
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
    for extra, reason in [
        (["--steps", "10", "--resume"], "is step 12; --steps 10 trains nothing more"),
        (["--steps", "16", "--resume", "--dim", "64"], "--resume: checkpoint step 12: 'model/"),
    ]:
        refused = subprocess.run(
            [*base, *extra], capture_output=True, text=True, env=env, timeout=600
        )
        assert refused.returncode == 2, refused.stderr[-2000:]
        assert refused.stderr.count("\n") == 1 and reason in refused.stderr, refused.stderr


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda d: d / "missing.txt", "text file {d}/missing.txt does not exist"),
        (lambda d: (d / "empty.txt").write_text("") or d / "empty.txt", "gives 0 training windows"),
        (lambda d: (d / "folder").mkdir() or d / "folder", "no *.txt files in directory"),
        (lambda d: (d / "short.txt").write_text("abc") and d / "short.txt", "0 training windows"),
        (
            lambda d: (d / "latin1.txt").write_bytes("café".encode("latin-1")) and d / "latin1.txt",
            "text file {d}/latin1.txt is not UTF-8: byte 3 is b'\\xe9'",
        ),
    ],
    ids=["missing", "empty", "no-txt-in-dir", "too-short", "not-utf8"],
)
def test_bad_text_exits_2_with_one_line(tmp_path, capsys, make, reason):
    path = make(tmp_path)
    argv = ["train", "--text", str(path), "--output-dir", str(tmp_path / "out"), "--steps", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mmnnx train: error: "), err
    assert reason.format(d=tmp_path) in err


def test_paths_that_are_files_exit_2_before_training(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    for flag in ("--output-dir", "--checkpoint-dir"):
        assert main(["train", flag, str(tmp_path / "file")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{flag} {tmp_path / 'file'} is a file" in err
