"""A small reference GPT (decoder-only transformer) built from ``mmnnx.modules``."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from mmnnx.modules import (
    Embed,
    Linear,
    RopeScaling,
    RouterStats,
    TransformerBlock,
    constrain,
    make_norm,
)
from mmnnx.modules.moe import check_moe_args

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

    A mixture of experts (Qwen3-MoE's knobs): ``experts > 0`` (``num_experts``) makes the
    feed-forward of layer ``i`` a ``MoE`` of that many SwiGLU experts of hidden size
    ``expert_hidden`` (``moe_intermediate_size``; default the MLP's), each token routed to
    ``experts_per_token`` (``num_experts_per_tok``) of them, when ``(i + 1) % moe_every == 0``
    (``decoder_sparse_step``) and ``i`` is not in ``dense_layers`` (``mlp_only_layers``);
    ``norm_topk_prob`` and ``capacity_factor`` (None: dropless) as ``MoE`` takes them.
    ``GPT.loss`` adds ``router_aux_loss_coef`` times the load-balancing loss of the routers of
    every MoE layer pooled (Hugging Face's ``load_balancing_loss_func`` over their concatenated
    logits) and ``router_z_loss_coef`` times their mean router z-loss. Stacked layers
    (``scan_layers``) must all be alike: all MoE, or none.

    Example:
        >>> GPTConfig(depth=2, dim=64).num_heads
        4
        >>> GPTConfig(dim=32, num_heads=4, head_dim=16, qk_norm=True).head_dim
        16
        >>> [GPTConfig(depth=4, experts=8, moe_every=2).is_moe(i) for i in range(4)]
        [False, True, False, True]
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
    experts: int = 0
    experts_per_token: int = 2
    expert_hidden: int | None = None
    moe_every: int = 1
    dense_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True
    capacity_factor: float | None = None
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0

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
        for name in ("qk_norm", "mlp_bias", "norm_topk_prob"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be a bool, got {getattr(self, name)!r}")
        self._check_experts()

    def _check_experts(self) -> None:
        if not _is_int(self.experts, minimum=0):
            raise ValueError(f"GPTConfig.experts must be an int >= 0, got {self.experts!r}")
        if self.experts:
            check_moe_args(self.experts, self.experts_per_token, self.capacity_factor, "GPTConfig")
        for name in ("expert_hidden",):
            value = getattr(self, name)
            if value is not None and not _is_int(value, minimum=1):
                raise ValueError(f"GPTConfig.{name} must be None or an int >= 1, got {value!r}")
        if not _is_int(self.moe_every, minimum=1):
            raise ValueError(f"GPTConfig.moe_every must be an int >= 1, got {self.moe_every!r}")
        dense = self.dense_layers
        if not isinstance(dense, tuple) or not all(
            _is_int(i, minimum=0) and i < self.depth for i in dense
        ):
            raise ValueError(
                f"GPTConfig.dense_layers must be a tuple of layer indices in 0..{self.depth - 1}, "
                f"got {dense!r}"
            )
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            if not (_is_positive(value) or (isinstance(value, numbers.Real) and value == 0)):
                raise ValueError(f"GPTConfig.{name} must be a finite number >= 0, got {value!r}")
        moe = {self.is_moe(i) for i in range(self.depth)}
        if self.scan_layers and len(moe) > 1:
            raise ValueError(
                "GPTConfig: scan_layers stacks alike layers, but with experts="
                f"{self.experts}, moe_every={self.moe_every} and dense_layers={dense} some "
                "layers are MoE and some dense; use moe_every=1 and no dense_layers, or "
                "scan_layers=False"
            )

    def is_moe(self, layer: int) -> bool:
        """Whether layer ``layer``'s feed-forward is a ``MoE`` (Qwen3-MoE's rule)."""
        return (
            self.experts > 0
            and layer not in self.dense_layers
            and (layer + 1) % self.moe_every == 0
        )


class GPT(nnx.Module):
    """Token embedding, ``depth`` pre-norm ``TransformerBlock``s, a final norm and a head.

    Attributes: ``embed`` (``Embed``), ``blocks`` (an ``nnx.List`` of ``TransformerBlock``; with
    ``config.scan_layers``, one ``TransformerBlock`` whose Variables have a leading ``depth``
    axis), ``norm``, and ``head`` (a ``Linear`` named ``("embed", "vocab")``; absent with
    ``tie_embeddings``, where ``embed.attend`` makes the logits). ``model(tokens)`` returns
    logits; ``model.loss(batch)`` is the next-token cross-entropy of a ``(B, T + 1)`` batch,
    plus the routers' losses with experts (``model.forward(tokens)`` returns the logits and
    every MoE layer's ``RouterStats`` merged).
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

        def block(rngs: nnx.Rngs, moe: bool) -> TransformerBlock:
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
                experts=c.experts if moe else 0,
                experts_per_token=c.experts_per_token,
                expert_hidden=c.expert_hidden,
                norm_topk_prob=c.norm_topk_prob,
                capacity_factor=c.capacity_factor,
                param_dtype=c.param_dtype,
                rngs=rngs,
            )

        if c.scan_layers:
            stacked = functools.partial(block, moe=c.is_moe(0))
            self.blocks = nnx.split_rngs(splits=c.depth)(nnx.vmap(stacked, in_axes=0))(rngs)
        else:
            self.blocks = nnx.List([block(rngs, c.is_moe(i)) for i in range(c.depth)])
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
        return self.forward(tokens)[0]

    def forward(self, tokens: jax.Array) -> tuple[jax.Array, RouterStats | None]:
        """The logits of ``tokens`` ``(batch, seq)`` and the ``RouterStats`` of every MoE layer
        merged (``None`` without experts)."""
        if tokens.ndim != 2 or tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"GPT: tokens must have shape (batch, seq) with seq <= max_seq_len "
                f"{self.config.max_seq_len}, got {tokens.shape}"
            )
        c = self.config
        x = self.embed(constrain(tokens, ("batch", "seq"))).astype(c.dtype)
        stats = RouterStats.zeros(c.experts) if c.experts else None
        if c.scan_layers:
            scan = nnx.scan(_apply_block, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            x, stats = scan((x, stats), self.blocks)
        else:
            for block in self.blocks:
                x, layer = block.forward(x)
                if layer is not None:
                    stats = stats.merge(layer)
        x = self.norm(x)
        logits = self.embed.attend(x) if c.tie_embeddings else self.head(x)
        return logits, stats

    def loss(self, batch: jax.Array) -> jax.Array:
        """Mean next-token cross-entropy of ``batch`` ``(B, T + 1)`` over its ``B * T`` targets.

        The inputs are ``batch[:, :-1]`` and the targets ``batch[:, 1:]``. A model with experts
        adds its routers' losses (``config.router_aux_loss_coef`` and ``router_z_loss_coef``
        times the ``aux_loss`` and ``z_loss`` of every MoE layer's ``RouterStats`` merged).

        Example:
            >>> with nnx.use_eager_sharding(False):
            ...     model = GPT(GPTConfig(dim=32, depth=1, vocab_size=64), rngs=nnx.Rngs(0))
            >>> loss = model.loss(jnp.ones((2, 5), dtype=jnp.int32))
            >>> bool(abs(loss - jnp.log(64)) < 0.5)  # about log(vocab) at initialisation
            True
        """
        batch = constrain(batch, ("batch", "seq"))
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits, stats = self.forward(inputs)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        loss = jnp.mean(nll)
        if stats is not None:
            c = self.config
            loss = loss + stats.loss(c.router_aux_loss_coef, c.router_z_loss_coef)
        return loss

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


def _apply_block(
    carry: tuple[jax.Array, RouterStats | None], block: TransformerBlock
) -> tuple[jax.Array, RouterStats | None]:
    x, stats = carry
    x, layer = block.forward(x)
    return x, stats if layer is None else stats.merge(layer)


def _is_int(value: object, *, minimum: int) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum


def _is_positive(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < value < math.inf
