"""Pausing Python's cyclic garbage collector while a model or a step is traced."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pauses Python's cyclic garbage collector (reference counting goes on) for the block: tracing
    makes objects by the hundred thousand that live until the trace is done, and the collections
    they trigger free next to nothing (2.2 of the 8.8 s of planning an unrolled 128-block GPT:
    benchmarks/first_call.py). Nested pauses leave it as the outermost found it.

    Example:
        >>> import gc
        >>> with cyclic_gc_paused():
        ...     gc.isenabled()
        False
        >>> gc.isenabled()
        True
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
