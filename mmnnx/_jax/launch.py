"""A compiled program launched straight on the runtime, without the per-argument checks of
JAX's own call (``DirectLaunch``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from jax._src.interpreters import pxla


# Used only where every argument was laid out as the program expects on a checked run
# (benchmarks/dispatch.py's call_cost measures the checks skipped).
@dataclasses.dataclass(frozen=True)
class DirectLaunch:
    """``compiled`` run straight on the runtime: ``launch(args)`` takes the arguments at ``kept``
    (``None``: all), laid out as ``shardings``, and returns the results as a list."""

    launch: Callable[[list], list]
    kept: tuple[int, ...] | None
    shardings: tuple[Any, ...]

    @classmethod
    def of(cls, compiled: Any) -> DirectLaunch | None:
        """The direct launch of ``compiled``, or ``None`` where JAX's own call is needed (effects,
        host callbacks, constant arguments, results not a flat sequence of arrays)."""
        executable = getattr(compiled, "_executable", None)
        call = getattr(executable, "unsafe_call", None)
        params = getattr(compiled, "_params", None)
        if (
            type(call) is not pxla.ExecuteReplicated
            or call.ordered_effects
            or call.has_unordered_effects
            or call.has_host_callbacks
            or call.mut is not None
            or call.pgle_profiler is not None
            or params is None
            or params.const_args
            or params.is_high
        ):
            return None
        out_tree = params.out_tree
        if out_tree.num_leaves != out_tree.num_nodes - 1 or out_tree.num_nodes == 1:
            return None  # a flat list or tuple of arrays only
        kept = tuple(sorted(call.kept_var_idx))
        shardings = tuple(executable._in_shardings)  # of the kept arguments
        if len(shardings) != len(kept):
            return None
        runtime, handlers = call.xla_executable, call.out_handler.handlers

        def launch(args: list) -> list:
            return runtime.execute_sharded(args).consume_with_handlers(handlers)

        whole = kept == tuple(range(params.in_tree.num_leaves))
        return cls(launch, None if whole else kept, shardings)
