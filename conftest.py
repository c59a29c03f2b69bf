"""Root conftest: 8 simulated CPU devices for the doctests in mmnnx/, the cyclic garbage
collector's threshold, and the order in which pytest-xdist hands the test files to its workers."""

import collections
import gc
import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Python's cyclic collector scans the youngest objects after 10,000 new ones rather than 700: a
# worker's heap grows past a million objects (modules, JAX's caches), and the full collections
# the young ones trigger took 7.2 of 83 s of CPU over 7 test files in one process (1.0 s at
# 10,000; the peak memory the same, 3.0 GB). Tests that count what a collection frees call
# gc.collect() themselves.
gc.set_threshold(10_000, 10, 10)

# The seconds the slowest tests of a file took under `make test` (3 workers on 2 cores; its
# tests of 7.5 s or more, and files of few tests measured alone x 1.5), rounded: under `--dist
# loadfile` a file runs whole on one worker, and a long one handed out last runs on alone at the
# end while the other workers idle (files of 1-3 tests of 15-40 s each came last in pytest-xdist's
# own order, fewest tests last). A file not here counts as its number of tests x 0.4 s (the
# suite's mean); a name no longer in the suite is ignored.
SLOW_TESTS_SECONDS = {
    "tests/test_distributed.py": 178,
    "tests/test_cli.py": 117,
    "tests/test_pipeline.py": 90,
    "tests/test_finetune.py": 81,
    "tests/test_launch_failures.py": 55,
    "tests/test_family_conformance.py": 52,
    "tests/test_checkpoint.py": 34,
    "tests/test_docs_examples.py": 34,
    "tests/test_engine_properties.py": 30,
    "tests/test_transformers_fixtures.py": 26,
    "tests/test_evaluation.py": 24,
    "tests/test_pretrained_processes.py": 22,
    "tests/test_notebooks.py": 21,
    "tests/test_whisper_pipeline.py": 20,
    "tests/test_resume_planned_layout.py": 18,
    "tests/test_cached_partial.py": 17,
    "tests/test_gemma4_pipeline.py": 16,
    "tests/test_zero_bubble_schedules.py": 14,
    "tests/test_flax_examples.py": 13,
    "tests/test_packing.py": 13,
    "tests/test_stacks.py": 13,
    "tests/test_run_log.py": 12,
    "tests/test_chat_data.py": 12,
    "tests/test_family_deepseek.py": 12,
    "tests/test_generate.py": 12,
    "mmnnx/mpmd/run/programs.py": 11,
    "tests/test_wandb.py": 11,
    "tests/test_gpt.py": 10,
    "tests/test_dpo.py": 10,
    "tests/test_microbatch_outputs.py": 9,
    "tests/test_partition.py": 9,
    "tests/test_precision_training.py": 9,
    "tests/test_modules.py": 9,
    "tests/test_jit_transformer.py": 9,
    "tests/test_plan.py": 9,
    "tests/test_memory.py": 9,
    "tests/test_pretrained_moe.py": 9,
    "tests/test_moe_training.py": 9,
    "tests/test_pipeline_state.py": 8,
    "tests/test_gpt_oss_pipeline.py": 8,
    "tests/test_fsdp.py": 8,
    "mmnnx/modules/deepseek_moe.py": 6,
    "mmnnx/models/gpt.py": 6,
    "tests/test_explicit_sharding.py": 6,
}
MEAN_TEST_SECONDS = 0.4


def pytest_collection_modifyitems(config, items):
    """In a pytest-xdist worker, the test files longest first by their estimate (the seconds of
    ``SLOW_TESTS_SECONDS`` plus ``MEAN_TEST_SECONDS`` a test), each file's tests in their own
    order: the controller hands out files in the order the workers collected them
    (pyproject.toml's ``--no-loadscope-reorder`` turns off pytest-xdist's own order, most tests
    first), and every worker collects alike."""
    if not hasattr(config, "workerinput"):
        return
    counts = collections.Counter(item.nodeid.split("::")[0] for item in items)

    def estimate(file: str) -> float:
        return SLOW_TESTS_SECONDS.get(file, 0) + MEAN_TEST_SECONDS * counts[file]

    items.sort(key=lambda item: (-estimate(f := item.nodeid.split("::")[0]), f))
