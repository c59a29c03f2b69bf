"""The exceptions and warnings mmnnx raises (re-exported as ``mmnnx.MPMDError`` etc.).

It imports nothing of mmnnx, so every layer may raise them."""


class MPMDError(ValueError):
    """A step that mm.jit cannot run as written; the message says what and where."""


class PlacementConflictError(MPMDError):
    """An op needs state placed on two tasks at once."""


class NoCandidateError(MPMDError):
    """``mm.schedules.tune`` found no candidate that can run the step or fits the memory
    budget; ``candidates`` holds every one simulated (the message shows them as a table)."""

    def __init__(self, message: str, candidates: list):
        super().__init__(message)
        self.candidates = candidates


class StepError(RuntimeError):
    """A step failed while its programs ran (e.g. a callback raised); the arguments keep the
    values they had before the call, and the next call runs normally."""


class SideEffectError(MPMDError):
    """The step changes its arguments in a way mm.jit cannot carry back (e.g. new attributes)."""


class UnrolledLayersWarning(UserWarning):
    """A step's model holds many equal blocks as a Python list (unrolled): tracing, planning
    and compiling grow with their number; stacking them and running them with ``nnx.scan``
    does not (the message names the list)."""


class UnrolledMicrobatchWarning(UserWarning):
    """An ``mm.microbatch`` call inside ``mm.jit`` runs as an unrolled loop, not a pipeline,
    because its function updates Variables (the message names them); ``plan()`` says so too."""
