"""``mmnnx train`` whose data loader fails on one process, on the first attempt of ``mmnnx
launch`` only (started by tests/test_launch_failures.py).

``python -m tests.failing_train RANK STEP HOW TRAIN_ARGS...`` (from the repository root): on
process RANK, while ``MMNNX_RESTART_COUNT`` is 0, reading the batch of the STEP-th step run
fails: HOW is ``raise`` (the loader raises), ``exit`` (``sys.exit(3)``) or ``kill``
(``SIGKILL``). It first prints ``failing at <time.time()>``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from mmnnx.cli import main
from mmnnx.train.data import TextDataset


def fail_at(rank: int, step: int, how: str) -> None:
    original = TextDataset.__next__
    read = 0

    def next_batch(self):
        nonlocal read
        read += 1
        if read == step:
            print(f"failing at {time.time()}", flush=True)
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "exit":
                sys.exit(3)
            raise OSError(f"the data loader of process {rank} failed at step {step}")
        return original(self)

    first_attempt = os.environ.get("MMNNX_RESTART_COUNT", "0") == "0"
    if int(os.environ["MMNNX_PROCESS_ID"]) == rank and first_attempt:
        TextDataset.__next__ = next_batch


if __name__ == "__main__":
    fail_at(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
    sys.exit(main(["train", *sys.argv[4:]]))
