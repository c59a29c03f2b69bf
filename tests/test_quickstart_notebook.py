"""notebooks/quickstart.ipynb executes and shows what it claims."""

import os
import pathlib

import nbclient
import nbformat

REPO = pathlib.Path(__file__).resolve().parents[1]

EXPECTED = [
    "8 devices",
    "Totals per task",
    "loss falls: True",
    "Plan: 2 task(s)",
    "actions timed: 16",
    "restored onto 4 stages, same loss: True",
    "kernel of block 3 now on devices [6, 7]",
    "restored onto one device, same loss: True",
    "data position restored: True",
]


def test_quickstart(monkeypatch):
    nb = nbformat.read(REPO / "notebooks" / "quickstart.ipynb", as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(REPO)}}
    )
    client.execute()
    out = "".join(
        o.get("text", "")
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "stream"
    )
    for line in EXPECTED:
        assert line in out, f"{line!r} not in output:\n{out}"
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "the timeline figure was not displayed"
