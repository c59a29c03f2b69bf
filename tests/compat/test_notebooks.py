"""The six multimesh tutorials, rebuilt on this layer, execute and print what they claim."""

from __future__ import annotations

import os
import pathlib

import pytest

from tests.flags import COMPILE_FLAGS

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks" / "multimesh"
REPO = NOTEBOOKS.parents[1]

ROWS_0_3 = "[0:2,0:8] on [0]; [2:4,0:8] on [1]; [4:6,0:8] on [2]; [6:8,0:8] on [3]"
COLS_4_7 = "[0:8,0:2] on [4]; [0:8,2:4] on [5]; [0:8,4:6] on [6]; [0:8,6:8] on [7]"
ALL_8 = "[0:8,0:8] on [0, 1, 2, 3, 4, 5, 6, 7]"
STATE = [
    "(4,) replicated on devices [0, 1, 2, 3]",
    "(16, 4) 4 blocks, spec P('x', 'y') on devices [0, 1, 2, 3]",
    "(4,) replicated on devices [4, 5, 6, 7]",
    "(4, 4) 4 blocks, spec P('x', 'y') on devices [4, 5, 6, 7]",
]

EXPECTED = {
    "hello-world.ipynb": [
        "2 devices",
        "plain jit on [0]",
        "spmd on [0, 1]",
        "mpmd result on [1]",
        "task 'f':",
        "task 'g':",
    ],
    "spmd-autosharding.ipynb": [
        f"no task input P() {ALL_8}",
        f"no task param1 P() {ALL_8}",
        f"no task param2 P() {ALL_8}",
        "task input P('x', None)",
        "task param1 P('x', None)",
        "task param2 P(None, 'x')",
        "matches plain JAX: True",
        "appendix matches: True",
    ],
    "mpmd-autosharding.ipynb": [
        f"param 1: {ROWS_0_3}",
        f"param 2: {COLS_4_7}",
        f"batch: {ROWS_0_3}",
        "output on [4, 5, 6, 7] matches: True",
        f"gen-b param 1: {ROWS_0_3}",
        f"gen-b param 2: {COLS_4_7}",
        "appendix matches: True",
    ],
    "flax-mpmd.ipynb": [*STATE, "same loss: True", "same update: True"],
    "implicit-flax-tasks.ipynb": [
        *STATE,
        "same as before: True",
        "callback calls [('layer_0', False), ('layer_0', True), ('layer_1', False), "
        "('layer_1', True)]",
    ],
    "mpmd-multimesh.ipynb": [
        "param 1: [0:4,0:8] on [0, 2]; [4:8,0:8] on [1, 3]",
        "param 2: [0:8,0:4] on [4, 6]; [0:8,4:8] on [5, 7]",
        "output on [4, 5, 6, 7] matches: True",
    ],
}


def _stdout(nb) -> str:
    return "".join(
        out.get("text", "")
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "stream" and out.get("name") == "stdout"
    )


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_notebook(name, monkeypatch):
    path = NOTEBOOKS / name
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
        "stored with outputs"
    )
    # each notebook asks for its devices with init(cpus=N) before importing jax, which adds
    # them to the flags every test compiles with
    monkeypatch.setenv("XLA_FLAGS", COMPILE_FLAGS)
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": str(REPO)}}
    )
    client.execute()
    out = _stdout(nb)
    for line in EXPECTED[name]:
        assert line in out, f"{name}: {line!r} not in output:\n{out}"
    if name in ("flax-mpmd.ipynb", "implicit-flax-tasks.ipynb"):
        assert "loss " in out
