"""``mmnnx train --resume`` on fewer devices than the run's layout needs (a job that goes on
without a lost process, ``mmnnx launch --min-processes``): the same stages, each on fewer
devices, by narrowing the data axis.

Only the data axis narrows: the stages, virtual stages and model (tensor) axis shape the model
and its schedule (``--model-axis`` even rounds the vocabulary up), while the data axis only
splits each microbatch's rows, so the losses stay those of the run as planned (every process
reads whole batches; the checkpoint holds whole arrays, restored onto any layout).
"""

from __future__ import annotations


def narrowed_data_axis(
    stages: int, data_axis: int, expert_axis: int, model_axis: int, devices: int
) -> int | None:
    """The largest divisor of ``data_axis`` with which ``stages x it x expert_axis x
    model_axis`` devices fit in ``devices`` (a divisor still splits each microbatch evenly);
    ``None`` when even 1 does not fit.

    Example:
        >>> narrowed_data_axis(2, 4, 1, 1, 6), narrowed_data_axis(2, 2, 1, 2, 2)
        (2, None)
    """
    others = stages * expert_axis * model_axis
    fitting = [d for d in range(1, data_axis + 1) if data_axis % d == 0 and others * d <= devices]
    return max(fitting, default=None)


def replanned_line(layout: str, needed: int, devices: str, data_axis: int, per_stage: int) -> str:
    """The line ``mmnnx train`` prints when it re-plans: ``layout`` (the flags) needs
    ``needed`` devices, the job has ``devices`` (in words), and each stage now runs on
    ``per_stage`` devices with ``--data-axis data_axis``.

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
