"""The README's example and `make demo`'s script run as written."""

import os
import pathlib
import re
import subprocess
import sys

from tests.flags import COMPILE_FLAGS

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_example_runs(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"])  # the example sets its own: undone
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert blocks, "README has no python example"
    assert len(blocks[0].splitlines()) <= 25
    namespace = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert "P('model', None)" in out
    assert "stage1" in out and "Totals per task" in out
    for block in blocks[1:]:
        exec(compile(block, "README.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert "Plan: 2 task(s)" in out
    assert "1f1b: 2 stages, 4 microbatches" in out
    assert (tmp_path / "timeline.png").stat().st_size > 1000


def test_readme_commands_exist_in_makefile():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, flags=re.M)
    assert re.search(r"^test:", makefile, flags=re.M)
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_demo_script_prints_two_task_tabulate():
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {COMPILE_FLAGS}")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "place_and_tabulate.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    assert "Totals per task" in proc.stdout
    assert re.search(r"stage0\s+│ 0-3", proc.stdout)
    assert re.search(r"stage1\s+│ 4-7", proc.stdout)
