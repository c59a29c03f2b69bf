"""Compiler contexts of multimesh.jax: flags kept as module state, set by context managers.

Only ``autoshard`` and ``ignore_transforms`` change what this layer does. The other flags steer
optimisations of the multimesh runtime (task fusion, recomputation, the native fast path) that
have no counterpart in mmnnx's engine: they are recorded and can be read back with
:func:`flag`, and nothing else changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_FLAGS: dict[str, bool] = {
    "autoshard": False,
    "enable_fast_path": True,
    "enable_recomputation": True,
    "enable_task_fusion": True,
    "only_fuse_loop_tasks": False,
    "ignore_transforms": False,
}


def flag(name: str) -> bool:
    """The current value of a compiler flag (``"autoshard"``, ``"ignore_transforms"``, ...).

    Example:
        >>> flag("enable_recomputation")
        True
    """
    if name not in _FLAGS:
        raise KeyError(f"unknown multimesh compiler flag {name!r}; known: {sorted(_FLAGS)}")
    return _FLAGS[name]


@contextlib.contextmanager
def _setting(name: str, value: bool | None) -> Iterator[None]:
    if value is None:
        yield
        return
    old = _FLAGS[name]
    _FLAGS[name] = bool(value)
    try:
        yield
    finally:
        _FLAGS[name] = old


@contextlib.contextmanager
def autoshard(autoshard: bool = True) -> Iterator[None]:
    """Opens a block in which sharding constraints are logical names.

    In multimesh.jax this turns ``with_sharding_constraint`` into logical annotations that task
    contexts translate later. Here every constraint traced by this layer's entry points
    (``parallelize``, ``mjit``, ``parallelize_step``) is logical anyway; outside them, with
    autoshard on, a constraint is dropped instead of being passed to JAX (whose meshes do not
    know logical names). Unlike the original, the previous value is restored even when an
    exception leaves the block.

    Example:
        >>> with autoshard():
        ...     flag("autoshard")
        True
    """
    with _setting("autoshard", autoshard):
        yield


def _flag_manager(name: str, doc: str):
    @contextlib.contextmanager
    def manager(enable: bool | None = None, context_value: object = None) -> Iterator[None]:
        # ``context_value`` is internal state in multimesh.jax; accepted and ignored here.
        del context_value
        with _setting(name, True if enable is None else enable):
            yield

    manager.__name__ = manager.__qualname__ = name
    manager.__doc__ = doc
    return manager


enable_fast_path = _flag_manager(
    "enable_fast_path",
    """Allows (or, with ``False``, forbids) the native fast path for tiny programs.

    multimesh.jax sends small single-task programs straight to the native CPU/GPU client. In
    this layer every program already runs on stock JAX, so the flag is only recorded
    (``flag("enable_fast_path")``); results and placement are the same either way.

    Example:
        >>> with enable_fast_path(False):
        ...     flag("enable_fast_path")
        False
    """,
)

enable_recomputation = _flag_manager(
    "enable_recomputation",
    """Allows (or forbids) communication-avoiding recomputation of inter-task values.

    mmnnx's engine never clones a producer into a consumer task: a value crossing tasks is always
    transferred. The flag is recorded and has no other effect; numerics are unchanged.

    Example:
        >>> with enable_recomputation(False):
        ...     flag("enable_recomputation")
        False
    """,
)

enable_task_fusion = _flag_manager(
    "enable_task_fusion",
    """Allows (or forbids) merging neighbouring tasks (Gen-A API).

    mmnnx's engine always compiles each maximal run of one task's ops as one program, which is
    what fusion achieves; the flag is recorded and has no other effect.

    Example:
        >>> with enable_task_fusion(False):
        ...     flag("enable_task_fusion")
        False
    """,
)

only_fuse_loop_tasks = _flag_manager(
    "only_fuse_loop_tasks",
    """Restricts task fusion to microbatch loops (Gen-A API).

    Recorded only: see :func:`enable_task_fusion`.

    Example:
        >>> with only_fuse_loop_tasks(True):
        ...     flag("only_fuse_loop_tasks")
        True
    """,
)


@contextlib.contextmanager
def ignore_transforms(ignore: bool | None = True) -> Iterator[None]:
    """Debug mode: ``task``, ``microbatch`` and the Flax ``task`` return their input unchanged,
    constraints go to plain JAX with physical names, and ``register_task`` scopes match nothing.

    Example:
        >>> with ignore_transforms():
        ...     flag("ignore_transforms")
        True
    """
    with _setting("ignore_transforms", ignore):
        yield


@contextlib.contextmanager
def context(
    autoshard: bool | None = None,
    enable_recomputation: bool | None = None,
    only_fuse_loop_tasks: bool | None = None,
    enable_task_fusion: bool | None = None,
    enable_fast_path: bool | None = None,
    ignore_transforms: bool | None = None,
) -> Iterator[None]:
    """Sets several compiler flags at once; ``None`` leaves a flag as it is.

    Accepts both API generations' options (``enable_task_fusion`` and ``only_fuse_loop_tasks``
    were dropped from the newer one but are still passed by the MaxText driver).

    Example:
        >>> with context(autoshard=True, enable_fast_path=False):
        ...     flag("autoshard"), flag("enable_fast_path")
        (True, False)
    """
    values = {
        "autoshard": autoshard,
        "enable_recomputation": enable_recomputation,
        "only_fuse_loop_tasks": only_fuse_loop_tasks,
        "enable_task_fusion": enable_task_fusion,
        "enable_fast_path": enable_fast_path,
        "ignore_transforms": ignore_transforms,
    }
    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            stack.enter_context(_setting(name, value))
        yield


def transforms_ignored() -> bool:
    """Whether ``ignore_transforms`` is in effect."""
    return _FLAGS["ignore_transforms"]
