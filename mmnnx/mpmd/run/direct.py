"""The runner's fast path: a step's emitted steps replayed as its last checked call ran them.

A call whose inputs are laid out as on the last checked call lays out every value as it was
then, so what that call found holds again: which programs may be launched directly
(:class:`~mmnnx._jax.launch.DirectLaunch`) and how each move went. :class:`DirectSteps` replays
those answers without looking at a layout again.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence
from typing import Any

from mmnnx.mpmd.run.emit import Launch, Move, Step

# What one operation of a replay does (the first field of each of DirectSteps.ops).
LAUNCH = 0  # a program launched straight on the runtime: fn(args) -> results
CALL = 1  # a program through JAX's checked call: fn(*args) -> results
COPY = 2  # a move by the runtime copy decided at compile: fn(value) -> value
KEEP = 3  # a move of a value already laid out as its target wants
OTHER = 4  # anything else (a put, a cross-process route, a reshard): fn(step, env)


def _getter(slots: Sequence[int]) -> Callable[[list], Sequence[Any]]:
    """A function of the slots' list returning the values in ``slots``, as a sequence."""
    if len(slots) > 1:
        return operator.itemgetter(*slots)
    if slots:
        (slot,) = slots
        return lambda env: (env[slot],)
    return lambda env: ()


@dataclasses.dataclass(frozen=True)
class DirectSteps:
    """A step's steps as its last checked call ran them: ``ops``, per step, ``(kind, fn, ins, outs,
    drop)``, ``kind`` one of :data:`LAUNCH`, :data:`CALL`, :data:`COPY`, :data:`KEEP`,
    :data:`OTHER`."""

    ops: tuple[tuple, ...]

    @classmethod
    def of(
        cls,
        steps: Sequence[Step],
        direct: Sequence[Any],
        ways: dict[int, int],
        other: Callable[[Step, list], None],
    ) -> DirectSteps:
        """The replay of ``steps``: ``direct``, per step, its
        :class:`~mmnnx._jax.launch.DirectLaunch` (``None``: JAX's checked call); ``ways``, per Move
        by index, how it went; ``other(step, env)`` runs any other step."""
        ops = []
        for i, step in enumerate(steps):
            if type(step) is Launch:
                launch = direct[i]
                if launch is None:
                    ops.append((CALL, step.program, _getter(step.args), step.results, step.drop))
                else:
                    kept = step.args if launch.kept is None else [step.args[k] for k in launch.kept]
                    ops.append((LAUNCH, launch.launch, _getter(kept), step.results, step.drop))
            elif type(step) is Move and ways[i] != OTHER:
                fn = step.mover if ways[i] == COPY else None
                ops.append((ways[i], fn, step.source, step.target, step.drop))
            else:
                ops.append((OTHER, other, step, None, step.drop))
        return cls(tuple(ops))

    def run(self, env: list) -> None:
        """Runs every step on ``env``, the step's slots."""
        for kind, fn, ins, outs, drop in self.ops:
            if kind <= CALL:
                results = fn(ins(env)) if kind == LAUNCH else fn(*ins(env))
                for slot, value in zip(outs, results, strict=True):
                    env[slot] = value
            elif kind == COPY:
                env[outs] = fn(env[ins])
            elif kind == KEEP:
                env[outs] = env[ins]
            else:
                fn(ins, env)
            for slot in drop:
                env[slot] = None
