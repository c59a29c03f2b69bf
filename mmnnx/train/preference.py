"""Direct preference optimization (DPO, Rafailov et al. 2023) as TRL's ``DPOTrainer``
computes it, each pair in one row so that any microbatching keeps it whole."""

from __future__ import annotations

import jax
import numpy as np

from mmnnx.modules import Packing


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
