"""What ``jax_plugins.multimesh`` provides after ``install_alias()``: ``init``.

Importing it does not import JAX.
"""

from multimesh_compat._init import init

__all__ = ["init"]
