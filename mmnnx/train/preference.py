"""Direct preference optimization (DPO, Rafailov et al. 2023) as TRL's ``DPOTrainer``
computes it, each pair in one row so that any microbatching keeps it whole; the policy and its
frozen reference trained as one module (:class:`PreferenceModel`) by ``fit``."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx

from mmnnx import _nnx
from mmnnx.modules import Packing

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")
METRICS += ("logps/chosen", "logps/rejected")
"""What :func:`dpo_loss` reports, by TRL's names; :class:`PreferenceModel` sows them."""


def pair_rows(pairs: list[tuple], length: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Preference pairs ``(prompt_ids, chosen_ids, rejected_ids)`` as rows of ``length``
    tokens, ``prompt + chosen`` then ``prompt + rejected`` packed in each (segments 1 and 2):
    ``tokens``, ``segments``, ``positions`` and the ``chosen`` and ``rejected`` masks
    ``(rows, length - 1)`` of the completions' predicted tokens.

    Example:
        >>> rows = pair_rows([([5, 6], [7], [8, 9])], length=8)
        >>> rows["tokens"].tolist(), rows["chosen"].astype(int).tolist()
        ([[5, 6, 7, 5, 6, 8, 9, 0]], [[0, 1, 0, 0, 0, 0, 0]])
    """
    shape = (len(pairs), length)
    rows = {k: np.zeros(shape, np.int32) for k in ("tokens", "segments", "positions")}
    rows["tokens"][:] = pad_id
    completion = np.zeros(shape, bool)
    for r, (prompt, chosen, rejected) in enumerate(pairs):
        at = 0
        for s, answer in enumerate((chosen, rejected), 1):
            ids = [*prompt, *answer]
            span = slice(at, at + len(ids))
            rows["tokens"][r, span], rows["segments"][r, span] = ids, s
            rows["positions"][r, span] = np.arange(len(ids))
            completion[r, at + len(prompt) : at + len(ids)] = True
            at += len(ids)
    targets = completion[:, 1:]
    rows["chosen"] = targets & (rows["segments"][:, 1:] == 1)
    rows["rejected"] = targets & (rows["segments"][:, 1:] == 2)
    return rows


def sequence_logps(model, rows: dict) -> tuple[jax.Array, jax.Array]:
    """Each row's summed log-probabilities of its chosen and of its rejected completion."""
    per_token, _ = model.next_token_log_probs(rows["tokens"], Packing.of(rows))
    return (per_token * rows["chosen"]).sum(-1), (per_token * rows["rejected"]).sum(-1)


def dpo_loss(model, reference, rows: dict, beta: float = 0.1) -> tuple[jax.Array, dict]:
    """The mean over rows of ``-log sigmoid(beta * (chosen's log-ratio - rejected's))``, the
    log-ratios against ``reference`` (no gradient through it), and TRL's metrics: the
    rewards (``beta`` times the log-ratios) of the chosen and rejected completions, their
    margin, how often the chosen's is larger, and the policy's log-probabilities.

    Example:
        >>> from flax import nnx
        >>> from mmnnx.models import GPT, GPTConfig
        >>> with nnx.use_eager_sharding(False):
        ...     model = GPT(GPTConfig(dim=16, depth=1, vocab_size=16), rngs=nnx.Rngs(0))
        >>> loss, metrics = dpo_loss(model, model, pair_rows([([1, 2], [3], [4])], 8))
        >>> round(float(loss), 4), float(metrics["rewards/margins"])  # log 2 against itself
        (0.6931, 0.0)
    """
    chosen, rejected = sequence_logps(model, rows)
    ref_chosen, ref_rejected = jax.lax.stop_gradient(sequence_logps(reference, rows))
    rewards = beta * (chosen - ref_chosen), beta * (rejected - ref_rejected)
    margins = rewards[0] - rewards[1]
    metrics = {
        "rewards/chosen": rewards[0].mean(),
        "rewards/rejected": rewards[1].mean(),
        "rewards/margins": margins.mean(),
        "rewards/accuracies": (margins > 0).mean(),
        "logps/chosen": chosen.mean(),
        "logps/rejected": rejected.mean(),
    }
    return -jax.nn.log_sigmoid(margins).mean(), metrics


class PreferenceModel(nnx.Module):
    """A policy trained by DPO against a frozen ``reference``: ``loss(rows)`` is
    :func:`dpo_loss` of :func:`pair_rows` rows (sowing :data:`METRICS` under
    ``nnx.capture(..., nnx.Intermediate)``), ``__call__`` the policy's.

    ``reference=None``: the policy itself with its LoRA adapters off (``nnx.view(policy,
    adapters=False)``): the same Variables, so no second copy of the weights is held, and the
    module's state is the policy's alone. Otherwise ``reference`` (e.g. ``nnx.clone`` of the
    initial policy) is held beside it, under ``reference/``: train only ``policy/``
    (:data:`TRAINED`). Both compute without dropout in the reference (TRL's ``eval()``).

    Example:
        >>> from mmnnx.models import GPT, GPTConfig
        >>> with nnx.use_eager_sharding(False):
        ...     policy = GPT(GPTConfig(dim=16, depth=1, vocab_size=16), rngs=nnx.Rngs(0))
        >>> model = PreferenceModel(policy, beta=0.1)
        >>> round(float(model.loss(pair_rows([([1, 2], [3], [4])], 8))), 4)  # log 2
        0.6931
        >>> list(nnx.state(model))  # the reference is the policy's own Variables
        ['policy']
    """

    def __init__(self, policy: nnx.Module, *, beta: float, reference: nnx.Module | None = None):
        self.policy, self.beta = policy, float(beta)
        base = policy if reference is None else reference
        self.reference = nnx.view(
            base, adapters=False, deterministic=True, raise_if_not_found=False
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.policy(*args, **kwargs)

    def loss(self, rows: dict) -> jax.Array:
        loss, metrics = dpo_loss(self.policy, self.reference, rows, self.beta)
        if _nnx.capturing(self):
            for name, value in metrics.items():
                self.sow(nnx.Intermediate, name.replace("/", "_"), value)
        return loss


TRAINED = nnx.PathContains("policy")
"""The Variables of a :class:`PreferenceModel` that train (``nnx.All(nnx.Param, TRAINED)``):
the policy's, never the reference's."""


@dataclasses.dataclass(frozen=True)
class PreferenceMetrics:
    """A DPO step's metrics (:data:`METRICS`), each the mean over the step's pairs."""

    values: dict[str, float]

    def scalars(self) -> dict[str, float]:
        """The metrics by TensorBoard tag (TRL's names); :meth:`record`: a metrics.jsonl row."""
        return dict(self.values)

    record = scalars

    def line(self) -> str:
        """The metrics of a plain log line."""
        v = self.values
        return f"margin {v['rewards/margins']:.4f} accuracy {v['rewards/accuracies']:.2f}"


def preference_metrics(captured: Any, *, microbatched: bool) -> PreferenceMetrics | None:
    """The :class:`PreferenceMetrics` of what a step captured (``nnx.capture(...,
    nnx.Intermediate)``'s state, fetched), or ``None`` when it holds none; ``microbatched``:
    one value per microbatch, each a mean over as many pairs, averaged.

    Example:
        >>> from mmnnx.models import GPT, GPTConfig
        >>> with nnx.use_eager_sharding(False):
        ...     policy = GPT(GPTConfig(dim=16, depth=1, vocab_size=16), rngs=nnx.Rngs(0))
        >>> loss = lambda m, rows: m.loss(rows)
        >>> _, captured = nnx.capture(loss, nnx.Intermediate)(
        ...     PreferenceModel(policy, beta=0.1), pair_rows([([1, 2], [3], [4])], 8))
        >>> preference_metrics(captured, microbatched=False).values["rewards/margins"]
        0.0
    """
    sown = {name.replace("/", "_"): name for name in METRICS}
    values: dict[str, list] = {}
    for path, variable in nnx.to_flat_state(captured):
        if path and path[-1] in sown:
            calls = variable.get_value()
            calls = calls if isinstance(calls, tuple) else (calls,)
            values[sown[path[-1]]] = [np.asarray(v, np.float64) for v in calls]
    if not values:
        return None
    return PreferenceMetrics({name: float(np.mean(np.stack(v))) for name, v in values.items()})
