"""What each stage's forward saves for its backward, once per microbatch in flight: its bytes,
and those of the saved values that do not depend on the microbatch (weights, or values computed
from weights alone, such as their casts), which need not be held once per microbatch. A pure
reading of a planned pipeline."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.extend import core as jcore

from mmnnx._jax.scan import scan_counts
from mmnnx.mpmd.ir import Graph
from mmnnx.mpmd.plan.pipeline import Pipeline


@dataclasses.dataclass(frozen=True)
class SavedResiduals:
    """A stage's residuals: ``nbytes`` of all the values its forward returns for its backward, and
    the shape and dtype of each one that does not depend on the microbatch."""

    nbytes: int
    invariant: tuple[tuple[tuple[int, ...], str], ...]


def saved_residuals(graph: Graph, pipeline: Pipeline) -> dict[int, SavedResiduals]:
    """Each stage's :class:`SavedResiduals` in a planned ``pipeline`` of ``graph`` (an
    executable's ``graph`` and ``plan.pipeline``).

    Example::

        step.plan(model, opt, batch)  # traced and lowered, nothing compiled
        ((executable, _),) = step._cache.values()
        saved_residuals(executable.graph, executable.plan.pipeline)[0].invariant  # ()
    """
    varying = per_microbatch(graph, {pipeline.index_value})
    out = {}
    for (kind, stage), forward in pipeline.stages.items():
        if kind != "F":
            continue
        back = [f for (k, s), f in pipeline.stages.items() if s == stage and k in "BIW"]
        saved = [v for v in forward.out_ids if any(v in b.in_ids for b in back)]
        invariant = tuple(
            (tuple(graph.shapes[v]), str(graph.dtypes[v])) for v in saved if v not in varying
        )
        out[stage] = SavedResiduals(sum(graph.nbytes[v] for v in saved), invariant)
    return out


def per_microbatch(graph: Graph, seeds: set[Any]) -> set[int]:
    """The values of ``graph`` that depend on ``seeds`` (e.g. the microbatch index), looking into
    scans (each result depends on what the body computes it from, carries to a fixpoint); any other
    op's results depend on all its operands."""
    found = set(seeds)
    for op in graph.ops:
        reads = [isinstance(a, int) and a in found for a in op.ins]
        if op.name == "scan":
            flags = _scan_depends(op.params, reads)
            found.update(v for v, d in zip(op.outs, flags, strict=True) if d)
        elif any(reads):
            found.update(op.outs)
    return found


def _scan_depends(params: dict, reads: Sequence[bool]) -> list[bool]:
    """Per result of a scan of ``params``: whether it depends on the operands flagged ``reads``."""
    body, (consts, carry) = params["jaxpr"].jaxpr, scan_counts(params)
    reads = list(reads)
    while True:
        marked = {v for v, d in zip(body.invars, reads, strict=True) if d}
        for eqn in body.eqns:
            ins = [isinstance(a, jcore.Var) and a in marked for a in eqn.invars]
            if eqn.primitive.name == "scan":
                flags = _scan_depends(eqn.params, ins)
                marked.update(v for v, d in zip(eqn.outvars, flags, strict=True) if d)
            elif any(ins):
                marked.update(eqn.outvars)
        outs = [isinstance(v, jcore.Var) and v in marked for v in body.outvars]
        was = reads[consts : consts + carry]
        carried = [a or b for a, b in zip(was, outs[:carry], strict=True)]
        if carried == was:
            return outs
        reads[consts : consts + carry] = carried
