"""An opt-in import alias: ``multimesh``, ``multimesh.jax``, ``multimesh.jax.flax`` and
``jax_plugins.multimesh`` resolve to this package's modules."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types

ALIASES = {
    "multimesh": "multimesh_compat",
    "multimesh.jax": "multimesh_compat.jax",
    "multimesh.jax.flax": "multimesh_compat.jax.flax",
    "jax_plugins.multimesh": "multimesh_compat.jax_plugin",
}


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module):
        pass


class _NamespaceLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds the alias names; a ``jax_plugins`` package is provided only if none is installed
    (so JAX's own plugin discovery is untouched)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in ALIASES:
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(ALIASES[fullname]))
        if fullname == "jax_plugins":
            if importlib.machinery.PathFinder.find_spec(fullname) is not None:
                return None
            return importlib.machinery.ModuleSpec(fullname, _NamespaceLoader(), is_package=True)
        return None


_FINDER = AliasFinder()


def install_alias() -> None:
    """Makes ``import multimesh.jax`` (and ``multimesh.jax.flax``, ``jax_plugins.multimesh``)
    load this package's modules. Idempotent; undo with :func:`uninstall_alias`.

    Example:
        >>> install_alias()
        >>> import multimesh.jax  # doctest: +SKIP
    """
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def uninstall_alias() -> None:
    """Removes the alias and forgets the alias modules already imported.

    Example:
        >>> uninstall_alias()
    """
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in list(sys.modules):
        if name in ALIASES:
            del sys.modules[name]
    stub = sys.modules.get("jax_plugins")
    if (
        stub is not None
        and getattr(stub, "__spec__", None) is not None
        and isinstance(stub.__spec__.loader, _NamespaceLoader)
    ):
        del sys.modules["jax_plugins"]
