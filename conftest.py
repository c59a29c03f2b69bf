"""Root conftest: 8 simulated CPU devices for the doctests in mmnnx/, the cyclic garbage
collector's threshold, and the order in which pytest-xdist hands the test files to its workers."""

import collections
import gc
import json
import os
import pathlib

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Python's cyclic collector scans the youngest objects after 10,000 new ones rather than 700: a
# worker's heap grows past a million objects (modules, JAX's caches), and the collections took
# 7.2 of 83 s of CPU over 7 test files in one process, 5.9 s of it in 22 full ones (at 10,000:
# 2.6 s, 1.1 s in 5 full ones; the peak memory the same, 3.0 GB). Tests that count what a
# collection frees call gc.collect() themselves.
gc.set_threshold(10_000, 10, 10)

# The seconds each test file took under `make test` (setup, call and teardown of its tests, as
# reported: 3 workers on 2 cores), those of 10 s or more, written by `--store-file-seconds`. Under
# `--dist loadfile` a file runs whole on one worker: a long one handed out last runs on alone at
# the end while the other workers idle (in pytest-xdist's own order, most tests first, files of
# 1-3 tests of 15-40 s each came last). A file not in it counts as its number of tests x
# MEAN_TEST_SECONDS (the mean of those files' tests); a name no longer in the suite is ignored.
FILE_SECONDS = pathlib.Path(__file__).parent / "tests" / "file_seconds.json"
MEAN_TEST_SECONDS = 0.2
STORED_FROM_S = 10.0


def pytest_addoption(parser):
    parser.addoption(
        "--store-file-seconds",
        action="store_true",
        help=f"write each test file's seconds (those of {STORED_FROM_S:g} s or more) into "
        f"{FILE_SECONDS.relative_to(FILE_SECONDS.parent.parent)}, the order in which "
        "pytest-xdist workers are handed the files",
    )


def pytest_collection_modifyitems(config, items):
    """In a pytest-xdist worker, the test files longest first (their seconds in FILE_SECONDS,
    else their number of tests x MEAN_TEST_SECONDS), each file's tests in their own order: the
    controller hands out files in the order the workers collected them (pyproject.toml's
    ``--no-loadscope-reorder`` turns off pytest-xdist's own order, most tests first), and every
    worker collects alike."""
    if not hasattr(config, "workerinput"):
        return
    measured = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.is_file() else {}
    counts = collections.Counter(item.nodeid.split("::")[0] for item in items)

    def estimate(file: str) -> float:
        return measured.get(file, MEAN_TEST_SECONDS * counts[file])

    items.sort(key=lambda item: (-estimate(f := item.nodeid.split("::")[0]), f))


_seconds: collections.Counter = collections.Counter()


def pytest_runtest_logreport(report):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # the controller adds up the reports the workers send it
    _seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_sessionfinish(session):
    if session.config.getoption("store_file_seconds") and not os.environ.get("PYTEST_XDIST_WORKER"):
        stored = {f: round(s) for f, s in _seconds.most_common() if s >= STORED_FROM_S}
        FILE_SECONDS.write_text(json.dumps(stored, indent=1) + "\n")
