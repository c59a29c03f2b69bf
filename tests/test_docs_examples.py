"""The docs' examples that build the reference GPT outside a mesh run as written."""

import pathlib
import re
import sys
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
    assert len(blocks) == 2
    namespace = {}
    for block in blocks:  # one after the other, as a reader runs them
        exec(compile(block, "docs/pretrained.md", "exec"), namespace)
    assert capsys.readouterr().out == "(1, 8, 256)\n(1, 8, 256) True\n"
