"""The `mmnnx train` command: bad input exits 2 in one line; a tiny run trains and resumes."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import mmnnx as mm
from mmnnx.cli import main
from mmnnx.train import BPETokenizer, load_tokenizer
from tests.flags import without_device_count


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["--stages", "3"], "needs 12 devices, but --devices is 8"),
        (["--depth", "1"], "--depth 1 gives fewer blocks than --stages 2"),
        (["--depth", "5", "--scan-layers"], "--stages 2 does not divide it"),
        (["--memory-budget", "1GiB"], "--memory-budget needs --schedule auto"),
        (["--schedule", "auto", "--memory-budget", "lots"], "expected a number of bytes"),
        (["--schedule", "auto", "--memory-budget", "0"], "--memory-budget must be positive"),
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
        (["--vocab-size", "512"], "--vocab-size needs --tokenizer bpe"),
        (["--schedule", "zero-bubble-v"], "--schedule zero-bubble-v needs --virtual-stages 2 "),
        (["--schedule", "dualpipev", "--virtual-stages", "3"], "dualpipev needs --virtual-stages"),
        (["--schedule", "interleaved-1f1b"], "interleaved-1f1b needs --virtual-stages 2 or more"),
        (["--virtual-stages", "2"], "--virtual-stages 2 needs a schedule that runs several"),
        (["--schedule", "auto", "--virtual-stages", "2"], "--schedule auto runs one"),
        (
            ["--schedule", "zero-bubble-v", "--virtual-stages", "2", "--scan-layers"],
            "leave out --scan-layers",
        ),
        (
            ["--schedule", "interleaved-gpipe", "--virtual-stages", "3"],
            "--depth 4 gives fewer blocks than --stages 2 x --virtual-stages 3 stages",
        ),
        (["--profile-steps", "400:401"], "--profile-steps starts at step 400, after --steps 300"),
        (["--wandb-name", "tiny"], "--wandb-name needs --wandb PROJECT"),
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
        (["--schedule-steps", "0"], "--schedule-steps must be >= 1, got 0"),
        (["--virtual-stages", "0"], "--virtual-stages must be >= 1, got 0"),
        (["--clip-grad-norm", "0"], "--clip-grad-norm must be a finite number > 0, got '0'"),
        (["--profile-steps", "5:3"], "--profile-steps needs 1 <= FIRST <= LAST, got '5:3'"),
        (["--profile-steps", "a:b"], "--profile-steps must be FIRST:LAST steps"),
        (["--dtype", "float16"], "invalid choice: 'float16'"),
    ],
)
def test_bad_values_exit_2(argv, reason, capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and reason in err


def test_a_budget_nothing_fits_exits_2_with_the_candidates(tmp_path, capsys):
    argv = ["train", "--dim", "16", "--depth", "2", "--heads", "2", "--seq-len", "16"]
    argv += ["--batch-size", "8", "--microbatches", "2", "--steps", "1"]
    argv += ["--output-dir", str(tmp_path), "--schedule", "auto", "--memory-budget", "1KiB"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmnnx train: error: --schedule auto: tune: no candidate fits the ")
    assert "memory budget of 1,024 B" in err and "Traceback" not in err
    assert "mm.schedules.tune" in err and "over the budget of 1,024 B" in err  # the table
    assert not (tmp_path / "metrics.jsonl").exists()


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in [
        "--dim",
        "--depth",
        "--heads",
        "--scan-layers",
        "--memory-budget",
        "--pack-residuals",
        "--no-pack-residuals",
        "--no-pack-weights",
        "--seq-len",
        "--batch-size",
        "--microbatches",
        "--stages",
        "--data-axis",
        "--model-axis",
        "--schedule",
        "--steps",
        "--schedule-steps",
        "--lr",
        "--warmup-steps",
        "--weight-decay",
        "--eval-batches",
        "--log-every",
        "--timeline-step",
        "--config",
        "--devices",
        "--checkpoint-dir",
        "--resume",
        "--checkpoint-every",
        "--output-dir",
        "--text",
        "--tokenizer",
        "--vocab-size",
        "--wandb",
        "--wandb-name",
        "--gated-mlp",
        "--init-from",
        "--lora-rank",
        "--lora-alpha",
        "--lora-targets",
        "--experts",
        "--experts-per-token",
        "--expert-hidden",
        "--moe-every",
        "--capacity-factor",
        "--router-aux-loss-coef",
        "--router-z-loss-coef",
        "--expert-axis",
    ]:
        assert flag in out


def test_pack_residuals_reaches_the_train_step():
    from mmnnx.mpmd.lower.pack import residual_bound  # noqa: PLC0415
    from mmnnx.train import TrainConfig  # noqa: PLC0415
    from mmnnx.train.loop import make_steps  # noqa: PLC0415

    train, evaluate = make_steps(TrainConfig(pack_residuals=True))
    assert train.pack_residuals == residual_bound(True)
    assert evaluate.pack_residuals == mm.PACK_RESIDUAL_BYTES  # mm.jit's default
    assert make_steps(TrainConfig(pack_residuals=False))[0].pack_residuals == 0
    assert make_steps(TrainConfig())[0].pack_residuals == mm.PACK_RESIDUAL_BYTES
    with pytest.raises(TypeError, match="pack_residuals must be True, False or a number"):
        TrainConfig(pack_residuals="all")


def test_pack_weights_reaches_the_train_step():
    from mmnnx.train import TrainConfig  # noqa: PLC0415
    from mmnnx.train.loop import make_steps  # noqa: PLC0415

    assert make_steps(TrainConfig())[0].pack_weights == mm.PACK_WEIGHT_BYTES
    assert make_steps(TrainConfig(pack_weights=False))[0].pack_weights == 0
    assert make_steps(TrainConfig(pack_weights=1024))[0].pack_weights == 1024
    with pytest.raises(TypeError, match="pack_weights must be True, False or a number"):
        TrainConfig(pack_weights="all")


@pytest.mark.slow
def test_tiny_run_trains_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    base = [
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
    env = dict(os.environ, XLA_FLAGS=without_device_count(os.environ["XLA_FLAGS"]))
    first = subprocess.run(  # the schedule measured and chosen for this model
        [sys.executable, "-m", "mmnnx", *base, "--steps", "8", "--schedule", "auto"]
        + ["--memory-budget", "1GiB"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert "mm.schedules.tune" in first.stdout and "schedule auto: " in first.stdout
    assert "Totals per task" in first.stdout and "run report" in first.stdout
    assert "pipeline bubble (step 3, measured)" in first.stdout
    for name in ("metrics.jsonl", "loss.png", "timeline.png"):
        assert (out / name).stat().st_size > 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert evals[-1] < 0.8 * 5.6  # well below uniform over 256 bytes
    # the rest in this process (the command's own start is checked above; each start costs
    # seconds): resumed with packed residuals, the same state either way
    assert main([*base, "--steps", "12", "--resume", "--pack-residuals"]) == 0
    assert "resumed from step 8" in capsys.readouterr().out
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 12
    assert main([*base, "--steps", "12"]) == 2
    assert "already holds checkpoints; pass --resume" in capsys.readouterr().err
    for extra, reason in [
        (["--steps", "10", "--resume"], "is step 12; --steps 10 trains nothing more"),
        (["--steps", "16", "--resume", "--dim", "64"], "--resume: checkpoint step 12: 'model/"),
    ]:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and reason in err, err


def test_one_stage_run_has_no_timeline_to_draw(tmp_path, capsys):
    """One stage, one microbatch: no pipeline, so the timeline step draws nothing (it raised
    "no events to draw" at step 3)."""
    out = tmp_path / "run"
    flags = "--dim 32 --depth 2 --heads 2 --seq-len 16 --stages 1 --data-axis 1 --model-axis 1"
    flags += " --batch-size 2 --microbatches 1 --steps 3 --eval-every 3"
    assert main(["train", *flags.split(), "--output-dir", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "run report" in stdout and "pipeline bubble" not in stdout
    assert (out / "loss.png").is_file() and not (out / "timeline.png").exists()


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


TINY = ["--dim", "32", "--depth", "2", "--heads", "2", "--seq-len", "16", "--batch-size", "8"]


def tiny_run(tmp_path, run: str, *argv: str) -> int:
    """``mmnnx train`` in this process on a tiny GPT and a short text, writing to tmp_path/run."""
    text = tmp_path / "text.txt"
    if not text.exists():
        text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    base = ["train", *TINY, "--microbatches", "2", "--text", str(text)]
    return main([*base, "--output-dir", str(tmp_path / run), *argv])


def damage(step_dir):
    """Truncates the largest data file of the step's model item; returns its path."""
    data = max((step_dir / "model" / "d").iterdir(), key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    return data


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def saved_extra(step_dir) -> dict:
    return json.loads((step_dir / "extra" / "metadata").read_text())


@pytest.mark.slow
def test_resume_falls_back_past_damaged_and_incomplete_steps(tmp_path, capsys):
    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    every = ["--eval-every", "2", "--checkpoint-every", "4"]
    assert tiny_run(tmp_path, "run", "--steps", "8", *every) == 0
    assert [r["step"] for r in metrics(run)] == [0, 2, 4, 6, 8]
    damaged = damage(ckpt / "8")
    (ckpt / "10" / "model").mkdir(parents=True)  # a step directory without its metadata
    capsys.readouterr()

    resume = ["--steps", "12", "--resume", "--schedule-steps", "10", *every]
    assert tiny_run(tmp_path, "run", *resume) == 0
    out = capsys.readouterr().out
    assert (
        f"resumed from step 4 ({ckpt}); skipped step 10: incomplete (no metadata), set aside as "
        f"10.unreadable; skipped step 8: damaged ({damaged} cannot be read), set aside as "
        "8.unreadable\n"
    ) in out
    assert (
        "learning-rate schedule over 10 steps as given (TrainConfig.schedule_steps / "
        "--schedule-steps), not the 8 steps saved with the checkpoint\n"
    ) in out
    # the lines of steps 6 and 8 from before the resume are gone: no step repeats
    assert [r["step"] for r in metrics(run)] == [0, 2, 4, 6, 8, 10, 12]
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == [
        "10.unreadable",
        "12",
        "4",
        "8",
        "8.unreadable",
    ]
    assert saved_extra(ckpt / "4")["schedule_steps"] == 8
    assert saved_extra(ckpt / "12")["schedule_steps"] == 10

    for step in (4, 8, 12):
        damage(ckpt / str(step))
    capsys.readouterr()
    assert tiny_run(tmp_path, "run", "--steps", "16", "--resume", *every) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(
        f"mmnnx train: error: --resume: no readable checkpoint in {ckpt}: skipped step 12: "
        f"damaged ({ckpt / '12' / 'model' / 'd'}"
    ), err
    assert "skipped step 8: damaged" in err and "skipped step 4: damaged" in err


@pytest.mark.slow
def test_extending_a_run_keeps_its_schedule_and_matches_a_straight_run(tmp_path, capsys):
    every = ["--eval-every", "1", "--checkpoint-every", "4"]
    assert tiny_run(tmp_path, "straight", "--steps", "12", "--schedule-steps", "16", *every) == 0
    assert tiny_run(tmp_path, "parts", "--steps", "8", "--schedule-steps", "16", *every) == 0
    capsys.readouterr()
    assert tiny_run(tmp_path, "parts", "--steps", "12", "--resume", *every) == 0  # keeps 16
    assert "learning-rate schedule over" not in capsys.readouterr().out
    straight, parts = metrics(tmp_path / "straight"), metrics(tmp_path / "parts")
    assert [r["step"] for r in parts] == list(range(13))
    for a, b in zip(straight, parts, strict=True):
        a.pop("tokens_per_s", None), b.pop("tokens_per_s", None)
        assert a == b  # step, loss and eval loss, to the last bit
    for item in ("model", "opt"):
        a = ocp.StandardCheckpointer().restore(tmp_path / "straight" / "checkpoints" / "12" / item)
        b = ocp.StandardCheckpointer().restore(tmp_path / "parts" / "checkpoints" / "12" / item)
        flat_a, flat_b = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
        assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
        for (path, x), (_, y) in zip(flat_a, flat_b, strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(path))
    assert saved_extra(tmp_path / "parts" / "checkpoints" / "12")["schedule_steps"] == 16


def test_a_bpe_run_saves_its_tokenizer_and_resumes_as_a_straight_run(tmp_path, capsys):
    bpe = ["--tokenizer", "bpe", "--vocab-size", "300", "--eval-every", "1"]
    every = ["--checkpoint-every", "2", "--schedule-steps", "4"]
    assert tiny_run(tmp_path, "straight", "--steps", "4", *bpe, *every) == 0
    assert tiny_run(tmp_path, "parts", "--steps", "2", *bpe, *every) == 0
    assert tiny_run(tmp_path, "parts", "--steps", "4", "--resume", *bpe, *every) == 0
    straight, parts = metrics(tmp_path / "straight"), metrics(tmp_path / "parts")
    for a, b in zip(straight, parts, strict=True):
        a.pop("tokens_per_s", None), b.pop("tokens_per_s", None)
        assert a == b  # the same batches in the same order: losses to the last bit
    assert saved_extra(tmp_path / "parts" / "checkpoints" / "4")["data"] == {"next_index": 4}
    tokenizer = load_tokenizer(tmp_path / "parts" / "tokenizer")
    assert isinstance(tokenizer, BPETokenizer) and 256 < tokenizer.vocab_size <= 300
    assert tokenizer.to_str() == load_tokenizer(tmp_path / "straight" / "tokenizer").to_str()
    text = (tmp_path / "text.txt").read_text()
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer.encode(text)) < len(text) / 3
    capsys.readouterr()
    refused = tiny_run(tmp_path, "parts", "--steps", "6", "--resume", "--tokenizer", "bytes")
    err = capsys.readouterr().err
    assert refused == 2 and err.count("\n") == 1, err
    assert "--tokenizer bytes: the run in" in err and "with --tokenizer bpe" in err
