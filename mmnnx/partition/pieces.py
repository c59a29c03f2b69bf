"""A model cut into the pieces the planner times: the embedding, each layer, and the head and
loss, each a pure function of its own Variables' values and its input arrays. Each piece merges
the whole model from its own state and zeros (which XLA drops), its layers replaced by stubs
that record calls, stop at the first layer, or stand in for them.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from mmnnx.models.stages import Layers

Path = tuple
EMBEDDING = "embedding"
HEAD = "head + loss"


@dataclasses.dataclass(frozen=True)
class Call:
    """How the loss function called one layer: method, ``(args, kwargs)`` and output."""

    method: str
    inputs: Any
    output: Any


@dataclasses.dataclass(frozen=True)
class Piece:
    """One timed part: ``fn(params, other, inputs)``; ``key`` equal for pieces timed once."""

    name: str
    fn: Callable[..., tuple]
    params: Any
    other: Any
    inputs: tuple
    grads: tuple[bool, ...]
    key: Any


class _Reached(Exception):  # noqa: N818  (not an error: carries layer 0's inputs out)
    def __init__(self, inputs: Any):
        super().__init__("layer 0 reached")
        self.inputs = inputs


class _Stub(nnx.Module):
    """Stands in for layer ``index``: every method called on it goes to ``hook``."""

    def __init__(self, inner: Any, index: int, hook: Callable[..., Any]):
        self.inner = inner
        self.index = index
        self.hook = hook

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.hook(self.index, "__call__", args, kwargs, self.inner)

    @property
    def __signature__(self) -> inspect.Signature:
        # the layer's own: nnx.Sequential passes ``rngs`` only to layers whose signature names it
        try:
            return inspect.signature(self.inner)
        except (TypeError, ValueError):
            return inspect.signature(self.__call__)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "index", "hook") or name.startswith("_"):
            raise AttributeError(name)
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr
        return lambda *args, **kwargs: self.hook(self.index, name, args, kwargs, self.inner)


def _abstract(tree: Any) -> Any:
    """``tree`` with every array (or tracer) as a ``ShapeDtypeStruct``; other leaves kept."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if _is_array(x) else x, tree
    )


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _zeros(tree: Any) -> Any:
    """Zeros shaped as ``tree``'s arrays (PRNG keys included); other leaves kept."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype) if _is_array(a) else a, tree)


def _differentiable(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _arrays(tree: Any) -> tuple[list, Callable[[Sequence], Any]]:
    """The arrays of ``tree`` and a function putting new arrays back in their places."""
    leaves, treedef = jax.tree.flatten(tree)
    where = [i for i, x in enumerate(leaves) if _is_array(x)]

    def rebuild(arrays: Sequence) -> Any:
        out = list(leaves)
        for i, a in zip(where, arrays, strict=True):
            out[i] = a
        return jax.tree.unflatten(treedef, out)

    return [leaves[i] for i in where], rebuild


class Model:
    """``model`` split as the planner times it, each group an ``nnx.State`` of its own."""

    def __init__(self, model: Any, found: Layers, wrt: Any):
        self.found = found
        self.wrt = wrt
        n = found.count
        inside = len(found.path)

        def under(prefixes: Sequence[Path]) -> Callable[[Path, Any], bool]:
            return lambda p, _: any(p[: len(g)] == g for g in prefixes)

        def layer(i: int) -> Callable[[Path, Any], bool]:
            return lambda p, _: p[:inside] == found.path and len(p) > inside and p[inside] == i

        filters = [under(found.firsts), under(found.lasts), *map(layer, range(n)), ...]
        self.graphdef, first, last, *states = nnx.split(model, *filters)
        self.states = [first, last, *states]  # first, last, layer 0 .. n - 1, rest
        self.abstract = [_abstract(s) for s in self.states]
        self.layer_graphdefs = [nnx.graphdef(b) for b in self._layers_of(model)]

    def _merged(self, live: dict[int, Any]) -> Any:
        states = [live[i] if i in live else _zeros(a) for i, a in enumerate(self.abstract)]
        return nnx.merge(self.graphdef, *states)

    def _layers_of(self, model: Any) -> Any:
        node = model
        for key in self.found.path:
            node = node[key] if isinstance(key, int) else getattr(node, key)
        return node

    def _stubbed(self, model: Any, hook: Callable[..., Any]) -> Any:
        layers = self._layers_of(model)
        for i in range(self.found.count):
            layers[i] = _Stub(layers[i], i, hook)
        return model

    def record(self, loss_fn: Callable, batch: Any) -> list[Call]:
        """How ``loss_fn(model, batch)`` calls each layer (each once, in order)."""
        calls: list[tuple[int, Call]] = []

        def hook(i: int, method: str, args: Any, kwargs: Any, inner: Any) -> Any:
            out = getattr(inner, method)(*args, **kwargs)
            calls.append((i, Call(method, _abstract((args, kwargs)), _abstract(out))))
            return out

        def run(states: list, batch: Any) -> Any:
            model = nnx.merge(self.graphdef, *states)
            return loss_fn(self._stubbed(model, hook), batch)

        jax.eval_shape(run, self.abstract, batch)
        order = [i for i, _ in calls]
        if order != list(range(self.found.count)):
            raise ValueError(
                f"partition: the loss function calls the layers of {self.found.where} in the "
                f"order {order}; the planner cuts layers called once each, in order "
                f"0..{self.found.count - 1}"
            )
        return [call for _, call in calls]

    def _piece(self, group: int, name: str, fn: Callable, inputs: Sequence, grads: Sequence,
               key: Any = None) -> Piece:  # fmt: skip
        """A piece of state group ``group``, its differentiated Variables its ``params``."""
        params, other = nnx.split_state(self.states[group], self.wrt, ...)
        return Piece(name=name, fn=fn, params=params, other=other, inputs=tuple(inputs),
                     grads=tuple(grads), key=key)  # fmt: skip

    def layer(self, i: int, call: Call) -> Piece:
        """Layer ``i`` as its ``call`` calls it."""
        arrays, rebuild = _arrays(call.inputs)
        out_arrays, _ = _arrays(call.output)
        keep = [j for j, a in enumerate(out_arrays) if _differentiable(a)]

        def fn(params: Any, other: Any, inputs: Sequence) -> tuple:
            model = self._merged({2 + i: nnx.merge_state(params, other)})
            args, kwargs = rebuild(inputs)
            out = getattr(self._layers_of(model)[i], call.method)(*args, **kwargs)
            leaves, _ = _arrays(out)
            return tuple(leaves[j] for j in keep)

        skip = len(self.found.path) + 1  # the layer's own paths: alike layers, one key
        key = (self.layer_graphdefs[i], _shapes(self.abstract[2 + i], skip), repr(call))
        return self._piece(2 + i, f"layer {i}", fn, arrays, map(_differentiable, arrays), key)

    def embedding(self, loss_fn: Callable, batch: Any) -> Piece:
        """Everything ``loss_fn`` runs before layer 0, on ``batch`` (one microbatch)."""
        batch_arrays, rebuild = _arrays(batch)

        def hook(i: int, method: str, args: Any, kwargs: Any, inner: Any) -> Any:
            raise _Reached((args, kwargs))

        def fn(params: Any, other: Any, inputs: Sequence) -> tuple:
            model = self._stubbed(self._merged({0: nnx.merge_state(params, other)}), hook)
            try:
                loss_fn(model, rebuild(inputs))
            except _Reached as reached:
                leaves, _ = _arrays(reached.inputs)
                return tuple(x for x in leaves if _differentiable(x))
            raise ValueError(  # the record found every layer called: unreachable
                f"partition: the loss function never calls layer 0 of {self.found.where}"
            )

        return self._piece(0, EMBEDDING, fn, batch_arrays, (False,) * len(batch_arrays))

    def head(self, loss_fn: Callable, batch: Any, calls: Sequence[Call]) -> Piece:
        """Everything ``loss_fn`` runs after the last layer, from its output, to the loss."""
        batch_arrays, rebuild_batch = _arrays(batch)
        last = calls[-1].output
        out_arrays, rebuild_out = _arrays(last)
        split = len(out_arrays)

        def fn(params: Any, other: Any, inputs: Sequence) -> tuple:
            injected = rebuild_out(inputs[:split])

            def hook(i: int, method: str, args: Any, kwargs: Any, inner: Any) -> Any:
                return injected if i == len(calls) - 1 else _zeros(calls[i].output)

            model = self._stubbed(self._merged({1: nnx.merge_state(params, other)}), hook)
            return (loss_fn(model, rebuild_batch(inputs[split:])),)

        grads = tuple(map(_differentiable, out_arrays)) + (False,) * len(batch_arrays)
        return self._piece(1, HEAD, fn, [*out_arrays, *batch_arrays], grads)


def _shapes(state: Any, skip: int) -> tuple:
    """The paths (less their first ``skip`` keys), shapes and dtypes of ``state``'s arrays."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return tuple((jax.tree_util.keystr(p[skip:]), a.shape, str(a.dtype)) for p, a in flat)
