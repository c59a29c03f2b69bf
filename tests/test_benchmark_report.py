"""benchmarks/report.py, the harness every benchmark script reports through: interleaved rounds,
"median [min-max]" spreads, per-round ratios, the machine record and the ``--rounds`` option;
and benchmarks/pinned.py, which runs a benchmark as processes pinned to a core each."""

import contextlib
import importlib.util
import json
import os
import pathlib
import sys
import threading

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _benchmark_module(name: str):
    """``benchmarks/<name>.py``, imported (the benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def report():
    return _benchmark_module("report")


def test_candidates_take_turns_in_each_round(report):
    calls = []

    def candidate(name):
        return lambda: calls.append(name) or len(calls)

    samples = report.interleaved({"a": candidate("a"), "b": candidate("b")}, rounds=3)
    assert calls == ["a", "b", "a", "b", "a", "b"]
    assert samples == {"a": [1, 3, 5], "b": [2, 4, 6]}
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        report.interleaved({"a": lambda: 1.0}, rounds=0)


def test_ratios_are_taken_per_round_before_the_median(report):
    # medians 2.0 / 2.0 = 1.0, but the per-round ratios are 0.5, 1.0, 4.0
    assert report.ratio_spread([1.0, 2.0, 8.0], [2.0, 2.0, 2.0]) == "1.00 [0.50-4.00]"
    assert report.spread([0.004, 0.001, 0.002], scale=1e3, digits=1) == "2.0 [1.0-4.0]"


def test_rounds_option(report):
    assert report.rounds_option(["x.py"]) == report.MIN_ROUNDS == 5
    assert report.rounds_option(["x.py", "--only", "a", "--rounds", "7"]) == 7
    with pytest.raises(SystemExit, match="--rounds"):
        report.rounds_option(["x.py", "--rounds", "many"])
    with pytest.raises(SystemExit, match="at least 1"):
        report.rounds_option(["x.py", "--rounds", "0"])
    assert report.only_sections(["x.py", "--only", "a", "b c", "--rounds", "1"]) == ["a", "b c"]


def test_help_prints_the_benchmark_s_docstring_and_runs_nothing(report, capsys, monkeypatch):
    monkeypatch.setattr(sys.modules["__main__"], "__doc__", "What this benchmark measures.")
    with pytest.raises(SystemExit) as exit_:
        report.rounds_option(["x.py", "--help", "--rounds", "3"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == "What this benchmark measures.\n"


def test_results_file_records_machine_and_rounds_per_section(report, tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RESULTS_DIR", str(tmp_path))
    path = report.results_path("bench.json")
    assert path == tmp_path / "bench.json"
    report.run_sections({"s": lambda rounds: {"rounds seen": rounds}}, path, "t", rounds=2)
    results = json.loads(path.read_text())
    assert results["s"] == {"rounds seen": 2}
    run = results["measured"]["s"]
    assert run["rounds"] == 2 and "quick check" in run["note"]
    assert run["cores"] >= 1 and run["load average before"] >= 0 and run["cpu"]
    assert run["speed probe s"] > 0
    # a later run of another section keeps this section's record
    report.run_sections(
        {"s": lambda rounds: {}, "u": lambda rounds: {"x": 1.0}}, path, "t", only=["u"]
    )
    results = json.loads(path.read_text())
    assert results["measured"]["s"]["rounds"] == 2 and results["measured"]["u"]["rounds"] == 5
    assert "note" not in results["measured"]["u"]


@pytest.fixture(scope="module")
def pinned():
    return _benchmark_module("pinned")


def test_a_pinned_process_puts_every_thread_on_the_core_at_its_rank(pinned, monkeypatch):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs a process allowed on two cores")
    started, stop = threading.Event(), threading.Event()
    other = threading.Thread(target=lambda: started.set() or stop.wait(30))
    other.start()
    started.wait(30)
    tasks = pathlib.Path("/proc/self/task")
    before = {int(t.name): os.sched_getaffinity(int(t.name)) for t in tasks.iterdir()}
    monkeypatch.setenv("MMNNX_PROCESS_ID", "3")
    try:
        core = pinned.pin_to_own_core()
        assert core == cores[3 % len(cores)]
        assert os.sched_getaffinity(other.native_id) == os.sched_getaffinity(0) == {core}
    finally:
        for tid, allowed in before.items():
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(tid, allowed)
        stop.set()
        other.join()


def test_each_process_s_result_comes_back_in_rank_order(pinned, tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_RANK_RESULTS", str(tmp_path))
    for rank, result in ((1, {"s": 0.5}), (0, [1, 2])):
        monkeypatch.setenv("MMNNX_PROCESS_ID", str(rank))
        pinned.write_result(result)
    assert pinned.results_in(tmp_path, 2) == [[1, 2], {"s": 0.5}]
    assert pinned.results_in(tmp_path, 3) is None  # rank 2 wrote nothing
