"""The docs' examples that build the reference GPT outside a mesh run as written."""

import pathlib
import re

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
