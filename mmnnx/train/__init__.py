"""mmnnx.train: what a training run needs on top of ``mm.jit``: text data, Orbax checkpoints of
task-placed state, and the training loop.

Example:
    >>> from mmnnx.train import ByteTokenizer, Checkpointer, TrainConfig
    >>> ByteTokenizer().encode("a").tolist(), Checkpointer.__name__, TrainConfig().schedule
    ([97], 'Checkpointer', '1f1b')
"""

import lazy_loader

# Each name is imported on first use, from where __init__.pyi says: `mmnnx launch` and the
# command line's parsing import nothing of JAX.
__getattr__, __dir__, __all__ = lazy_loader.attach_stub(__name__, __file__)
