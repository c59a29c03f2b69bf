"""Comparisons against the single-device oracle, shared by the engine tests."""

import jax
import numpy as np
from flax import nnx


def close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


def trees_close(a, b):
    """Every leaf of ``a`` close to the same leaf of ``b``."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        close(x, y)


def close_to_max(a, b):
    """Each leaf of ``a`` equal to ``b``'s to 1e-5 of ``b``'s largest magnitude (and 1e-8: a
    leaf of one small element, a scale's gradient, is held to rounding noise, not below it)."""
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5 * np.abs(y).max() + 1e-8)


def params_close(model, ref, ref_grads, steps, lr):
    """Parameters after ``steps`` Adam steps against the oracle's.

    Adam turns a gradient at rounding noise into a full +-lr step, and a gradient near its
    epsilon (1e-8) into a step that follows the gradient's rounding: elements whose first
    gradient is nonzero but below 1e-5 of their array's largest, or below 1e-6, are held to
    ``steps`` x ``lr``; every other element (exact zeros included) to 1e-5 relative.
    """
    noise = [
        (g != 0) & ((np.abs(g) < 1e-5 * np.abs(g).max()) | (np.abs(g) < 1e-6))
        for g in map(np.asarray, jax.tree.leaves(ref_grads))
    ]
    pairs = zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)),
        jax.tree.leaves(nnx.state(ref, nnx.Param)),
        noise,
        strict=True,
    )
    for a, b, is_noise in pairs:
        a, b = np.asarray(a), np.asarray(b)
        close(a[~is_noise], b[~is_noise])
        np.testing.assert_allclose(a[is_noise], b[is_noise], atol=steps * lr)
