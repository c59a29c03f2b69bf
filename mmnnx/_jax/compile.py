"""Compiling a program once for every submesh of its shape (``SharedCompiles``)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax._src.interpreters import mlir

# Compiling a program once for every submesh of its shape. The programs of equal pipeline stages
# (the middle blocks of a transformer) differ only in the devices they run on, which XLA takes
# as a compile option, not as part of the program: the first is compiled, the others load its
# executable onto their own devices (JAX's persistent cache does the same on GPU, and only there,
# where it leaves the device assignment out of its key). JAX calls ``compile_or_get_cached``
# through its module, so the wrapper below sees every compilation; it acts only on the threads
# of a ``SharedCompiles`` table, and falls back to compiling where loading fails. Only an
# executable compiled in this process is handed on: one read from JAX's persistent cache
# serializes incompletely on XLA:CPU (its kernels missing: measured 5.7 kB of 10 kB).
_compiling_for = threading.local()


class SharedCompiles:
    """The executables compiled so far in one ``compile`` of a step, by program and device-free
    compile options; ``compile(lowered)`` compiles a ``jax.stages.Lowered`` through it.

    Example:
        >>> import jax, numpy as np
        >>> shared = SharedCompiles()
        >>> on = lambda d: jax.sharding.SingleDeviceSharding(d)
        >>> one, two = (jax.jit(lambda x: x + 1, in_shardings=on(d)).lower(np.float32(0))
        ...             for d in jax.devices()[:2])
        >>> shared.compile(one)(jax.device_put(1.0, on(jax.devices()[0]))), shared.loaded
        (Array(2., dtype=float32), 0)
        >>> out = shared.compile(two)(jax.device_put(1.0, on(jax.devices()[1])))
        >>> float(out), out.devices() == {jax.devices()[1]}, shared.loaded
        (2.0, True, 1)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: dict[tuple, Any] = {}
        self.loaded = 0
        self.loaded_lowered: set[int] = set()  # ids of the Lowered objects loaded, not compiled
        _install_shared_compiles()

    def compile(self, lowered: Any) -> Any:
        _compiling_for.table = self
        _compiling_for.loaded = False
        try:
            compiled = lowered.compile()
        finally:
            _compiling_for.table = None
        if _compiling_for.loaded:
            with self._lock:
                self.loaded_lowered.add(id(lowered))
        return compiled

    def executable(
        self,
        compile: Callable,
        backend: Any,
        computation: Any,
        devices: np.ndarray,
        options: Any,
        host_callbacks: Sequence,
        executable_devices: Any,
        *rest: Any,
    ) -> Any:
        own = functools.partial(compile, backend, computation, devices, options, host_callbacks,
                                executable_devices, *rest)  # fmt: skip
        if host_callbacks or len({d.process_index for d in devices.flat}) > 1:
            return own()
        key = (backend.platform, devices.shape, mlir.module_to_bytecode(computation),
               _without_devices(options))  # fmt: skip
        with self._lock:
            first = self._first.get(key)
            mine = first is None
            if mine:
                first = self._first[key] = concurrent.futures.Future()
        if mine:
            _compiling_for.fresh = False
            started = time.monotonic()
            try:
                executable = own()
            except BaseException as e:
                first.set_exception(e)
                raise
            took = time.monotonic() - started
            # serialized once, for every program loading it; not one read from JAX's persistent
            # cache, which XLA:CPU serializes without its kernels
            serialized = functools.cache(lambda: backend.serialize_executable(executable))
            first.set_result((serialized, took) if _compiling_for.fresh else None)
            return executable
        try:
            serialized, took = first.result() or (None, 0.0)
            if serialized is None:
                raise LookupError
            executable = backend.deserialize_executable(serialized(), executable_devices, options)
        except Exception:  # the first failed, was read from the cache, or does not serialize here
            return own()
        _persist(backend, computation, devices, options, serialized(), took)
        with self._lock:
            self.loaded += 1
        _compiling_for.loaded = True
        return executable


@dataclasses.dataclass(frozen=True)
class _Serialized:
    """An executable's bytes, as JAX's persistent cache takes an executable to write."""

    data: bytes

    def serialize(self) -> bytes:
        return self.data


def _persist(
    backend: Any, computation: Any, devices: np.ndarray, options: Any, data: bytes, took: float
) -> None:
    """Writes a loaded program to JAX's persistent compilation cache, if one is on, under its
    own key, as JAX writes a program it compiled: a later process then reads it instead of
    compiling it. ``data``: the executable it was loaded from, as compiled (an executable
    loaded from bytes re-serializes without its kernels on XLA:CPU); ``took``: that compile's
    seconds, which JAX's ``persistent_cache_min_compile_time_secs`` is checked against."""
    from jax._src import compiler

    name = mlir.ir.StringAttr(computation.operation.attributes["sym_name"]).value
    lowest = min(devices.flat, key=lambda d: d.id).process_index
    try:
        key, _ = compiler._resolve_compilation_strategy(
            computation, devices, options, backend, None, False, name, lowest
        )
        if key is not None:
            compiler._cache_write(key, took, name, backend, _Serialized(data), [])
    except Exception:  # no cache entry: the next process compiles this program, as before
        return


def _without_devices(options: Any) -> bytes:
    """``options`` (an XLA ``CompileOptions``) serialized with the device assignment numbered
    0, 1, ... in place of the devices' ids."""
    from jax._src.lib import xla_client

    stripped = xla_client.CompileOptions.ParseFromString(options.SerializeAsString())
    if stripped.device_assignment is not None:
        assignment = stripped.device_assignment
        shape = (assignment.replica_count(), assignment.computation_count())
        ids = np.arange(math.prod(shape)).reshape(shape)
        stripped.device_assignment = xla_client.DeviceAssignment.create(ids)
    return stripped.SerializeAsString()


@functools.cache
def _install_shared_compiles() -> None:
    from jax._src import compiler

    compile = compiler.compile_or_get_cached

    @functools.wraps(compile)
    def compile_or_share(*args: Any, **kwargs: Any) -> Any:
        table = getattr(_compiling_for, "table", None)
        if table is None or kwargs:
            return compile(*args, **kwargs)
        return table.executable(compile, *args)

    compiler.compile_or_get_cached = compile_or_share
    backend_compile = compiler.backend_compile_and_load

    @functools.wraps(backend_compile)
    def compile_fresh(*args: Any, **kwargs: Any) -> Any:
        _compiling_for.fresh = True
        return backend_compile(*args, **kwargs)

    compiler.backend_compile_and_load = compile_fresh
