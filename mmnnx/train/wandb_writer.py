"""``WandbWriter``: a Weights & Biases run that takes scalars as a TensorBoard ``SummaryWriter``
does, so that ``RunLog`` writes the same scalars to both (``wandb`` imported when it starts)."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import Any

RUN_ID_FILE = "wandb_run_id"  # in the output directory: the run a --resume continues
INIT_TIMEOUT_S = 30.0  # wandb's own is 90 s of retries when it cannot reach its server


class WandbStartError(RuntimeError):
    """``wandb.init`` failed (no network or credentials, a bad project, ...); the message is one
    line naming the project and saying how to log without a network."""


class WandbWriter:
    """Logs ``add_scalar(tag, value, step)`` to the wandb ``run`` as ``run.log({tag: value},
    step=step)`` (the scalars of one step make one row of its history); ``close`` finishes the
    run. :meth:`start` starts the run of a training run's output directory.

    Example:
        >>> class Run:  # stands for the run wandb.init returns
        ...     def log(self, row, step):
        ...         print(step, row)
        >>> WandbWriter(Run()).add_scalar("loss", 2.5, 10)
        10 {'loss': 2.5}
    """

    def __init__(self, run: Any):
        self.run = run

    @classmethod
    def start(
        cls,
        project: str,
        output_dir: str | os.PathLike[str],
        *,
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        resume: bool = False,
    ) -> WandbWriter:
        """Starts a wandb run in ``project`` named ``name`` (default: the output directory's
        name) recording ``config``; with ``resume``, the run whose id ``output_dir/wandb_run_id``
        holds (``resume="allow"``), whose id it then stores. Its files go to
        ``output_dir/wandb`` unless ``WANDB_DIR`` says where; ``WANDB_MODE=offline`` (and every
        other ``WANDB_*`` variable) is honoured as wandb does. It gives up reaching the server
        after 30 s unless ``WANDB_INIT_TIMEOUT`` says otherwise.

        Raises:
            WandbStartError: wandb could not start the run.

        Example (``fit`` starts one with ``TrainConfig(wandb="my-project")``)::

            writer = WandbWriter.start("my-project", "runs/demo", config={"lr": 3e-3})
            writer.add_scalar("loss", 2.5, 10)
            writer.close()
        """
        import wandb  # noqa: PLC0415  (only when asked for: slow to import)

        out = pathlib.Path(output_dir)
        run_id = stored_run_id(out) if resume else None
        settings = {} if "WANDB_INIT_TIMEOUT" in os.environ else {"init_timeout": INIT_TIMEOUT_S}
        try:
            run = wandb.init(
                project=project,
                name=name or out.resolve().name,
                config=dict(config or {}),
                dir=None if os.environ.get("WANDB_DIR") else str(out),
                id=run_id,
                resume="allow" if run_id else None,
                settings=wandb.Settings(**settings),
            )
        except Exception as e:  # whatever stopped it: one line, before any step
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise WandbStartError(
                f"--wandb {project}: wandb could not start a run: {reason} (to log without a "
                "network or an account, set WANDB_MODE=offline, and `wandb sync` the "
                "offline-run-* directory later)"
            ) from None
        (out / RUN_ID_FILE).write_text(run.id + "\n")
        return cls(run)

    @property
    def directory(self) -> pathlib.Path:
        """The run's own directory (``.../wandb/offline-run-*`` or ``run-*``)."""
        return pathlib.Path(self.run.dir).parent

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.run.log({tag: value}, step=step)

    def flush(self) -> None:
        """Nothing to do: wandb writes a step's row when a later step begins, or at close."""

    def close(self) -> None:
        self.run.finish()


def stored_run_id(output_dir: str | os.PathLike[str]) -> str | None:
    """The id of the wandb run an earlier run in ``output_dir`` logged to, or ``None``.

    Example:
        >>> import tempfile
        >>> out = pathlib.Path(tempfile.mkdtemp())
        >>> stored_run_id(out) is None
        True
        >>> _ = (out / RUN_ID_FILE).write_text("1a2b3c4d\\n")
        >>> stored_run_id(out)
        '1a2b3c4d'
    """
    path = pathlib.Path(output_dir, RUN_ID_FILE)
    run_id = path.read_text().strip() if path.is_file() else ""
    return run_id or None
