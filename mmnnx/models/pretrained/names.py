"""``TensorRule``: how a checkpoint's tensor names map to a model's Variable paths, both ways.

``{name}`` fields of the templates stand for integers (``{layer}``, ``{expert}``); a field in
the tensor name but not in the Variable path is a *stacked* axis, in the order the fields
appear in the tensor name (``nnx.vmap``/``scan_layers`` stacks).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

_FIELD = re.compile(r"\{(\w+)\}")


class Part(NamedTuple):
    """Piece ``index`` of ``count`` equal pieces along the tensor's axis ``axis`` (its own axes,
    before any transpose): one fused tensor filling several Variables.

    Example:
        >>> Part(axis=1, index=1, count=2).of((8, 6, 4))  # the second half of axis 1
        (slice(None, None, None), slice(3, 6, None), slice(None, None, None))
    """

    axis: int
    index: int
    count: int

    def of(self, shape: Sequence[int]) -> tuple[slice, ...]:
        """The index of this piece in a tensor of ``shape``."""
        size = shape[self.axis] // self.count
        out = [slice(None)] * len(shape)
        out[self.axis] = slice(self.index * size, (self.index + 1) * size)
        return tuple(out)


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """Checkpoint tensors named like ``tensor`` fill the Variable at path ``variable``.

    The Variable's value (or, for stacked axes, each slot of it) is
    ``tensor[part].transpose(transpose).reshape(reshape)``, each step skipped when ``None``
    (a :class:`Part` lets one fused tensor, e.g. ``gate_up_proj``, fill two Variables; such a
    rule only reads: writing uses the first rule that names the Variable).
    Linear weights are stored ``(out, in)`` in Hugging Face checkpoints and ``(in, out)`` as NNX
    kernels, hence ``transpose=(1, 0)``. ``variable=None`` marks tensors that are read by no
    Variable (a tied ``lm_head.weight``, old ``rotary_emb.inv_freq`` buffers).

    Example:
        >>> rule = TensorRule("model.layers.{layer}.mlp.up_proj.weight",
        ...                   "blocks/{layer}/mlp/up/kernel", transpose=(1, 0))
        >>> rule.fields, rule.stacked
        (('layer',), ())
        >>> TensorRule("layers.{layer}.w", "blocks/w").stacked  # a scanned (stacked) layer axis
        ('layer',)
    """

    tensor: str
    variable: str | None
    transpose: tuple[int, ...] | None = None
    reshape: tuple[int, ...] | None = None
    part: Part | None = dataclasses.field(default=None, kw_only=True)
    layers: tuple[int, ...] | None = dataclasses.field(default=None, kw_only=True)
    """The values of the stacked ``{layer}`` field the rule reads, in the order of the
    Variable's layer axis (a scanned segment's layers); ``None``: any, each its own index."""

    def __post_init__(self):
        if self.part is not None and self.reshape is not None:
            raise ValueError(f"TensorRule {self.tensor!r}: a part and a reshape together")
        missing = set(_FIELD.findall(self.variable or "")) - set(self.fields)
        if missing:
            raise ValueError(
                f"TensorRule {self.tensor!r} -> {self.variable!r}: the Variable path uses "
                f"{sorted(missing)}, which the tensor name does not have"
            )

    def slot(self, values: dict[str, int]) -> tuple[int, ...] | None:
        """The stacked slot the tensor of field ``values`` fills, ``None`` if ``layers`` has
        not its layer.

        Example:
            >>> TensorRule("l.{layer}.w", "b/w", layers=(1, 3)).slot({"layer": 3})
            (1,)
        """
        if self.layers is not None and "layer" in self.stacked:
            if values["layer"] not in self.layers:
                return None
            values = {**values, "layer": self.layers.index(values["layer"])}
        return tuple(values[f] for f in self.stacked)

    def name(self, values: dict[str, int], slot: Sequence[int]) -> str:
        """The tensor name filling stacked ``slot`` with the other fields' ``values``."""
        values = {**values, **dict(zip(self.stacked, slot, strict=True))}
        if self.layers is not None and "layer" in self.stacked:
            values["layer"] = self.layers[values["layer"]]
        return self.tensor.format(**values)

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(_FIELD.findall(self.tensor))

    @property
    def stacked(self) -> tuple[str, ...]:
        """The fields that index the Variable's leading (stacked) axes, in order."""
        if self.variable is None:
            return ()
        kept = set(_FIELD.findall(self.variable))
        return tuple(f for f in self.fields if f not in kept)

    def tensor_shape(self, variable_shape: Sequence[int]) -> tuple[int, ...]:
        """The shape of one tensor filling a Variable of ``variable_shape`` (export's view)."""
        if self.reshape is not None or self.part is not None:
            raise ValueError(
                f"TensorRule {self.tensor!r}: cannot write a tensor back through a "
                f"{'reshape' if self.part is None else 'part'}; "
                "give the rule no reshape, or write this tensor yourself"
            )
        inner = tuple(variable_shape[len(self.stacked) :])
        if self.transpose is None:
            return inner
        return tuple(inner[i] for i in np.argsort(self.transpose))

    def variable_shape(self, tensor_shape: Sequence[int], name: str = "") -> tuple[int, ...]:
        """The shape one tensor of ``tensor_shape`` (named ``name`` in errors; by default the
        rule's template) takes in the Variable (without stacked axes)."""
        shape, name = tuple(tensor_shape), name or self.tensor
        if self.part is not None:
            axis, _, count = self.part
            if not -len(shape) <= axis < len(shape) or shape[axis] % count:
                raise ValueError(
                    f"tensor {name!r}: shape {shape} does not split into {count} equal "
                    f"parts along axis {axis}"
                )
            shape = tuple(n // count if i == axis % len(shape) else n for i, n in enumerate(shape))
        if self.transpose is not None:
            if sorted(self.transpose) != list(range(len(shape))):
                raise ValueError(
                    f"tensor {name!r}: transpose {self.transpose} does not fit its "
                    f"{len(shape)} dimensions {shape}"
                )
            shape = tuple(shape[i] for i in self.transpose)
        if self.reshape is not None:
            if int(np.prod(self.reshape)) != int(np.prod(shape)):
                raise ValueError(f"tensor {name!r}: cannot reshape {shape} to {self.reshape}")
            shape = tuple(self.reshape)
        return shape


class Source(NamedTuple):
    """Where one Variable's value comes from: its rule and, per stacked slot, a tensor name."""

    path: str
    rule: TensorRule
    tensors: dict[tuple[int, ...], str]  # by the stacked fields' values, () when unstacked

    @property
    def stack_shape(self) -> tuple[int, ...]:
        return tuple(max(k[i] for k in self.tensors) + 1 for i in range(len(self.rule.stacked)))

    def name(self, slot: tuple[int, ...]) -> str:
        """The name of the tensor filling stacked ``slot``, held by the files or not.

        Example:
            >>> rule = TensorRule("layers.{layer}.experts.{expert}.w", "blocks/{layer}/w")
            >>> Source("blocks/1/w", rule, {(0,): "layers.1.experts.0.w"}).name((5,))
            'layers.1.experts.5.w'
        """
        found = _pattern(self.rule.tensor).match(next(iter(self.tensors.values()))).groupdict()
        return self.rule.name({k: int(v) for k, v in found.items()}, slot)


def _pattern(template: str) -> re.Pattern:
    parts = _FIELD.split(template)  # literal, field, literal, field, ...
    out = [rf"(?P<{p}>\d+)" if i % 2 else re.escape(p) for i, p in enumerate(parts)]
    return re.compile("".join(out) + r"\Z")


def match(names: Iterable[str], rules: Sequence[TensorRule]) -> tuple[dict[str, Source], list[str]]:
    """The sources of tensor ``names`` by Variable path, and the names no rule matches.

    Example:
        >>> rules = [TensorRule("layers.{layer}.w", "blocks/w"), TensorRule("extra", None)]
        >>> sources, unmatched = match(["layers.1.w", "layers.0.w", "extra", "odd"], rules)
        >>> sources["blocks/w"].tensors, sources["blocks/w"].stack_shape, unmatched
        ({(1,): 'layers.1.w', (0,): 'layers.0.w'}, (2,), ['odd'])
        >>> halves = [TensorRule("gu", v, part=Part(0, i, 2)) for i, v in enumerate("ab")]
        >>> sorted(match(["gu"], halves)[0])  # one fused tensor, two Variables
        ['a', 'b']
    """
    patterns = [_pattern(r.tensor) for r in rules]
    sources: dict[str, Source] = {}
    unmatched: list[str] = []
    for name in names:
        parts = 0  # a fused tensor fills one Variable per part rule it matches
        for rule, pattern in zip(rules, patterns, strict=True):
            found = pattern.match(name)
            if found is None or (parts and rule.part is None):
                continue
            if rule.variable is None:
                break
            values = {k: int(v) for k, v in found.groupdict().items()}
            slot = rule.slot(values)
            if slot is None:  # a layer of another segment
                continue
            path = rule.variable.format(**values)
            source = sources.setdefault(path, Source(path=path, rule=rule, tensors={}))
            if source.rule is not rule:
                raise ValueError(
                    f"tensors {name!r} and {next(iter(source.tensors.values()))!r} both fill "
                    f"Variable {path!r} through different rules"
                )
            if slot in source.tensors:
                raise ValueError(
                    f"tensors {source.tensors[slot]!r} and {name!r} both fill Variable {path!r}"
                )
            source.tensors[slot] = name
            if rule.part is None:
                break
            parts += 1
        else:
            if not parts:
                unmatched.append(name)
    return sources, unmatched


def tensors_of(
    path: str, shape: Sequence[int], rules: Sequence[TensorRule]
) -> tuple[TensorRule, dict[tuple[int, ...], str]] | None:
    """The rule writing the Variable at ``path`` and its tensor name per slot, or None.

    Example:
        >>> rules = [TensorRule("layers.{layer}.w", "blocks/w")]
        >>> tensors_of("blocks/w", (2, 3), rules)[1]
        {(0,): 'layers.0.w', (1,): 'layers.1.w'}
    """
    for rule in rules:
        found = rule.variable is not None and _pattern(rule.variable).match(path)
        if not found:
            continue
        values = {k: int(v) for k, v in found.groupdict().items()}
        slots = itertools.product(*(range(n) for n in shape[: len(rule.stacked)]))
        return rule, {slot: rule.name(values, slot) for slot in slots}
    return None
