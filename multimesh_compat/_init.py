"""``init``: the multimesh plugin's start-up call, reduced to what stock JAX needs.

This module does not import JAX, so ``init`` can run before ``import jax`` as the notebooks do.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

_LOG_LEVELS = {"info": logging.INFO, "debug": logging.DEBUG, "spew": 5}
_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _set_xla_flag(flag: str, value: str | None = None) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    flags = re.sub(rf"\s*{re.escape(flag)}(=\S*)?", "", flags).strip()
    entry = flag if value is None else f"{flag}={value}"
    os.environ["XLA_FLAGS"] = f"{flags} {entry}".strip()


def init(
    disable_gc: bool | None = None,
    cpus: int | None = None,
    gpus: int | None = None,
    fbmem: int = 8000,
    sysmem: int = 4000,
    zcmem: int = 32,
    debug: str | None = None,
    network: str = "none",
    kthreads: bool = False,
    profile: bool = False,
    distributed: bool = False,
    dump: str | None = None,
    dump_all_passes: bool = False,
    realm_argv: Sequence[str] | None = None,
    coordinator_address: str | None = None,
    num_processes: int = 1,
    process_id: int = 0,
    local_device_ids: Any = None,
    cluster_detection_method: str | None = None,
    initialization_timeout: int = 300,
    coordinator_bind_address: str | None = None,
) -> None:
    """Configures JAX before its backend starts: ``cpus=N`` gives N CPU devices.

    ``cpus`` sets ``--xla_force_host_platform_device_count=N`` in ``XLA_FLAGS`` and, unless
    ``gpus`` is given, the CPU platform. ``dump`` (and ``dump_all_passes``) add XLA's dump
    flags, ``debug`` ("info", "debug" or "spew"; anything else is a ``KeyError``) sets the
    ``multimesh_compat`` logger's level, and ``distributed=True`` calls
    ``jax.distributed.initialize`` with the coordinator arguments. The memory sizes, network,
    thread and profiling options configure multimesh's Realm runtime and are accepted and
    ignored here.

    Call it before JAX creates its devices (ideally before ``import jax``). If JAX's backend
    already runs with another device count, a ``RuntimeError`` says so; with the same count the
    call does nothing.

    Example:
        >>> init(cpus=8)  # in the test suite JAX already runs with 8 CPU devices
    """
    del disable_gc, fbmem, sysmem, zcmem, network, kthreads, profile, realm_argv
    if debug is not None:
        logging.getLogger("multimesh_compat").setLevel(_LOG_LEVELS[debug])
    jax_mod = sys.modules.get("jax")
    if jax_mod is not None:
        from mmnnx.distributed import backends_started  # imports JAX, imported already

        if backends_started():
            if cpus is not None:
                have = len(jax_mod.devices("cpu"))
                if have != cpus:
                    raise RuntimeError(
                        f"init(cpus={cpus}): JAX already started with {have} CPU devices; call "
                        "init before importing jax (and before anything creates JAX arrays)"
                    )
            if dump is not None:
                raise RuntimeError(
                    "init(dump=...): JAX already started; call init before importing jax"
                )
            return
    if cpus is not None:
        _set_xla_flag(_COUNT_FLAG, str(int(cpus)))
        if gpus is None:
            os.environ["JAX_PLATFORMS"] = "cpu"
            if jax_mod is not None:
                jax_mod.config.update("jax_platforms", "cpu")
    if dump is not None:
        _set_xla_flag("--xla_dump_to", dump)
        if dump_all_passes:
            _set_xla_flag("--xla_dump_hlo_pass_re", ".*")
    if distributed:
        import jax

        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=local_device_ids,
            cluster_detection_method=cluster_detection_method,
            initialization_timeout=initialization_timeout,
            coordinator_bind_address=coordinator_bind_address,
        )
