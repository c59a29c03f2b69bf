"""A rank that stops making progress, for tests/test_launch_failures.py: ``python
tests/stuck_rank.py RANK`` reports ``loading batch`` of steps 1 to 3 with
``mm.distributed.progress`` (as ``mmnnx train`` does) on every process; then process RANK spins
in Python for ever (``spin_for_ever``: no exception, its JAX heartbeat still beating) while the
others go on reporting. It first prints ``spinning at <time.time()>``."""

from __future__ import annotations

import sys
import time

import jax

import mmnnx as mm


def spin_for_ever() -> None:
    while True:
        sum(range(1000))


if __name__ == "__main__":
    stuck = int(sys.argv[1])
    mm.distributed.initialize()
    rank = jax.process_index()
    for step in range(1, 4):
        mm.distributed.progress("loading batch", step)
        time.sleep(0.1)
    if rank == stuck:
        print(f"spinning at {time.time()}", flush=True)
        spin_for_ever()
    step = 4
    while True:
        mm.distributed.progress("running the step", step)
        step += 1
        time.sleep(0.2)
