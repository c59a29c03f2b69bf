"""``mm.jit``: an NNX-aware jit that runs one step as one compiled program per task.

A call flattens its arguments' NNX state into one record per input leaf (``_call.py``), looks the
step up in its cache, else builds it (``mpmd/engine.py``: trace, plan, lower), runs it
(``mpmd/run/failures.py``: nothing is written back when it fails) and writes the new values back
into the Variables.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from mmnnx._argnums import Argnums, checked_argnums
from mmnnx._call import Call
from mmnnx._jax.tracing import tracing
from mmnnx.distributed.step import peers_for
from mmnnx.distributed.timeline import timed
from mmnnx.errors import MPMDError, UnrolledMicrobatchWarning
from mmnnx.mpmd import engine
from mmnnx.mpmd.run.failures import run_step


def _step_name(fun: Callable) -> str:
    return getattr(fun, "__name__", "the step")


@dataclasses.dataclass(frozen=True)
class JitOptions:
    """Everything a step is built with besides its function: ``mm.jit``'s options (see
    :func:`jit`) and the planning options, held normalised. :meth:`JitFunction.with_options`
    replaces some and keeps the others, so an option added here is kept too."""

    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    pack_residuals: int = engine.PACK_RESIDUAL_BYTES  # bytes (True / False given: every / none)
    recompute_residuals: bool = True
    pack_weights: int = engine.PACK_WEIGHT_BYTES  # bytes (True / False given: every / none)
    schedule: str | engine.Schedule | None = None  # replaces each mm.microbatch's, when planned
    share_cores: bool = True  # edge stages reuse a middle stage's program
    gather_weights: str | None = None  # the mesh axis stages' weights are gathered over once

    def __post_init__(self) -> None:
        planning = self.planning()  # checks the planning options and normalises the bounds
        normalised = {
            "static_argnums": _as_tuple(self.static_argnums),
            "static_argnames": _as_tuple(self.static_argnames),
            "donate_argnums": _as_tuple(self.donate_argnums),
            "pack_residuals": planning.residual_bytes,
            "pack_weights": planning.weight_bytes,
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)

    def planning(self) -> engine.PlanningOptions:
        """The options the engine plans a step with.

        Example:
            >>> JitOptions(pack_residuals=False, schedule="gpipe").planning().schedule
            'gpipe'
        """
        return engine.PlanningOptions(
            residual_bytes=self.pack_residuals,
            weight_bytes=self.pack_weights,
            recompute_residuals=self.recompute_residuals,
            schedule=self.schedule,
            share_cores=self.share_cores,
            gather_weights=self.gather_weights,
        )


def _as_tuple(x: Any) -> tuple:
    return (x,) if isinstance(x, int | str) else tuple(x)


class _Compiled(NamedTuple):
    """A cache entry of :class:`JitFunction`: the step's executable, the engine's step and the
    Variables the step added (sown: ``_added.Added``), their values last, and the input Variable
    each Variable the step returns is (``Call.traceable``'s)."""

    executable: Any
    results: tuple[engine.BuiltStep, list, list]


class JitFunction:
    """The callable ``mm.jit`` returns; see :func:`jit`. ``JitFunction(fun, *options,
    **options)`` takes :class:`JitOptions`' fields, in their order or by name."""

    def __init__(self, fun, *options, **named_options):
        self.fun = fun
        self._cache: dict[Any, _Compiled] = {}
        # per kind of call: the step traced, the Variables it added and those it returned
        self._traces: dict[Any, tuple[engine.TracedCall, list, list]] = {}
        self.trace_count = 0
        functools.update_wrapper(self, fun)
        given = JitOptions(*options, **named_options)
        argnums = checked_argnums(
            fun, _step_name(fun), given.static_argnums, given.static_argnames, given.donate_argnums
        )
        self.options = dataclasses.replace(given, **argnums._asdict())

    static_argnums = property(lambda self: self.options.static_argnums)
    static_argnames = property(lambda self: self.options.static_argnames)
    donate_argnums = property(lambda self: self.options.donate_argnums)
    pack_residuals = property(lambda self: self.options.pack_residuals)
    recompute_residuals = property(lambda self: self.options.recompute_residuals)
    pack_weights = property(lambda self: self.options.pack_weights)
    share_cores = property(lambda self: self.options.share_cores)
    gather_weights = property(lambda self: self.options.gather_weights)

    def with_options(self, **changes: Any) -> JitFunction:
        """A new step of the same function with the same options except ``changes`` (any field
        of :class:`JitOptions`), planned and compiled afresh on its first call.

        With the same static and donated arguments, the new step plans this one's traces rather
        than tracing again: ``schedule`` replaces the schedule of the step's ``mm.microbatch``
        when planned, so ``mm.schedules.tune`` measures a split backward by planning
        ``step.with_options(schedule="zero-bubble-h1")``.

        Example:
            >>> step = jit(lambda x: x * 2, pack_residuals=False)
            >>> gpipe = step.with_options(schedule="gpipe")
            >>> gpipe.options.schedule, gpipe.pack_residuals, step.options.schedule
            ('gpipe', 0, None)
        """
        new = JitFunction(self.fun, **vars(dataclasses.replace(self.options, **changes)))
        if all(getattr(new.options, f) == getattr(self.options, f) for f in Argnums._fields):
            new._traces = self._traces  # traced alike: planned from the same traces
        return new

    def _build(self, call: Call) -> _Compiled:
        inputs = call.step_inputs()
        if call.key not in self._traces:
            pure, added, returned = call.traceable(self.fun, first=self.trace_count == 0)
            self.trace_count += 1
            outputs = functools.partial(call.step_outputs, inputs=inputs, added=added)
            traced = engine.trace(pure, inputs, outputs, name_as=self.fun, located=call.located)
            self._traces[call.key] = (traced, added, returned)
        traced, added, returned = self._traces[call.key]
        built = engine.build_step(traced, inputs, self.options.planning(), peers=peers_for)
        return _Compiled(built.executable, (built, added, returned))

    def _lookup(self, call: Call) -> _Compiled:
        try:
            entry = self._cache.get(call.key)
        except TypeError as e:
            raise MPMDError(
                f"mm.jit: an argument holds a leaf that is neither an array nor hashable ({e}); "
                "pass arrays, or mark the argument static with a hashable value"
            ) from None
        if entry is None:
            if call.bound:  # a new plan for a bound call: was the model placed again?
                call.check_placement()
            entry = self._cache[call.key] = self._build(call)
        else:
            call.check_free_devices(entry.executable.owned_devices)
        return entry

    def __call__(self, *args, **kwargs):
        if tracing():
            return self._traced_call(args, kwargs)
        return self._run(Call(self, args, kwargs))

    def _traced_call(self, args: tuple, kwargs: dict) -> Any:
        """Inside another ``mm.jit`` step the function is inlined (as a ``jax.jit`` in a
        ``jax.jit``); no other transformation can trace a step running programs on submeshes."""
        if not engine.inside_step():
            name = _step_name(self.fun)
            raise MPMDError(
                f"mm.jit: {name} was called inside a JAX transformation (jax.jit, nnx.jit, "
                "jax.grad, jax.vmap, ...); an mm.jit step runs its own programs on several "
                f"submeshes and cannot be traced by another transformation. Call {name} outside "
                "it, or apply the transformation inside the step"
            )
        return self.fun(*args, **kwargs)

    def _run(self, call: Call, **modes):
        executable, (built, added, returned) = self._lookup(call)
        outs = run_step(
            executable,
            call.values,
            expansion=built.expansion,
            callback_failures=built.callback_failures,
            name=_step_name(self.fun),
            donated=built.donated,
            deleted=call.deleted_input,
            look_first=bool(self.donate_argnums),
            **modes,
        )
        return call.write_back(outs, built, added, returned)

    def timeline(self, *args, **kwargs) -> list:
        """Runs one step (updating the arguments as a call does) and returns a timed event per
        pipeline action: task, kind (F, B, I or W), stage, microbatch, start and end in seconds.

        Each action runs alone: the step waits for its results before launching the next, so
        its duration is its own work with nothing else running (what
        ``mm.schedules.measured_costs`` and ``tune`` want). :meth:`overlapped_timeline` times
        the step as a call runs it. ``mm.plot_timeline`` draws either. A step with no pipeline
        has no actions to time (an empty list); when its ``mm.microbatch`` runs unrolled, an
        ``mm.UnrolledMicrobatchWarning`` says why.

        With several processes, every process calls it (as any step) and gets the events of
        the whole job, every task's: each process times its own programs, and the step
        starts on all of them at once, after a barrier whose end is their common clock's
        zero (``mmnnx/distributed/timeline.py``); times count from the earliest start of the
        step on any process.

        Example::

            events = step.timeline(model, x)
            costs = mm.schedules.measured_costs(events)  # {(kind, stage): seconds}
        """
        return self._timed(Call(self, args, kwargs), overlapped=False)

    def overlapped_timeline(self, *args, **kwargs) -> list:
        """:meth:`timeline` for a step run as a call runs it: nothing waits between actions, so
        the tasks overlap; a thread per task (shared with its virtual stages) notes when each of
        its programs ends. An action starts when its task's previous program has ended and the
        programs that made its inputs have (a move between tasks is counted in the action that
        reads the value), so durations include what the running step slowed them by, e.g. tasks
        sharing CPU cores, and the gaps between a task's events are its real idle time (the
        bubble as it happened).

        Example::

            events = step.overlapped_timeline(model, x)
            mm.plot_timeline(events, "timeline.png")  # the step as it ran, tasks overlapping
        """
        return self._timed(Call(self, args, kwargs), overlapped=True)

    def _timed(self, call: Call, *, overlapped: bool) -> list:
        events = timed(lambda timer: self._run(call, timer=timer), overlapped=overlapped)
        if not events:
            for why in self._cache[call.key].executable.plan.unrolled:
                warnings.warn(f"timeline: nothing to time, {why}", UnrolledMicrobatchWarning, 3)
        return events

    def memory_profile(self, *args, **kwargs) -> dict[str, tuple[int, int]]:
        """Runs one step and returns, per task, the peak bytes of live per-microbatch values
        (activations, cotangents) and the peak number of microbatches holding them."""
        memory: dict[str, tuple[int, int]] = {}
        self._run(Call(self, args, kwargs), memory=memory)
        return memory

    def plan(self, *args, process: int | None = None, **kwargs) -> engine.Plan:
        """The plan this step runs for these arguments (traced and lowered if needed; compiles
        nothing): fragments, transfers and each task's typed program, as the runner runs it
        (packed buffers, and with several processes this process's share, moves between
        processes as routes). ``process``: another process's share. ``print`` draws it; once
        the step is compiled, it shows the layouts the compiler chose."""
        if process is not None and not 0 <= process < jax.process_count():
            raise ValueError(
                f"mm.jit: plan(process={process!r}): this job has {jax.process_count()} "
                f"process(es), numbered 0 to {jax.process_count() - 1}"
            )
        executable, (built, *_) = self._lookup(Call(self, args, kwargs))
        if process is not None and process != jax.process_index():
            return built.plan_for(process)
        return executable.compiled_plan or executable.plan

    def compile(self, *args, **kwargs) -> engine.Plan:
        """Compiles every program the step runs for these arguments, without running it, so the
        first call starts at once; returns the compiled plan. A call compiles on first use
        otherwise."""
        executable, _ = self._lookup(Call(self, args, kwargs))
        return executable.compile()


def jit(
    fun: Callable | None = None,
    *,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    pack_residuals: bool | int = engine.PACK_RESIDUAL_BYTES,
    recompute_residuals: bool = True,
    pack_weights: bool | int = engine.PACK_WEIGHT_BYTES,
    share_cores: bool = True,
    gather_weights: str | None = None,
) -> JitFunction:
    """Lifts an NNX step over several tasks: one compiled program per task, run asynchronously.

    Arguments may be Modules, Optimizers, other graph nodes and pytrees of arrays; Variable updates
    made inside ``fun`` are written back to the caller's objects, on their tasks. An op that reads
    state placed on task T runs on T; other ops go where the fewest bytes move. Called inside
    another ``mm.jit`` step, ``fun`` is inlined into it.

    The options (docs/jit.md says what each costs and saves, with measurements):

    - ``static_argnums`` / ``static_argnames`` / ``donate_argnums``: as ``jax.jit``'s. Positions
      count positional arguments, negative ones from the end of ``fun``'s signature, and either
      static kind is inferred from the other; a position or name ``fun`` lacks, or an argument
      both static and donated, is a ``ValueError`` here (unchecked for a ``fun`` taking ``*args``).
    - ``pack_residuals``: in a pipelined step, a forward's residuals of at most this many bytes
      (``mm.PACK_RESIDUAL_BYTES``, 64 KiB) travel to its backward as one flat buffer per dtype
      (fewer arrays for the host to handle); ``True`` packs every one, ``False`` none.
    - ``pack_weights``: a block's weights of at most this many bytes (64 KiB) on a one-device or
      replicated stage travel to its programs as one buffer per dtype packed once a step (a
      second copy while the step runs); ``True`` / ``False`` as above.
    - ``recompute_residuals``: a stage's backward recomputes its forward's cheap residuals
      (arithmetic and layout ops, never exp, tanh, rsqrt, reductions or contractions) instead of
      keeping them; ``False`` keeps every one.
    - ``share_cores``: an edge stage's forward or backward runs a middle stage's computation as
      that stage's program, so XLA compiles the blocks' kernels once; ``False`` runs each pass
      as one program.
    - ``gather_weights``: a mesh axis (FSDP's, ``mm.fsdp_rules``) over which each stage's
      weights are gathered once a step and held through its busy span, instead of in every
      program that reads them (``None``, the default); one process only.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from mmnnx.sharding import Task, TaskMesh, place
        >>> s0, s1 = Task("s0", mesh=TaskMesh(devices=[0])), Task("s1", mesh=TaskMesh(devices=[1]))
        >>> model = place(nnx.Sequential(nnx.Linear(2, 4, rngs=nnx.Rngs(0)),
        ...                              nnx.Linear(4, 1, rngs=nnx.Rngs(1))),
        ...               [("layers/0", s0), ("layers/1", s1)])
        >>> @jit
        ... def loss_and_grads(model, x):
        ...     return nnx.value_and_grad(lambda m: m(x).sum())(model)
        >>> loss, grads = loss_and_grads(model, jnp.ones((8, 2)))
        >>> [d.id for d in grads["layers"][1]["kernel"].get_value().devices()]
        [1]
    """
    options = {name: value for name, value in locals().items() if name != "fun"}  # the options
    if fun is None:
        JitOptions(**options)  # a bad option raises here, before a function is given
        return functools.partial(jit, **options)
    return JitFunction(fun, **options)
