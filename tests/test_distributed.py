"""Several processes: real processes on loopback (``mmnnx launch`` + ``jax.distributed``), each
run compared with the same step in this one process (8 devices)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np
import pytest

import mmnnx as mm
from mmnnx.cli import main
from mmnnx.launcher import launch as launcher
from mmnnx.mpmd.run.timing import Event
from mmnnx.mpmd.schedules import measured_bubble
from mmnnx.train import CheckpointCorruptError
from tests import distributed_worker as worker
from tests.flags import without_device_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "distributed_worker.py")
TIMEOUT_S = 240
# how much later than the end of the action sending it a value's reader may seem to start:
# a watcher thread notes a program's end when it next runs (late on a busy machine), and the
# processes leave the barrier that aligns their clocks up to about 0.1 ms apart. Under the whole
# suite on a slow day (4 workers on 2 cores) a sender's end was noted 7.4 ms late.
SLACK_S = 0.02


def launch(
    args: list[str], timeout: float = TIMEOUT_S, **extra_env: str
) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=without_device_count(os.environ["XLA_FLAGS"]), **extra_env)
    return subprocess.run(
        [sys.executable, "-m", "mmnnx", "launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def run_scenarios(
    names: list[str],
    processes: int,
    devices: int,
    out,
    collectives: str | None = None,
    verbose: bool = False,
    **env: str,
) -> tuple[dict[str, list[dict]], str]:
    """The scenarios ``names`` of tests/distributed_worker.py run in turn in one launch (each
    start of the processes costs seconds): what each process wrote of each, and what the
    launch printed."""
    flags = [] if collectives is None else ["--collectives", collectives]
    flags += ["--verbose"] * verbose
    timeout = TIMEOUT_S * max(1, len(names) // 3)
    proc = launch(
        ["-n", str(processes), "--devices-per-process", str(devices), *flags, "--",
         sys.executable, "-m", "tests.distributed_worker", ",".join(names), str(out)],
        timeout=timeout, WORKER_TIMEOUT=str(timeout), **env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return {
        name: [json.loads((out / name / f"rank{i}.json").read_text()) for i in range(processes)]
        for name in names
    }, proc.stdout


class Launched(NamedTuple):
    """One launch of several scenarios: its directory, what each process wrote of each
    scenario, what the launch printed, and the one-process GPT checkpoint it restored
    (``alone``'s digest)."""

    out: pathlib.Path
    results: dict[str, list[dict]]
    stdout: str
    alone: dict | None = None


# each schedule's order of actions on 4-device tasks (transfers of 4 shards matched slice by
# slice), and 1F1B on 1-device tasks (one shard each way, three devices of each process outside
# the tasks); 2-device tasks took no path of their own (2 shards matched as 4 are, devices outside
# the tasks as with 1)
BACK_TO_BACK = [("1f1b", 4), ("gpipe", 4), ("zero-bubble-h1", 4), ("interleaved-1f1b", 4),
                ("1f1b", 1)]  # fmt: skip


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Launched:
    """Every scenario of two processes of 4 devices each that needs nothing else of its test, in
    one launch; those that refuse their step last."""
    out = tmp_path_factory.mktemp("two-processes")
    alone = worker.checkpoint_save(out / "alone", stages=2)  # one process: a 1F1B step, saved
    names = ["two_task", *(f"back_to_back:{s}:{d}" for s, d in BACK_TO_BACK),
             "compat_autosharding", "tools", "schedules", "scanned_gpt", "checkpoint_roundtrip",
             "dropout_model", "spanning_without_collectives", "different_models"]  # fmt: skip
    env = dict(CKPT_IN=str(out / "alone"), CKPT_OUT=str(out / "together"),
               CKPT_OUT4=str(out / "four"), SCANNED_OUT=str(out / "scanned"))  # fmt: skip
    return Launched(out, *run_scenarios(names, 2, 4, out, **env), alone)


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory) -> Launched:
    """The scenarios of four processes of 2 devices each, collectives over gloo: each
    4-device task spans two processes. Launched with ``--verbose``: gloo's connection lines
    and JAX's information logs show (tests/test_launch_report.py: not without it)."""
    out = tmp_path_factory.mktemp("four-processes")
    names = ["two_task", "back_to_back:1f1b:4", "fsdp_spanning", "error_on_stderr"]
    return Launched(out, *run_scenarios(names, 4, 2, out, collectives="gloo", verbose=True))


def assert_same_run(results: list[dict], reference: dict, atol: float = 1e-6) -> None:
    for r in results:
        np.testing.assert_allclose(r["losses"], reference["losses"], rtol=1e-5)
        for key, value in reference["params"].items():
            np.testing.assert_allclose(r["params"][key], value, rtol=1e-5, atol=atol, err_msg=key)


@pytest.fixture(scope="module")
def two_task_reference():
    return worker.two_task()


@pytest.mark.parametrize("processes", [2, 4])
def test_readme_two_task_step_matches_one_process(request, two_task_reference, processes):
    # 2 x 4: one stage per process; 4 x 2: each stage's tensor-parallel mesh spans two processes,
    # whose programs need collectives between processes
    launched = request.getfixturevalue("two_processes" if processes == 2 else "four_processes")
    results = launched.results["two_task"]
    assert [r["process"] for r in results] == list(range(processes))
    assert_same_run(results, two_task_reference)
    for i, r in enumerate(results):  # each process's share, as it runs and as others plan it
        assert f"process {i}'s share" in r["program"] and "route v" in r["program"]
        assert all(other["programs"][i] == r["program"] for other in results)


@pytest.fixture(scope="module")
def back_to_back_reference():
    """The back-to-back scenario in this one process, per (schedule, devices per task)."""
    return functools.cache(worker.back_to_back)


@pytest.mark.parametrize("schedule,per_task", BACK_TO_BACK)
def test_steps_back_to_back_on_tasks_of_every_size_match_one_process(
    two_processes, back_to_back_reference, schedule, per_task
):
    # issue 41: steps called back to back, nothing read in between, hung here (on the second)
    assert_same_run(
        two_processes.results[f"back_to_back:{schedule}:{per_task}"],
        back_to_back_reference(schedule, per_task),
    )


def test_a_stage_offers_each_activation_before_it_waits_for_a_cotangent(two_processes):
    # 1F1B over one process per stage: stage 0 sends microbatch 1's activation before it waits
    # for microbatch 0's cotangent, which stage 1 makes only after that activation's forward
    # if it can; sent at its reader's turn instead, it waited for the cotangent and the two
    # processes took turns instead of overlapping (benchmarks/HISTORY.md, 2026-11-27)
    first, last = (r["transfers"] for r in two_processes.results["back_to_back:1f1b:4"])
    assert first.index(["send", "F", 0, 1]) < first.index(["receive", "B", 1, 0])
    sent = [t[1:] for t in first if t[0] == "send"]
    received = [t[1:] for t in last if t[0] == "receive"]
    assert sent == received  # both ends of the one channel take its messages in one order


def test_steps_back_to_back_on_tasks_spanning_processes_match_one_process(
    four_processes, back_to_back_reference
):
    # 4 processes of 2 devices: each 4-device task spans two of them (collectives over gloo)
    results = four_processes.results["back_to_back:1f1b:4"]
    # gloo sums a gradient's parts in another order than one process: AdamW's steps on a
    # near-zero second moment turn that last bit into a few 1e-6
    assert_same_run(results, back_to_back_reference("1f1b", 4), atol=1e-5)


def test_an_fsdp_axis_spanning_processes_trains_as_one_process(four_processes):
    # each stage's 4 devices, its fsdp axis, are 2 devices of each of two processes: every
    # device holds a quarter of each of its stage's parameters, the steps equal one process's
    reference = worker.fsdp_spanning()
    results = four_processes.results["fsdp_spanning"]
    assert_same_run(results, reference, atol=1e-5)  # gloo's order of sums, as above
    for rank, r in enumerate(results):
        assert r["task_processes"] == [[0, 1], [2, 3]]
        stage = "blocks/0/" if rank < 2 else "blocks/3/"
        assert any(name.startswith(stage) for name in r["held"]), r["held"]
        assert all(4 * one == whole for one, whole in r["held"].values()), r["held"]
    assert reference["held"] == {k: v for r in results for k, v in r["held"].items()}


def test_with_verbose_gloo_s_connection_lines_and_jax_s_logs_show(four_processes):
    # a collective among one process's devices goes over gloo once it is on (--collectives);
    # --verbose leaves nothing out, an error's traceback included
    assert "[Gloo]" in four_processes.stdout
    assert "is connected to 1 peer ranks" in four_processes.stdout
    assert "coordination service" in four_processes.stdout  # JAX's C++ information logs
    assert "[rank 1] ValueError: an error still shows" in four_processes.stdout


def test_a_task_spanning_processes_without_collectives_is_refused_naming_it(two_processes):
    for r in two_processes.results["spanning_without_collectives"]:
        assert "task 'stage0' runs on devices of processes [0, 1]" in r["error"]
        assert "collectives='gloo'" in r["error"] and "--collectives gloo" in r["error"]
        assert r["unchanged"]


def test_multimesh_compat_autosharding_across_processes(two_processes):
    # multimesh's autosharding example: layer 1 on process 0's devices, layer 2 on process 1's
    alone = worker.compat_autosharding()
    for r in two_processes.results["compat_autosharding"]:
        np.testing.assert_array_equal(r["out"], alone["out"])
        np.testing.assert_allclose(r["out"], r["reference"], rtol=1e-5)


def test_processes_that_planned_differently_all_refuse_naming_the_difference(two_processes):
    results = two_processes.results["different_models"]
    for r in results:
        assert "differs between processes 0 and 1" in r["error"]
        assert "process 0: input arg0/layers/0/bias: (32,)" in r["error"]
        assert "process 1: input arg0/layers/0/bias: (48,)" in r["error"]


def test_a_killed_process_stops_its_peers_without_the_launcher(tmp_path):
    # as on a cluster: no launcher watches the processes; the survivor must exit on its own
    port = launcher.free_port()
    procs = []
    for rank in range(2):
        env = launcher.process_env(dict(os.environ), rank, 2, port, 4)
        env["MMNNX_HEARTBEAT_TIMEOUT"] = "5"  # how soon the coordination service gives up
        procs.append(
            subprocess.Popen(
                [sys.executable, WORKER, "killed_peer", str(tmp_path)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        started = time.monotonic()
        out, _ = procs[0].communicate(timeout=TIMEOUT_S)
        killed = procs[1].wait(timeout=10)
        assert killed == -signal.SIGKILL, (
            f"rank 1 exited with {killed}:\n{procs[1].stdout.read()[-3000:]}"
        )
        assert procs[0].returncode != 0
        assert time.monotonic() - started < 90
        assert "Error" in out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# The launcher itself, with commands that do not use JAX.

CHILD = "import os, sys, time; rank = int(os.environ['MMNNX_PROCESS_ID']); "


def test_launch_prefixes_lines_and_sets_each_process_environment():
    code = CHILD + (
        "print('hello', rank, os.environ['MMNNX_NUM_PROCESSES'], os.environ['MMNNX_COORDINATOR']"
        ".split(':')[0], os.environ['XLA_FLAGS'])"
    )
    proc = launch(["-n", "3", "--devices-per-process", "2", "--", sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr
    kept = without_device_count(os.environ["XLA_FLAGS"])  # the caller's other flags stay
    for rank in range(3):
        flags = f"{kept} --xla_force_host_platform_device_count=2".strip()
        assert f"[rank {rank}] hello {rank} 3 127.0.0.1 {flags}" in proc.stdout.splitlines()


def test_launch_imports_nothing_of_jax():
    code = (
        "import sys; from mmnnx.cli import main; "
        "status = main(['launch', '-n', '2', '--', sys.executable, '-c', 'pass']); "
        "print(status, sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'flax', 'numpy'}))"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT
    )
    assert run.stdout.splitlines()[-1] == "0 []", run.stdout + run.stderr


def test_launch_stops_the_others_when_one_fails_and_returns_its_status():
    code = CHILD + "sys.exit(3) if rank == 1 else time.sleep(120)"
    started = time.monotonic()
    proc = launch(["-n", "3", "--", sys.executable, "-c", code], timeout=60)
    assert proc.returncode == 3
    assert "rank 1 failed first (exit code 3); stopped the other 2 process(es)" in proc.stderr
    assert time.monotonic() - started < 30


def test_launch_on_ctrl_c_leaves_no_process_behind(tmp_path):
    pids = tmp_path / "pids"
    code = CHILD + f"open({str(pids)!r} + str(rank), 'w').write(str(os.getpid())); time.sleep(120)"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "mmnnx", "launch", "-n", "2", "--", sys.executable, "-c", code],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    written = lambda: [p.read_text() for p in tmp_path.glob("pids*")]  # noqa: E731
    while not (len(w := written()) == 2 and all(w)) and time.monotonic() < deadline:
        time.sleep(0.1)  # (a file exists before its process has written its pid in it)
    children = [int(text) for text in written()]
    assert len(children) == 2
    launcher.send_signal(signal.SIGINT)
    _, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGINT
    assert "SIGINT received; stopped all 2 processes" in err
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_launch_refuses_a_port_in_use_and_a_missing_command():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = launch(["-n", "2", "--port", str(port), "--", sys.executable, "-c", "pass"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"mmnnx launch: port {port} on 127.0.0.1 is in use (Address already in use)"
    )
    proc = launch(["-n", "2", "--", "no-such-command-xyz"])
    assert proc.returncode == 2
    assert "cannot run 'no-such-command-xyz'" in proc.stderr
    proc = launch(["-n", "0", "--", sys.executable, "-c", "pass"])
    assert proc.returncode == 2 and "-n must be" in proc.stderr


def test_initialize_alone_is_a_no_op_and_checks_its_arguments():
    assert mm.distributed.initialize() is False
    assert mm.distributed.is_distributed() is False
    with pytest.raises(ValueError, match="give num_processes and process_id"):
        mm.distributed.initialize("127.0.0.1:1234")
    with pytest.raises(ValueError, match=r"process_id 2 is not in \[0, 2\)"):
        mm.distributed.initialize("127.0.0.1:1234", num_processes=2, process_id=2)


def test_tabulate_cached_partial_timeline_and_memory_profile_across_processes(two_processes):
    results = two_processes.results["tools"]
    reference = worker.tools()
    for rank, r in enumerate(results):
        np.testing.assert_allclose(r["losses"], reference["losses"], rtol=1e-5)
        # every process gets the whole job's timeline; memory is profiled per process
        assert r["event_tasks"] == ["stage0", "stage1"] and r["memory_tasks"] == [f"stage{rank}"]
        assert r["events"] == reference["events"]
        # each value crossing to the other process's stage is a transfer of the timeline,
        # starting once its producer ended there, as each crossing between two tasks of one
        # process is
        assert r["transfers"] == reference["transfers"] and r["transfers"]
        assert reference["lag"] <= 0 and r["lag"] <= SLACK_S  # clocks aligned to about 0.1 ms
        # the link between the processes, measured through the runner's route: one result
        # everywhere; the step's boundaries priced over it, each process launching its own
        assert r["link"] == results[0]["link"] and r["link"][0] >= 0 and r["link"][1] > 0
        for key in ("links", "nbytes", "priced"):
            assert r[key] == reference[key], key
        assert r["links"] == [["stage0", "stage1"], ["stage1", "stage0"]]
        assert r["launching"] == [0, 1] and reference["launching"] == [0, 0]
        # devices as jax.devices() indices (JAX's ids of process 1's devices are 2048..)
        assert "stage0 │ 0-3 (process 0)" in r["table"]
        assert "stage1 │ 4-7 (process 1)" in r["table"] and "2048" not in r["table"]


def test_every_schedule_pipelines_across_processes_as_in_one(two_processes):
    results = two_processes.results["schedules"]
    reference = worker.schedules()["losses"]
    assert set(reference) == {*mm.schedules.names(), "dualpipev fused pairs"}
    for r in results:
        assert set(r["losses"]) == set(reference)
        for name, losses in reference.items():
            np.testing.assert_allclose(r["losses"][name], losses, rtol=1e-5, err_msg=name)


def test_a_model_holding_an_rng_stream_pipelines_across_processes_as_in_one(two_processes):
    assert_same_run(two_processes.results["dropout_model"], worker.dropout_model())


def test_scanned_layers_split_over_processes_as_in_one(two_processes):
    alone = worker.scanned_gpt(save=False)
    for r in two_processes.results["scanned_gpt"]:
        np.testing.assert_allclose(r["losses"], alone["losses"], rtol=1e-5)
        for key, value in alone["state"].items():
            np.testing.assert_allclose(r["state"][key], value, rtol=1e-4, atol=1e-6, err_msg=key)
        assert r["restored"] == r["state"]  # saved and restored across processes: bit-exact


def test_pipelined_gpt_and_checkpoints_across_process_counts(two_processes):
    # one process: a 1F1B GPT step, saved (alone); two processes, one stage each: the same
    # step, saved (together); then the one-process checkpoint restored
    root, alone = two_processes.out, two_processes.alone
    results = two_processes.results["checkpoint_roundtrip"]
    for r in results:
        assert r["saved"]["loss"] == pytest.approx(alone["loss"], rel=1e-6)
        for key, value in alone["state"].items():
            np.testing.assert_allclose(r["saved"]["state"][key], value, rtol=1e-5, err_msg=key)
        assert r["restored"]["state"] == alone["state"]  # 1 process -> 2: bit-exact
    here = worker.checkpoint_restore(root / "alone", stages=2)
    assert results[0]["restored"]["next_loss"] == pytest.approx(here["next_loss"], rel=1e-6)
    # 2 processes -> 1 process, in 2 and in 4 stages: bit-exact
    saved = results[0]["saved"]
    for stages in (2, 4):
        restored = worker.checkpoint_restore(root / "together", stages=stages, train=False)
        assert restored["extra"] == {"loss": saved["loss"]}
        assert restored["state"] == saved["state"]
    # what a resume depends on is checked in a step saved by several processes too: an extra
    # changed to another valid value is damage, named, and nothing is written
    extra_file = root / "together" / "1" / "extra" / "metadata"
    extra_file.write_text(json.dumps({"loss": saved["loss"] + 1.0}))
    with pytest.raises(
        CheckpointCorruptError, match=r"checkpoint step 1 .*'extra' reads back different .*checksum"
    ):
        worker.checkpoint_restore(root / "together", stages=2, train=False)
    # every process wrote the arrays of its own tasks, each array one process
    manifest = json.loads((root / "together" / "1" / "mmnnx" / "metadata").read_text())
    writers = {name: {c[3] for c in a["chunks"]} for name, a in manifest["arrays"].items()}
    assert writers["model/blocks/0/attn/q/kernel"] == {0}
    assert writers["model/blocks/3/attn/q/kernel"] == {1}
    assert all(len(w) == 1 for w in writers.values())
    # 2 processes x 2 tasks -> 2 processes x 1 task: bit-exact, each reading only its arrays
    for r in results:
        assert r["restored4"]["state"] == r["saved4"]["state"]
        assert r["reads"] and all(here for _, here in r["reads"])
    # both read only the values every process has its own copy of (the optimizer's counts)
    both = {n for n, _ in results[0]["reads"]} & {n for n, _ in results[1]["reads"]}
    manifest4 = json.loads((root / "four" / "1" / "mmnnx" / "metadata").read_text())
    assert all(manifest4["arrays"][n]["shape"] == [] for n in both)
    # steps 1, 2, 3, 5 saved by both, the newest 3 kept; step 5 damaged where process 1 alone
    # reads: both pass over it and restore step 3; saving step 4 then deletes step 5 (before,
    # it was kept, and a restore of the latest step went back to it)
    for r in results:
        assert r["damaged"] == {
            "kept": [2, 3, 5],
            "step": 3,
            "skipped": [
                "skipped step 5: damaged (array 'model/blocks/3/attn/q/kernel' fails its checksum)"
            ],
            "after": [2, 3, 4],
        }


# the main job's flags, launched and in one process: 2 stages of 2 (data) x 2 (model) devices,
# the parameters and optimizer state sharded over the data devices (FSDP), 1F1B over 4
# microbatches; step 3 is timed (the default --timeline-step)
TRAIN_FLAGS = ["--tokenizer", "bpe", "--vocab-size", "300", "--steps", "4", "--eval-every", "2",
               "--dim", "32", "--depth", "2", "--heads", "2", "--seq-len", "16",
               "--batch-size", "8", "--microbatches", "4", "--schedule", "1f1b",
               "--fsdp-axis", "2", "--checkpoint-every", "1"]  # fmt: skip
TRAIN_LAUNCH = ["-n", "2", "--devices-per-process", "4", "--", sys.executable, "-m", "mmnnx",
                "train"]  # fmt: skip


class TrainLaunched(NamedTuple):
    """``mmnnx train`` launched (each stage in its own process) and the same run in this one
    process: the launch, both output directories, what the one-process run printed, and both
    ``timeline.json`` as first written (a test resumes the launched run later)."""

    proc: subprocess.CompletedProcess
    out: pathlib.Path
    alone: pathlib.Path
    single: str
    timelines: dict[str, dict]


@pytest.fixture(scope="module")
def train_launched(tmp_path_factory) -> TrainLaunched:
    root = tmp_path_factory.mktemp("train")
    out, alone = root / "launched", root / "alone"
    proc = launch([*TRAIN_LAUNCH, "--output-dir", str(out), *TRAIN_FLAGS])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    single = io.StringIO()  # one process: this one (a process start costs seconds)
    with contextlib.redirect_stdout(single):
        assert main(["train", "--output-dir", str(alone), *TRAIN_FLAGS]) == 0
    timelines = {d.name: json.loads((d / "timeline.json").read_text()) for d in (out, alone)}
    return TrainLaunched(proc, out, alone, single.getvalue(), timelines)


def _timeline(saved: dict) -> tuple[float, list[Event]]:
    assert saved["step"] == 3
    return saved["bubble"], [Event(**row) for row in saved["events"]]


def _reported_bubble(stdout: str) -> str:
    line = next(line for line in stdout.splitlines() if "pipeline bubble (step 3" in line)
    return line.split("│")[-2].strip()


def test_rank_zero_reports_every_stage_with_user_device_indices(train_launched):
    # issue 41, item 5: under mmnnx launch, rank 0 shows the whole job
    proc, single = train_launched.proc, train_launched.single

    # the timeline has every stage's actions, from both processes, on one clock
    bubble, timed = _timeline(train_launched.timelines["launched"])
    events = [e for e in timed if e.kind != "T"]
    by_action = {(e.task, e.kind, e.microbatch): e for e in events}
    assert sorted(by_action) == sorted(
        (task, kind, m) for task in ("stage0", "stage1") for kind in "FB" for m in range(4)
    )
    moved = {(e.carries, e.microbatch): e for e in timed if e.kind == "T"}
    for m in range(4):  # a value is read after the action sending it ended and it arrived
        sent, read = by_action[("stage0", "F", m)], by_action[("stage1", "F", m)]
        assert read.start >= moved[("F", m)].end >= moved[("F", m)].start >= sent.end - SLACK_S
        sent, read = by_action[("stage1", "B", m)], by_action[("stage0", "B", m)]
        assert read.start >= moved[("B", m)].end >= moved[("B", m)].start >= sent.end - SLACK_S
    assert min(e.start for e in events) >= 0

    # the report's bubble is the whole job's; rank 0 alone once reported 1% here
    assert bubble == pytest.approx(measured_bubble(events))
    assert _reported_bubble(proc.stdout) == f"{bubble:.0%}"
    alone_bubble, alone_events = _timeline(train_launched.timelines["alone"])
    assert {e.task for e in alone_events} == {"stage0", "stage1"}
    # 2-stage 1F1B over 4 microbatches idles at least 1/5 of the time with equal actions.
    # Launched, a value crossing the stage boundary is a pull through the transfer server that
    # the reader waits for (2-20 ms here), where one process moves it inside one runtime: up to
    # 26 points more (0.29-0.55 against 0.27-0.37 here, docs/distributed.md); the machine's
    # noise is about 10 points more either way, and under the whole suite on a slow day (4
    # workers on 2 cores, ends noted late) the launched run measured 0.82 against 0.15 alone.
    assert 0.15 <= bubble <= 0.9
    assert -0.15 <= bubble - alone_bubble <= 0.75, (bubble, alone_bubble)

    # devices as jax.devices() indices (JAX's ids of process 1's CPU devices are 2048..)
    assert "[rank 0] │ stage0 │ 0-3 (process 0) │" in proc.stdout
    assert "[rank 0] │ stage1 │ 4-7 (process 1) │" in proc.stdout
    assert "2048" not in proc.stdout
    assert re.search(r"\n│ stage0 │ 0-3 +│", single)  # one process: as before
    assert re.search(r"\n│ stage1 │ 4-7 +│", single) and "(process" not in single


def test_mmnnx_train_under_launch_matches_one_process_and_resumes_past_damage(
    train_launched, tmp_path
):
    # the main job: each pipeline stage in its own process, FSDP inside it; rank 0 reports and
    # writes; each process trains the BPE (the same one), and both make the token file at once
    proc, out, alone = train_launched.proc, train_launched.out, train_launched.alone
    assert "[rank 0] step 4/4 loss " in proc.stdout  # a plain line: no terminal under launch
    assert "[rank 0] step 4/4 eval_loss " in proc.stdout and "[rank 1] step" not in proc.stdout
    assert "run report" in proc.stdout and "[rank 1]" not in "".join(
        line for line in proc.stdout.splitlines(keepends=True) if "run report" in line
    )
    launched = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (alone / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in launched] == [r["step"] for r in reference]
    for a, b in zip(launched, reference, strict=True):
        for key in ("loss", "eval_loss"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-5), (a, b)
    assert (out / "loss.png").is_file() and (out / "timeline.png").is_file()
    ckpt = out / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["2", "3", "4"]
    saved = (out / "tokenizer" / "bpe.json").read_text()
    assert saved == (alone / "tokenizer" / "bpe.json").read_text() and '"merges"' in saved
    # each process wrote only its stage's arrays, each in its fsdp x model shards (a 32 x 32
    # kernel: 4 chunks of 16 x 16; 2 without FSDP), its Adam moments alike
    arrays = json.loads((ckpt / "4" / "mmnnx" / "metadata").read_text())["arrays"]
    for block, rank in ((0, 0), (1, 1)):
        for name in (f"model/blocks/{block}/attn/q/kernel",
                     f"opt/opt_state/0/mu/blocks/{block}/attn/q/kernel"):  # fmt: skip
            chunks = arrays[name]["chunks"]
            assert {c[3] for c in chunks} == {rank}, name
            assert sorted(c[:2] for c in chunks) == [
                [[i, j], [i + 16, j + 16]] for i in (0, 16) for j in (0, 16)
            ], name
    # the launched run's step 3 continued in this one process without FSDP (--fsdp-axis 1), as
    # the launch continues it below
    here = tmp_path / "here"
    shutil.copytree(out, here)
    shutil.rmtree(here / "checkpoints" / "4")
    # the newest step damaged where process 1 alone reads (a layer of its stage): both
    # processes resume from the step before, and rank 0 says which step it passed over
    kernel = ckpt / "4" / "arrays" / "model" / "blocks" / "1" / "attn" / "q" / "kernel"
    for chunk in kernel.iterdir():
        if not chunk.name.startswith("."):
            chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])
    flags = list(TRAIN_FLAGS)
    flags[flags.index("--steps") + 1] = "5"
    resumed = launch([*TRAIN_LAUNCH, "--output-dir", str(out), *flags, "--resume"])
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-2000:]
    assert (
        f"[rank 0] resumed from step 3 ({ckpt}); skipped step 4: damaged (array "
        "'model/blocks/1/attn/q/kernel' fails its checksum), set aside as 4.unreadable\n"
    ) in resumed.stdout
    assert sorted(p.name for p in ckpt.iterdir() if not p.name.startswith(".")) == [
        "3",
        "4",
        "4.unreadable",
        "5",
    ]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2, 4, 5]  # step 4 once: trained again
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", "--output-dir", str(here), *flags, "--fsdp-axis", "1",
                     "--resume"]) == 0  # fmt: skip
    continued = [json.loads(line) for line in (here / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in continued] == [0, 2, 4, 5]
    for a, b in zip(continued[2:], rows[2:], strict=True):
        for key in ("loss", "eval_loss"):
            assert a[key] == pytest.approx(b[key], rel=1e-5), (a, b)


def test_state_on_no_task_is_on_every_process_after_a_step(tmp_path):
    # issue 69: one device per process, two stages, no warm-up: the optimizer's step counts
    # (state on no task) were computed on stage 1 and handed to process 0 as a placeholder on
    # process 1's device, which process 0's stage read at step 2 ("does not support cross-host
    # device transfers"). Each process now keeps its own copy, and the run equals one process.
    # It trains on packed completion records (issue 71: --data under mmnnx launch).
    data = tmp_path / "records.jsonl"
    records = [{"prompt": f"{i} plus {i} is ", "completion": f"{2 * i}."} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    flags = ["--data", str(data), "--pack", "--stages", "2", "--data-axis", "1", "--model-axis",
             "1", "--warmup-steps", "0",
             "--steps", "3", "--eval-every", "3", "--checkpoint-every", "3", "--timeline-step",
             "0", "--dim", "16", "--depth", "2", "--heads", "2", "--seq-len", "16",
             "--batch-size", "4", "--microbatches", "2", "--log-every", "1",
             "--no-tensorboard"]  # fmt: skip
    out, alone = tmp_path / "launched", tmp_path / "alone"
    proc = launch(["-n", "2", "--devices-per-process", "1", "--", sys.executable, "-m", "mmnnx",
                   "train", "--output-dir", str(out), *flags])  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", "--output-dir", str(alone), *flags]) == 0
    rows = [
        [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        for run in (out, alone)
    ]
    assert [r["step"] for r in rows[0]] == [r["step"] for r in rows[1]] == [0, 1, 2, 3]
    for launched, reference in zip(*rows, strict=True):
        for key in ("loss", "eval_loss"):
            if key in reference:
                assert launched[key] == pytest.approx(reference[key], rel=1e-5)
    assert (out / "checkpoints" / "3").is_dir()


# Process 0 offers process 1 a value, then enters a program with a collective between the two;
# process 1 receives the value first, then enters the program (1F1B over stages spanning two
# processes does this: a stage's rank offers an activation, then runs a program summing over its
# stage's processes, while the next stage's rank needs the activation before its own sum).
OFFER_THEN_COLLECTIVE = """
import time, numpy as np, jax, jax.numpy as jnp, mmnnx as mm
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from mmnnx._jax import runtime
from mmnnx.distributed.transport import transport
mm.distributed.initialize()
me, here = jax.process_index(), jax.local_devices()[0]
mesh = Mesh(np.array(jax.devices()), ("d",))
x = jax.make_array_from_callback((4,), NamedSharding(mesh, PartitionSpec("d")),
                                 lambda index: np.ones(1, np.float32))
total = jax.jit(lambda x: x + jnp.sum(x))  # sums over both processes' devices
total(x).block_until_ready()
if me == 0:
    transport().send(1, [jax.device_put(np.arange(3, dtype=np.float32), here)])
    y = total(x)  # launched: it waits for process 1 on this process's threads
    runtime.key_value_set("entered", b"1")
else:
    runtime.key_value_get("entered", 60)
    time.sleep(1)  # process 0 waits in the program
    spec = jax.ShapeDtypeStruct((3,), np.float32, sharding=SingleDeviceSharding(here))
    (got,) = transport().receive(0, [spec])
    deadline = time.monotonic() + 30
    while not got.is_ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    print("received", got.is_ready(), flush=True)
    if not got.is_ready():
        raise SystemExit(3)
    y = total(x)
print("total", float(y.addressable_shards[0].data[0]), flush=True)
"""

# Runs the rest of its arguments with python pinned to one core (the launcher and its processes
# inherit it), without forking this multithreaded process to pin it.
ON_ONE_CORE = (
    "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
)


def test_a_value_offered_before_a_collective_reaches_a_peer_that_needs_it_first():
    # a CPU program with a collective between processes holds a thread of its process's pool per
    # local device while it waits; with as many devices as threads (2 here: every process pinned
    # to one core, XLA's pool one thread per core), the transfer server had none left to hand
    # process 1 the value, and both waited for ever (the 4 x 2 gloo resume that hung once).
    # mm.distributed.initialize now makes the pool 2 threads larger than the local devices.
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC")}
    env["XLA_FLAGS"] = without_device_count(os.environ["XLA_FLAGS"])
    proc = subprocess.run(
        [sys.executable, "-c", ON_ONE_CORE, str(min(os.sched_getaffinity(0))), "-m", "mmnnx",
         "launch", "-n", "2", "--devices-per-process", "2", "--collectives", "gloo", "--",
         sys.executable, "-c", OFFER_THEN_COLLECTIVE],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "[rank 1] received True" in proc.stdout
    assert "[rank 0] total 5.0" in proc.stdout and "[rank 1] total 5.0" in proc.stdout


def test_initialize_names_a_coordinator_port_in_use():
    code = (
        "import socket, mmnnx as mm\n"
        "busy = socket.socket(); busy.bind(('127.0.0.1', 0)); busy.listen()\n"
        "address = '127.0.0.1:%d' % busy.getsockname()[1]\n"
        "try:\n"
        "    mm.distributed.initialize(address, num_processes=2, process_id=0)\n"
        "except RuntimeError as e:\n"
        "    print(str(e).replace(address, 'ADDRESS'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]  # the error, and no crash at exit
    assert proc.stdout.strip() == (
        "mm.distributed.initialize: process 0 cannot start the coordinator on ADDRESS: the port "
        "is in use (another run, or a leftover process); choose another port (mmnnx launch picks "
        "a free one)"
    ), proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize("victim", [0, 1])
def test_a_process_killed_while_a_checkpoint_is_saved_leaves_the_previous_one(
    tmp_path, monkeypatch, victim
):
    # rank 0 killed before it commits (every process has written); rank 1 half-way through
    # writing its own arrays
    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("CKPT_DIR", str(ckpt))
    monkeypatch.setenv("KILL_RANK", str(victim))
    proc = launch(["-n", "2", "--devices-per-process", "4", "--", sys.executable, "-m",
                   "tests.distributed_worker", "killed_during_save", str(tmp_path)])  # fmt: skip
    assert proc.returncode == 128 + signal.SIGKILL, proc.stdout[-3000:]
    assert f"rank {victim} failed first (killed by SIGKILL)" in proc.stderr
    assert any(p.name.startswith("2.") for p in ckpt.iterdir())  # step 2's data, not committed
    from mmnnx.train import Checkpointer

    with Checkpointer(ckpt) as checkpoints:
        assert checkpoints.latest_step() == 1
    restored = worker.checkpoint_restore(ckpt, stages=2, train=False)
    assert restored["state"] == json.loads((tmp_path / "step1.json").read_text())


def test_mmnnx_train_with_too_few_devices_across_processes_says_what_it_needs(tmp_path):
    # two processes are enough to be across processes (a third only cost its start)
    proc = launch(["-n", "2", "--devices-per-process", "3", "--", sys.executable, "-m", "mmnnx",
                   "train", "--output-dir", str(tmp_path), "--steps", "1"])  # fmt: skip
    assert proc.returncode == 2
    assert (
        "mmnnx train: error: only 6 devices are available (2 processes x 3); --stages 2 x "
        "--data-axis 2 x --model-axis 2 needs 8"
    ) in proc.stdout
    assert "failed first (exit code 2)" in proc.stderr
