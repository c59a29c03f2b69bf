"""A loop of steps under ``mmnnx launch``, for tests/test_launch_failures.py: ``python
tests/launched_loop.py HOW RANK``. Every process reports ``loading batch`` of each step with
``mm.distributed.progress`` (as ``mmnnx train`` does) and asks ``mm.distributed.Preemption``
after each. On process RANK at step 3, HOW ``spin`` spins in a Python loop for ever (no
exception, its JAX heartbeat still beating, a short sleep each turn), after printing ``spinning
at <time.time()>``; HOW ``preempt`` sends SIGTERM to the launcher (a preemption notice, which
it forwards to every process). A process the notice stops prints ``stopped after step N`` and
exits with 143.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import jax

import mmnnx as mm


def spin_for_ever() -> None:
    while True:  # a Python loop that never ends, resting between turns: no core burnt meanwhile
        sum(range(1000))
        time.sleep(0.01)


if __name__ == "__main__":
    how, chosen = sys.argv[1], int(sys.argv[2])
    mm.distributed.initialize()
    with mm.distributed.Preemption() as preemption:
        for step in range(1, 1000):
            mm.distributed.progress("loading batch", step)
            time.sleep(0.05)
            if jax.process_index() == chosen and step == 3:
                if how == "spin":
                    print(f"spinning at {time.time()}", flush=True)
                    spin_for_ever()
                os.kill(os.getppid(), signal.SIGTERM)
            if preemption.reached(step):
                print(f"stopped after step {step}", flush=True)
                sys.exit(preemption.STATUS)
