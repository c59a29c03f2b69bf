"""``mm.jit``: an NNX-aware jit that runs one step as one compiled program per task.

A call flattens its arguments' NNX state into one record per input leaf, looks the step up in
its cache (else traces it, ``mpmd/trace_step.py``; plans it, ``mpmd/engine.py``; and wires it to
the other processes, ``distributed/step.py``), runs it (``mpmd/failures.py``: nothing is written
back when it fails) and writes the new values back into the Variables.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from mmnnx import _nnx
from mmnnx._argnums import checked_argnums
from mmnnx._call import Added, Call, state_outputs, user_outputs
from mmnnx._error_location import with_location
from mmnnx._gc import cyclic_gc_paused
from mmnnx._jax.tracing import tracing
from mmnnx.deep_models import warn_unrolled_blocks
from mmnnx.distributed.step import peers_for
from mmnnx.distributed.timeline import JobTimeline
from mmnnx.errors import MPMDError, UnrolledMicrobatchWarning
from mmnnx.mpmd.engine import PlanningOptions, plan_step
from mmnnx.mpmd.lower.pack import (
    PACK_RESIDUAL_BYTES,
    PACK_WEIGHT_BYTES,
    residual_bound,
    weight_bound,
)
from mmnnx.mpmd.lower.plan import Plan
from mmnnx.mpmd.plan.stack_split import Expansion
from mmnnx.mpmd.run.failures import run_step
from mmnnx.mpmd.run.runner import Executable
from mmnnx.mpmd.run.stay_home import stay_home
from mmnnx.mpmd.run.timing import BlockingTimer, Event, OverlapTimer, Timer
from mmnnx.mpmd.schedules import Schedule
from mmnnx.mpmd.schedules import names as schedule_names
from mmnnx.mpmd.step_io import StepOutput
from mmnnx.mpmd.trace import trace_state
from mmnnx.mpmd.trace.callbacks import CallbackFailures
from mmnnx.mpmd.trace.mesh_context import auto_twin, no_ambient_mesh
from mmnnx.mpmd.trace.trace_step import check_outputs, trace_step


def _as_tuple(x: int | Sequence[int]) -> tuple[int, ...]:
    return (x,) if isinstance(x, int) else tuple(x)


def _step_name(fun: Callable) -> str:
    return getattr(fun, "__name__", "the step")


def _parameter_names(fun: Callable, count: int) -> list[str]:
    """The names of ``fun``'s first ``count`` positional parameters (``arg<i>`` where unknown)."""
    try:
        names = [
            p.name
            for p in inspect.signature(fun).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        names = []
    return [names[i] if i < len(names) else f"arg{i}" for i in range(count)]


@dataclasses.dataclass(frozen=True)
class JitOptions:
    """Everything a step is built with besides its function: ``mm.jit``'s options (see
    :func:`jit`) and the planning options, held normalised. :meth:`JitFunction.with_options`
    replaces some and keeps the others, so an option added here is kept too."""

    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    pack_residuals: int = PACK_RESIDUAL_BYTES  # bytes (True / False given: every / none)
    recompute_residuals: bool = True
    pack_weights: int = PACK_WEIGHT_BYTES  # bytes (True / False given: every / none)
    schedule: str | Schedule | None = None  # replaces each mm.microbatch's schedule when planned
    share_cores: bool = True  # edge stages reuse a middle stage's program

    def __post_init__(self) -> None:
        names = self.static_argnames
        normalised = {
            "static_argnums": _as_tuple(self.static_argnums),
            "static_argnames": (names,) if isinstance(names, str) else tuple(names),
            "donate_argnums": _as_tuple(self.donate_argnums),
            "pack_residuals": residual_bound(self.pack_residuals),
            "pack_weights": weight_bound(self.pack_weights),
        }
        for name, value in normalised.items():
            object.__setattr__(self, name, value)
        for name in ("recompute_residuals", "share_cores"):
            if not isinstance(got := getattr(self, name), bool):
                raise TypeError(f"mm.jit: {name} must be True or False, got {got!r}")
        if isinstance(self.schedule, str) and self.schedule not in schedule_names():
            raise ValueError(
                f"mm.jit: unknown schedule {self.schedule!r}; valid schedules are "
                f"{', '.join(schedule_names())} (or a Schedule object)"
            )
        if not isinstance(self.schedule, str | Schedule | None):
            raise TypeError(f"mm.jit: schedule {self.schedule!r} is not a name or a Schedule")

    def planning(self) -> PlanningOptions:
        """The options the engine plans a step with.

        Example:
            >>> JitOptions(pack_residuals=False, schedule="gpipe").planning().schedule
            'gpipe'
        """
        return PlanningOptions(
            residual_bytes=self.pack_residuals,
            weight_bytes=self.pack_weights,
            recompute_residuals=self.recompute_residuals,
            schedule=self.schedule,
            share_cores=self.share_cores,
        )


@dataclasses.dataclass(frozen=True)
class _Results:
    """How a compiled step's flat results become the step's return value and Variables."""

    tree: Any  # the pytree structure of the step's own return value
    numuser_outputs: int  # its leaves come first; then each Variable's new value
    expansion: Expansion | None  # stacked layers: their chunks, joined again
    added: list[Added]  # Variables the step added (sown), whose values come last
    plan_for: Callable[[int], Plan]  # the plan of another process
    callback_failures: CallbackFailures  # what the step's host callbacks raised
    donated: bool  # some input is donated (a failed step keeps the others)


class _Compiled(NamedTuple):
    """A cache entry of :class:`JitFunction`: the step's executable and its results' map."""

    executable: Executable
    results: _Results


class JitFunction:
    """The callable ``mm.jit`` returns; see :func:`jit`. ``JitFunction(fun, *options,
    **options)`` takes :class:`JitOptions`' fields, in their order or by name."""

    def __init__(self, fun, *options, **named_options):
        self.fun = fun
        self._cache: dict[Any, _Compiled] = {}
        self.trace_count = 0
        functools.update_wrapper(self, fun)
        given = JitOptions(*options, **named_options)
        static, donate = checked_argnums(
            fun,
            _step_name(fun),
            given.static_argnums,
            given.static_argnames,
            given.donate_argnums,
        )
        self.options = dataclasses.replace(given, static_argnums=static, donate_argnums=donate)

    static_argnums = property(lambda self: self.options.static_argnums)
    static_argnames = property(lambda self: self.options.static_argnames)
    donate_argnums = property(lambda self: self.options.donate_argnums)
    pack_residuals = property(lambda self: self.options.pack_residuals)
    recompute_residuals = property(lambda self: self.options.recompute_residuals)
    pack_weights = property(lambda self: self.options.pack_weights)
    share_cores = property(lambda self: self.options.share_cores)

    def with_options(self, **changes: Any) -> JitFunction:
        """A new step of the same function with the same options except ``changes`` (any field
        of :class:`JitOptions`), planned and compiled afresh on its first call.

        ``schedule``, a planning option, replaces the schedule of the step's ``mm.microbatch``
        when the step is planned (the trace is the same): ``mm.schedules.tune`` measures a
        split backward with ``step.with_options(schedule="zero-bubble-h1")``.

        Example:
            >>> step = jit(lambda x: x * 2, pack_residuals=False)
            >>> gpipe = step.with_options(schedule="gpipe")
            >>> gpipe.options.schedule, gpipe.pack_residuals, step.options.schedule
            ('gpipe', 0, None)
        """
        options = dataclasses.replace(self.options, **changes)
        fields = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
        return JitFunction(self.fun, **fields)

    def _build(self, call: Call) -> _Compiled:
        inputs = call.step_inputs()
        call.check_devices(inputs)
        call.check_optimizer_state()
        fun, name = self.fun, _step_name(self.fun)
        if self.trace_count == 0:
            dyn_args, dyn_kwargs = call.target
            warn_unrolled_blocks(
                [*dyn_args, *dyn_kwargs.values()],
                [*_parameter_names(fun, len(dyn_args)), *dyn_kwargs],
                f"mm.jit({name})",
            )

        added: list[Added] = []
        rebuilt: list[Any] = []  # the step's arguments as traced: to name a failing module

        def pure(*leaves):
            dyn_args, dyn_kwargs, fresh, nodes = call.rebuild(leaves)
            args, kwargs = call.full_args(dyn_args, dyn_kwargs)
            rebuilt[:] = [*args, *kwargs.values()]
            out = fun(*args, **kwargs)
            check_outputs(out, name)
            added[:] = call.take_added(dyn_args, dyn_kwargs, fresh)
            call.check_unchanged(dyn_args, dyn_kwargs, nodes)
            return out, [v.get_value() for v in fresh], [a.value for a in added]

        self.trace_count += 1
        callback_failures = CallbackFailures()
        traced = trace_step(
            pure,
            inputs,
            name_as=fun,
            callback_failures=callback_failures,
            located=lambda e: with_location(e, rebuilt),
        )
        rebuilt.clear()
        num_added = sum(a.num_leaves for a in added)
        for a in added:
            del a.value  # a tracer: the step's results give the value
        variables = inputs[: call.num_variables]
        planned = plan_step(
            traced.graph,
            traced.trace,
            inputs,
            [
                *user_outputs(traced.out_shape[0]),
                *state_outputs(variables),
                *[StepOutput()] * num_added,
            ],
            self.options.planning(),
            name=name,
            process=jax.process_index(),
            num_processes=jax.process_count(),
        )
        executable = Executable(
            planned.graph, planned.plan, name=repr(name), peers=peers_for(planned, inputs, name)
        )
        results = _Results(
            tree=jax.tree.structure(traced.out_shape[0]),
            numuser_outputs=len(traced.graph.outputs) - call.num_variables - num_added,
            expansion=planned.expansion,
            added=added,
            plan_for=planned.plan_for,
            callback_failures=callback_failures,
            donated=any(i.donated for i in inputs),
        )
        return _Compiled(executable=executable, results=results)

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
            with no_ambient_mesh(), cyclic_gc_paused():
                entry = self._cache[call.key] = self._build(call)
        else:
            call.check_free_devices(entry.executable.owned_devices)
        return entry

    def __call__(self, *args, **kwargs):
        if tracing():
            return self._traced_call(args, kwargs)
        return self._run(Call(self, args, kwargs))

    def _traced_call(self, args: tuple, kwargs: dict) -> Any:
        """A call while something traces. Inside another ``mm.jit`` step the function is inlined:
        its ops join that step's, which carries its Variable updates back (as a ``jax.jit``
        inside a ``jax.jit`` does). Any other transformation cannot trace a step that dispatches
        its own programs on several submeshes."""
        if trace_state.current_trace() is None:
            name = _step_name(self.fun)
            raise MPMDError(
                f"mm.jit: {name} was called inside a JAX transformation (jax.jit, nnx.jit, "
                "jax.grad, jax.vmap, ...); an mm.jit step runs its own programs on several "
                f"submeshes and cannot be traced by another transformation. Call {name} outside "
                "it, or apply the transformation inside the step"
            )
        return self.fun(*args, **kwargs)

    def _run(self, call: Call, **modes):
        executable, results = self._lookup(call)
        with no_ambient_mesh():  # each fragment runs on its own task's mesh
            outs = run_step(
                executable,
                call.values,
                expansion=results.expansion,
                callback_failures=results.callback_failures,
                name=_step_name(self.fun),
                donated=results.donated,
                deleted=call.deleted_input,
                look_first=bool(self.donate_argnums),
                **modes,
            )
        users, num_variables = results.numuser_outputs, call.num_variables
        if executable.graph.specs:  # sharding in types: hand back on the tasks' own meshes
            likes = [None] * users + [
                value.sharding if leaf.placed else None
                for leaf, value in zip(call.leaves[:num_variables], call.values, strict=False)
            ]
            outs = [
                auto_twin(r, like=like)
                for r, like in itertools.zip_longest(outs, likes)  # added: no like
            ]
        updates = outs[users : users + num_variables]
        if call.unplaced and jax.process_count() == 1:
            for i in call.unplaced:
                updates[i] = stay_home(call.values[i], updates[i])
        _nnx.set_values(call.variables, updates)
        call.put_added(results.added, outs[users + num_variables :])
        return jax.tree.unflatten(results.tree, outs[:users])

    def timeline(self, *args, **kwargs) -> list[Event]:
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
        return self._timed(BlockingTimer(), Call(self, args, kwargs))

    def overlapped_timeline(self, *args, **kwargs) -> list[Event]:
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
        return self._timed(OverlapTimer(), Call(self, args, kwargs))

    def _timed(self, timer: Timer, call: Call) -> list[Event]:
        with JobTimeline() as job:  # with several processes: every process's events, one clock
            timer = job.timer(timer)
            try:
                self._run(call, timer=timer)
            finally:
                timer.stop()
            events = job.events(timer.events())
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

    def plan(self, *args, process: int | None = None, **kwargs) -> Plan:
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
        executable, results = self._lookup(Call(self, args, kwargs))
        if process is not None and process != jax.process_index():
            return results.plan_for(process)
        return executable.compiled_plan or executable.plan

    def compile(self, *args, **kwargs) -> Plan:
        """Compiles every program the step runs for these arguments, without running it, so the
        first call starts at once; returns the compiled plan. A call compiles on first use
        otherwise."""
        executable, _ = self._lookup(Call(self, args, kwargs))
        with no_ambient_mesh():
            return executable.compile()


def jit(
    fun: Callable | None = None,
    *,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    pack_residuals: bool | int = PACK_RESIDUAL_BYTES,
    recompute_residuals: bool = True,
    pack_weights: bool | int = PACK_WEIGHT_BYTES,
    share_cores: bool = True,
) -> JitFunction:
    """Lifts an NNX step over several tasks: one compiled program per task, run asynchronously.

    Arguments may be Modules, Optimizers, other graph nodes and pytrees of arrays; Variable updates
    made inside ``fun`` are written back to the caller's objects, on their tasks. An op that reads
    state placed on task T runs on T; other ops go where the fewest bytes move. Called inside
    another ``mm.jit`` step, ``fun`` is inlined into it.

    ``pack_residuals``: in a pipelined step, each forward on a one-device task (or on a task
    whose values are all replicated: a step that splits nothing over a task's devices) returns the
    residuals its backward reads of at most this many bytes (default
    ``mm.PACK_RESIDUAL_BYTES``, 64 KiB) as one flat buffer per dtype instead of one array each;
    ``True`` packs every residual, ``False`` none. The host pays for each array a program
    returns, more than copying a small array into the buffer costs; so small stages (many
    microbatches, a host-bound step) launch in less host time (``benchmarks/dispatch.py``
    measures how much). Large residuals travel alone: packing them would copy each and hold it
    twice while the buffer is made. A stage's gradient sums travel as one buffer either way.

    ``pack_weights``: in a pipelined step, the weights of at most this many bytes (default
    64 KiB) of each block of a one-device stage, or replicated over a stage's devices (the
    Variables under one list index, such as
    ``blocks/3/...``) travel to its forwards and backwards as one flat buffer per dtype, packed
    once per step by a program at its start, instead of one argument each per launch: laid out
    alike in every block, the blocks' programs slice them at the same offsets, so XLA still
    compiles each kernel once. ``True`` packs every block's weights, ``False`` none. The buffers
    are a copy: they hold the packed weights twice while the step runs.

    ``recompute_residuals``: in a pipelined step, each stage's backward recomputes the cheap
    residuals of its forward (arithmetic and layout ops: ``2 * x``, a norm's scaled output, the
    pieces of a GELU) from those it keeps, instead of the forward returning them: half the
    arrays a GPT stage's forward returns, and fewer bytes held between the passes. Exp, tanh,
    rsqrt, reductions and contractions are never recomputed. ``False`` keeps every residual.

    ``share_cores``: in a pipelined step, a stage's forward or backward that runs a middle
    stage's computation and more (the first stage's blocks after the embedding, the last's
    before the head and the loss) runs it as that stage's program, alike on other devices, with
    the rest as programs of their own before and after it: XLA compiles the blocks' kernels
    once for all the stages instead of once more for each edge stage, at the cost of a launch
    or two more per microbatch on those stages. ``False`` runs each as one program.

    ``static_argnums`` / ``donate_argnums`` count positional arguments, negative ones from the
    end of ``fun``'s signature. As with ``jax.jit``, a position ``fun`` does not have, a
    ``static_argnames`` entry it does not take, or an argument both static and donated raises
    a ``ValueError`` when ``mm.jit`` is applied (a ``fun`` taking ``*args`` is not checked).

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
    options = {
        "static_argnums": static_argnums,
        "static_argnames": static_argnames,
        "donate_argnums": donate_argnums,
        "pack_residuals": pack_residuals,
        "recompute_residuals": recompute_residuals,
        "pack_weights": pack_weights,
        "share_cores": share_cores,
    }
    if fun is None:
        JitOptions(**options)  # a bad option raises here, before a function is given
        return functools.partial(jit, **options)
    return JitFunction(fun, **options)


class CachedPartial:
    """A :class:`JitFunction` with its leading arguments bound; see :func:`cached_partial`."""

    def __init__(self, fn: JitFunction, cached_args: tuple):
        self.fn = fn
        self.cached_args = cached_args
        self._template: Call | None = None
        self._tail_treedef: Any = None
        functools.update_wrapper(self, fn, updated=())

    @property
    def trace_count(self) -> int:
        """How often the underlying step has traced (shared with the ``mm.jit`` function)."""
        return self.fn.trace_count

    def _call(self, args: tuple, kwargs: dict) -> Call:
        full = (*self.cached_args, *args)
        offset = len(self.cached_args)
        statics, names = self.fn.static_argnums, self.fn.static_argnames
        tail = (
            tuple(None if i + offset in statics else a for i, a in enumerate(args)),
            {k: v for k, v in kwargs.items() if k not in names},
        )
        nodes, treedef = jax.tree.flatten(tail, is_leaf=_nnx.is_variable)
        plain = not any(_nnx.is_variable(n) for n in nodes)
        if plain and self._template is not None and treedef == self._tail_treedef:
            self._template.check_bound()  # a Variable or submodule replaced: named
            if not self._template.grown():
                return self._template.rebound(full, kwargs, nodes)
            call = Call(self.fn, full, kwargs)  # walked afresh
            self._template.check_none_added(call)  # a Variable added: named
        else:
            call = Call(self.fn, full, kwargs)
        if plain:  # arguments holding Variables are walked on every call
            self._template = call.template(len(nodes), offset)
            self._tail_treedef = treedef
        return call

    def __call__(self, *args, **kwargs):
        if tracing():
            name = _step_name(self.fn.fun)
            raise MPMDError(
                f"mm.cached_partial: {name} was called while another function is traced (an "
                "mm.jit step, jax.jit, ...); its bound arguments would enter that trace as "
                f"constants. Inside an mm.jit step, call the mm.jit function {name} with the "
                "step's own arguments (it is inlined there)"
            )
        return self.fn._run(self._call(args, kwargs))

    def with_options(self, **changes: Any) -> CachedPartial:
        """:meth:`JitFunction.with_options`, with the same bound arguments."""
        return CachedPartial(self.fn.with_options(**changes), self.cached_args)

    def timeline(self, *args, **kwargs) -> list[Event]:
        """:meth:`JitFunction.timeline` with the bound arguments first."""
        return self.fn.timeline(*self.cached_args, *args, **kwargs)

    def overlapped_timeline(self, *args, **kwargs) -> list[Event]:
        """:meth:`JitFunction.overlapped_timeline` with the bound arguments first."""
        return self.fn.overlapped_timeline(*self.cached_args, *args, **kwargs)

    def memory_profile(self, *args, **kwargs) -> dict[str, tuple[int, int]]:
        """:meth:`JitFunction.memory_profile` with the bound arguments first."""
        return self.fn.memory_profile(*self.cached_args, *args, **kwargs)

    def plan(self, *args, **kwargs) -> Plan:
        """:meth:`JitFunction.plan` with the bound arguments first."""
        return self.fn.plan(*self.cached_args, *args, **kwargs)

    def compile(self, *args, **kwargs) -> Plan:
        """:meth:`JitFunction.compile` with the bound arguments first."""
        return self.fn.compile(*self.cached_args, *args, **kwargs)


def cached_partial(fn: JitFunction, *cached_args: Any) -> CachedPartial:
    """Binds the leading arguments of an ``mm.jit`` step and caches their structure.

    ``mm.jit`` walks every Module and Optimizer argument on every call to find its Variables;
    for a large model that walk is most of the per-call host time. ``cached_partial`` walks the
    bound arguments once: later calls read and write their Variables directly, and only the
    other arguments (a batch) are walked. Values may change freely between calls (a new
    array of another shape or sharding re-plans as usual); the bound objects' structure must
    not: adding, removing or replacing a Variable or submodule, or placing them again with
    ``mm.place``, needs a new ``cached_partial`` (the same contract as ``nnx.cached_partial``).
    A call notices each of these and raises :class:`mm.SideEffectError` naming it before
    anything runs (an added Variable by its path, e.g. ``'arg0/l0/scale'``), rather than
    run a step that would never read or train it. Anything else added to a bound object (a
    plain attribute) makes that call walk the bound arguments afresh, as a first call does. A
    static attribute changed in place (``model.eval()``) is not noticed: bind again after it.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> from mmnnx.sharding import Task, TaskMesh, place
        >>> solo = Task("solo", mesh=TaskMesh(devices=[0]))
        >>> model = place(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), [(".*", solo)])
        >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> @jit
        ... def train_step(model, opt, x):
        ...     loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
        ...     opt.update(model, grads)
        ...     return loss
        >>> step = cached_partial(train_step, model, opt)
        >>> losses = [float(step(jnp.ones((4, 2)))) for _ in range(3)]
        >>> losses[2] < losses[0]
        True
    """
    if not isinstance(fn, JitFunction):
        raise TypeError(
            f"mm.cached_partial binds arguments of an mm.jit function, got {type(fn).__name__}; "
            "wrap the step with mm.jit first"
        )
    return CachedPartial(fn, cached_args)
