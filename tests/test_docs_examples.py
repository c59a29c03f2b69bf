"""The docs' examples that build the reference GPT outside a mesh run as written."""

import json
import pathlib
import re
import shlex
import sys
import tomllib
import types

import pytest
from flax import nnx

import mmnnx as mm

ROOT = pathlib.Path(__file__).resolve().parents[1]


def blocks_with(doc: str, marker: str) -> list[str]:
    text = (ROOT / doc).read_text()
    return [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if marker in b]


@pytest.mark.parametrize("doc", ["docs/sharding.md", "docs/training.md"])
def test_gpt_examples_outside_a_mesh_run_as_written(doc, capsys):
    blocks = blocks_with(doc, "use_eager_sharding(False):  # no mesh")
    assert blocks, f"{doc} shows no GPT built outside a mesh"
    for block in blocks:
        exec(compile(block, doc, "exec"), {"mm": mm, "nnx": nnx})  # the doc's own imports
    if doc == "docs/training.md":
        assert capsys.readouterr().out == "(1, 8)\n"


def test_pretrained_examples_run_as_written(monkeypatch, capsys):
    # `from bonsai.models.qwen3 import modeling` finds the vendored copy of that very file
    from tests.outside.vendored import bonsai_qwen3_modeling

    for name in ("bonsai", "bonsai.models", "bonsai.models.qwen3"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["bonsai.models.qwen3"].modeling = bonsai_qwen3_modeling
    monkeypatch.setitem(sys.modules, "bonsai.models.qwen3.modeling", bonsai_qwen3_modeling)
    blocks = blocks_with("docs/pretrained.md", "")
    assert len(blocks) == 3
    namespace = {}
    for block in blocks:  # one after the other, as a reader runs them
        exec(compile(block, "docs/pretrained.md", "exec"), namespace)
    assert capsys.readouterr().out == ("(1, 8, 256)\n(8, 64, 32) {(4, 64, 32)}\n(1, 8, 256) True\n")


def claimed_outputs(code: str) -> list[str]:
    """What a block says each ``print`` shows: the comment after it on its line, or on the
    line below."""
    lines = code.splitlines()
    claims = []
    for i, line in enumerate(lines):
        if line.startswith("print("):
            after = line.split("  # ", 1)[1] if "  # " in line else lines[i + 1].removeprefix("# ")
            claims.append(after)
    return claims


def test_the_fine_tuning_walkthrough_runs_as_written(tmp_path, monkeypatch, capsys):
    """docs/training.md's "Fine-tuning a Hugging Face checkpoint": its Python blocks and its
    `mmnnx` commands, in order, in an empty directory; then the files it says each wrote."""
    from mmnnx.cli import main

    text = (ROOT / "docs/training.md").read_text()
    section = text.split("## Fine-tuning a Hugging Face checkpoint\n", 1)[1].split("\n## ")[0]
    blocks = re.findall(r"```(python|bash)\n(.*?)```", section, flags=re.S)
    assert [language for language, _ in blocks] == ["python", "bash", "python"]
    monkeypatch.chdir(tmp_path)
    printed = []
    for language, code in blocks:
        if language == "python":
            exec(compile(code, "docs/training.md", "exec"), {})
            printed += claimed_outputs(code)
            continue
        for command in code.replace("\\\n", " ").splitlines():
            argv = shlex.split(command)
            assert argv[0] == "mmnnx", command
            assert main(argv[1:]) == 0, command
    out = capsys.readouterr().out
    assert printed and all(line in out for line in printed), (printed, out[-2000:])
    run = tmp_path / "runs" / "tiny-lora"
    saved = tomllib.loads((run / "config.toml").read_text())["model"]
    assert saved["init_from"] == "tiny-llama" and saved["lora_rank"] == 8
    tokenizer = {p.name for p in (run / "tokenizer").iterdir()}
    assert tokenizer == {"tokenizer.json", "hf_tokenizer.json"}
    assert {p.name for p in (run / "checkpoints" / "6").iterdir()} >= {"model", "opt", "extra"}
    for name in ("metrics.jsonl", "loss.png", "timeline.png"):
        assert (run / name).is_file(), name
    adapter = json.loads((tmp_path / "tiny-llama-lora" / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and adapter["base_model_name_or_path"] == "tiny-llama"
    merged = json.loads((tmp_path / "tiny-llama-merged" / "config.json").read_text())
    assert merged["dtype"] == "bfloat16" and "torch_dtype" not in merged
    assert (tmp_path / "tiny-llama-merged" / "tokenizer.json").is_file()


def test_the_sft_dpo_eval_walkthrough_runs_as_written(tmp_path, monkeypatch, capsys):
    """docs/training.md's walkthrough of SFT, DPO and evaluation: its Python block and its
    commands."""
    from mmnnx.cli import main

    text = (ROOT / "docs/training.md").read_text()
    section = text.split("### A walkthrough: SFT, DPO and evaluation", 1)[1].split("\n## ")[0]
    blocks = re.findall(r"```(python|bash)\n(.*?)```", section, flags=re.S)
    assert [language for language, _ in blocks] == ["python", "bash"]
    monkeypatch.chdir(tmp_path)
    exec(compile(blocks[0][1], "docs/training.md", "exec"), {})
    for command in blocks[1][1].replace("\\\n", " ").splitlines():
        argv = shlex.split(command)
        assert argv[0] == "mmnnx" and main(argv[1:]) == 0, command
    out = capsys.readouterr().out
    assert "data: 38 examples in" in out and "packed" in out
    saved = tomllib.loads((tmp_path / "runs/tiny-sft/config.toml").read_text())
    assert saved["dataset"]["data"] == "chat.jsonl" and saved["dataset"]["pack"] is True
    logged = (tmp_path / "runs/tiny-dpo/metrics.jsonl").read_text().splitlines()
    last = json.loads(logged[-1])
    assert last["rewards/margins"] > 0 and "rewards/accuracies" in last
    assert "preference pairs" in out and re.search(r"\|sums\s*\|.*\|acc\s*\|", out)


def test_sft_of_a_model_of_ones_own_runs_as_written(tmp_path, monkeypatch, capsys):
    """docs/training.md's "SFT of a model of your own": a model read with load_tensors."""
    text = (ROOT / "docs/training.md").read_text()
    section = text.split("### SFT of a model of your own", 1)[1].split("\n### ")[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "docs/training.md", "exec"), {"__name__": "docs"})
    assert capsys.readouterr().out.endswith("True\n")
