"""``mmnnx train --resume`` on fewer devices than the run's layout needs (``mmnnx launch
--min-processes``): the same stages, each on fewer devices. Only the data axis narrows: it only
splits each microbatch's rows, so the losses stay those of the run as planned, while the other
axes shape the model and its schedule.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmnnx.train.config import RunConfig


def data_axis(run: RunConfig, devices: int) -> int:
    """``--data-axis``, or with ``--resume`` a narrower one that fits ``devices`` (said)."""
    import jax  # noqa: PLC0415

    from mmnnx.train.validate import devices_needed, layout  # noqa: PLC0415

    needed, lay = devices_needed(run), run.layout
    if devices >= needed:
        return lay.data_axis
    processes = jax.process_count()
    where = f" ({processes} processes x {jax.local_device_count()})" if processes > 1 else ""
    problem = f"only {devices} devices are available{where}; {layout(run)} needs {needed}"
    if not run.outputs.resume:
        raise ValueError(problem)
    narrowed = narrowed_data_axis(
        lay.stages, lay.data_axis, lay.expert_axis, lay.model_axis, devices
    )
    if narrowed is None:
        least = needed // lay.data_axis
        raise ValueError(
            f"{problem}; --resume narrows only --data-axis, and --data-axis 1 needs {least}"
        )
    per_stage = narrowed * lay.expert_axis * lay.model_axis
    if jax.process_index() == 0:
        line = replanned_line(layout(run), needed, f"{devices}{where}", narrowed, per_stage)
        print(line, file=sys.stderr)
    return narrowed


def narrowed_data_axis(
    stages: int, data_axis: int, expert_axis: int, model_axis: int, devices: int
) -> int | None:
    """The largest divisor of ``data_axis`` with which the layout fits in ``devices`` (a
    divisor still splits each microbatch evenly), or ``None``.

    Example:
        >>> narrowed_data_axis(2, 4, 1, 1, 6), narrowed_data_axis(2, 2, 1, 2, 2)
        (2, None)
    """
    others = stages * expert_axis * model_axis
    fitting = [d for d in range(1, data_axis + 1) if data_axis % d == 0 and others * d <= devices]
    return max(fitting, default=None)


def replanned_line(layout: str, needed: int, devices: str, data_axis: int, per_stage: int) -> str:
    """The line ``mmnnx train`` prints when it re-plans.

    Example:
        >>> replanned_line("--stages 2 x --data-axis 4 x --model-axis 1", 8, "6 (3 processes x 2)",
        ...                2, 2)  # doctest: +NORMALIZE_WHITESPACE
        'mmnnx train: --resume: --stages 2 x --data-axis 4 x --model-axis 1 needs 8 devices,
        the job has 6 (3 processes x 2): re-planned as --data-axis 2, the same stages on 2
        devices each'
    """
    each = f"{per_stage} device{'s' if per_stage > 1 else ''} each"
    return (
        f"mmnnx train: --resume: {layout} needs {needed} devices, the job has {devices}: "
        f"re-planned as --data-axis {data_axis}, the same stages on {each}"
    )
