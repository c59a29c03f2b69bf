"""Every schedule family from `mmnnx train`: --virtual-stages places the blocks as the schedule
needs, and the losses equal 1F1B's on the same model and data; flags a schedule cannot run with
are refused in one line naming the requirement."""

import json
import re

import numpy as np
import pytest

from mmnnx.cli import main

TINY = ["--dim", "32", "--depth", "4", "--heads", "2", "--seq-len", "16", "--batch-size", "8"]
LAYOUT = ["--stages", "2", "--data-axis", "1", "--model-axis", "1", "--microbatches", "4"]


@pytest.fixture(scope="module")
def one_f_one_b(tmp_path_factory) -> list[float]:
    """The losses of the 1F1B run (one stage per task), the reference of every schedule."""
    return losses(run(tmp_path_factory.mktemp("reference"), "1f1b", "--schedule", "1f1b"))


def run(tmp_path, name: str, *argv: str) -> list[dict]:
    """A 2-step `mmnnx train` of a 4-block GPT over 2 tasks in this process; its metrics."""
    text = tmp_path / "text.txt"
    if not text.exists():
        text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    out = tmp_path / name
    flags = ["--steps", "2", "--eval-every", "2", "--log-every", "1", "--no-tensorboard"]
    argv = ["train", *TINY, *LAYOUT, *flags, "--text", str(text), "--output-dir", str(out), *argv]
    assert main(argv) == 0
    assert not (out / "tensorboard").exists()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(rows: list[dict]) -> list[float]:
    return [r[k] for r in rows for k in ("loss", "eval_loss") if k in r]


@pytest.mark.parametrize(
    "schedule, placed_on",
    [
        ("interleaved-1f1b", "stage0, stage1, stage0, stage1"),
        ("zero-bubble-v", "stage0, stage1, stage1:1, stage0:1"),
        ("dualpipev", "stage0, stage1, stage1:1, stage0:1"),
    ],
)
def test_each_family_runs_from_the_cli_with_1f1b_s_losses(
    tmp_path, capsys, one_f_one_b, schedule, placed_on
):
    reference = one_f_one_b
    capsys.readouterr()
    rows = run(tmp_path, schedule, "--schedule", schedule, "--virtual-stages", "2")
    printed = capsys.readouterr().out
    assert len(losses(rows)) == len(reference) == 4
    np.testing.assert_allclose(losses(rows), reference, rtol=2e-5)
    assert ", ".join(report_tasks(printed)) == placed_on


def report_tasks(printed: str) -> list[str]:
    """The task of each stage in stage_rules' printed report (rows `task  blocks  params ...`)."""
    return re.findall(r"^\s*(stage\d(?::1)?)\s+\d", printed, re.MULTILINE)


def test_help_gives_each_schedule_s_requirement(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--virtual-stages", "--dtype", "--clip-grad-norm", "--log-every"):
        assert flag in out
    assert "--no-tensorboard" in out and "--profile-steps A:B" in out
    assert "zero-bubble-v, dualpipev: --virtual-stages 2" in out.replace("- ", "-")
    assert "interleaved-zero-bubble: --virtual-stages 2 or more" in out.replace("- ", "-")
    one = "1f1b, zero-bubble-h1, zero-bubble-h2: --virtual-stages 1 (one stage per task)"
    assert one in out.replace("- ", "-")
