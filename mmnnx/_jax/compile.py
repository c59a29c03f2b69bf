"""Compiling a program once for every submesh of its shape (``SharedCompiles``).

Equal pipeline stages' programs differ only in their devices, a compile option to XLA: the first
is compiled (``Lowered.compile``), the others load its serialized executable onto their own
devices, built as JAX's ``UnloadedMeshExecutable.from_hlo`` builds a compiled program; loading
falls back to compiling where it fails. Only an executable compiled in this process is handed
on (one read from JAX's persistent cache serializes without its kernels on XLA:CPU). The table
is the process's, bounded like JAX's own caches, so later steps reuse it; ``clear`` empties it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import inspect
import math
import threading
import time
from typing import Any

import jax
import numpy as np
from jax._src import compiler
from jax._src.interpreters import mlir, pxla
from jax._src.lib import xla_client

from mmnnx._jax.retarget import stage_args


class Recent:
    """A thread-safe table of at most ``size`` entries, the least recently used dropped first."""

    def __init__(self, size: int):
        self.size = size
        self.lock = threading.RLock()
        self._items: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: Any) -> Any:
        with self.lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> None:
        with self.lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def pop(self, key: Any, value: Any) -> None:
        """Drops ``key`` if it still holds ``value``."""
        with self.lock:
            if self._items.get(key) is value:
                del self._items[key]

    def clear(self) -> None:
        with self.lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


_FIRST = Recent(64)  # program key -> future of (its serialized executable, compile s) | None
_COMPILED = Recent(64)  # (program key, device ids) -> the jax.stages.Compiled


def clear() -> None:
    """Forgets every program compiled so far in this process (``SharedCompiles``' table)."""
    _FIRST.clear()
    _COMPILED.clear()


class SharedCompiles:
    """Compiles a step's programs through the process's table of executables."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.loaded: set[int] = set()
        self.reused: set[int] = set()
        self._alive: list[Any] = []  # the Lowered objects of loaded and reused

    def compile(self, lowered: Any) -> Any:
        """The program ``lowered`` compiled, or loaded from an equal one's executable."""
        return self._compile(lowered, _Program.of(lowered))

    def submit(self, lowered: Any, pool: concurrent.futures.Executor) -> concurrent.futures.Future:
        """Compiles ``lowered`` (as :meth:`compile`) on ``pool``."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def settle(program: _Program | None) -> None:
            try:
                done.set_result(self._compile(lowered, program))
            except BaseException as e:
                done.set_exception(e)

        def queue_again(program: _Program) -> None:
            try:
                pool.submit(settle, program)
            except RuntimeError as e:  # the pool was shut down: the step's build failed
                done.set_exception(e)

        def start() -> None:
            try:
                program = _Program.of(lowered)
            except BaseException as e:
                done.set_exception(e)
                return
            if program is not None:
                first = _FIRST.get(program.key)
                if first is not None and not first.done():
                    first.add_done_callback(lambda _: queue_again(program))
                    return
            settle(program)

        pool.submit(start)
        return done

    def _compile(self, lowered: Any, program: _Program | None) -> Any:
        if program is None:  # host callbacks, several processes, or no mesh computation
            return lowered.compile()
        where = (program.key, tuple(d.id for d in program.devices.flat))
        compiled = _COMPILED.get(where)
        if compiled is not None:
            self._note(self.reused, lowered)
            return compiled
        with _FIRST.lock:
            first = _FIRST.get(program.key)
            mine = first is None
            if mine:
                first = concurrent.futures.Future()
                _FIRST.put(program.key, first)
        if mine:
            fresh = not program.in_persistent_cache()
            started = time.monotonic()
            try:
                compiled = lowered.compile()
            except BaseException as e:
                _FIRST.pop(program.key, first)  # a later step tries again
                first.set_exception(e)
                raise
            took = time.monotonic() - started
            # serialized once, for every program loading it
            executable = compiled._executable.xla_executable
            serialized = functools.cache(lambda: program.backend.serialize_executable(executable))
            first.set_result((serialized, took) if fresh else None)
        else:
            try:
                serialized, took = first.result() or (None, 0.0)
                if serialized is None:
                    raise LookupError
                compiled = program.load(serialized())
            except Exception:  # the first failed, was read from the cache, or does not serialize
                compiled = lowered.compile()
            else:
                program.persist(serialized(), took)
                self._note(self.loaded, lowered)
        _COMPILED.put(where, compiled)
        return compiled

    def _note(self, ids: set[int], lowered: Any) -> None:
        with self._lock:
            ids.add(id(lowered))
            self._alive.append(lowered)


@dataclasses.dataclass(frozen=True)
class _Program:
    """A lowered program as ``UnloadedMeshExecutable.from_hlo`` passes it to
    ``compile_or_get_cached``; ``key`` is equal for programs that differ only in their devices."""

    lowered: Any  # the jax.stages.Lowered
    devices: np.ndarray  # the device assignment, as JAX passes it to the compiler
    in_shardings: tuple
    out_shardings: tuple
    options: Any  # XLA CompileOptions, with this program's device assignment
    key: tuple

    @classmethod
    def of(cls, lowered: Any) -> _Program | None:
        computation = getattr(lowered, "_lowering", None)
        if not isinstance(computation, pxla.MeshComputation):
            return None
        args = computation.compile_args
        device_list = computation._device_list
        poly = args.get("shape_poly_state")
        if (
            device_list is None
            or args["host_callbacks"]
            or len({d.process_index for d in device_list}) > 1
            or (poly is not None and poly.uses_dim_vars)
        ):
            return None
        backend = args["backend"]
        in_shardings, out_shardings = (
            tuple(pxla.maybe_concretize_mesh(s, device_list) for s in args[which])
            for which in ("in_shardings", "out_shardings")
        )
        to_inputs, to_outputs = pxla.get_prop_to_input_output(
            in_shardings, out_shardings, len(args["ordered_effects"])
        )
        devices = np.empty(len(device_list), dtype=object)
        devices[:] = list(device_list)
        options = pxla.create_compile_options(
            computation._hlo,
            args["tuple_args"],
            to_inputs,
            to_outputs,
            backend,
            devices,
            dict(computation._compiler_options_kvs),
        )
        key = (
            backend.platform,
            devices.shape,
            mlir.module_to_bytecode(computation._hlo),
            _without_devices(options),
        )
        return cls(lowered, devices, in_shardings, out_shardings, options, key)

    @property
    def _computation(self) -> Any:
        return self.lowered._lowering

    @property
    def backend(self) -> Any:
        return self._computation.compile_args["backend"]

    @property
    def _module_name(self) -> str:
        module = self._computation._hlo
        return mlir.ir.StringAttr(module.operation.attributes["sym_name"]).value

    def _cache_key(self) -> str | None:
        """The program's key in JAX's persistent compilation cache (``None``: no cache)."""
        lowest = min(self.devices.flat, key=lambda d: d.id).process_index
        key, _ = compiler._resolve_compilation_strategy(
            self._computation._hlo,
            self.devices,
            self.options,
            self.backend,
            None,
            False,
            self._module_name,
            lowest,
        )
        return key

    def in_persistent_cache(self) -> bool:
        """Whether compiling the program will read it from JAX's persistent cache."""
        key = self._cache_key()
        return key is not None and compiler._is_executable_in_cache(self.backend, key)

    def load(self, data: bytes) -> Any:
        """The executable serialized as ``data`` (an equal program's) loaded onto this program's
        devices, as a ``jax.stages.Compiled`` made as ``Lowered.compile`` makes it."""
        lowered, computation = self.lowered, self._computation
        args = computation.compile_args
        device_list = computation._device_list
        executable = self.backend.deserialize_executable(data, device_list, self.options)
        in_avals, out_avals = args["global_in_avals"], args["global_out_avals"]
        ordered = len(args["ordered_effects"])
        # as UnloadedMeshExecutable.from_hlo goes on after compiling
        in_shardings = pxla._maybe_get_and_check_in_shardings(
            executable, self.in_shardings, device_list, in_avals, ordered
        )
        out_shardings = pxla._maybe_get_and_check_out_shardings(
            executable, self.out_shardings, device_list, out_avals, ordered
        )
        in_layouts, out_layouts = pxla._get_layouts_from_executable(
            executable, args["in_layouts"], args["out_layouts"], ordered, in_avals, out_avals
        )
        dispatch_in_layouts = pxla.get_dispatch_layouts(in_layouts, in_shardings, in_avals)
        out_shardings = pxla.maybe_recover_user_shardings(
            in_shardings,
            out_shardings,
            in_avals,
            out_avals,
            args.get("intermediate_shardings"),
            args.get("context_mesh"),
        )
        unloaded = pxla.UnloadedMeshExecutable(
            xla_executable=executable,
            device_list=device_list,
            backend=self.backend,
            input_avals=in_avals,
            input_shardings=pxla.finalize_shardings(in_shardings, device_list),
            output_avals=out_avals,
            output_shardings=pxla.finalize_shardings(out_shardings, device_list),
            committed=args["committed"],
            name=computation._name,
            unordered_effects=args["unordered_effects"],
            ordered_effects=args["ordered_effects"],
            keepalive=args["keepalive"],
            host_callbacks=args["host_callbacks"],
            kept_var_idx=args["kept_var_idx"],
            mut=args.get("mut"),
            xla_in_layouts=in_layouts,
            dispatch_in_layouts=dispatch_in_layouts,
            xla_out_layouts=out_layouts,
            all_args_info=args.get("all_args_info"),
            pgle_profiler=args.get("pgle_profiler"),
        )
        return jax.stages.Compiled(unloaded.load(), computation.const_args, *stage_args(lowered))

    def persist(self, data: bytes, took: float) -> None:
        """Writes the program, loaded from ``data`` (its executable as compiled, in ``took``
        seconds), to JAX's persistent compilation cache, if on, as JAX writes one it compiled."""
        try:
            key = self._cache_key()
            if key is not None:
                args = [key, took, self._module_name, self.backend, _Serialized(data)]
                if "host_callbacks" in inspect.signature(compiler._cache_write).parameters:
                    args.append([])  # JAX 0.10; 0.11 takes none
                compiler._cache_write(*args)
        except Exception:  # no cache entry: the next process compiles this program, as before
            return


@dataclasses.dataclass(frozen=True)
class _Serialized:
    """An executable's bytes, as JAX's persistent cache takes an executable to write."""

    data: bytes

    def serialize(self) -> bytes:
        return self.data


def _without_devices(options: Any) -> bytes:
    """``options`` serialized with the device assignment numbered 0, 1, ... in place of ids."""
    stripped = xla_client.CompileOptions.ParseFromString(options.SerializeAsString())
    if stripped.device_assignment is not None:
        assignment = stripped.device_assignment
        shape = (assignment.replica_count(), assignment.computation_count())
        ids = np.arange(math.prod(shape)).reshape(shape)
        stripped.device_assignment = xla_client.DeviceAssignment.create(ids)
    return stripped.SerializeAsString()
