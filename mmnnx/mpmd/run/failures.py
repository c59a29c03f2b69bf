"""What a step does when it fails while running: nothing is written back, and the error says so.

A step that calls back into Python is waited for, so that a failure raises before its results
are handed back; a host callback's exception is recorded (:mod:`~mmnnx.mpmd.trace.callbacks`)
and raised here. An input whose array was deleted is named instead of JAX's error about it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

from mmnnx.errors import StepError
from mmnnx.mpmd.plan.stack_split import Expansion
from mmnnx.mpmd.run.runner import Executable
from mmnnx.mpmd.trace.callbacks import CallbackFailures
from mmnnx.mpmd.trace.mesh_context import no_ambient_mesh


def run_step(
    executable: Executable,
    leaves: Sequence[Any],
    *,
    expansion: Expansion | None,
    callback_failures: CallbackFailures,
    name: str,
    donated: bool,
    deleted: Callable[[], BaseException | None],
    look_first: bool = False,
    **modes: Any,
) -> list[Any]:
    """Runs ``executable`` on the step's input ``leaves`` (stacks split and joined by
    ``expansion``). A failure raises :class:`StepError` naming the step and whether ``donated``
    inputs were lost; ``deleted()``: the error for an input deleted before the call, or ``None``
    (looked for first with ``look_first``: a donating step must not run on one)."""
    if look_first and (error := deleted()):
        raise error  # before any input is donated
    callback_failures.take()  # from a run that did not check them (a timeline, a tabulate)
    with no_ambient_mesh():  # each fragment runs on its own task's mesh
        try:
            results = executable(
                leaves if expansion is None else expansion.split_leaves(leaves), **modes
            )
            if executable.may_fail:
                jax.block_until_ready(results)
            if raised := callback_failures.take():
                error = raised[0]
                raise step_failed(name, donated, f"{type(error).__name__}: {error}") from error
            if expansion is not None:
                results = expansion.join_results(results)
        except jax.errors.JaxRuntimeError as e:
            if error := deleted():
                raise error from None
            lines = [line.strip() for line in str(e).splitlines() if line.strip()]
            cause = lines[-1] if lines else type(e).__name__  # a callback's exception is last
            raise step_failed(name, donated, cause) from e
        except RuntimeError:  # JAX refuses a deleted array when a program is dispatched
            if error := deleted():
                raise error from None
            raise
    return results


def step_failed(name: str, donated: bool, cause: str) -> StepError:
    """The error of step ``name`` failing while running (``cause``): its arguments are kept,
    except ``donated`` ones.

    Example:
        >>> str(step_failed("train_step", False, "ValueError: bad batch")).split(";")[0]
        'mm.jit: train_step failed while running (ValueError: bad batch)'
    """
    kept = "its arguments keep the values they had before this call"
    if donated:
        kept += ", except donated ones"
    return StepError(
        f"mm.jit: {name} failed while running ({cause}); {kept}, and the next call runs normally"
    )
