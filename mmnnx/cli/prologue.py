"""What every command that runs a model does first: say an error as its one line, simulate the
devices it needs (``XLA_FLAGS``, unless set) before JAX starts, and join a job of several
processes (under ``mmnnx launch`` or a cluster; alone, nothing); and, for those reading a run
``mmnnx train`` wrote, its spec and the errors of its checkpoints."""

from __future__ import annotations

import os
import sys
from typing import Any

from mmnnx._env import ENV_NUM_PROCESSES


def error(command: str, message: str) -> int:
    """``message`` as ``mmnnx COMMAND``'s one line on stderr; exit status 2.

    Example:
        >>> import contextlib, io
        >>> with contextlib.redirect_stderr(io.StringIO()) as err:
        ...     error("train", "no")
        2
        >>> err.getvalue()
        'mmnnx train: error: no\\n'
    """
    print(f"mmnnx {command}: error: {message}", file=sys.stderr)
    return 2


def start(devices: int, *, distributed: bool = True) -> str | None:
    """Simulates ``devices`` CPU devices unless ``XLA_FLAGS`` gives a count; joins the job. A
    command of one process (``distributed=False``) started as one of several by ``mmnnx launch``
    gets the line to exit with instead (each process would need the run's devices alone)."""
    processes = int(os.environ.get(ENV_NUM_PROCESSES, "1"))
    if not distributed and processes > 1:
        return (
            f"runs in one process, not as one of the {processes} of mmnnx launch; run it alone "
            "(it simulates the run's devices itself)"
        )
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    if distributed:
        import mmnnx as mm  # noqa: PLC0415  (after XLA_FLAGS)

        mm.distributed.initialize()
    return None


def run_spec(run: str) -> tuple[Any, str | None]:
    """The ``RunSpec`` of run directory ``run`` (``--run``), its devices simulated for this one
    process (:func:`start`), and the line to exit with if it cannot be used, else ``None``."""
    from mmnnx.train.generation import RunError, read_run  # noqa: PLC0415

    try:
        spec = read_run(run)
    except RunError as e:
        return None, f"--run: {e}"
    return spec, start(spec.run.layout.devices, distributed=False)


def unrestorable() -> tuple[type[Exception], ...]:
    """The errors of a run's checkpoints that cannot be restored: another model, or damage."""
    from mmnnx.train import checkpoint as ck  # noqa: PLC0415

    return ck.CheckpointMismatchError, ck.CheckpointCorruptError, ck.NoReadableCheckpointError
