"""`mmnnx train --wandb PROJECT`: the TensorBoard scalars and the run's config go to a Weights &
Biases run (read back from its offline `.wandb` file), `--resume` continues that run, and a run
wandb cannot start is one line on stderr before anything is trained."""

import json
import os
import struct
import tomllib

import numpy as np
import pytest

from mmnnx.train.wandb_writer import RUN_ID_FILE, WandbWriter, stored_run_id
from tests.test_cli import tiny_run
from tests.test_run_log import read_scalars


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """wandb offline and silent, with no key and its own files under tmp_path; its settings
    read afresh from this environment (wandb keeps the first ones it reads, process-wide)."""
    import wandb  # noqa: PLC0415

    had_service = "WANDB_SERVICE" in os.environ
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))
    for name in ("WANDB_DIR", "WANDB_API_KEY", "WANDB_INIT_TIMEOUT", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc: no credentials
    wandb.teardown()
    yield monkeypatch
    wandb.teardown()
    if not had_service:  # set by wandb.setup() for child processes; the service is gone
        os.environ.pop("WANDB_SERVICE", None)


def wandb_records(path) -> list:
    """The ``Record`` protobufs of a ``.wandb`` file: a W&B header (``:W&B``, magic, version)
    then LevelDB log framing: 32 KiB blocks of chunks (CRC, length, type: full, first, middle,
    last), a block's last bytes zero when too few for a chunk's header."""
    from wandb.proto import wandb_internal_pb2  # noqa: PLC0415

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    block, at, records, parts = 32768, 7, [], b""
    while at + 7 <= len(data):
        if block - at % block < 7:
            at += block - at % block
            continue
        _, length, kind = struct.unpack("<IHB", data[at : at + 7])
        parts += data[at + 7 : at + 7 + length]
        at += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            records.append(wandb_internal_pb2.Record.FromString(parts))
            parts = b""
    return records


def history(records) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] of the history rows in ``records`` (wandb's own ``_*`` left out)."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): item.value_json
                for item in record.history.item
            }
            step = record.history.step.num
            for tag, value in row.items():
                if not tag.startswith("_"):
                    scalars.setdefault(tag, []).append((step, json.loads(value)))
    return scalars


def run_record(records):
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


def test_a_run_logs_the_tensorboard_scalars_and_its_config_and_resume_continues_it(
    tmp_path, wandb_env
):
    run = tmp_path / "run"
    every = ["--eval-every", "2", "--log-every", "2", "--checkpoint-every", "2"]
    first = ["--steps", "4", "--timeline-step", "0", *every]
    assert tiny_run(tmp_path, "run", *first, "--wandb", "proj", "--wandb-name", "tiny") == 0
    run_id = stored_run_id(run)
    assert (run / RUN_ID_FILE).read_text() == f"{run_id}\n"
    # flags not given are the run's own: --wandb and --wandb-name too
    assert tiny_run(tmp_path, "run", "--steps", "6", "--resume", *every) == 0

    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2  # one run, logged to twice
    parts = [wandb_records(f) for f in files]
    for records in parts:
        assert (run_record(records).run_id, run_record(records).project) == (run_id, "proj")
        assert run_record(records).display_name == "tiny"
    logged = history(parts[0])
    for tag, rows in history(parts[1]).items():
        logged.setdefault(tag, []).extend(rows)
    scalars = read_scalars(run / "tensorboard")
    assert set(logged) == set(scalars) == {"loss", "eval_loss", "learning_rate", "tokens_per_sec"}
    for tag, rows in scalars.items():
        assert [s for s, _ in logged[tag]] == [s for s, _ in rows], tag
        for (step, value), (_, event) in zip(logged[tag], rows, strict=True):
            assert float(np.float32(value)) == event, (tag, step)  # TensorBoard's are float32
    assert [s for s, _ in logged["eval_loss"]] == [0, 2, 4, 6]  # step 4 once: not resumed twice

    saved = tomllib.loads((run / "config.toml").read_text())  # the resumed run's
    config = {
        u.key: json.loads(u.value_json)
        for u in run_record(parts[1]).config.update
        if not u.key.startswith("_")
    }
    assert config == saved and config["logging"]["wandb"] == "proj"
    assert config["training"]["steps"] == 6 and "resume" not in config["outputs"]  # an act


def test_the_writer_honours_wandb_dir_and_resumes_the_stored_run(tmp_path, wandb_env):
    wandb_env.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    out = tmp_path / "out"
    out.mkdir()
    writer = WandbWriter.start("proj", out, config={"lr": 0.5})
    writer.add_scalar("loss", 2.5, 3)
    writer.close()
    assert writer.directory.parent == tmp_path / "elsewhere" / "wandb"
    assert not (out / "wandb").exists()
    again = WandbWriter.start("proj", out, resume=True)
    again.close()
    fresh = WandbWriter.start("proj", out)  # no resume: a run of its own
    fresh.close()
    ids = [w.run.id for w in (writer, again, fresh)]
    assert ids[0] == ids[1] != ids[2] and stored_run_id(out) == ids[2]
    records = wandb_records(next(writer.directory.glob("run-*.wandb")))
    assert history(records) == {"loss": [(3, 2.5)]}
    assert run_record(records).display_name == "out"


def test_a_run_wandb_cannot_start_is_one_line_before_training(tmp_path, wandb_env, capsys):
    """Online with no API key: wandb.init fails at once (with a key and no network it retries
    until its init timeout, ours 30 s: too long for a test)."""
    wandb_env.setenv("WANDB_MODE", "online")
    assert tiny_run(tmp_path, "run", "--steps", "2", "--wandb", "proj") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("mmnnx train: error: --wandb proj: wandb could not start a run: ")
    assert "set WANDB_MODE=offline" in err and "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "run" / "tensorboard").exists()
