"""Shared models for the compat tests: the tutorials' einsum and MLP pipelines."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from multimesh_compat.jax import with_sharding_constraint
from multimesh_compat.jax.flax import shard_axes


def f(param, x):
    return jnp.einsum("bm,mh->bh", x, param)


def get_input_batch():
    return jnp.arange(64, dtype=jnp.float32).reshape(8, 8)


def init_params():
    return jnp.arange(64, dtype=jnp.float32).reshape(8, 8), jnp.arange(64.0).reshape(8, 8) / 7


def make_model(layer1=f, layer2=f, scopes=False):
    def model(params, x):
        x = with_sharding_constraint(x, P("batch", None))
        p1, p2 = params
        p1 = with_sharding_constraint(p1, P("model", None))
        p2 = with_sharding_constraint(p2, P(None, "model"))
        if scopes:
            with jax.named_scope("layer0"):
                x = layer1(p1, x)
            with jax.named_scope("layer1"):
                x = layer2(p2, x)
        else:
            x = layer2(p2, layer1(p1, x))
        return with_sharding_constraint(x, P("batch", None))

    return model


def reference(params, x):
    return (x @ params[0]) @ params[1]


def blocks(a: jax.Array) -> list[tuple[tuple, list[int]]]:
    """Each distinct shard of ``a`` as ((start, stop), ...) and the devices holding it."""
    out: dict[tuple, list[int]] = {}
    for dev, idx in a.sharding.devices_indices_map(a.shape).items():
        key = tuple(
            (s.start or 0, s.stop if s.stop is not None else n)
            for s, n in zip(idx, a.shape, strict=True)
        )
        out.setdefault(key, []).append(dev.id)
    return sorted((k, sorted(v)) for k, v in out.items())


def device_ids(a: jax.Array) -> list[int]:
    return sorted(d.id for d in a.sharding.device_set)


class MLPBlock(nn.Module):
    features: int = 4
    use_jax_lax: bool = False

    @nn.compact
    def __call__(self, x):
        wsc = jax.lax.with_sharding_constraint if self.use_jax_lax else with_sharding_constraint
        x = wsc(x, P("batch"))
        x = nn.Dense(self.features, kernel_init=shard_axes("data", "model"))(x)
        return nn.relu(x)


AXIS_MAP = (("batch", "x"), ("data", "x"), ("model", "y"))


def mlp_loss(layers, x):
    """The two-block pipeline's loss on one device, from a list of (kernel, bias)."""
    h = x.astype(jnp.float32)
    for kernel, bias in layers:
        h = jax.nn.relu(h @ kernel + bias)
    return (h * h).sum()


def unbox(tree):
    return jax.tree.map(
        lambda v: v.unbox() if isinstance(v, nn.Partitioned) else v,
        tree,
        is_leaf=lambda v: isinstance(v, nn.Partitioned),
    )


def host(tree):
    return jax.tree.map(np.asarray, unbox(tree))
