"""The suite's guard on JAX's environment (tests/conftest.py): a module imported, or a test run,
that changes ``XLA_FLAGS`` (or another variable of JAX, XLA or its thread pool) is failed by
name and the variable put back. A probe script that set the flags on import made the processes
tests start compile at XLA's default optimisation while the references computed in process did
not: 10 comparisons failed on numbers, in whichever worker had collected the probe first."""

import os
from types import SimpleNamespace

from tests import conftest


def test_a_change_to_xla_flags_is_named_and_undone(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    message = conftest.environment_changed_by("tests/test_x.py::test_y")
    assert message.startswith("tests/test_x.py::test_y changed XLA_FLAGS from ")
    assert "to '--xla_force_host_platform_device_count=8'" in message
    assert os.environ["XLA_FLAGS"] == conftest.JAX_ENVIRONMENT["XLA_FLAGS"]
    assert conftest.environment_changed_by("the next test") is None


def test_a_module_that_changes_them_on_import_fails_its_collection(monkeypatch):
    collecting = conftest.pytest_make_collect_report(SimpleNamespace(nodeid="tests/x_probe.py"))
    next(collecting)  # the module is imported here...
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # ...and sets them
    try:
        collecting.send(SimpleNamespace(outcome="passed", longrepr=None))
    except StopIteration as done:
        report = done.value
    assert report.outcome == "failed"
    assert report.longrepr.startswith("importing tests/x_probe.py changed XLA_FLAGS")
    assert os.environ["XLA_FLAGS"] == conftest.JAX_ENVIRONMENT["XLA_FLAGS"]


def test_a_variable_added_is_named_and_removed(monkeypatch):
    monkeypatch.delenv("JAX_ENABLE_X64", raising=False)
    os.environ["JAX_ENABLE_X64"] = "1"  # not through monkeypatch: as a module would
    message = conftest.environment_changed_by("tests/test_x.py::test_z")
    assert message.startswith("tests/test_x.py::test_z changed JAX_ENABLE_X64 from None to '1'")
    assert "JAX_ENABLE_X64" not in os.environ
