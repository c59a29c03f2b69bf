"""Lowering as a chain of named passes over typed programs, each from program to program.

``lower`` (``lower.py``) makes the :class:`~mmnnx.mpmd.lower.program.StepProgram` of a cut graph;
:class:`Passes` then applies ``pack`` (values travelling as flat buffers), ``fold`` (each task's
small start programs as one), ``localize`` (one process's share, with several processes, after
:func:`~mmnnx.mpmd.lower.order.check_same_order`) and ``add_releases`` (a release after each
value's last reader). The runner executes the result as ``step.plan()`` prints it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.lower.fold import fold
from mmnnx.mpmd.lower.localize import localize
from mmnnx.mpmd.lower.order import check_same_order
from mmnnx.mpmd.lower.pack import pack
from mmnnx.mpmd.lower.program import StepProgram
from mmnnx.mpmd.lower.releases import add_releases
from mmnnx.mpmd.step_io import StepInput


@dataclasses.dataclass(frozen=True)
class Passes:
    """The passes after ``lower`` for one step: :meth:`share` is what ``process`` runs."""

    packed: StepProgram  # the lowered program, packed and folded (the same for every process)
    num_processes: int = 1

    @classmethod
    def of(
        cls,
        lowered: StepProgram,
        graph: Graph,
        *,
        residual_bytes: int,
        weight_bytes: int,
        inputs: Sequence[StepInput],
        num_processes: int = 1,
    ) -> Passes:
        """Packs ``lowered`` (nothing where the step was traced with sharding in types), folds it
        and, with several processes, checks that their shares meet in one order."""
        packed = lowered
        if not graph.specs:
            packed = pack(
                lowered,
                graph,
                residual_bytes=residual_bytes,
                weight_bytes=weight_bytes,
                inputs=inputs,
            )
        packed = fold(packed)
        if num_processes > 1:
            check_same_order([localize(packed, p, num_processes) for p in range(num_processes)])
        return cls(packed, num_processes)

    def share(self, process: int = 0) -> StepProgram:
        """What ``process`` runs: its share of the packed program, with its releases."""
        program = self.packed
        if self.num_processes > 1:
            program = localize(program, process, self.num_processes)
        return add_releases(program)
