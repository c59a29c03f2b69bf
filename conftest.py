"""Root conftest: 8 simulated CPU devices for the doctests in mmnnx/, and the order in which
pytest-xdist hands the test files to its workers."""

import collections
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The files that each keep a worker busy longest (processes started, runs trained, measured
# under `make test`), longest first: under `--dist loadfile` a file runs whole on one worker,
# so one of them handed out last would run on alone at the end while the other workers idle.
# Handed out first, the many short files fill in around them. A file missing here only starts
# later; a name no longer in the suite is ignored.
LONG_FILES = (
    "tests/test_distributed.py",
    "tests/test_cli.py",
    "tests/test_pipeline.py",
    "tests/test_finetune.py",
    "tests/test_launch_failures.py",
    "tests/test_family_conformance.py",
    "tests/test_checkpoint.py",
    "tests/test_docs_examples.py",
    "tests/test_engine_properties.py",
    "tests/test_transformers_fixtures.py",
    "tests/test_evaluation.py",
    "tests/test_pretrained_processes.py",
    "tests/test_notebooks.py",
)


def pytest_collection_modifyitems(config, items):
    """In a pytest-xdist worker, the files of ``LONG_FILES`` first, in its order, then the others
    by their number of tests, most first (pytest-xdist's own order, which pyproject.toml's
    ``--no-loadscope-reorder`` turns off in favour of this one); each file's tests keep their
    order. The workers all collect alike, and the controller hands out files in this order."""
    if not hasattr(config, "workerinput"):
        return
    counts = collections.Counter(item.nodeid.split("::")[0] for item in items)
    rank = {name: i for i, name in enumerate(LONG_FILES)}

    def key(item):
        file = item.nodeid.split("::")[0]
        return (rank.get(file, len(rank)), -counts[file], file)

    items.sort(key=key)
