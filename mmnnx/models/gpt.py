"""A small reference GPT (decoder-only transformer) built from ``mmnnx.modules``."""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from mmnnx.modules import Embed, Linear, RopeScaling, TransformerBlock, constrain, make_norm

DTYPES = ("float32", "bfloat16")  # of the computation (dtype) and of the Variables


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of a ``GPT``; the defaults are a byte-level model of about 0.86M parameters.

    ``num_kv_heads`` (default ``num_heads``) enables grouped-query attention, ``gated_mlp`` a
    SiLU-gated MLP, ``tie_embeddings`` an output head that reuses the embedding table, and
    ``norm`` is ``"rms"`` or ``"layer"``. Positions are rotary (RoPE); ``max_seq_len`` bounds
    the input length. ``scan_layers`` stacks the blocks (``nnx.vmap``) and runs them with
    ``nnx.scan``: tracing and compiling cost one block, not ``depth``. ``dropout`` is the
    residual dropout rate of every block (0: none). ``dtype`` is the compute dtype
    (``"float32"`` or ``"bfloat16"``): activations and matmuls run in it while the parameters
    (and so the optimizer state) stay in ``param_dtype`` (float32 by default); norms, softmax
    and the loss compute in float32.

    The knobs of Llama 3.x and Qwen3 checkpoints (their defaults keep the model above):
    ``head_dim`` (default ``dim // num_heads``; any even size, the attention's width being
    ``num_heads * head_dim``), ``qk_norm`` (an ``RMSNorm`` over ``head_dim`` on each head of the
    queries and keys, before RoPE), ``rope_theta`` (RoPE's base), ``rope_scaling`` (Llama 3.1's
    ``RopeScaling``), ``norm_eps`` (the epsilon of every norm; ``None``: each norm's own, 1e-6
    for RMSNorm and the q/k norms, 1e-5 for LayerNorm), ``mlp_hidden`` (the MLP's hidden size,
    Hugging Face's ``intermediate_size``; default ``int(mlp_ratio * dim)``), ``mlp_bias`` (MLP
    biases; Llama and Qwen3 have none) and ``param_dtype`` (``"float32"`` or ``"bfloat16"``:
    the dtype every Variable is created in).

    Example:
        >>> GPTConfig(depth=2, dim=64).num_heads
        4
        >>> GPTConfig(dim=32, num_heads=4, head_dim=16, qk_norm=True).head_dim
        16
    """

    vocab_size: int = 256
    dim: int = 128
    depth: int = 4
    num_heads: int = 4
    num_kv_heads: int | None = None
    mlp_ratio: float = 4
    gated_mlp: bool = False
    max_seq_len: int = 128
    tie_embeddings: bool = False
    norm: str = "rms"
    scan_layers: bool = False
    dropout: float = 0.0
    dtype: str = "float32"
    head_dim: int | None = None
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float | None = None
    mlp_hidden: int | None = None
    mlp_bias: bool = True
    param_dtype: str = "float32"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"GPTConfig.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.param_dtype not in DTYPES:
            raise ValueError(
                f"GPTConfig.param_dtype must be 'float32' or 'bfloat16', got {self.param_dtype!r}"
            )
        for name in ("head_dim", "mlp_hidden"):
            value = getattr(self, name)
            if value is not None and not _is_int(value, minimum=1):
                raise ValueError(f"GPTConfig.{name} must be None or an int >= 1, got {value!r}")
        if self.head_dim is not None and self.head_dim % 2:
            raise ValueError(
                f"GPTConfig.head_dim must be even (RoPE rotates pairs of features), "
                f"got {self.head_dim}"
            )
        if not _is_positive(self.rope_theta):
            raise ValueError(
                f"GPTConfig.rope_theta must be a finite number > 0, got {self.rope_theta!r}"
            )
        if self.norm_eps is not None and not _is_positive(self.norm_eps):
            raise ValueError(
                f"GPTConfig.norm_eps must be None or a finite number > 0, got {self.norm_eps!r}"
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"GPTConfig.rope_scaling must be None or a mmnnx.modules.RopeScaling, got "
                f"{self.rope_scaling!r}"
            )
        for name in ("qk_norm", "mlp_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be a bool, got {getattr(self, name)!r}")


class GPT(nnx.Module):
    """Token embedding, ``depth`` pre-norm ``TransformerBlock``s, a final norm and a head.

    Attributes: ``embed`` (``Embed``), ``blocks`` (an ``nnx.List`` of ``TransformerBlock``; with
    ``config.scan_layers``, one ``TransformerBlock`` whose Variables have a leading ``depth``
    axis), ``norm``, and ``head`` (a ``Linear`` named ``("embed", "vocab")``; absent with
    ``tie_embeddings``, where ``embed.attend`` makes the logits). ``model(tokens)`` returns
    logits; ``model.loss(batch)`` is the next-token cross-entropy of a ``(B, T + 1)`` batch.
    ``mmnnx.models.stage_rules(model, tasks)`` cuts it into pipeline stages (stacked blocks
    are split over the tasks).

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=32, depth=2, vocab_size=64), rngs=nnx.Rngs(0))
        >>> batch = jnp.zeros((2, 9), dtype=jnp.int32)
        >>> model(batch[:, :-1]).shape, model.loss(batch).shape
        ((2, 8, 64), ())
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.config = config
        c = config
        self.embed = Embed(c.vocab_size, c.dim, param_dtype=c.param_dtype, rngs=rngs)

        def block(rngs: nnx.Rngs) -> TransformerBlock:
            return TransformerBlock(
                c.dim,
                c.num_heads,
                num_kv_heads=c.num_kv_heads,
                head_dim=c.head_dim,
                mlp_ratio=c.mlp_ratio,
                mlp_hidden=c.mlp_hidden,
                mlp_bias=c.mlp_bias,
                gated_mlp=c.gated_mlp,
                norm=c.norm,
                norm_eps=c.norm_eps,
                rope_base=c.rope_theta,
                rope_scaling=c.rope_scaling,
                qk_norm=c.qk_norm,
                dropout=c.dropout,
                param_dtype=c.param_dtype,
                rngs=rngs,
            )

        if c.scan_layers:
            self.blocks = nnx.split_rngs(splits=c.depth)(nnx.vmap(block, in_axes=0))(rngs)
        else:
            self.blocks = nnx.List([block(rngs) for _ in range(c.depth)])
        self.norm = make_norm(c.norm, c.dim, eps=c.norm_eps, param_dtype=c.param_dtype)
        if not c.tie_embeddings:
            self.head = Linear(
                c.dim,
                c.vocab_size,
                axes=("embed", "vocab"),
                use_bias=False,
                param_dtype=c.param_dtype,
                rngs=rngs,
            )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if tokens.ndim != 2 or tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"GPT: tokens must have shape (batch, seq) with seq <= max_seq_len "
                f"{self.config.max_seq_len}, got {tokens.shape}"
            )
        x = self.embed(constrain(tokens, ("batch", "seq"))).astype(self.config.dtype)
        if self.config.scan_layers:
            x = nnx.scan(_apply_block, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.blocks)
        else:
            for block in self.blocks:
                x = block(x)
        x = self.norm(x)
        return self.embed.attend(x) if self.config.tie_embeddings else self.head(x)

    def loss(self, batch: jax.Array) -> jax.Array:
        """Mean next-token cross-entropy of ``batch`` ``(B, T + 1)`` over its ``B * T`` targets.

        The inputs are ``batch[:, :-1]`` and the targets ``batch[:, 1:]``.

        Example:
            >>> with nnx.use_eager_sharding(False):
            ...     model = GPT(GPTConfig(dim=32, depth=1, vocab_size=64), rngs=nnx.Rngs(0))
            >>> loss = model.loss(jnp.ones((2, 5), dtype=jnp.int32))
            >>> bool(abs(loss - jnp.log(64)) < 0.5)  # about log(vocab) at initialisation
            True
        """
        batch = constrain(batch, ("batch", "seq"))
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self(inputs).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return jnp.mean(nll)

    def generate(
        self,
        prompt: jax.Array,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        rng: jax.Array | None = None,
    ) -> jax.Array:
        """The next ``max_new_tokens`` tokens after ``prompt`` (``(seq,)`` or ``(batch, seq)``
        ids), ``(batch, max_new_tokens)``: greedy with ``temperature`` 0, else sampled (from the
        ``top_k`` most likely when given, keys from ``rng``), with a key/value cache. Placed on
        tasks (``mm.init``), each step runs with ``mm.jit``, each stage on its own submesh. See
        ``mmnnx.models.decoding.generate``.

        Example:
            >>> with nnx.use_eager_sharding(False):
            ...     model = GPT(GPTConfig(dim=32, depth=1, vocab_size=64), rngs=nnx.Rngs(0))
            >>> model.generate(jnp.array([5, 6]), 3).shape
            (1, 3)
        """
        from mmnnx.models.decoding import generate  # noqa: PLC0415  (it runs GPTs: no cycle)

        return generate(self, prompt, max_new_tokens, temperature=temperature, top_k=top_k, rng=rng)


def _apply_block(x: jax.Array, block: TransformerBlock) -> jax.Array:
    return block(x)


def _is_int(value: object, *, minimum: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def _is_positive(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < value < math.inf
