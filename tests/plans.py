"""What a compiled ``mm.jit`` step planned, read back for the tests."""

from mmnnx.mpmd.packing import Packing, plan_packing


def packing_of(executable) -> tuple[Packing, dict[int, str]]:
    """The packing ``executable`` runs with (residuals, sums and weights, as its runner plans
    them) and each input slot's path."""
    program = executable.plan.program
    packing = plan_packing(
        program,
        executable.graph,
        residual_bytes=executable.pack_residuals,
        weight_bytes=executable.pack_weights,
        input_names=executable.input_names,
    )
    return packing, {slot: executable.input_names[leaf] for slot, leaf in program.inputs}
