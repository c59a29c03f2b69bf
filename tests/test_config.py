"""`mmnnx train --config FILE.toml`: tables are the flag groups, flags override the file, bad
files exit 2 in one line; every run writes its resolved flags, which `--resume` reads back, and
a resume beyond the saved learning-rate horizon extends it, saying so."""

import dataclasses
import json
import tomllib

import pytest
from rich.console import Console

from mmnnx.cli import main, parse_args
from mmnnx.cli.flags import GIVEN
from mmnnx.train import TrainConfig
from mmnnx.train.config import RunConfig
from mmnnx.train.loop import _resumed_horizon, learning_rates
from mmnnx.train.options import spec, tables
from mmnnx.train.run_config import read_config, resolved_config, write_config


def write(tmp_path, text: str | bytes, name: str = "run.toml"):
    path = tmp_path / name
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    return path


def test_flags_override_the_file_which_overrides_the_defaults(tmp_path):
    path = write(
        tmp_path,
        "[model]\ndim = 64\nseq-len = 32\nscan_layers = true\n"
        '[training]\nlr = 0.01\nwarmup_steps = 5\nweight_decay = 0.0\nschedule = "gpipe"\n'
        'text = ["a.txt", "b.txt"]\nno_pack_weights = true\npack_residuals = 4096\n'
        '[outputs]\noutput_dir = "runs/x"\n',
    )
    args = parse_args(["train", "--config", str(path), "--dim", "96", "--warmup-steps", "7"])
    assert (args.dim, args.warmup_steps) == (96, 7)  # flags win
    assert (args.seq_len, args.scan_layers, args.lr, args.weight_decay) == (32, True, 0.01, 0.0)
    assert (args.schedule, args.text, args.output_dir) == ("gpipe", ["a.txt", "b.txt"], "runs/x")
    assert (args.pack_weights, args.pack_residuals) == (False, 4096)
    assert (args.depth, args.stages, args.steps) == (4, 2, 300)  # untouched: the defaults


@pytest.mark.parametrize(
    "text, reason",
    [
        ("[model]\ndimm = 64\n", "[model] dimm: unknown key (known: dim, depth, heads,"),
        (
            "[modle]\ndim = 64\n",
            "[modle]: unknown table (known: model, layout, training, dataset, preference, "
            "precision, logging, outputs)",
        ),
        ("dim = 64\n", "dim: a key outside any table (put it under [model])"),
        ("[training]\ndim = 64\n", "[training] dim: belongs in [model], not [training]"),
        ('[model]\ndim = "big"\n', "[model] dim: --dim must be an integer, got 'big'"),
        ("[model]\ndim = 0\n", "[model] dim: --dim must be >= 1, got 0"),
        ("[model]\ndim = true\n", "[model] dim: expected a value for --dim, got True"),
        ("[model]\nscan_layers = 1\n", "[model] scan_layers: expected true or false"),
        ('[training]\nschedule = "zigzag"\n', "[training] schedule: 'zigzag' is not one of"),
        ("[training]\nlr = -1.0\n", "[training] lr: --lr must be a finite number > 0"),
        ('[training]\ntext = "a.txt"\n', "[training] text: expected a list, got 'a.txt'"),
        ("[outputs]\noutput_dir = 3\n", "[outputs] output_dir: expected a string, got 3"),
        ("[model]\ndim = 64\ndim = 32\n", "not valid TOML"),
        ("[model]\ndim = 64\n'dim' = 32\n", "not valid TOML"),
        ("[model]\nseq_len = 8\nseq-len = 16\n", "[model] seq-len: sets seq_len a second time"),
        (b"[model]\n# caf\xe9\ndim = 64\n", "not UTF-8: byte 13 is b'\\xe9'; save it as UTF-8"),
        # a byte-order mark (Windows editors) is skipped: the file reads on to its bad key
        (b"\xef\xbb\xbf[model]\ndimm = 64\n", "[model] dimm: unknown key"),
    ],
)
def test_a_bad_config_exits_2_naming_file_and_key(tmp_path, capsys, text, reason):
    path = write(tmp_path, text)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"mmnnx train: error: {path}: "), err
    assert reason in err, err


def test_a_missing_config_exits_2(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path / "none.toml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'none.toml'}: cannot read it" in err


def test_every_train_config_field_has_an_option():
    options = {spec(f).api or f.name for fields in tables(RunConfig).values() for f in fields}
    for field in dataclasses.fields(TrainConfig):
        assert field.name in options, field.name


def test_help_says_where_the_schedule_ends_and_how_a_long_warm_up_is_cut(capsys):
    rate = learning_rates(TrainConfig(steps=4, warmup_steps=20, learning_rate=1.0))
    assert [round(float(rate(n)), 6) for n in range(5)] == [0.0, 0.333333, 0.666667, 1.0, 0.1]
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "the cosine decay ends at a tenth of it" in out  # --lr
    assert "at most the schedule's horizon - 1 (--schedule-steps)" in out  # --warmup-steps
    assert "weight decay, of every trained parameter: norm scales, biases and embeddings" in out


def test_a_one_step_run_trains_at_the_peak_rate():  # it ran at 0: its one update did nothing
    for steps in (1, 2, 3):
        rate = learning_rates(TrainConfig(steps=steps, learning_rate=1.0))
        assert float(rate(steps - 1)) == 1.0


def test_resume_extends_a_shorter_saved_schedule_in_one_line():
    def horizon(saved, **config):
        console = Console(record=True, width=200)
        value = _resumed_horizon(TrainConfig(**config), saved, console)
        return value, console.export_text()

    value, said = horizon(8, steps=12)
    assert value == 12
    assert said == (
        "learning-rate schedule extended from the checkpoint's 8 steps to 12 (TrainConfig.steps "
        "/ --steps): the cosine decay now ends at step 12; give --schedule-steps 8 to keep the "
        "old one\n"
    )
    assert horizon(16, steps=12) == (16, "")  # planned longer from the start: kept
    assert horizon(12, steps=12) == (12, "")  # a crashed run resumed as it was
    assert horizon(None, steps=12) == (12, "")  # a checkpoint without a horizon
    assert horizon(8, steps=12, schedule_steps=8) == (8, "")  # kept as asked


def test_a_run_writes_its_config_and_resume_reads_it(tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    run = tmp_path / "run"
    config = write(
        tmp_path,
        "[model]\ndim = 32\ndepth = 2\nheads = 2\nseq_len = 16\n"
        f"[training]\nbatch_size = 8\nmicrobatches = 2\nsteps = 4\ntext = [{json.dumps(str(text))}]"
        "\neval_every = 2\nweight_decay = 0.05\ntimeline_step = 0\n",
    )
    assert main(["train", "--config", str(config), "--output-dir", str(run), "--lr", "0.01"]) == 0
    saved = tomllib.loads((run / "config.toml").read_text())
    tables = {
        "model",
        "layout",
        "training",
        "dataset",
        "preference",
        "precision",
        "logging",
        "outputs",
    }
    assert set(saved) == tables
    model = {"dim": 32, "depth": 2, "heads": 2, "seq_len": 16, "scan_layers": False}
    model |= {"gated_mlp": False, "remat": "none"}
    assert saved["model"] == model
    assert saved["training"]["lr"] == 0.01 and saved["training"]["weight_decay"] == 0.05
    assert saved["training"]["text"] == [str(text)] and saved["outputs"]["output_dir"] == str(run)
    assert "schedule_steps" not in saved["training"]  # None: the flag's default
    assert parse_args(["train", "--config", str(run / "config.toml")]).lr == 0.01  # reads back
    capsys.readouterr()

    # nothing but where the run is and how far to go: the model, data and rate are the run's
    assert main(["train", "--output-dir", str(run), "--resume", "--steps", "6"]) == 0
    out = capsys.readouterr().out
    assert f"flags not given default to the run's {run / 'config.toml'}" in out
    assert "schedule extended from the checkpoint's 4 steps to 6" in out
    extra = json.loads((run / "checkpoints" / "6" / "extra" / "metadata").read_text())
    assert extra["schedule_steps"] == 6
    resaved = tomllib.loads((run / "config.toml").read_text())
    assert resaved["training"]["steps"] == 6 and "resume" not in resaved["outputs"]  # an act
    assert resaved["training"]["lr"] == 0.01 and resaved["model"] == saved["model"]


def test_a_written_config_reads_back_as_the_values_it_holds(tmp_path):
    args = parse_args(["train", "--profile-steps", "2:3", "--text", "a", "--no-pack-weights"])
    values = {k: v for k, v in vars(args).items() if v is not None}
    path = write_config(tmp_path / "config.toml", resolved_config(values))
    assert read_config(path) == {k: v for k, v in values.items() if k not in ("command", GIVEN)}


def test_a_memory_budget_of_bytes_may_be_a_toml_integer(tmp_path):
    # 'memory_budget = 80000000000' was refused: "expected a string"
    path = write(tmp_path, "[training]\nmemory_budget = 80000000000\n")
    run = RunConfig.of(vars(parse_args(["train", "--config", str(path)])))
    assert run.training.memory_budget == "80000000000"


def test_the_flags_and_a_config_file_parse_into_one_typed_run_config(tmp_path):
    """Issue 68: one nested ``RunConfig`` travels; what an option is comes from its field."""
    from mmnnx.train.config import ARCHITECTURE, MAY_CHANGE_ON_RESUME, MOE, flag

    path = write(tmp_path, '[model]\nlora_rank = 2\nlora_targets = "q,v"\n[layout]\nstages = 4\n')
    args = parse_args(["train", "--config", str(path), "--profile-steps", "2:3"])
    run = RunConfig.of(vars(args))
    assert (run.model.lora_targets, run.layout.stages) == (("q", "v"), 4)
    assert run.logging.profile_steps == (2, 3) and run.model.dim == 128  # a default
    write_config(tmp_path / "config.toml", resolved_config(run.options()))
    assert RunConfig.of(read_config(tmp_path / "config.toml")) == run  # as generate reads it
    pretrained = dataclasses.replace(run, model=dataclasses.replace(run.model, init_from="hf"))
    assert not set(ARCHITECTURE) & set(pretrained.options())  # config.json gives them
    assert set(MOE) < set(ARCHITECTURE) and "experts" in MOE
    layout = {f.name for f in dataclasses.fields(type(run.layout))}
    assert layout < set(MAY_CHANGE_ON_RESUME) and "steps" in MAY_CHANGE_ON_RESUME
    assert "lr" not in MAY_CHANGE_ON_RESUME and "seq_len" not in MAY_CHANGE_ON_RESUME
    assert (flag("pack_weights"), flag("data_axis", 2)) == ("--no-pack-weights", "--data-axis 2")
