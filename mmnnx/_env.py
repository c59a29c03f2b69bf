"""The environment through which ``mmnnx launch`` tells each process its place in the job.

The launcher (:mod:`mmnnx.launcher`) sets these variables and ``mm.distributed.initialize``
reads them; both import the names from here, so the launcher needs nothing of the JAX side.
"""

from __future__ import annotations

ENV_COORDINATOR = "MMNNX_COORDINATOR"
"""The coordinator's ``host:port``."""
ENV_NUM_PROCESSES = "MMNNX_NUM_PROCESSES"
ENV_PROCESS_ID = "MMNNX_PROCESS_ID"
ENV_HEARTBEAT = "MMNNX_HEARTBEAT_TIMEOUT"
"""Seconds of missed heartbeats after which JAX's coordination service ends the job."""
ENV_COLLECTIVES = "MMNNX_COLLECTIVES"
ENV_RESTART_COUNT = "MMNNX_RESTART_COUNT"
"""How many times ``mmnnx launch`` restarted the processes before this attempt (0, 1, ...)."""
ENV_PROGRESS_DIR = "MMNNX_PROGRESS_DIR"
"""Where each process writes what it is doing (``mm.distributed.progress``), for ``mmnnx launch
--step-timeout`` to read; unset: nothing is written."""

COLLECTIVES = ("none", "gloo", "mpi")
"""Collectives between processes on CPU: none (the default), or JAX's gloo or MPI ones."""
