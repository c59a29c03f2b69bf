"""multimesh_compat: the multimesh.jax API on stock JAX, run by mmnnx's engine.

``multimesh_compat.jax`` and ``multimesh_compat.jax.flax`` mirror ``multimesh.jax`` and
``multimesh.jax.flax``. :func:`install_alias` makes ``import multimesh.jax`` (and
``jax_plugins.multimesh``) resolve to them; importing this package changes nothing by itself
and does not import JAX.

Example:
    >>> import multimesh_compat
    >>> multimesh_compat.install_alias()
    >>> from jax_plugins.multimesh import init  # the compat ``init``
    >>> multimesh_compat.uninstall_alias()
"""

from multimesh_compat._alias import install_alias, uninstall_alias

__all__ = ["install_alias", "uninstall_alias"]
