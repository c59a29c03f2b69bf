"""notebooks/scan_layers.ipynb executes and shows what it claims."""

import os
import pathlib

import nbclient
import nbformat

REPO = pathlib.Path(__file__).resolve().parents[1]

EXPECTED = [
    "8 devices",
    "stack: stage0+stage1+stage2+stage3",
    "spec: P('mm_stack',)",
    "Totals per task",
    "loss falls: True",
    "Adam moments split like the kernel: True",
    "matches one device: True",
    "tasks scanning their chunk: ['stage0', 'stage1', 'stage2', 'stage3']",
    "actions timed: 32",
    "GPT loss falls: True",
]


def test_scan_layers(monkeypatch):
    nb = nbformat.read(REPO / "notebooks" / "scan_layers.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code)
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
