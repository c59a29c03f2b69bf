"""mmnnx.distributed: one step spread over several processes (``jax.distributed``).

Start processes with ``mmnnx launch -n N -- python train.py`` (or a cluster's launcher), call
:func:`initialize` first thing in the script, and run it as in one process: tasks may hold any
process's devices; every process plans every step and runs its own tasks' parts of it.
"""

from mmnnx._jax.runtime import backends_started
from mmnnx.distributed.exits import PeerExitedError, fail
from mmnnx.distributed.fetch import fetch
from mmnnx.distributed.gather import gather
from mmnnx.distributed.initialize import initialize, is_distributed
from mmnnx.distributed.preemption import Preemption
from mmnnx.distributed.progress import progress

__all__ = [
    "PeerExitedError",
    "Preemption",
    "backends_started",
    "fail",
    "fetch",
    "gather",
    "initialize",
    "is_distributed",
    "progress",
]
