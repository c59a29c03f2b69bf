"""Lowering as a chain of named passes over typed programs.

``lower`` (``lower.py``) makes the :class:`~mmnnx.mpmd.program.StepProgram` of a cut graph;
:func:`run_passes` then applies, in order:

1. ``pack`` (``pack.py``): values that travel as flat buffers (weights, residuals, sums);
2. ``localize`` (``localize.py``): one process's share, moves between processes as routes
   (only with several processes);
3. ``add_releases`` (``releases.py``): a release after each value's last reader.

Each is a function from program to program; the runner executes the result as it is, and
``step.plan()`` prints it.
"""

from __future__ import annotations

from collections.abc import Sequence

from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.localize import localize
from mmnnx.mpmd.pack import pack
from mmnnx.mpmd.program import StepProgram
from mmnnx.mpmd.releases import add_releases


def run_passes(
    program: StepProgram,
    graph: Graph,
    *,
    residual_bytes: int,
    weight_bytes: int,
    input_names: Sequence[str],
    process: int = 0,
    num_processes: int = 1,
) -> StepProgram:
    """``program`` (as lowered) through every pass, for ``process`` of ``num_processes``.
    A step traced with sharding in types (``graph.specs``) packs nothing: every program keeps
    the types of its arguments."""
    if not graph.specs:
        program = pack(
            program,
            graph,
            residual_bytes=residual_bytes,
            weight_bytes=weight_bytes,
            input_names=input_names,
        )
    if num_processes > 1:
        program = localize(program, process, num_processes)
    return add_releases(program)
