"""mmnnx: multi-mesh (MPMD) parallelism for Flax NNX on stock JAX.

Example:
    >>> import mmnnx as mm
    >>> mesh = mm.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "data"))
    >>> s0 = mm.Task("stage0", mesh=mesh.slice(stage=0))
"""

import lazy_loader

# Each name is imported on first use, from where __init__.pyi says: `mmnnx launch` and the
# command line's parsing import nothing of JAX.
__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)

__version__ = "0.1.0"
