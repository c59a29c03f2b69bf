"""What a compiled ``mm.jit`` step runs, read back from its plan's program for the tests."""

import dataclasses

from mmnnx.mpmd.lower.program import Buffer, PackWeights, Run, Zeros
from mmnnx.mpmd.run.emit import Launch


@dataclasses.dataclass
class Packed:
    """The packed buffers of a program: ``by_run``, the buffers of results each Run returns
    (by its index in ``program.actions``); ``by_zeros``, the sum buffers each Zeros action
    (or PackWeights action with its zeros folded in) fills; ``of_member``, the residual or sum
    buffer holding each slot; ``weights``, each task's weight buffers."""

    by_run: dict[int, tuple[Buffer, ...]]
    by_zeros: dict[int, tuple[Buffer, ...]]
    of_member: dict[int, Buffer]
    weights: dict

    @property
    def buffers(self) -> list[Buffer]:
        made = (*self.by_run.values(), *self.by_zeros.values(), *self.weights.values())
        return [b for buffers in made for b in buffers]


def packed_buffers(program) -> Packed:
    """The buffers ``program`` (as it runs, after the ``pack`` pass) packs values into."""
    by_run, of_member, sums = {}, {}, {}
    for i, a in enumerate(program.actions):
        if isinstance(a, Run) and a.packing is not None:
            if a.packing.packs:
                by_run[i] = a.packing.packs
            for s in a.packing.sums:
                if s.buffer is not None:
                    sums[s.buffer.slot] = s.buffer
            for b in (*a.packing.packs, *sums.values()):
                of_member.update({m.slot: b for m in b.members})
    by_zeros = {
        i: tuple(sums[s] for s in zeros.slots if s in sums)
        for i, zeros in enumerate(zeros_of(a) for a in program.actions)
        if zeros is not None and any(s in sums for s in zeros.slots)
    }
    weights = {a.task: a.buffers for a in program.actions if isinstance(a, PackWeights)}
    return Packed(by_run, by_zeros, of_member, weights)


def zeros_of(action):
    """The running sums ``action`` fills with zeros: a Zeros action, or those folded into a
    PackWeights action (``None`` for any other)."""
    if isinstance(action, Zeros):
        return action
    return action.zeros if isinstance(action, PackWeights) else None


def packing_of(executable) -> tuple[Packed, dict[int, str]]:
    """The packing ``executable`` runs with (residuals, sums and weights) and each input
    slot's path."""
    plan = executable.plan
    return packed_buffers(plan.program), {
        slot: plan.input_names[leaf] for slot, leaf in plan.program.inputs
    }


def launches_of(executable, kind):
    """The runner's launches of a ``kind`` (F, B, I, W) pass."""
    return [
        step
        for step in executable._steps
        if isinstance(step, Launch)
        and step.labels
        and step.labels[0][0]
        and step.labels[0][0][1] == kind
    ]
