"""A planned step's wiring to the other processes of the job: the collectives its tasks need,
and the description every process checks it planned alike before the step first compiles."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np

from mmnnx.distributed.initialize import check_collectives_for
from mmnnx.distributed.peers import StepPeers
from mmnnx.mpmd.engine import PlannedStep
from mmnnx.mpmd.run.peers import Peers
from mmnnx.mpmd.step_io import StepInput


def peers_for(
    planned: PlannedStep, inputs: Sequence[StepInput], name: str
) -> Callable[[], Peers] | None:
    """The step's :class:`~mmnnx.distributed.peers.StepPeers` (``None`` alone), collectives
    checked."""
    if jax.process_count() == 1:
        return None
    check_collectives_for(planned.plan.tasks)
    return functools.partial(StepPeers, repr(name), fingerprint(planned, inputs))


def fingerprint(planned: PlannedStep, inputs: Sequence[StepInput]) -> list[str]:
    """Lines describing a step, which processes compare before running it together."""
    graph = planned.graph
    lines = [
        f"input {i.name}: {tuple(i.shape)} {_dtype_name(i.dtype)} on "
        f"{i.task.name if i.task is not None else '-'} "
        f"{getattr(i.sharding, 'spec', '') if i.placed else ''}"
        for i in inputs
    ]
    tasks = planned.plan.tasks
    lines += [f"task {t.name}: devices {[d.id for d in t.jax_mesh.devices.flat]}" for t in tasks]
    lines += [
        f"op {op.primitive} {[graph.shapes[v] for v in op.outs]} at {op.source}" for op in graph.ops
    ]
    lines += str(planned.lowered).splitlines()
    return lines


def _dtype_name(dtype: object) -> str:
    """``float32``; a PRNG key's ``key<fry>`` (an extended dtype, which NumPy cannot read: an
    ``nnx.Rngs`` or ``nnx.Dropout`` stream held by the model is such an input)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return str(dtype)
    return np.dtype(dtype).name
