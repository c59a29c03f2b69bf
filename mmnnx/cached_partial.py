"""``mm.cached_partial``: an ``mm.jit`` step with its leading arguments bound, walked once.

A :class:`_Binding` keeps the bound arguments' Variables and structure (never their values) and
every edge from them to their Variables, so that a later call reads and writes the Variables
directly, after checking that nothing was replaced, added or placed again.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from mmnnx import _nnx
from mmnnx._call import Call, _arg_position
from mmnnx._jax.tracing import tracing
from mmnnx.errors import MPMDError, SideEffectError
from mmnnx.jit import JitFunction
from mmnnx.mpmd.engine import Plan


class _Binding:
    """A call's Variables and structure, holding none of its values (keeping them would keep a
    step's old arrays alive); also every edge from the first ``num_bound`` positional arguments to
    their Variables (:meth:`check_bound`) and the size of each container they hold
    (:meth:`grown`)."""

    def __init__(self, call: Call, num_tail: int, num_bound: int):
        template = self.template = object.__new__(Call)
        template.__dict__.update(call.__dict__)
        self.bound_arrays = call.values[call.num_variables : len(call.values) - num_tail]
        edges: dict[tuple[int, Any], tuple[Any, ...]] = {}
        roots = call.target[0]
        for path in call._paths:
            position = _arg_position(path)
            if position is None or position >= num_bound:
                continue
            parent = roots[position]
            for key in path[2:]:
                slot = _nnx.child_slot(parent, key)
                if slot is None:
                    break
                holder, k = slot
                child = holder[k]
                edges.setdefault((id(holder), k), (holder, k, child, parent, key))
                parent = child
        self.edges = list(edges.values())
        holders = {id(h): h for h in _nnx.holders_of(roots[:num_bound])}
        holders.update((id(e[0]), e[0]) for e in self.edges)
        self.holders = list(holders.values())
        self.sizes = [len(h) for h in self.holders]
        template.values = template.target = None

    def check_none_added(self, call: Call) -> None:
        """Raises if ``call`` (walked afresh) holds a Variable the binding does not."""
        known = {id(v) for v in self.template.variables}
        for name, variable in zip(call.names, call.variables, strict=False):
            if id(variable) not in known:
                raise SideEffectError(
                    f"mm.cached_partial: a bound argument changed since the binding was made "
                    f"({name!r}, an nnx.{type(variable).__name__}, was added); the binding "
                    "would never read or update it. Make a new mm.cached_partial after "
                    "changing the model"
                )

    def grown(self) -> bool:
        """Whether something was added to a bound argument since the binding was made."""
        return list(map(len, self.holders)) != self.sizes

    def check_bound(self) -> None:
        """Raises if a bound argument's Variable or submodule was replaced since the binding."""
        for holder, k, child, parent, key in self.edges:
            try:
                same = holder[k] is child
            except (IndexError, KeyError):
                same = False
            if not same:
                where = jax.tree_util.keystr((key,))
                raise SideEffectError(
                    f"mm.cached_partial: a bound argument changed since the binding was made "
                    f"(its {type(parent).__name__}{where} is another object now: a Variable or "
                    "submodule was replaced); the new one would never be updated. Make a new "
                    "mm.cached_partial after changing the model"
                )

    def rebound(self, args: tuple, kwargs: dict, tail: list[Any]) -> Call:
        """The binding with new trailing array leaves (``tail``) and the static values of ``args`` /
        ``kwargs``: a call that walks nothing."""
        call = object.__new__(Call)
        call.__dict__.update(self.template.__dict__)
        call.bound = True
        call._set_statics(args, kwargs)
        call._set_values(self.bound_arrays + tail)
        return call


class CachedPartial:
    """A :class:`JitFunction` with its leading arguments bound; see :func:`cached_partial`."""

    def __init__(self, fn: JitFunction, cached_args: tuple):
        self.fn = fn
        self.cached_args = cached_args
        self._binding: _Binding | None = None
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
        binding = self._binding
        if plain and binding is not None and treedef == self._tail_treedef:
            binding.check_bound()  # a Variable or submodule replaced: named
            if not binding.grown():
                return binding.rebound(full, kwargs, nodes)
            call = Call(self.fn, full, kwargs)  # walked afresh
            binding.check_none_added(call)  # a Variable added: named
        else:
            call = Call(self.fn, full, kwargs)
        if plain:  # arguments holding Variables are walked on every call
            self._binding = _Binding(call, len(nodes), offset)
            self._tail_treedef = treedef
        return call

    def __call__(self, *args, **kwargs):
        if tracing():
            name = getattr(self.fn.fun, "__name__", "the step")
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

    def timeline(self, *args, **kwargs) -> list:
        """:meth:`JitFunction.timeline` with the bound arguments first."""
        return self.fn.timeline(*self.cached_args, *args, **kwargs)

    def overlapped_timeline(self, *args, **kwargs) -> list:
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
        >>> from mmnnx.jit import jit
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
