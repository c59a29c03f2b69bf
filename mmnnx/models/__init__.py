"""Reference models built from ``mmnnx.modules``, and ``stage_rules`` to pipeline them.

Example:
    >>> from flax import nnx
    >>> from mmnnx.models import GPT, GPTConfig
    >>> with nnx.use_eager_sharding(False):
    ...     model = GPT(GPTConfig(depth=2), rngs=nnx.Rngs(0))
    >>> len(model.blocks)
    2
"""

from mmnnx.models.gpt import GPT, GPTConfig
from mmnnx.models.pretrained import (
    FAMILIES,
    CheckpointError,
    TensorRule,
    from_pretrained,
    load_tensors,
    pretrained_config,
    save_adapter,
    save_pretrained,
    save_tensors,
)
from mmnnx.models.stages import split_rules, stage_rules

__all__ = [
    "FAMILIES",
    "GPT",
    "CheckpointError",
    "GPTConfig",
    "TensorRule",
    "from_pretrained",
    "load_tensors",
    "pretrained_config",
    "save_adapter",
    "save_pretrained",
    "save_tensors",
    "split_rules",
    "stage_rules",
]
