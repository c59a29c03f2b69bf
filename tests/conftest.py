"""Test set-up: 8 simulated CPU devices, configured before JAX is imported."""

import atexit
import gc
import os
import shutil
import sys
import tempfile

from tests.flags import COMPILE_FLAGS

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
# Both sides of every comparison compile alike (processes tests start included); benchmarks
# and notebooks keep XLA's defaults.
if COMPILE_FLAGS not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " " + COMPILE_FLAGS
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache for the whole run (the processes tests start included): tests compile
# the same small programs again and again. Fresh per run, so nothing carries over between runs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="mmnnx-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402
import pytest  # noqa: E402

assert len(jax.devices()) == 8, "tests need 8 simulated CPU devices"


_JAX_PREFIXES = ("XLA_", "JAX_", "PJRT_")


def jax_environment() -> dict[str, str]:
    """The variables that shape how JAX and XLA compile and run here and in the processes tests
    start: ``XLA_*`` (the flags), ``JAX_*`` (platforms, the compilation cache), ``PJRT_*`` and
    ``NPROC`` (the CPU thread pool)."""
    return {k: v for k, v in os.environ.items() if k.startswith(_JAX_PREFIXES) or k == "NPROC"}


JAX_ENVIRONMENT = jax_environment()
"""As XLA started in this process. Changed later, it reaches the processes tests start: with
other flags they compile otherwise than this one (their numbers then differ from the references
computed here, in whichever worker ran the change first), and this process's programs are keyed
in the shared compilation cache under flags they were not compiled with."""


def environment_changed_by(what: str) -> str | None:
    """What to fail ``what`` with if :data:`JAX_ENVIRONMENT` changed (restored, so that the one
    at fault is named and nothing after it), else ``None``."""
    now = jax_environment()
    if now == JAX_ENVIRONMENT:
        return None
    changed = sorted(
        k for k in now.keys() | JAX_ENVIRONMENT.keys() if now.get(k) != JAX_ENVIRONMENT.get(k)
    )
    for k in changed:
        if k in JAX_ENVIRONMENT:
            os.environ[k] = JAX_ENVIRONMENT[k]
        else:
            del os.environ[k]
    changes = ", ".join(f"{k} from {JAX_ENVIRONMENT.get(k)!r} to {now.get(k)!r}" for k in changed)
    return (
        f"{what} changed {changes}: a script sets its environment under "
        "`if __name__ == '__main__'`, a test with monkeypatch"
    )


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    message = environment_changed_by(f"importing {collector.nodeid}")
    if message is not None:
        report.outcome, report.longrepr = "failed", message
    return report


@pytest.fixture(autouse=True)
def _jax_environment_kept(request):
    yield
    message = environment_changed_by(request.node.nodeid)
    if message is not None:
        pytest.fail(message)


# scripts run by hand in a separate environment with torch and transformers (their outputs are
# the fixtures beside them): never imported by the suite, nor its doctests
collect_ignore = ["transformers_fixtures"]


@pytest.fixture
def devices():
    return jax.devices()


@pytest.fixture
def stray_errors(monkeypatch):
    """Errors raised in callbacks no caller awaits any more (``sys.unraisablehook``, such as a
    library's reads completing into a closed event loop), printed on stderr as a user sees them
    rather than turned into pytest warnings; the fixture's value lists them."""
    seen = []

    def hook(unraisable):
        seen.append(unraisable.exc_value)
        sys.__unraisablehook__(unraisable)

    monkeypatch.setattr(sys, "unraisablehook", hook)
    return seen


@pytest.fixture
def frozen_heap():
    """The objects alive before the test frozen out of the garbage collector (``gc.freeze``):
    a test counting live arrays after ``gc.collect()`` then scans only what it made. In a
    worker that has run many modules each full collection takes a large part of a second
    (test_cached_partial.py's 10 of them: 1.8 s alone, 5.5 s after one other module). A cycle
    the freeze keeps alive (garbage already there, counted as before the test) can only add to
    what such a test counts, never hide an array."""
    gc.freeze()
    yield
    gc.unfreeze()
