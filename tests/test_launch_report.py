"""Under ``mmnnx launch``, what the processes print: gloo's connection chatter left out without
``--verbose`` (with it: tests/test_distributed.py's four processes), and the timeline merged
from every process (issue 41, item 5). Rank 0's report of a launched ``mmnnx train`` against
the same run in one process is checked on tests/test_distributed.py's launched run (one launch
for both)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

from mmnnx.distributed.timeline import _merged
from mmnnx.errors import MPMDError
from mmnnx.launcher.chatter import is_chatter
from mmnnx.mpmd.run.timing import Event
from tests.flags import without_device_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240


def _env() -> dict[str, str]:
    return dict(os.environ, XLA_FLAGS=without_device_count(os.environ["XLA_FLAGS"]))


GLOO_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np, mmnnx as mm
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mm.distributed.initialize()
mesh = Mesh(np.array(jax.local_devices()), ("d",))
x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("d")))
print("sum", float(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)))
if jax.process_index() == 1:  # an error's traceback, on stderr (the process goes on)
    import traceback
    traceback.print_exception(ValueError("an error still shows"))
"""


def test_gloo_connection_lines_are_left_out_without_verbose():
    # a collective among one process's devices goes over gloo once it is on (--collectives);
    # with --verbose they show (tests/test_distributed.py, its four processes' launch)
    proc = subprocess.run(
        [sys.executable, "-m", "mmnnx", "launch", "-n", "2", "--devices-per-process", "2",
         "--collectives", "gloo", "--", sys.executable, "-c", GLOO_SCRIPT],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=_env(), cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "[rank 0] sum 28.0" in proc.stdout and "[rank 1] sum 28.0" in proc.stdout
    assert "[rank 1] ValueError: an error still shows" in proc.stdout
    assert "[Gloo]" not in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    "line, chatter",
    [
        ("[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks "
         "is : 1", True),
        # pieces of three messages printed in between each other by three threads
        ("[Gloo] Rank [Gloo] Rank [Gloo] Rank 1 is connected to 1 peer ranks. Expected number "
         "of connected peer ranks is : 1", True),
        ("0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1", True),
        # two messages' pieces, the line ending in a message's middle (seen in a clean-clone run)
        ("[Gloo] Rank 1 is connected to [Gloo] Rank 10 peer ranks.  is connected to Expected "
         "number of connected peer ranks is : 11 peer ranks. ", True),
        ("[Gloo] Rank 0 is NOT connected to: [1]", False),
        ("1", False),
        ("step 3 is connected to nothing", False),
        ("[rank 0] [Gloo] Rank 0 is connected to 1 peer ranks.", False),
    ],
)  # fmt: skip
def test_chatter_is_gloo_connected_lines_only(line, chatter):
    assert is_chatter(line) is chatter


def test_merged_events_count_from_the_earliest_start_and_a_failure_is_named():
    # process 0 started its step 0.5 s after the common barriers, process 1 0.2 s after them;
    # process 1 was descheduled as it left the first barrier (noted it 0.03 s late) and
    # process 0 as it left the fourth: the median over the rounds is not moved
    event = Event("stage0", "F", 0, 0, 0.0, 1.0, rank="stage0")
    parts = [
        {"offsets": [0.5, 0.5, 0.5, 0.47, 0.5], "events": [list(dataclasses.astuple(event))]},
        {
            "offsets": [0.17, 0.2, 0.2, 0.2, 0.2],
            "events": [["stage1", "F", 1, 0, 0.0, 1.0, False, "stage1"]],
        },
    ]
    first, second = _merged(parts)
    assert (first.task, first.start, first.end) == (
        "stage0",
        pytest.approx(0.3),
        pytest.approx(1.3),
    )
    assert (second.task, second.start, second.end) == ("stage1", 0.0, 1.0)
    with pytest.raises(MPMDError, match="failed on process 1"):
        _merged([parts[0], "failed"])
