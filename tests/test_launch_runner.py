"""``mmnnx launch`` runs a Python command through ``mmnnx/launcher/run_main.py``: the program
sees what ``python`` itself gives it (``sys.argv``, ``sys.path[0]``, its ``__main__``, classes
that pickle), ends with the same status and output, and a failing ``raise SystemExit(n)``
reaches ``sys.exit``, which ``mm.distributed`` wraps. Plain Python processes, no JAX."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mmnnx.launcher.python_main import RUNNER, through_runner

PROBE = """
import pickle, sys
class Point:
    pass
main = sys.modules["__main__"]
print(sys.argv, repr(sys.path[0]), __name__, globals().get("__file__"), main.__dict__ is globals())
print(type(pickle.loads(pickle.dumps(Point()))).__module__, sorted(dir(main)))
exit_ = sys.exit
sys.exit = lambda status=None: (print("sys.exit saw", status, file=sys.stderr), exit_(status))
raise SystemExit({status!r})
"""


@pytest.mark.parametrize("status", [3, "a message", None])
@pytest.mark.parametrize("mode", ["file", "-m", "-c"])
def test_a_program_run_through_the_runner_sees_what_python_gives_it(tmp_path, mode, status):
    source = PROBE.format(status=status)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "probe.py").write_text(source)
    script = str(tmp_path / "pkg" / "probe.py")
    program = {"file": [script], "-m": ["-m", "pkg.probe"], "-c": ["-c", source]}[mode]
    command = [sys.executable, "-u", *program, "an", "--argument"]
    through = through_runner(command)
    assert through == [sys.executable, "-u", RUNNER, *(["file"] if mode == "file" else []),
                       *command[2:]]  # fmt: skip
    plain, runner = (
        subprocess.run(c, capture_output=True, text=True, cwd=tmp_path, timeout=60)
        for c in (command, through)
    )
    assert runner.stdout == plain.stdout and plain.stdout.count("\n") == 2, runner.stderr
    assert runner.returncode == plain.returncode == {3: 3, "a message": 1, None: 0}[status]
    if status is None:
        assert runner.stderr == plain.stderr == ""
    else:  # the runner gives a failing status to sys.exit, then Python ends as it would
        assert runner.stderr == f"sys.exit saw {status}\n" + plain.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["python3", "-i", "probe.py"],  # interactive afterwards
        ["python3", "-"],  # the program on standard input
        ["python3", "no_such_file.py"],  # Python's own error
        ["python3", "-m"],
        ["bash", "-c", "python3 -c pass"],
    ],
)
def test_other_commands_run_as_given(command):
    assert through_runner(command) == command
