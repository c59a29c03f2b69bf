"""``RunLog``: what ``fit`` reports while it trains besides its progress bar and
``metrics.jsonl``: plain lines, evaluation losses, scalars for TensorBoard or wandb, a trace."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from types import TracebackType
from typing import Protocol

import jax
from rich.console import Console

from mmnnx.train.preference import PreferenceMetrics
from mmnnx.train.router_metrics import RouterMetrics


def print_line(console: Console, line: str) -> None:
    """``line`` as it is: one line however wide (no wrapping), paths not read as markup."""
    console.print(line, soft_wrap=True, markup=False, highlight=False)


class ScalarWriter(Protocol):
    """Where ``RunLog`` writes its scalars: a tensorboardX ``SummaryWriter``, a ``WandbWriter``."""

    def add_scalar(self, tag: str, value: float, step: int) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class RunLog:
    """Reports a run as it goes (scalars to TensorBoard and ``writers``, plain lines without a
    terminal, a profiler trace of ``profile_steps``); closes its writers and trace on exit.

    Example:
        >>> import io, tempfile
        >>> console = Console(file=io.StringIO())  # not a terminal: plain lines
        >>> with RunLog(console, tempfile.mkdtemp(), total_steps=20, tensorboard=False) as log:
        ...     log.train(10, loss=2.5, tokens_per_s=1000.0, learning_rate=1e-3)
        ...     log.evaluation(10, 2.25)
        >>> print(console.file.getvalue(), end="")
        step 10/20 loss 2.5000 tokens/s 1,000 lr 1.00e-03
        step 10/20 eval_loss 2.2500
    """

    def __init__(
        self,
        console: Console,
        output_dir: str | pathlib.Path,
        *,
        total_steps: int,
        first_step: int = 0,
        tensorboard: bool = True,
        profile_steps: tuple[int, int] | None = None,
        writers: Sequence[ScalarWriter] = (),
    ):
        self.console = console
        self.plain = not console.is_terminal
        self.total_steps = total_steps
        self.first_step = first_step
        self.profile_steps = profile_steps
        self.files: dict[str, str] = {}
        self._tracing = False
        self._profile_dir = pathlib.Path(output_dir) / "profile"
        self._writers: list[ScalarWriter] = []
        if tensorboard:
            from tensorboardX import SummaryWriter  # noqa: PLC0415  (only when asked for)

            directory = pathlib.Path(output_dir) / "tensorboard"
            purge = first_step + 1 if first_step else None  # a resumed run's later events go
            writer = SummaryWriter(  # one file per run, named after its first step
                str(directory), purge_step=purge, filename_suffix=f".from-step-{first_step}"
            )
            self._writers.append(writer)
            self.files["tensorboard"] = str(directory)
        self._writers.extend(writers)

    def train(
        self,
        step: int,
        *,
        loss: float,
        tokens_per_s: float,
        learning_rate: float | None,
        sown: Sequence[RouterMetrics | PreferenceMetrics] = (),
    ) -> None:
        """A logged training step: scalars, and a plain line when no terminal shows the bar."""
        self._scalar("loss", loss, step)
        if tokens_per_s:  # 0 until a step after the compiling one is timed
            self._scalar("tokens_per_sec", tokens_per_s, step)
        if learning_rate is not None:
            self._scalar("learning_rate", learning_rate, step)
        for metrics in sown:
            for tag, value in metrics.scalars().items():
                self._scalar(tag, value, step)
        if self.plain:
            line = f"step {step}/{self.total_steps} loss {loss:.4f} tokens/s {tokens_per_s:,.0f}"
            if learning_rate is not None:
                line += f" lr {learning_rate:.2e}"
            line += "".join(f" {metrics.line()}" for metrics in sown)
            print_line(self.console, line)

    def evaluation(self, step: int, loss: float) -> None:
        """An evaluation's loss: printed, and a scalar (but a resumed run's first, written)."""
        if step > self.first_step or step == 0:
            self._scalar("eval_loss", loss, step)
            for writer in self._writers:
                writer.flush()
        print_line(self.console, f"step {step}/{self.total_steps} eval_loss {loss:.4f}")

    def step_begins(self, step: int) -> None:
        """Starts the profiler trace at the first profiled step."""
        if self.profile_steps is None or self._tracing:
            return
        first, last = self.profile_steps
        if first <= step <= last:
            jax.profiler.start_trace(str(self._profile_dir))
            self._tracing = True
            self.files["profile"] = str(self._profile_dir)

    def step_ends(self, step: int) -> None:
        """Stops the trace after the last profiled step (the step's result already fetched)."""
        if self._tracing and step >= self.profile_steps[1]:
            self._stop_trace()

    def close(self) -> None:
        """Stops a trace still running and closes the writers."""
        if self._tracing:
            self._stop_trace()
        writers, self._writers = self._writers, []
        for writer in writers:
            writer.close()

    def _scalar(self, tag: str, value: float, step: int) -> None:
        for writer in self._writers:
            writer.add_scalar(tag, value, step)

    def _stop_trace(self) -> None:
        jax.profiler.stop_trace()
        self._tracing = False

    def __enter__(self) -> RunLog:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
