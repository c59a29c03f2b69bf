"""Exceptions raised by the engine."""


class MPMDError(ValueError):
    """A step that mm.jit cannot run as written; the message says what and where."""


class PlacementConflictError(MPMDError):
    """An op needs state placed on two tasks at once."""


class SideEffectError(MPMDError):
    """The step changes its arguments in a way mm.jit cannot carry back (e.g. new attributes)."""
