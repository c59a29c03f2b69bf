"""Benchmarks run as processes of one simulated CPU device each, each pinned to its own core:
on this machine the one layout where two stages compute at once (a one-device XLA:CPU program
keeps nearly both cores busy in one process, exactly one in a process of its own with Eigen's
threads off; benchmarks/HISTORY.md, "a core per stage").

The parent calls :func:`launch` with a script and its arguments; each process of it calls
:func:`pin_to_own_core`, does its work and hands its result back with :func:`write_result`;
:func:`launch` returns the results in rank order.
"""

import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Sequence

EIGEN_OFF = "--xla_cpu_multi_thread_eigen=false"
_RESULTS = "BENCH_RANK_RESULTS"  # the folder each process writes its result to


def pin_to_own_core() -> int | None:
    """Pins every thread of this process (and so those it starts later) to one core of those
    it may run on, the one at its rank (``MMNNX_PROCESS_ID``, 0 when unset) modulo their
    number, and returns it; ``None`` (nothing pinned) where it may run on a single core only.

    Called before the JAX backend starts (as the benchmarks do), XLA:CPU sizes its thread
    pools for one core; a value this process sends another then leaves only once the programs
    launched on its device before the other asked for it have run. Called after, the pools are
    sized for every core and the value leaves at once, but the programs run slower, their
    threads sharing the one core (benchmarks/HISTORY.md, issue 54 item 5 with a core per
    stage).

    Example::

        core = pin_to_own_core()  # first thing in a process `launch` started
    """
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    core = cores[int(os.environ.get("MMNNX_PROCESS_ID", "0")) % len(cores)]
    for thread in pathlib.Path("/proc/self/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(int(thread.name), {core})
    return core


def launch(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    processes: int = 2,
    collectives: str = "none",
    timeout_s: float = 900,
) -> list:
    """Runs ``python script *args`` as ``processes`` processes of one device each
    (``mmnnx launch --devices-per-process 1``, ``--collectives`` as given: ``"gloo"`` for a
    program spanning processes) with XLA's Eigen threads off, and returns what each passed to
    :func:`write_result`, in rank order.

    Example::

        step_seconds = max(launch(__file__, ["--worker", "7/1"]))

    Raises:
        SystemExit: a process failed or gave no result (its output's last lines attached).
    """
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = EIGEN_OFF
    with tempfile.TemporaryDirectory() as out:
        env[_RESULTS] = out
        command = [
            sys.executable, "-m", "mmnnx", "launch", "-n", str(processes),
            "--devices-per-process", "1", "--collectives", collectives,
            "--", sys.executable, str(script), *args,
        ]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
        results = results_in(out, processes)
        if done.returncode != 0 or results is None:
            raise SystemExit(
                f"{' '.join(command)} failed (exit {done.returncode}):\n"
                f"{done.stdout[-4000:]}{done.stderr[-4000:]}"
            )
        return results


def write_result(result: object) -> None:
    """Hands this process's ``result`` (JSON-serialisable) back to :func:`launch`.

    Example::

        write_result({"step s": 0.05})
    """
    rank = os.environ.get("MMNNX_PROCESS_ID", "0")
    pathlib.Path(os.environ[_RESULTS], f"rank{rank}.json").write_text(json.dumps(result))


def results_in(folder: str | os.PathLike, processes: int) -> list | None:
    """The results ``processes`` processes wrote to ``folder`` with :func:`write_result`, in
    rank order; ``None`` when one of them wrote none.

    Example::

        results_in(out, 2)  # [rank 0's, rank 1's]
    """
    paths = [pathlib.Path(folder, f"rank{rank}.json") for rank in range(processes)]
    if not all(p.exists() for p in paths):
        return None
    return [json.loads(p.read_text()) for p in paths]
