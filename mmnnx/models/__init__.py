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
from mmnnx.models.stages import stage_rules

__all__ = ["GPT", "GPTConfig", "stage_rules"]
