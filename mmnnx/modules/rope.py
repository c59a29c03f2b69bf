"""Rotary position embeddings (RoPE), half-split layout, with linear, Llama 3's or YaRN's
scaling."""

from __future__ import annotations

import dataclasses
import math
from math import inf

import jax
import jax.numpy as jnp
import numpy as np

from mmnnx.modules.checks import check, is_int, is_positive


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1+'s RoPE frequency scaling (``rope_type: "llama3"``; see ``rope_frequencies``).

    Example:
        >>> RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        ...             original_max_position_embeddings=8192).factor
        8.0
    """

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            check(is_positive(value), f"RopeScaling.{name}", "a finite number > 0", value)
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"RopeScaling.high_freq_factor ({self.high_freq_factor}) must be greater than "
                f"low_freq_factor ({self.low_freq_factor})"
            )
        original = self.original_max_position_embeddings
        where = "RopeScaling.original_max_position_embeddings"
        check(is_int(original, minimum=1), where, "an int >= 1", original)


@dataclasses.dataclass(frozen=True)
class LinearScaling:
    """Linear RoPE scaling (``rope_type: "linear"``): every inverse frequency divided by ``factor``.

    Example:
        >>> rope_frequencies(4, base=100.0, scaling=LinearScaling(factor=2.0))
        array([0.5 , 0.05], dtype=float32)
    """

    factor: float

    def __post_init__(self):
        check(is_positive(self.factor), "LinearScaling.factor", "a finite number > 0", self.factor)


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN's RoPE scaling (``rope_type: "yarn"``), as transformers' ``_compute_yarn_parameters``:
    frequencies ramped between ``inv_freq`` and ``inv_freq / factor``, cosines and sines scaled by
    :attr:`attention_scale`.

    Example:
        >>> YarnScaling(factor=4.0, original_max_position_embeddings=8).attention_scale
        1.138629436111989
    """

    factor: float
    original_max_position_embeddings: int
    beta_fast: float | None = None  # None: 32, as absent from a config.json
    beta_slow: float | None = None  # None: 1
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None  # None: True

    def __post_init__(self):
        check(is_positive(self.factor), "YarnScaling.factor", "a finite number > 0", self.factor)
        original = self.original_max_position_embeddings
        where = "YarnScaling.original_max_position_embeddings"
        check(is_int(original, minimum=1), where, "an int >= 1", original)

    @property
    def attention_scale(self) -> float:
        """``attention_factor``, else ``0.1 ln(factor) + 1`` (a ratio of two with ``mscale``)."""
        if self.attention_factor is not None:
            return self.attention_factor

        def scale(m: float = 1.0) -> float:
            return 1.0 if self.factor <= 1 else 0.1 * m * math.log(self.factor) + 1.0

        if self.mscale and self.mscale_all_dim:
            return scale(self.mscale) / scale(self.mscale_all_dim)
        return scale()

    def frequencies(self, head_dim: int, base: float) -> np.ndarray:
        """The ``head_dim // 2`` inverse frequencies, float32."""
        extrapolated = rope_frequencies(head_dim, base)
        original = self.original_max_position_embeddings

        def dim(rotations: float) -> float:
            turns = original / (rotations * 2 * math.pi)
            return head_dim * math.log(turns) / (2 * math.log(base))

        low, high = dim(self.beta_fast or 32.0), dim(self.beta_slow or 1.0)
        if self.truncate is not False:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        high = high + 0.001 if low == high else high
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        kept = 1 - ramp  # the share of the extrapolated frequency
        return (extrapolated / self.factor * (1 - kept) + extrapolated * kept).astype(np.float32)


Scaling = LinearScaling | RopeScaling | YarnScaling
"""The RoPE frequency scalings mmnnx computes."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE as an ``Attention`` applies it: base ``theta`` and an optional frequency ``scaling``.

    Example:
        >>> RopeConfig(theta=0)
        Traceback (most recent call last):
        ...
        ValueError: RopeConfig.theta must be a finite number > 0, got 0
    """

    theta: float = 10000.0
    scaling: Scaling | None = None

    def __post_init__(self):
        check(is_positive(self.theta), "RopeConfig.theta", "a finite number > 0", self.theta)
        ok = self.scaling is None or isinstance(self.scaling, Scaling)
        where = "None, a mmnnx.modules.RopeScaling or YarnScaling, or a LinearScaling"
        check(ok, "RopeConfig.scaling", where, self.scaling)


def rope_frequencies(
    head_dim: int, base: float = 10000.0, scaling: Scaling | None = None
) -> np.ndarray:
    """The ``head_dim // 2`` inverse frequencies of RoPE, float32, as transformers computes them
    (``_compute_default_rope_parameters``, then ``scaling``'s), as a NumPy constant.

    Example:
        >>> rope_frequencies(4, base=100.0)
        array([1. , 0.1], dtype=float32)
    """
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"rope_frequencies: head_dim must be even and >= 2, got {head_dim}")
    if not 0 < base < inf:
        raise ValueError(f"rope_frequencies: base must be a finite number > 0, got {base}")
    if isinstance(scaling, YarnScaling):
        return scaling.frequencies(head_dim, base)
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = np.float32(1.0) / (np.float32(base) ** exponents)
    if scaling is None:
        return inv_freq
    if isinstance(scaling, LinearScaling):  # a Python float: the division stays float32
        return (inv_freq / scaling.factor).astype(np.float32)
    # Python scalars, as in transformers: NumPy keeps them weak, so every operation is float32
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    original = scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(
    x: jax.Array,
    positions: jax.Array | None = None,
    *,
    base: float = 10000.0,
    scaling: Scaling | None = None,
) -> jax.Array:
    """Rotates ``x`` ``(..., seq, heads, head_dim)`` by ``positions`` (default ``0 .. seq - 1``):
    features ``i`` and ``i + head_dim // 2`` turned by ``position * rope_frequencies(...)[i]``
    (Hugging Face's rotate-half layout), in float32, cast back to ``x``'s dtype.

    Example:
        >>> x = jnp.ones((1, 3, 2, 4))  # batch, seq, heads, head_dim
        >>> y = apply_rope(x)
        >>> y.shape, bool(jnp.allclose(y[:, 0], x[:, 0]))  # position 0 is not rotated
        ((1, 3, 2, 4), True)
    """
    seq, head_dim = x.shape[-3], x.shape[-1]
    if head_dim % 2:
        raise ValueError(f"apply_rope: head_dim must be even, got {head_dim}")
    half = head_dim // 2
    positions = jnp.arange(seq) if positions is None else positions
    inv_freq = rope_frequencies(head_dim, base, scaling)
    angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq  # (..., seq, half)
    scale = np.float32(getattr(scaling, "attention_scale", 1.0))  # YaRN's
    cos = (jnp.cos(angles) * scale)[..., None, :].astype(x.dtype)  # broadcast over heads
    sin = (jnp.sin(angles) * scale)[..., None, :].astype(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
