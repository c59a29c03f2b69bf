"""A small reference GPT (decoder-only transformer) built from ``mmnnx.modules``."""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from mmnnx.modules import (
    AttentionConfig,
    BlockConfig,
    DeepSeekMoEConfig,
    Embed,
    Linear,
    MLPConfig,
    MoEConfig,
    NormConfig,
    Packing,
    RopeConfig,
    RopeScaling,
    RouterStats,
    TransformerBlock,
    constrain,
)
from mmnnx.modules.checks import check, is_int, is_positive

REMAT = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}
"""``GPTConfig.remat``'s policies: what each block's forward keeps for its backward (``nnx.remat``
recomputes the rest there): everything, only the block's input, its matmuls' outputs, or those
in host memory."""
DTYPES = ("float32", "bfloat16")  # of the computation (dtype) and of the Variables
PER_LAYER = (
    *("mlp_ratio", "gated_mlp", "dropout", "head_dim", "qk_norm", "rope_theta", "rope_scaling"),
    *("mlp_hidden", "mlp_bias", "experts", "experts_per_token", "expert_hidden", "moe_every"),
    *("dense_layers", "norm_topk_prob", "capacity_factor"),
)
"""The knobs of ``GPTConfig`` from which ``block_configs`` derives every layer's
``BlockConfig``, left out (``None``) when ``layers`` gives them."""


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Sizes of a ``GPT``; the defaults are a byte-level model of about 0.86M parameters.

    ``layers`` gives each layer's ``BlockConfig`` (nested component configs, as the pretrained
    families map a ``config.json``); without it, ``block_configs`` derives one for every layer
    from the flat knobs (the scratch model's, those ``mmnnx train`` sets): ``AttentionConfig``
    (``num_heads``, ``num_kv_heads``, ``head_dim``, ``qk_norm``, its eps ``norm_eps`` or 1e-6)
    with ``RopeConfig`` (``rope_theta``, ``rope_scaling``), ``NormConfig`` (``norm``,
    ``norm_eps``), the residual ``dropout``, and ``MLPConfig`` (``mlp_hidden``, default
    ``int(mlp_ratio * dim)``; ``gated_mlp``, ``mlp_bias``) or, with ``experts > 0``, in layer
    ``i`` when ``(i + 1) % moe_every == 0`` and ``i`` is not in ``dense_layers`` (Qwen3-MoE's
    rule), ``MoEConfig`` (``expert_hidden``, default the MLP's; ``experts``,
    ``experts_per_token``, ``norm_topk_prob``, ``capacity_factor``). ``num_heads`` and
    ``num_kv_heads`` are the model's head counts either way (with ``layers``, those of their
    ``AttentionConfig``s).

    The rest is the model's: the output's ``norm`` (``"rms"`` or ``"layer"``, epsilon
    ``norm_eps``; default the norm's own); ``tie_embeddings`` (the head reuses the embedding
    table); ``max_seq_len`` (bounds the input length); ``scan_layers`` (the layers cut into
    ``segments``, runs of a repeated period of layers (:func:`layer_segments`: all alike, one
    segment of period 1; Gemma 3's ``[5 sliding, 1 global] * k``, one of period 6; DeepSeek-V3's
    dense layers then MoE ones, two), each segment's period stacked with ``nnx.vmap`` over its
    repetitions and run with ``nnx.scan``, a layer starting no repetition unrolled: tracing and
    compiling cost one period per segment, not ``depth`` layers; refused where no layer
    repeats); ``dtype`` (of activations and matmuls; norms, softmax and the loss are
    float32) and ``param_dtype`` (of every Variable), ``"float32"`` or ``"bfloat16"``; ``remat``
    (a key of :data:`REMAT`: ``"full"`` recomputes each block's forward in its backward, keeping
    only its input; the same numbers with less memory);
    ``GPT.loss`` adds ``router_aux_loss_coef`` times the load-balancing loss of every MoE
    layer's router pooled (Hugging Face's ``load_balancing_loss_func``) and
    ``router_z_loss_coef`` times their mean z-loss, and ``router_seq_aux_loss_coef`` times
    DeepSeek-V3's sequence-wise balance loss of each layer (``RouterStats.seq_balance``, summed
    over the layers, each a mean over the batch's rows); ``router_bias_rate`` (DeepSeek-V3's
    auxiliary-loss-free balancing, for ``DeepSeekMoE`` layers) is how far a train step
    (``mmnnx.train.make_steps``) moves each router's correction bias per expert, towards the
    experts that got fewer than the mean assignments (``balance_router_biases``).

    ``final_norm`` (a ``NormConfig``; ``None``: that of ``norm`` and ``norm_eps``) builds the
    output's norm, e.g. Gemma's ``(1 + weight)`` RMSNorm; ``embed_scale`` multiplies the
    embeddings, in the table's dtype (Gemma's ``sqrt(dim)``; ``None``: not scaled).

    Example:
        >>> block = GPTConfig(dim=32, num_heads=4, head_dim=16, qk_norm=True).block_configs[0]
        >>> block.attention.head_dim, block.attention.qk_norm, block.attention.rope
        (16, True, RopeConfig(theta=10000.0, scaling=None))
        >>> [type(b.feed_forward).__name__ for b in GPTConfig(experts=8, moe_every=2).block_configs]
        ['MLPConfig', 'MoEConfig', 'MLPConfig', 'MoEConfig']
        >>> layer = BlockConfig(AttentionConfig(num_heads=2), MLPConfig(64, gated=True))
        >>> GPTConfig(dim=32, depth=2, num_heads=2, layers=(layer, layer)).block_configs[1] == layer
        True
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
    layers: tuple[BlockConfig, ...] | None = None
    remat: str = "none"
    final_norm: NormConfig | None = None
    embed_scale: float | None = None
    router_bias_rate: float = 0.0
    router_seq_aux_loss_coef: float = 0.0

    def __post_init__(self):
        check(self.remat in REMAT, "GPTConfig.remat", f"one of {', '.join(REMAT)}", self.remat)
        final = self.final_norm
        ok = final is None or isinstance(final, NormConfig)
        check(ok, "GPTConfig.final_norm", "None or a NormConfig", final)
        scale = self.embed_scale
        check(scale is None or is_positive(scale), "GPTConfig.embed_scale", "None or > 0", scale)
        for name in ("vocab_size", "dim", "depth", "max_seq_len"):
            value = getattr(self, name)
            check(is_int(value, 1), f"GPTConfig.{name}", "an int >= 1", value)
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            check(value in DTYPES, f"GPTConfig.{name}", "'float32' or 'bfloat16'", value)
        coefs = ("router_aux_loss_coef", "router_z_loss_coef", "router_seq_aux_loss_coef")
        for name in (*coefs, "router_bias_rate"):
            value = getattr(self, name)
            ok = is_positive(value) or (isinstance(value, numbers.Real) and value == 0)
            check(ok, f"GPTConfig.{name}", "a finite number >= 0", value)
        if self.layers is None:
            check(is_int(self.experts), "GPTConfig.experts", "an int >= 0", self.experts)
            check(is_int(self.moe_every, 1), "GPTConfig.moe_every", "an int >= 1", self.moe_every)
            dense = self.dense_layers
            ok = isinstance(dense, tuple) and all(is_int(i) and i < self.depth for i in dense)
            where = f"a tuple of layer indices in 0..{self.depth - 1}"
            check(ok, "GPTConfig.dense_layers", where, dense)
        else:
            layers, depth = self.layers, self.depth
            ok = isinstance(layers, tuple) and all(isinstance(b, BlockConfig) for b in layers)
            where = f"None or a tuple of depth ({depth}) BlockConfigs"
            check(ok and len(layers) == depth, "GPTConfig.layers", where, layers)
            given = [k for k in PER_LAYER if getattr(self, k) not in (None, getattr(GPTConfig, k))]
            if given:
                raise ValueError(f"GPTConfig: layers= sets every layer; leave out {given}")
            for name in PER_LAYER:  # no default to read as if it were the layers' (rope_theta)
                object.__setattr__(self, name, None)
            ours = (self.num_heads, self.num_kv_heads or self.num_heads)
            attention = [b.attention for b in layers if isinstance(b.attention, AttentionConfig)]
            theirs = sorted({(a.num_heads, a.num_kv_heads or a.num_heads) for a in attention})
            if theirs not in ([], [ours]):
                raise ValueError(
                    f"GPTConfig: num_heads, num_kv_heads {ours} are not the layers' {theirs}"
                )
        try:
            NormConfig(self.norm, self.norm_eps)
            blocks = self.block_configs
        except ValueError as e:
            raise ValueError(f"GPTConfig: {e}") from None
        if self.router_bias_rate and not any(
            isinstance(b.feed_forward, DeepSeekMoEConfig) for b in blocks
        ):
            raise ValueError(
                "GPTConfig: router_bias_rate moves the correction biases of DeepSeekMoE layers "
                "(DeepSeekMoEConfig), and this model has none"
            )
        if self.scan_layers and len(blocks) > 1 and all(g.repeats == 1 for g in self.segments):
            moe = {isinstance(b.feed_forward, MoEConfig) for b in blocks}
            differ = "some layers are MoE and some dense" if len(moe) > 1 else "layers differ"
            raise ValueError(
                f"GPTConfig: scan_layers scans runs of a repeated period of layers, but {differ} "
                f"and no run of these {len(blocks)} layers repeats; scan_layers=False"
            )

    @property
    def output_norm(self) -> NormConfig:
        """The output norm's config: ``final_norm``, else that of ``norm`` and ``norm_eps``,
        e.g. ``GPTConfig(norm_eps=1e-5).output_norm.eps``."""
        return self.final_norm or NormConfig(self.norm, self.norm_eps)

    @functools.cached_property
    def block_configs(self) -> tuple[BlockConfig, ...]:
        """Every layer's ``BlockConfig``: ``layers``, or those derived from the flat knobs (the
        one place that does), e.g. ``GPTConfig().block_configs[0].feed_forward.hidden``."""
        if self.layers is not None:
            return self.layers
        hidden = int(self.mlp_ratio * self.dim) if self.mlp_hidden is None else self.mlp_hidden
        dense = MLPConfig(hidden, gated=self.gated_mlp, bias=self.mlp_bias)
        moe = self.experts and MoEConfig(
            hidden if self.expert_hidden is None else self.expert_hidden,
            self.experts,
            self.experts_per_token,
            norm_topk_prob=self.norm_topk_prob,
            capacity_factor=self.capacity_factor,
        )
        attention = AttentionConfig(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            qk_norm=self.qk_norm,
            qk_norm_eps=1e-6 if self.norm_eps is None else self.norm_eps,
            rope=RopeConfig(self.rope_theta, self.rope_scaling),
        )
        norm = NormConfig(self.norm, self.norm_eps)
        block = BlockConfig(attention, dense, norm, dropout=self.dropout)
        layers = []
        for i in range(self.depth):
            sparse = moe and i not in self.dense_layers and (i + 1) % self.moe_every == 0
            layers.append(dataclasses.replace(block, feed_forward=moe) if sparse else block)
        return tuple(layers)

    @functools.cached_property
    def segments(self) -> tuple[Segment, ...]:
        """``block_configs`` cut into :class:`Segment` s (:func:`layer_segments`), e.g.
        ``GPTConfig(experts=8, moe_every=2).segments[0].repeats == 2``."""
        return layer_segments(self.block_configs)

    def layer_path(self, layer: int) -> tuple[str, int | None]:
        """The path of the module holding ``layer`` in ``GPT(self)`` and its index on that
        module's stacked layer axis (``None``: not stacked), as the checkpoint readers map it.

        Example:
            >>> dense = BlockConfig(AttentionConfig(2), MLPConfig(16))
            >>> moe = dataclasses.replace(dense, feed_forward=MoEConfig(16, 4, 2))
            >>> config = GPTConfig(dim=8, depth=4, num_heads=2, scan_layers=True,
            ...                    layers=(dense, moe, moe, moe))
            >>> [config.layer_path(i) for i in range(4)]
            [('blocks/0', None), ('blocks/1', 0), ('blocks/1', 1), ('blocks/1', 2)]
        """
        if not self.scan_layers:
            return f"blocks/{layer}", None
        segments = self.segments
        for s, g in enumerate(segments):
            if g.start <= layer < g.start + g.repeats * len(g.period):
                rep, position = divmod(layer - g.start, len(g.period))
                path = "blocks" if len(segments) == 1 else f"blocks/{s}"
                path += f"/layers/{position}" if len(g.period) > 1 else ""
                return path, rep if g.stacked(len(segments)) else None
        raise ValueError(f"GPTConfig.layer_path: no layer {layer} in a model of depth {self.depth}")


class Segment(NamedTuple):
    """Layers ``start ..`` of a model: the layers ``period`` repeated ``repeats`` times.

    Example:
        >>> Segment(start=1, period=("a", "b"), repeats=2).stacked(segments=2)
        True
    """

    start: int
    period: tuple[BlockConfig, ...]
    repeats: int

    def stacked(self, segments: int) -> bool:
        """Whether ``GPT`` stacks it (scanned): it repeats, or it is the model's only one."""
        return self.repeats > 1 or segments == 1


def layer_segments(blocks: Sequence[BlockConfig]) -> tuple[Segment, ...]:
    """``blocks`` cut into runs of a repeated period, from the first layer on, each run the
    longest a period starting there repeats (of those, the shortest period); a layer starting
    no repetition is a segment of its own (``repeats`` 1). ``GPT(scan_layers=True)`` stacks
    every repeated segment and scans it over its repetitions, the period's layers its body.

    Example:
        >>> [(g.start, "".join(g.period), g.repeats) for g in layer_segments("DMMM")]
        [(0, 'D', 1), (1, 'M', 3)]
        >>> [("".join(g.period), g.repeats) for g in layer_segments("SSGSSGS")]
        [('SSG', 2), ('S', 1)]
    """
    out, i, n = [], 0, len(blocks)
    while i < n:
        covered, period = 1, 1
        for p in range(1, (n - i) // 2 + 1):
            r = 1
            while blocks[i + r * p : i + (r + 1) * p] == blocks[i : i + p]:
                r += 1
            if r > 1 and r * p > covered:
                covered, period = r * p, p
        out.append(
            Segment(start=i, period=tuple(blocks[i : i + period]), repeats=covered // period)
        )
        i += covered
    return tuple(out)


class Period(nnx.Module):
    """One repetition of a :class:`Segment` of several layers: ``layers``, an ``nnx.Dict`` of
    ``TransformerBlock`` by position (``"0"``, ``"1"``, ...: paths ``layers/<j>/...``);
    ``GPT(scan_layers=True)`` stacks it over the repetitions. Not an ``nnx.List``: under
    ``nnx.capture`` (sown router metrics), Flax 0.12.8's ``nnx.scan`` fails on a list's
    integer keys beside the captures' string ones."""

    def __init__(
        self, configs: Sequence[BlockConfig], dim: int, *, param_dtype: str, rngs: nnx.Rngs
    ):
        self.layers = nnx.Dict(
            {
                str(j): b.build(dim, param_dtype=param_dtype, rngs=rngs)
                for j, b in enumerate(configs)
            }
        )

    def in_order(self) -> list[TransformerBlock]:
        """The layers, first to last."""
        positions = sorted((k for k in self.layers if k.isdigit()), key=int)  # not captures
        return [self.layers[k] for k in positions]


class GPT(nnx.Module):
    """Token embedding, ``depth`` pre-norm ``TransformerBlock``s, a final norm and a head.

    Attributes: ``embed`` (``Embed``), ``blocks`` (an ``nnx.List`` of ``TransformerBlock``; with
    ``config.scan_layers``, one module per segment of ``config.segments``: a stacked one's
    Variables have a leading axis of its repetitions, the module a ``TransformerBlock``, or a
    :class:`Period` of several (``blocks/layers/<j>/...``); an unrolled layer a
    ``TransformerBlock``; ``blocks`` the module itself where there is one segment, as with alike
    layers, else an ``nnx.List`` of them), ``norm``, and ``head`` (a ``Linear`` named
    ``("embed", "vocab")``; absent with ``tie_embeddings``, where ``embed.attend`` makes the
    logits). ``model(tokens)`` returns logits; ``model.loss(batch)`` is the next-token
    cross-entropy of a ``(B, T + 1)`` batch, plus the routers' losses with experts
    (``model.forward(tokens)`` returns the logits and every MoE layer's ``RouterStats`` merged).
    ``mmnnx.models.stage_rules(model, tasks)`` cuts it into pipeline stages (one stacked
    segment is split over the tasks, in equal chunks of its repetitions; of several segments,
    each goes whole on a task).

    Example:
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=32, depth=2, vocab_size=64), rngs=nnx.Rngs(0))
        >>> batch = jnp.zeros((2, 9), dtype=jnp.int32)
        >>> model(batch[:, :-1]).shape, model.loss(batch).shape
        ((2, 8, 64), ())
    """

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.config = c = config
        kw = dict(param_dtype=c.param_dtype, rngs=rngs)
        self.embed = Embed(c.vocab_size, c.dim, scale=c.embed_scale, **kw)
        if c.scan_layers:  # each repeated segment one module, its Variables stacked
            built = [_segment(g, c, len(c.segments), rngs) for g in c.segments]
            self.blocks = built[0] if len(built) == 1 else nnx.List(built)
        else:
            self.blocks = nnx.List([b.build(c.dim, **kw) for b in c.block_configs])
        self.norm = c.output_norm.build(c.dim, param_dtype=c.param_dtype)
        if not c.tie_embeddings:
            self.head = Linear(c.dim, c.vocab_size, axes=("embed", "vocab"), use_bias=False, **kw)

    def __call__(self, tokens: jax.Array, packing: Packing | None = None) -> jax.Array:
        return self.forward(tokens, packing)[0]

    def segments(self) -> list[tuple[nnx.Module, bool]]:
        """The modules that run the layers in order, each with whether it is stacked (scanned
        over its leading layer axis): one ``TransformerBlock`` per layer unscanned; scanned, one
        per :class:`Segment` (a ``TransformerBlock``, or a :class:`Period` of several).

        Example:
            >>> with nnx.use_eager_sharding(False):
            ...     model = GPT(GPTConfig(dim=32, depth=2, scan_layers=True), rngs=nnx.Rngs(0))
            >>> [(type(m).__name__, stacked) for m, stacked in model.segments()]
            [('TransformerBlock', True)]
        """
        c = self.config
        if not c.scan_layers:
            return [(block, False) for block in self.blocks]
        if len(c.segments) == 1:
            return [(self.blocks, True)]
        return [
            (m, g.stacked(len(c.segments))) for m, g in zip(self.blocks, c.segments, strict=True)
        ]

    def forward(
        self, tokens: jax.Array, packing: Packing | None = None
    ) -> tuple[jax.Array, RouterStats | None]:
        """The logits of ``tokens`` ``(batch, seq)`` and the ``RouterStats`` of every MoE layer
        merged (``None`` without experts); ``packing``: rows of several examples."""
        if tokens.ndim != 2 or tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"GPT: tokens must have shape (batch, seq) with seq <= max_seq_len "
                f"{self.config.max_seq_len}, got {tokens.shape}"
            )
        c = self.config
        x = self.embed(constrain(tokens, ("batch", "seq"))).astype(c.dtype)
        moe = [b.feed_forward for b in c.block_configs if isinstance(b.feed_forward, MoEConfig)]
        stats = RouterStats.zeros(moe[0].num_experts) if moe else None
        apply = (
            _apply_block if c.remat == "none" else nnx.remat(_apply_block, policy=REMAT[c.remat])
        )
        for layers, stacked in self.segments():
            if stacked:
                scan = nnx.scan(apply, in_axes=(nnx.Carry, 0, None), out_axes=nnx.Carry)
                x, stats = scan((x, stats), layers, packing)
            else:
                x, stats = apply((x, stats), layers, packing)
        x = self.norm(x)
        return (self.embed.attend(x) if c.tie_embeddings else self.head(x)), stats

    def loss(self, batch: jax.Array | Mapping[str, jax.Array]) -> jax.Array:
        """Mean next-token cross-entropy of ``batch`` ``(B, T + 1)`` over its ``B * T`` targets.

        The inputs are ``batch[:, :-1]`` and the targets ``batch[:, 1:]``. ``batch`` may be a
        dict of ``tokens`` (that array) and ``weights`` ``(B, T)``: the loss is then the mean
        over rows of each row's weighted sum, so weights of ``mask * B / mask.sum()`` (as
        ``mmnnx.train.examples.Rows.batch`` makes them for the whole global batch) give the
        mean over the masked targets, whatever the microbatches; with ``segments`` and ``positions``
        (``(B, T + 1)``, :class:`mmnnx.modules.Packing`), rows of several examples. A model
        with experts adds its routers' losses (``config.router_aux_loss_coef`` and
        ``router_z_loss_coef`` times the ``aux_loss`` and ``z_loss`` of every MoE layer's
        ``RouterStats`` merged).

        Example:
            >>> with nnx.use_eager_sharding(False):
            ...     model = GPT(GPTConfig(dim=32, depth=1, vocab_size=64), rngs=nnx.Rngs(0))
            >>> loss = model.loss(jnp.ones((2, 5), dtype=jnp.int32))
            >>> bool(abs(loss - jnp.log(64)) < 0.5)  # about log(vocab) at initialisation
            True
        """
        fields = batch if isinstance(batch, Mapping) else {"tokens": batch}
        logp, stats = self.next_token_log_probs(fields["tokens"], Packing.of(fields))
        nll = -logp
        weights = fields.get("weights")
        loss = jnp.mean(nll) if weights is None else jnp.mean(jnp.sum(weights * nll, axis=-1))
        if stats is not None:
            c = self.config
            coefs = (c.router_aux_loss_coef, c.router_z_loss_coef, c.router_seq_aux_loss_coef)
            loss = loss + stats.loss(*coefs)
        return loss

    def next_token_log_probs(
        self, tokens: jax.Array, packing: Packing | None = None
    ) -> tuple[jax.Array, RouterStats | None]:
        """The log-probability the model gives each next token of ``tokens`` ``(B, T + 1)``,
        float32 ``(B, T)`` (``tokens[:, :-1]`` the inputs), and the ``RouterStats`` of
        :meth:`forward`.

        Example:
            >>> with nnx.use_eager_sharding(False):
            ...     model = GPT(GPTConfig(dim=32, depth=1, vocab_size=64), rngs=nnx.Rngs(0))
            >>> model.next_token_log_probs(jnp.ones((2, 5), dtype=jnp.int32))[0].shape
            (2, 4)
        """
        tokens = constrain(tokens, ("batch", "seq"))
        logits, stats = self.forward(tokens[:, :-1], packing)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0], stats

    def generate(
        self,
        prompt: jax.Array,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        rng: jax.Array | None = None,
        stop: Sequence[int] = (),
    ) -> jax.Array:
        """The next ``max_new_tokens`` tokens after ``prompt`` (``(seq,)`` or ``(batch, seq)``
        ids), ``(batch, max_new_tokens)``: greedy with ``temperature`` 0, else sampled (from the
        ``top_k`` most likely when given, keys from ``rng``), with a key/value cache. Placed on
        tasks (``mm.init``), each step runs with ``mm.jit``, each stage on its own submesh.
        With ``stop`` ids (eos tokens), fewer columns where every row has generated one of them
        by then: decoding ends at that step. See ``mmnnx.models.decoding.generate``.

        Example:
            >>> with nnx.use_eager_sharding(False):
            ...     model = GPT(GPTConfig(dim=32, depth=1, vocab_size=64), rngs=nnx.Rngs(0))
            >>> model.generate(jnp.array([5, 6]), 3).shape
            (1, 3)
        """
        from mmnnx.models.decoding import generate  # noqa: PLC0415  (it runs GPTs: no cycle)

        options = {"temperature": temperature, "top_k": top_k, "rng": rng, "stop": stop}
        return generate(self, prompt, max_new_tokens, **options)


def _segment(segment: Segment, c: GPTConfig, segments: int, rngs: nnx.Rngs) -> nnx.Module:
    """The module of ``segment``: its layer (unstacked), or its period stacked over its
    repetitions (a ``TransformerBlock``, or a :class:`Period` of several)."""
    if len(segment.period) == 1:
        build = functools.partial(segment.period[0].build, c.dim, param_dtype=c.param_dtype)
    else:
        build = functools.partial(Period, segment.period, c.dim, param_dtype=c.param_dtype)
    if not segment.stacked(segments):
        return build(rngs=rngs)
    stacked = nnx.vmap(lambda rngs: build(rngs=rngs), in_axes=0)
    return nnx.split_rngs(splits=segment.repeats)(stacked)(rngs)


def _apply_block(
    carry: tuple[jax.Array, RouterStats | None],
    block: TransformerBlock | Period,
    packing: Packing | None,
) -> tuple[jax.Array, RouterStats | None]:
    if isinstance(block, Period):
        for layer in block.in_order():
            carry = _apply_block(carry, layer, packing)
        return carry
    x, stats = carry
    x, layer = block.forward(x, packing)
    return x, stats if layer is None else stats.merge(layer)
