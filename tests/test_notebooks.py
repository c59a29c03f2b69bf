"""The notebooks in notebooks/ execute, saved without outputs, and show what they claim."""

import os
import pathlib

import nbclient
import nbformat
import pytest

from tests.flags import COMPILE_FLAGS

REPO = pathlib.Path(__file__).resolve().parents[1]

CLAIMS = {
    "quickstart.ipynb": [
        "8 devices",
        "Totals per task",
        "loss falls: True",
        "Plan: 2 task(s)",
        "actions timed: 16",
        "restored onto 4 stages, same loss: True",
        "kernel of block 3 now on devices [6, 7]",
        "restored onto one device, same loss: True",
        "data position restored: True",
    ],
    "scan_layers.ipynb": [
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
    ],
}


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_notebook(monkeypatch, name):
    nb = nbformat.read(REPO / "notebooks" / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in code)
    monkeypatch.delenv("XLA_FLAGS", raising=False)  # each notebook sets its own devices...
    devices = '"--xla_force_host_platform_device_count=8"'
    assert devices in code[0].source
    # ...to which the test adds the flags every test compiles with: the numbers a notebook
    # checks are its own runs against each other, and compiling is most of its time
    code[0].source = code[0].source.replace(devices, f'"{devices[1:-1]} {COMPILE_FLAGS}"')
    monkeypatch.setenv("PYTHONPATH", str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    client = nbclient.NotebookClient(
        nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(REPO)}}
    )
    client.execute()
    out = "".join(
        o.get("text", "")
        for c in code
        for o in c.get("outputs", [])
        if o.get("output_type") == "stream"
    )
    for line in CLAIMS[name]:
        assert line in out, f"{line!r} not in output:\n{out}"
    images = [o for c in code for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "the timeline figure was not displayed"
