"""A failing process of several ends the job in seconds, and ``mmnnx launch --max-restarts``
heals it: real processes on loopback, each run under a timeout."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from mmnnx.cli import main
from mmnnx.launcher import progress
from tests.flags import without_device_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 240
WITHIN_S = 60  # the bound for a failure to end every process

TRAIN_FLAGS = [
    "--dim", "32", "--depth", "2", "--heads", "2", "--seq-len", "16", "--batch-size", "8",
    "--microbatches", "4", "--schedule", "1f1b", "--eval-every", "100",
]  # fmt: skip


def _env() -> dict[str, str]:
    return dict(os.environ, XLA_FLAGS=without_device_count(os.environ["XLA_FLAGS"]))


def launch(
    args: list[str], timeout: float = TIMEOUT_S
) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "mmnnx", "launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
        cwd=ROOT,
    )
    return proc, time.monotonic() - started


def launch_timed(args: list[str]) -> tuple[subprocess.CompletedProcess, dict[str, float]]:
    """``launch``, with the time (``time.time()``) each line of its stderr came at."""
    came = {}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmnnx", "launch", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
    )  # fmt: skip
    out, err = [], []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    reader.start()
    timer = threading.Timer(TIMEOUT_S, proc.kill)  # as launch's timeout
    timer.start()
    try:
        for line in proc.stderr:
            came.setdefault(line.rstrip("\n"), time.time())
            err.append(line)
        proc.wait()
        reader.join()
    finally:
        timer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out[0], "".join(err))
    return done, came


def _restart_within_seconds_of_the_failure(proc, came, restart: str) -> None:
    """The attempt in which rank 1 failed (it printed ``failing at <time>``) ended, every process
    of it, within ``WITHIN_S``: the launcher restarts only once all have ended."""
    failed_at = float(re.search(r"\[rank 1\] failing at ([0-9.]+)", proc.stdout).group(1))
    assert came[restart] - failed_at < WITHIN_S, (came[restart] - failed_at, proc.stderr[-3000:])


# A JAX barrier in the coordination service: rank 0 waits there for rank 1, in no wait of mmnnx.
BARRIER = """
import sys, jax, mmnnx as mm
from mmnnx._jax import runtime
mm.distributed.initialize()
print('ready', flush=True)
if jax.process_index() == {rank}:
    {fail}
runtime.barrier('the other process never comes', 600)
"""


@pytest.mark.parametrize(
    "rank,fail,status",
    [
        # sys.exit with a failing status (mmnnx's wrapped sys.exit), on process 0, which holds
        # the coordination service
        (0, "sys.exit(4)", 4),
        # Python keeps no trace of it: the launcher's runner gives it to sys.exit again (rank 1's
        # sys.exit(n) takes this path too). An uncaught exception (sys.last_value at exit): the
        # excepthook test below
        (1, "raise SystemExit(3)", 3),
    ],
)
def test_a_failing_process_ends_every_process_in_seconds_and_is_named(rank, fail, status):
    code = BARRIER.format(rank=rank, fail=fail)
    proc, seconds = launch(["-n", "2", "--", sys.executable, "-c", code])
    assert proc.returncode == status, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert seconds < WITHIN_S, (seconds, proc.stderr[-3000:])
    assert f"mmnnx launch: rank {rank} failed first (exit code {status})" in proc.stderr
    assert f"[rank {rank}] ready" in proc.stdout  # it failed after initialize


def test_processes_that_all_fail_leave_together_without_a_runtime_abort():
    # an error every process finds (a bad option read after initialize), process 0 first: it
    # held the coordination service and took it along at once, so the others printed JAX's
    # "Check failure" stack and aborted; they now leave the service together first
    code = """
import time, jax, mmnnx as mm
mm.distributed.initialize()
time.sleep(0.5 * jax.process_index())
raise ValueError(f'bad option on process {jax.process_index()}')
"""
    proc, seconds = launch(["-n", "2", "--", sys.executable, "-c", code])
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "Check failure" not in output and "Polled an error" not in output, output[-3000:]
    assert "[rank 0] ValueError: bad option on process 0" in output
    assert "[rank 1] ValueError: bad option on process 1" in output
    assert "mmnnx launch: rank 0 failed first (exit code 1)" in proc.stderr


def test_a_script_keeps_its_own_excepthook_and_its_uncaught_exception_is_a_failure():
    # mmnnx reads the exception from sys.last_value at exit: sys.excepthook is the script's own.
    # The uncaught exception of a failing process of several: it ends every process in seconds
    hook = """
def own_hook(kind, value, traceback):
    print('own hook:', value, flush=True)
sys.excepthook = own_hook
"""
    code = BARRIER.format(rank=1, fail="print('kept', sys.excepthook is own_hook); 1 / 0")
    code = code.replace("mm.distributed.initialize()", hook + "mm.distributed.initialize()")
    proc, seconds = launch(["-n", "2", "--", sys.executable, "-c", code])
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert seconds < WITHIN_S, (seconds, proc.stderr[-3000:])
    assert "mmnnx launch: rank 1 failed first (exit code 1)" in proc.stderr
    assert "[rank 1] kept True" in proc.stdout
    assert "[rank 1] own hook: division by zero" in proc.stdout
    assert "[rank 1] ready" in proc.stdout  # it failed after initialize


def test_a_process_of_several_that_exits_with_a_failing_status_does_not_wait_for_the_others(
    tmp_path,
):
    # without the launcher (as on a cluster): rank 1's sys.exit(1) must not hold it at exit for
    # rank 0 (which waits in a barrier); rank 0 then fails when the coordination service notices
    from mmnnx.launcher import launch as launcher

    port = launcher.free_port()
    code = BARRIER.format(rank=1, fail="sys.exit(1)")
    procs = []
    for process in range(2):
        env = launcher.process_env(_env(), process, 2, port, 1)
        env["MMNNX_HEARTBEAT_TIMEOUT"] = "5"
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT))
    try:
        started = time.monotonic()
        assert procs[1].wait(timeout=WITHIN_S) == 1
        assert time.monotonic() - started < 30
        assert procs[0].wait(timeout=WITHIN_S) != 0
        assert time.monotonic() - started < WITHIN_S
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _failing_train(rank: int, step: int, how: str, out, *flags: str) -> list[str]:
    return [sys.executable, "-m", "tests.failing_train", str(rank), str(step), how,
            "--output-dir", str(out), *TRAIN_FLAGS, *flags]  # fmt: skip


def test_a_process_that_stops_responding_is_named_and_the_job_ends():
    code = (
        "import os, time, mmnnx as mm\n"
        "mm.distributed.initialize()\n"
        "print('pid', os.getpid(), flush=True)\n"
        "while True:\n"
        "    mm.distributed.gather(0, what='heartbeat of the script')\n"
        "    time.sleep(0.05)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-m", "mmnnx", "launch", "-n", "2", "--heartbeat-timeout", "4", "--",
         sys.executable, "-c", code],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
    )  # fmt: skip
    try:
        pids = {}
        deadline = time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline:
            line = launcher.stdout.readline()
            if match := re.match(r"\[rank (\d)\] pid (\d+)", line):
                pids[int(match.group(1))] = int(match.group(2))
        assert len(pids) == 2
        stopped = time.monotonic()
        os.kill(pids[1], signal.SIGSTOP)
        _, err = launcher.communicate(timeout=120)
        assert launcher.returncode == 1, err[-3000:]
        assert "mmnnx launch: rank 1 stopped responding" in err, err[-3000:]
        assert time.monotonic() - stopped < 4 + 30
        for pid in pids.values():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def test_a_rank_that_makes_no_progress_ends_the_job_named_with_its_last_phase():
    # rank 1 spins in Python after reporting "loading batch" of step 3: no exception, its
    # heartbeat still beating; rank 0 goes on reporting
    proc, _ = launch(
        ["-n", "2", "--step-timeout", "5", "--",
         sys.executable, os.path.join("tests", "launched_loop.py"), "spin", "1"]
    )  # fmt: skip
    ended = time.time()
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        "mmnnx launch: rank 1 made no progress for 5 s; last: loading batch (step 3); stopped "
        "the other 1 process(es)"
    ) in proc.stderr, proc.stderr[-3000:]
    assert re.search(
        r"\[rank 1\]   File \"[^\"]*launched_loop.py\", line \d+ in spin_for_ever", proc.stdout
    )
    spun_at = float(re.search(r"\[rank 1\] spinning at ([0-9.]+)", proc.stdout).group(1))
    assert ended - spun_at < 5 + 15


@pytest.mark.parametrize("flags,watched", [([], True), (["--step-timeout", "0"], False)])
def test_the_watchdog_is_on_unless_turned_off(flags, watched):
    # issue 69: a spinning data loader hung a job unless --step-timeout was given
    code = "import os; print('watched' if os.environ.get('MMNNX_PROGRESS_DIR') else 'not')"
    proc, _ = launch(["-n", "1", *flags, "--", sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"[rank 0] {'watched' if watched else 'not'}" in proc.stdout


def test_the_watchdog_names_the_oldest_report_of_the_processes_it_watches(tmp_path):
    where = str(tmp_path)
    reports = [("running the step", 2, False), ("loading batch", 9, False),
               ("finished training", 20, True), ("evaluating", 30, False)]  # fmt: skip
    for rank, (phase, age, finished) in enumerate(reports):  # rank 4 never reports
        progress.write(where, rank, progress.Record(phase, 7, finished))
        os.utime(progress.path(where, rank), (time.time() - age,) * 2)
    watchdog = progress.Watchdog(where, 5, timeout_s=5)
    assert str(watchdog.stale()) == "rank 3 made no progress for 30 s; last: evaluating (step 7)"
    assert str(watchdog.stale(ended={3})) == (
        "rank 1 made no progress for 9 s; last: loading batch (step 7)"
    )
    assert progress.Watchdog(where, 5, timeout_s=10).stale(ended={3}) is None


def test_a_preemption_notice_to_the_launcher_stops_every_process_after_one_step():
    # rank 1 sends SIGTERM to the launcher at step 3; the launcher forwards it to both ranks,
    # which agree on a step (JAX's preemption service) and end with 143
    proc, _ = launch(
        ["-n", "2", "--", sys.executable, os.path.join("tests", "launched_loop.py"), "preempt", "1"]
    )
    assert proc.returncode == 143, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        "mmnnx launch: SIGTERM received; forwarded to all 2 processes, which ended (exit "
        "status 143)"
    ) in proc.stderr, proc.stderr[-3000:]
    steps = dict(re.findall(r"\[rank (\d)\] stopped after step (\d+)", proc.stdout))
    assert steps.keys() == {"0", "1"} and steps["0"] == steps["1"], proc.stdout[-3000:]
    assert int(steps["0"]) >= 3


def _losses(out) -> list[tuple[int, float, float]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["loss"], r["eval_loss"]) for r in map(json.loads, lines) if "loss" in r]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[tuple[int, float, float]]:
    """The losses of the run the healed jobs below must end with: never interrupted, in this
    process (its 8 devices: the default layout, 2 stages x 2 data x 2 model)."""
    alone = tmp_path_factory.mktemp("alone")
    argv = ["train", "--output-dir", str(alone), *TRAIN_FLAGS, "--steps", "6", "--eval-every", "2"]
    assert main(argv) == 0
    losses = _losses(alone)
    assert [r[0] for r in losses] == [2, 4, 6]
    return losses


def test_max_restarts_restarts_every_process_and_train_resumes_to_the_uninterrupted_losses(
    tmp_path, uninterrupted
):
    # the data loader of rank 1 raises reading its 5th batch: the attempt ends in seconds (rank 0
    # waits for rank 1 in the step). Checkpoints every 2 steps: the restart resumes from step 4
    # and the finished run's losses equal a run that was never interrupted. (A rank killed in
    # mmnnx train: the next test.)
    flags = ["--steps", "6", "--eval-every", "2", "--checkpoint-every", "2", "--resume"]
    proc, came = launch_timed(
        ["-n", "2", "--devices-per-process", "4", "--max-restarts", "1", "--",
         *_failing_train(1, 5, "raise", tmp_path / "healed", *flags)]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    restart = (
        "mmnnx launch: rank 1 failed first (exit code 1); restarting all 2 processes "
        "(restart 1 of 1)"
    )
    assert restart in proc.stderr, proc.stderr[-3000:]
    assert "the data loader of process 1 failed at step 5" in proc.stdout, proc.stdout[-4000:]
    _restart_within_seconds_of_the_failure(proc, came, restart)
    assert "[rank 0] resumed from step 4" in proc.stdout, proc.stdout[-4000:]
    healed = _losses(tmp_path / "healed")
    assert [r[0] for r in healed] == [2, 4, 6]
    for a, b in zip(healed, uninterrupted, strict=True):
        assert a[1:] == pytest.approx(b[1:], rel=1e-5), (a, b)


def test_min_processes_drops_a_rank_that_keeps_failing_and_train_resumes_on_the_devices_left(
    tmp_path, uninterrupted
):
    # rank 1 is killed (SIGKILL) reading its 5th batch: the attempt ends in seconds; then it
    # dies as it starts (a lost host): dropped at its second failure in a row. The last attempt,
    # one process of 4 devices, re-plans the 2 stages of 2 x 2 devices onto 1 x 2 each, resumes
    # from step 4 and finishes with the losses of a run never interrupted
    flags = ["--steps", "6", "--eval-every", "2", "--checkpoint-every", "2", "--resume"]
    proc, came = launch_timed(
        ["-n", "2", "--devices-per-process", "4", "--max-restarts", "2", "--min-processes", "1",
         "--", *_failing_train(1, 5, "gone", tmp_path / "shrunk", *flags)]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    restart = (
        "mmnnx launch: rank 1 failed first (killed by SIGKILL); restarting all 2 processes "
        "(restart 1 of 2)"
    )
    assert proc.stderr.splitlines()[-2:] == [
        restart,
        "mmnnx launch: rank 1 failed first (killed by SIGKILL), as in the attempt before: "
        "dropped rank 1; restarting the other 1 process(es) (restart 2 of 2)",
    ], proc.stderr[-3000:]
    _restart_within_seconds_of_the_failure(proc, came, restart)
    assert "[rank 1] gone" in proc.stdout
    assert (
        "[rank 0] mmnnx train: --resume: --stages 2 x --data-axis 2 x --model-axis 2 needs 8 "
        "devices, the job has 4: re-planned as --data-axis 1, the same stages on 2 devices each"
    ) in proc.stdout, proc.stdout[-4000:]
    assert "[rank 0] resumed from step 4" in proc.stdout
    shrunk = _losses(tmp_path / "shrunk")
    assert [r[0] for r in shrunk] == [2, 4, 6]
    for a, b in zip(shrunk, uninterrupted, strict=True):
        assert a[1:] == pytest.approx(b[1:], rel=1e-4), (a, b)


def test_min_processes_drops_a_rank_failing_twice_in_a_row_down_to_k():
    code = (
        "import os, sys\n"
        "rank, count = os.environ['MMNNX_PROCESS_ID'], os.environ['MMNNX_NUM_PROCESSES']\n"
        "print('of', count, 'in attempt', os.environ['MMNNX_RESTART_COUNT'], flush=True)\n"
        "sys.exit(3 if rank == '1' else 0)\n"
    )
    proc, _ = launch(["-n", "3", "--max-restarts", "3", "--min-processes", "2", "--",
                      sys.executable, "-c", code])  # fmt: skip
    assert proc.returncode == 3
    assert proc.stderr.strip().splitlines() == [
        "mmnnx launch: rank 1 failed first (exit code 3); restarting all 3 processes "
        "(restart 1 of 3)",
        "mmnnx launch: rank 1 failed first (exit code 3), as in the attempt before: dropped "
        "rank 1; restarting the other 2 process(es), the ranks above it one lower "
        "(restart 2 of 3)",
        "mmnnx launch: rank 1 failed first (exit code 3); restarting all 2 processes "
        "(restart 3 of 3)",  # at --min-processes 2: kept
        "mmnnx launch: rank 1 failed first (exit code 3); stopped the other 1 process(es)",
    ]
    # rank 1 prints before it fails: in a job of 3, then of 2 (the others may be stopped first)
    for attempt, count in ((0, 3), (1, 3), (2, 2), (3, 2)):
        assert f"[rank 1] of {count} in attempt {attempt}\n" in proc.stdout, proc.stdout


def test_max_restarts_gives_up_after_n_attempts_with_the_last_status():
    code = "import sys, os; sys.exit(3 if os.environ['MMNNX_PROCESS_ID'] == '1' else 0)"
    proc, _ = launch(["-n", "2", "--max-restarts", "2", "--", sys.executable, "-c", code])
    assert proc.returncode == 3
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "mmnnx launch: rank 1 failed first (exit code 3); restarting all 2 processes "
        "(restart 1 of 2)",
        "mmnnx launch: rank 1 failed first (exit code 3); restarting all 2 processes "
        "(restart 2 of 2)",
        "mmnnx launch: rank 1 failed first (exit code 3); stopped the other 1 process(es)",
    ]


@pytest.mark.parametrize(
    "flags,said",
    [
        (["--port", "70000"], "--port"),
        (["--max-restarts", "-1"], "--max-restarts"),
        (["--heartbeat-timeout", "0"], "--heartbeat-timeout"),
        (["--min-processes", "1", "--max-restarts", "1"], "needs --max-restarts 2 or more, got 1"),
        (["--step-timeout", "-1"], "--step-timeout"),
        (["--collectives", "tcp"], "--collectives"),
        (["-n", "two"], "-n"),
    ],
)
def test_bad_launcher_flags_are_one_line_and_exit_2(flags, said, capsys):
    # in this process (a process start costs seconds); test_distributed starts the command
    # itself for its bad -n and the errors found after parsing
    args = ["-n", "2", *flags] if flags[0] != "-n" else flags
    try:  # argparse's errors exit; those found after parsing are returned
        status = main(["launch", *args, "--", sys.executable, "-c", "pass"])
    except SystemExit as e:
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert said in err
    assert len(err.strip().splitlines()) == 1, err
