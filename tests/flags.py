"""The XLA flags the tests compile with, handed on to the processes tests start so that both
sides of a comparison compile alike."""

import os
from importlib.metadata import version

_EMITTERS_OFF = "--xla_cpu_use_fusion_emitters=false"
"""jaxlib 0.11 has no such flag (XLA:CPU keeps only its fusion emitters there) and aborts on it."""

COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1" + (
    f" {_EMITTERS_OFF}" if tuple(map(int, version("jaxlib").split(".")[:2])) < (0, 11) else ""
)
"""Tests check numbers, not speed, and compiling is most of the suite's time: XLA's backend
optimisation off halves it (measured: 37 s -> 21 s for the GPT dropout pipelines), and XLA:CPU's
MLIR fusion emitters off then cuts it 3x more (pipeline, packing, stack and output tests: 212 s
-> 67 s compiling the programs of pipeline stages, 250 s -> 173 s for the four files; the
whole suite 886 s -> 735 s). At the default optimisation level the emitters are the faster.
Each program's LLVM module compiled whole rather than split into parts compiled apart (XLA:CPU
splits it for parallel codegen; on 2 cores running 2 test workers that only adds work): 10-13%
less CPU time for test_jit_transformer.py and test_deep_models.py, the same numbers."""

_DEVICE_COUNT = "--xla_force_host_platform_device_count"


def without_device_count(flags: str) -> str:
    """``flags`` less the simulated device count, which a started process sets for itself.

    Example:
        >>> without_device_count("--xla_force_host_platform_device_count=8 --a=1")
        '--a=1'
    """
    return " ".join(f for f in flags.split() if not f.startswith(_DEVICE_COUNT))


def with_device_count(flags: str, count: int) -> str:
    """``flags`` with ``count`` simulated CPU devices in place of any count they give.

    Example:
        >>> with_device_count("--a=1 --xla_force_host_platform_device_count=2", 8)
        '--a=1 --xla_force_host_platform_device_count=8'
    """
    return f"{without_device_count(flags)} {_DEVICE_COUNT}={count}".strip()


def set_device_count(count: int) -> None:
    """For a script run by hand or a started process, before JAX starts (never on import: the
    suite's doctest collection imports every module under ``tests/``): ``count`` simulated CPU
    devices in ``XLA_FLAGS``, its other flags kept."""
    os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), count)
