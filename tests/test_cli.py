"""The `mmnnx train` command: bad input exits 2 in one line; a tiny run trains and resumes."""

import contextlib
import importlib
import io
import json
import os
import signal
from tempfile import mkdtemp

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import mmnnx as mm
from mmnnx.cli import main
from mmnnx.train import BPETokenizer, load_tokenizer
from mmnnx.train.checkpoint.integrity import extra_checksum
from mmnnx.train.data import TextDataset
from mmnnx.train.run_record import RunRecord


@pytest.mark.parametrize(
    "argv, reason",
    [
        (["--stages", "3"], "needs 12 devices, but --devices is 8"),
        (["--depth", "1"], "--depth 1 gives fewer blocks than --stages 2"),
        (["--depth", "5", "--scan-layers"], "--stages 2 does not divide it"),
        (["--memory-budget", "-1"], "--memory-budget"),
        (["--partition", "3,2"], "--partition 3,2 gives 5 blocks, but the model has 4 (--depth 4)"),
        (["--partition", "1,1,2"], "gives 3 stages, but --stages 2 x --virtual-stages 1 makes 2"),
        (["--partition", "auto", "--scan-layers"], "--partition auto needs the blocks as a list"),
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
        (["--virtual-stages", "2"], "--schedule 1f1b needs --virtual-stages 1 (one stage per"),
        (["--schedule", "auto", "--virtual-stages", "2"], "auto needs --virtual-stages 1"),
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
        (  # issue 69 (e): past E no expert drops a token; 1e9 overflowed in JAX
            ["--experts", "4", "--capacity-factor", "1e9"],
            "--capacity-factor 1e+09 is more than --experts 4: from 2 (E / K) on no expert",
        ),
        (  # issue 69 (f): before anything is loaded, not add_lora's traceback
            ["--lora-rank", "2", "--lora-targets", "router"],
            "--lora-targets router: the model has no mixture of experts (--experts); its "
            "projections are q,k,v,out,up,down",
        ),
        (
            ["--lora-rank", "2", "--lora-targets", "gate"],
            "--lora-targets gate: the model has no gated MLP (--gated-mlp)",
        ),
        (  # found only on the devices there are (this process's 8)
            [
                "--resume",
                "--output-dir",
                "/nonexistent/run",
                "--stages",
                "4",
                "--model-axis",
                "4",
                "--devices",
                "32",
            ],
            "only 8 devices are available; --stages 4 x --data-axis 2 x --model-axis 4 needs 32; "
            "--resume narrows only --data-axis, and --data-axis 1 needs 16",
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
        (["--partition", "even"], "--partition must be params, auto or blocks per stage such as"),
        (["--partition", "1,0,1"], "only the first and the last may be 0), got '1,0,1'"),
        (  # issue 69 (c): not argparse's "expected one argument"
            ["--partition", "-1,3"],
            "error: --partition must be params, auto or blocks per stage such as 3,1 (only the "
            "first and the last may be 0), got '-1,3'",
        ),
        (["--output-dir", "-run"], "--output-dir -run: a value starting with '-' reads as a flag"),
        (["--wandb", ""], "--wandb must not be empty, got ''"),  # issue 69 (d)
        (["--wandb", "p", "--wandb-name", " "], "--wandb-name must not be empty"),
        (
            ["--data-ax", "1"],
            "unrecognized arguments: --data-ax 1",
        ),  # issue 69 (b): no abbreviation
        (["--exp", "4"], "unrecognized arguments: --exp 4"),
    ],
)
def test_bad_values_exit_2(argv, reason, capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and reason in err


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--run", "r", "--prompt", "p", "--temp", "1"],
        ["export", "--run", "r", "--output", "o", "--over"],
        ["launch", "-n", "1", "--devices", "1", "--", "true"],
    ],
)
def test_no_command_takes_an_abbreviated_flag(argv, capsys):
    """Issue 69 (b): ``allow_abbrev=False`` for every parser."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and "unrecognized arguments: --" in capsys.readouterr().err


def test_a_budget_nothing_fits_exits_2_with_the_candidates(tmp_path, capsys):
    # the model of test_tiny_run_trains_and_resumes, whose --schedule auto then finds the
    # candidates' programs compiled (one compilation cache for the run)
    argv = ["train", "--dim", "32", "--depth", "2", "--heads", "2", "--seq-len", "16"]
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
        "--partition",
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
    # the schedule measured and chosen for this model. All in this process (each start costs
    # seconds): `python -m mmnnx train` started as a command, setting its devices itself, is
    # tests/test_run_log.py's test_without_a_terminal_it_prints_a_line_per_interval_...
    capsys.readouterr()
    auto = ["--steps", "8", "--schedule", "auto", "--memory-budget", "1GiB"]
    assert main([*base, *auto]) == 0
    first = capsys.readouterr().out
    assert "mm.schedules.tune" in first and "schedule auto: " in first
    assert "Totals per task" in first and "run report" in first
    assert "pipeline bubble (step 3, measured)" in first
    for name in ("metrics.jsonl", "loss.png", "timeline.png"):
        assert (out / name).stat().st_size > 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert evals[-1] < 0.8 * 5.6  # well below uniform over 256 bytes
    # resumed with packed residuals, the same state either way
    assert main([*base, "--steps", "12", "--resume", "--pack-residuals"]) == 0
    assert "resumed from step 8" in capsys.readouterr().out
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 12
    assert main([*base, "--steps", "12"]) == 2
    assert "already holds checkpoints; pass --resume" in capsys.readouterr().err
    # --resume is what an invocation did, not a setting of the run: a --config of the run's
    # config.toml does not resume by itself
    assert "resume" not in (out / "config.toml").read_text()
    assert main(["train", "--config", str(out / "config.toml")]) == 2
    assert "already holds checkpoints; pass --resume" in capsys.readouterr().err
    for extra, reason in [
        (["--steps", "10", "--resume"], "is step 12; --steps 10 trains nothing more"),
        (["--steps", "16", "--resume", "--dim", "64"], f"--dim 64: the run in {out} was trained"),
    ]:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and reason in err, err


@pytest.mark.slow
def test_a_planned_partition_trains_and_resumes_with_its_split(tmp_path, capsys):
    """``--partition auto``: the blocks' split measured and planned with the schedule and the
    microbatch count (``--schedule auto``), the table printed, the split recorded with the
    checkpoints; ``--resume`` places the blocks as planned, without planning again. The model
    is a mixture of experts trained on packed records (issue 71: ``--data`` works with both),
    its routers' metrics in TensorBoard."""
    from tests.test_run_log import read_scalars

    data = tmp_path / "records.jsonl"
    records = [{"prompt": f"{i} plus {i} is ", "completion": f"{2 * i}."} for i in range(60)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    argv = ["--depth", "3", "--steps", "2", "--eval-every", "2", "--eval-batches", "1"]
    argv += ["--timeline-step", "0", "--partition", "auto", "--schedule", "auto"]
    argv += ["--data", str(data), "--pack", "--experts", "4"]
    base = ["train", *TINY, "--microbatches", "2", "--output-dir", str(tmp_path / "run")]
    assert main([*base, *argv]) == 0
    out = capsys.readouterr().out
    scalars = read_scalars(tmp_path / "run" / "tensorboard")
    assert [s for s, _ in scalars["router_aux_loss"]] == [2] and "eval_loss" in scalars
    assert "mm.schedules.partition: GPT.blocks as " in out and "runners-up" in out
    line = next(x for x in out.splitlines() if x.startswith("partition auto: "))
    sizes = line.split()[2]  # "2/1"
    assert "mm.schedules.tune" not in out  # the planner chose the schedule
    recorded = saved_extra(tmp_path / "run" / "checkpoints" / "2")["partition"]["sizes"]
    assert "/".join(map(str, recorded)) == sizes
    resume = ["--depth", "3", "--steps", "3", "--resume", "--schedule", "1f1b"]  # may change
    assert main([*base, *resume]) == 0
    out = capsys.readouterr().out
    assert f"the split the run was planned with, {sizes} blocks per stage" in out
    assert "mm.schedules.partition" not in out
    assert main([*base, *argv, "--text", str(data), "--output-dir", str(tmp_path / "t")]) == 2
    assert "--data rules out --text (train on one or the other)" in capsys.readouterr().err


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


def _files(folder) -> dict:
    """Every file under ``folder``, by path, with its bytes (directories as None)."""
    return {p: p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def _unwritable(path):
    path.mkdir()
    path.chmod(0o555)


@pytest.mark.parametrize(
    "name, make, reason",
    [
        (
            "tensorboard",
            lambda p: p.write_text(""),
            "is a file, but the run writes the TensorBoard",
        ),
        (
            "tokenizer",
            lambda p: p.write_text(""),
            "is a file, but the run writes the run's tokenizer",
        ),
        ("config.toml", os.mkdir, "is a directory, but the run writes the run's flags to a file"),
        ("metrics.jsonl", os.mkdir, "is a directory, but the run writes the metrics to a file"),
        ("loss.png", os.mkdir, "is a directory, but the run writes the loss curve to a file"),
        pytest.param(
            "tensorboard",
            _unwritable,
            "is not writable (the TensorBoard event files); make it writable or choose another "
            "--output-dir (or pass --no-tensorboard)",
            marks=pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod 555"),
        ),
    ],
    ids=["tensorboard-file", "tokenizer-file", "config-dir", "metrics-dir", "loss-dir", "ro-tb"],
)
def test_a_path_the_run_writes_in_the_way_exits_2_before_anything_is_built(
    tmp_path, capsys, name, make, reason
):
    out = tmp_path / "run"
    out.mkdir()
    make(out / name)
    before = _files(tmp_path)
    assert main(["train", "--output-dir", str(out), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"mmnnx train: error: --output-dir {out}: {out / name} {reason}"
    ), err
    assert _files(tmp_path) == before


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


def edit_extra(step_dir, **changes) -> None:
    """Changes the step's ``extra`` by hand, its checksum made to match (no damage to read)."""
    extra = {**saved_extra(step_dir), **changes}
    (step_dir / "extra" / "metadata").write_text(json.dumps(extra))
    meta = json.loads((step_dir / "mmnnx" / "metadata").read_text())
    meta["extra_checksum"] = extra_checksum(extra)
    (step_dir / "mmnnx" / "metadata").write_text(json.dumps(meta))


@pytest.mark.slow
def test_resume_falls_back_past_damaged_and_incomplete_steps(tmp_path, capsys, stray_errors):
    run, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    every = ["--eval-every", "2", "--checkpoint-every", "4"]
    assert tiny_run(tmp_path, "run", "--steps", "8", *every) == 0
    assert [r["step"] for r in metrics(run)] == [0, 2, 4, 6, 8]
    damaged = damage(ckpt / "8")
    (ckpt / "10" / "model").mkdir(parents=True)  # a step directory without its metadata
    capsys.readouterr()

    resume = ["--steps", "12", "--resume", "--schedule-steps", "10", *every]
    assert tiny_run(tmp_path, "run", *resume) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Event loop" not in err, err
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

    # a step whose extra says another step (edited by hand, or a step directory copied) would
    # resume at the wrong step: it is damaged too
    edit_extra(ckpt / "12", step=100)
    for step in (4, 8):
        damage(ckpt / str(step))
    capsys.readouterr()
    assert tiny_run(tmp_path, "run", "--steps", "16", "--resume", *every) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # nothing else: no Orbax or asyncio traceback
    assert err.startswith(
        f"mmnnx train: error: --resume: no readable checkpoint in {ckpt}: skipped step 12: "
        f"damaged (its extra's step is 100, not 12); skipped step 8: damaged "
        f"({ckpt / '8' / 'model' / 'd'}"
    ), err
    assert "skipped step 4: damaged" in err


def preempted_while_loading(batch: int, monkeypatch) -> list[str]:
    """Makes the next run send itself SIGTERM (a preemption notice) while it reads its batch
    number ``batch``, and report its progress (``mm.distributed.progress``) into the list
    returned, as well as to a directory (as under ``mmnnx launch --step-timeout``)."""
    read, reports = 0, []
    module = importlib.import_module("mmnnx.distributed.progress")
    write = module.write
    original = TextDataset.__next__

    def next_batch(self):
        nonlocal read
        read += 1
        if read == batch:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self)

    def reported(directory, rank, record):
        reports.append(str(record))
        write(directory, rank, record)

    monkeypatch.setattr(TextDataset, "__next__", next_batch)
    monkeypatch.setattr(module, "write", reported)
    monkeypatch.setenv("MMNNX_PROGRESS_DIR", mkdtemp())
    return reports


@pytest.mark.slow
def test_extending_a_run_preempted_by_sigterm_keeps_its_schedule_and_matches_a_straight_run(
    tmp_path, capsys, monkeypatch
):
    every = ["--eval-every", "1", "--checkpoint-every", "4"]
    assert tiny_run(tmp_path, "straight", "--steps", "12", "--schedule-steps", "16", *every) == 0
    handler = signal.getsignal(signal.SIGTERM)
    reports = preempted_while_loading(6, monkeypatch)
    assert tiny_run(tmp_path, "parts", "--steps", "8", "--schedule-steps", "16", *every) == 143
    monkeypatch.undo()
    assert signal.getsignal(signal.SIGTERM) == handler
    ckpt = tmp_path / "parts" / "checkpoints"
    assert (
        f"preemption notice (SIGTERM): stopped after step 6, saved in {ckpt}; continue with "
        "--resume (TrainConfig.resume)\n"
    ) in capsys.readouterr().out
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [4, 6]
    expected = ["evaluating (step 0)"]
    for step in range(1, 7):  # fit's phases, each reported as it begins
        expected += [f"{phase} (step {step})" for phase in ("loading batch", "running the step")]
        expected.append(f"evaluating (step {step})")
        if step in (4, 6):
            expected.append(f"saving checkpoint (step {step})")
    assert reports == [*expected, "finished training (step 6)"]
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


@pytest.fixture(scope="module")
def bpe_runs(tmp_path_factory):
    """Two tiny BPE runs of 4 steps: ``straight``, and ``parts``: 2 steps by an mmnnx that
    recorded no run in its checkpoints, then resumed to 4; and what that resume said on
    stderr."""
    tmp_path = tmp_path_factory.mktemp("bpe")
    bpe = ["--tokenizer", "bpe", "--vocab-size", "300", "--eval-every", "1"]
    every = ["--checkpoint-every", "2", "--schedule-steps", "4"]
    assert tiny_run(tmp_path, "straight", "--steps", "4", *bpe, *every) == 0
    with pytest.MonkeyPatch.context() as older:
        older.setattr(RunRecord, "extra", lambda self: {})
        assert tiny_run(tmp_path, "parts", "--steps", "2", *bpe, *every) == 0
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        assert tiny_run(tmp_path, "parts", "--steps", "4", "--resume", *bpe, *every) == 0
    return tmp_path, said.getvalue()


def test_a_bpe_run_saves_its_tokenizer_and_resumes_as_a_straight_run(bpe_runs, capsys):
    tmp_path, _ = bpe_runs
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


def _truncate(path):
    path.write_text(path.read_text()[:100])


@pytest.mark.parametrize(
    "damage, prompt, reason",
    [
        (
            lambda tok: _truncate(tok / "bpe.json"),
            "the",
            "{tok}/bpe.json: not a tokenizer file the tokenizers library reads: EOF while parsing",
        ),
        (
            lambda tok: (tok / "tokenizer.json").write_text("{name: bpe}"),
            "the",
            "{tok}/tokenizer.json: not valid JSON (Expecting property name enclosed in double",
        ),
        (
            None,
            "the \udcff",  # b"the \xff" on the command line
            "--prompt is not UTF-8: byte 4 is b'\\xff' (the bpe tokenizer reads UTF-8 text only)",
        ),
    ],
    ids=["bpe-json-truncated", "tokenizer-json-not-json", "prompt-not-utf8"],
)
def test_a_bpe_run_whose_tokenizer_or_prompt_cannot_be_read_exits_2_in_one_line(
    tmp_path, capsys, damage, prompt, reason
):
    """generate, and train --resume, stop at the tokenizer: no model or checkpoint is needed."""
    run, tok = tmp_path / "run", tmp_path / "run" / "tokenizer"
    BPETokenizer.train(["the cat sat on the mat. " * 20], vocab_size=260).save(tok)
    (run / "config.toml").write_text('[model]\ndim = 32\n[training]\ntokenizer = "bpe"\n')
    (run / "checkpoints").mkdir()
    if damage:
        damage(tok)
    before = _files(run)
    assert main(["generate", "--run", str(run), "--prompt", prompt]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mmnnx generate: error: "), err
    assert reason.format(tok=tok) in err, err
    if damage:
        assert main(["train", "--output-dir", str(run), "--resume", "--steps", "1"]) == 2
        *notes, last = capsys.readouterr().err.splitlines()
        assert last == f"mmnnx train: error: {err.split(': ', 3)[3].rstrip()}", last
        assert [n for n in notes if "error" in n or "Traceback" in n] == [], notes
    assert _files(run) == before


ONE_STAGE = "--dim 16 --depth 1 --heads 2 --seq-len 8 --stages 1 --data-axis 1 --model-axis 1"
ONE_STAGE += " --batch-size 2 --microbatches 1 --eval-batches 1 --no-tensorboard"


@pytest.fixture(scope="module")
def one_step_run_said(tmp_path_factory) -> tuple:
    """A run of one step on one stage (the cheapest to make), checkpointed at step 1, its
    timeline step that step; and what it printed."""
    tmp = tmp_path_factory.mktemp("one_step")
    (tmp / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 100)
    argv = ["train", *ONE_STAGE.split(), "--steps", "1", "--text", str(tmp / "text.txt")]
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        assert main([*argv, "--timeline-step", "1", "--output-dir", str(tmp / "run")]) == 0
    return tmp / "run", said.getvalue()


@pytest.fixture
def one_step_run(one_step_run_said):
    return one_step_run_said[0]


def test_one_stage_run_has_no_timeline_to_draw(one_step_run_said):
    """One stage, one microbatch: no pipeline, so the timeline step draws nothing (it raised
    "no events to draw" at step 3, the default timeline step)."""
    out, stdout = one_step_run_said
    assert "run report" in stdout and "pipeline bubble" not in stdout
    assert (out / "loss.png").is_file() and not (out / "timeline.png").exists()


@pytest.mark.parametrize(
    "data, reason",
    [
        ({"next_index": -5}, "data state next_index -5 is not a position of the batch stream"),
        ({"next_index": "abc"}, "data state next_index 'abc' is not an integer"),
        ({"position": 3}, "data state {'position': 3} is not a Grain iterator's state"),
    ],
    ids=["negative", "string", "missing"],
)
def test_a_hand_edited_data_state_exits_2_naming_the_step(one_step_run, capsys, data, reason):
    """The step's extra edited and its checksum made to match: the step reads back whole, its
    data state is refused in one line naming the step, the checkpoints left as they were."""
    step = one_step_run / "checkpoints" / "1"
    extra_file, meta_file = step / "extra" / "metadata", step / "mmnnx" / "metadata"
    saved_extra, saved_meta = extra_file.read_text(), meta_file.read_text()
    extra = {**json.loads(saved_extra), "data": data}
    meta = {**json.loads(saved_meta), "extra_checksum": extra_checksum(extra)}
    extra_file.write_text(json.dumps(extra))
    meta_file.write_text(json.dumps(meta))
    try:
        before = _files(one_step_run / "checkpoints")
        capsys.readouterr()
        with contextlib.redirect_stdout(io.StringIO()):
            assert (
                main(["train", "--output-dir", str(one_step_run), "--resume", "--steps", "2"]) == 2
            )
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith(
            f"mmnnx train: error: --resume: checkpoint step 1 in {step.parent}: {reason}"
        ), err
        assert err.endswith(f"; move {step} aside to resume from an older step\n"), err
        assert _files(one_step_run / "checkpoints") == before
    finally:
        extra_file.write_text(saved_extra)
        meta_file.write_text(saved_meta)


def test_extending_a_run_past_the_horizon_it_was_given_stretches_the_schedule(
    bpe_runs, tmp_path, capsys
):
    # --schedule-steps given to the first run only: --resume read it back from config.toml as
    # if given again, and steps past it trained at the final rate, with no line saying so
    import shutil

    runs, _ = bpe_runs
    shutil.copytree(runs / "parts", tmp_path / "parts")
    capsys.readouterr()
    assert main(["train", "--output-dir", str(tmp_path / "parts"), "--steps", "5", "--resume"]) == 0
    assert (
        "learning-rate schedule extended from the checkpoint's 4 steps to 5 (TrainConfig.steps "
        "/ --steps)"
    ) in capsys.readouterr().out
    assert saved_extra(tmp_path / "parts" / "checkpoints" / "5")["schedule_steps"] == 5


def test_a_run_is_resumed_and_generated_from_only_with_what_it_was_trained_with(bpe_runs, capsys):
    """Each checkpoint records the options a resumed run may not change and the tokenizer's
    fingerprint; `--resume` and `generate` refuse what differs, in one line naming it, before
    anything is compiled or written. A checkpoint without a record (an older mmnnx's) resumes,
    saying it cannot be checked."""
    tmp_path, said = bpe_runs
    run, resume = tmp_path / "parts", ["--steps", "6", "--resume"]
    assert said == (
        "mmnnx train: --resume: checkpoint step 2 holds no run record (saved by an mmnnx that "
        "kept none): its options and tokenizer cannot be checked\n"
    )
    assert saved_extra(run / "checkpoints" / "4")["run"]["options"]["heads"] == 2
    config, tokenizer = run / "config.toml", run / "tokenizer"
    files = {p: p.read_bytes() for p in [config, *tokenizer.iterdir()]}
    capsys.readouterr()

    def refused(command: str = "train", *argv: str) -> str:
        if command == "train":
            status = tiny_run(tmp_path, "parts", *resume, *argv)
        else:
            status = main(["generate", "--run", str(run), "--prompt", "the"])
        err = capsys.readouterr().err
        assert status == 2 and err.count("\n") == 1, err
        return err

    trained = f"the run in {run} was trained with"
    for argv, said in [
        (["--heads", "4"], f"error: --heads 4: {trained} --heads 2 (checkpoint step 4 records it)"),
        (["--clip-grad-norm", "1"], f"--clip-grad-norm 1.0: {trained} no --clip-grad-norm ("),
        (["--scan-layers"], f"--scan-layers: {trained} no --scan-layers ("),
        (["--vocab-size", "280"], f"--vocab-size 280: {trained} --vocab-size 300 ("),
        (["--tokenizer", "bytes"], f"--tokenizer bytes: {trained} --tokenizer bpe ("),
    ]:
        err = refused("train", *argv)
        assert said in err, err
    assert "; a resumed run may change only its [layout], [logging] and [outputs] options, " in err
    assert "--steps, --schedule-steps, " in err and err.endswith(" and the process count\n")

    edited = files[config].decode().replace("gated_mlp = false", "gated_mlp = true")
    config.write_text(edited)
    said = f"error: {config} has gated_mlp = true: {trained} gated_mlp = false (checkpoint step 4"
    assert said in refused()
    assert (
        f"mmnnx generate: error: --run: {config} has gated_mlp = true, but checkpoint step 4 of "
        "the run was trained with gated_mlp = false: config.toml no longer describes the run"
    ) in refused("generate")
    config.unlink()  # the run's own options are gone: not the defaults' model instead
    assert main(["train", "--output-dir", str(run), "--steps", "6", "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mmnnx train: error: --resume: {config} is missing; a resumed run "), err
    config.write_bytes(files[config])

    size = load_tokenizer(tokenizer).vocab_size
    other = BPETokenizer.train(["pack my box with five dozen liquor jugs. " * 400], size)
    assert other.vocab_size == size  # the same shapes
    other.save(tokenizer)
    assert (
        f"error: --resume: {tokenizer} holds a tokenizer that is not the one the run was trained "
        "with (checkpoint step 4 records another): were its files replaced?\n"
    ) in refused()
    assert f"{tokenizer} holds a tokenizer that is not the one checkpoint step 4" in refused(
        "generate"
    )
    for path, content in files.items():
        path.write_bytes(content)
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "4"]
