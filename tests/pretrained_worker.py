"""One process of the multi-process checkpoint tests of tests/test_pretrained_processes.py.

``python -m tests.pretrained_worker SCENARIO OUT_DIR`` (from the repository root, under
``mmnnx launch -n 2 --devices-per-process 4`` or started by hand with the launcher's
environment): joins the run, loads the checkpoint in ``$SOURCE`` onto two stages of 2 x 2
(data x model) devices, one stage per process, runs SCENARIO and writes what it saw to
``OUT_DIR/rank{i}.json``.

- ``load_and_save``: every tensor slice this process read (``CheckpointFiles.read`` recorded),
  the pipelined logits and loss of an ``mm.jit`` step (fetched), then ``save_pretrained`` into
  ``OUT_DIR/saved``, then a second save over it (bfloat16, ``overwrite=True``) while process
  1's writing raises: the error each process got.
- ``save_abandoned``: saves into ``$TARGET``, then saves again while process 1 leaves right
  after writing its shard file (``$LEAVE``: ``kill``, SIGKILL, or ``exit``, status 3), before
  the step that renames the checkpoint into place; process 0 is left to find out on its own.
"""

from __future__ import annotations

import faulthandler
import json
import os
import pathlib
import signal
import sys

import jax
import jax.numpy as jnp
import numpy as np

import mmnnx as mm
from mmnnx.models import from_pretrained, save_pretrained
from mmnnx.models.pretrained import save as save_module
from mmnnx.models.pretrained.files import CheckpointFiles

TOKENS = np.array([[3, 17, 250, 9, 101, 77, 5, 42], [1, 2, 3, 4, 5, 6, 7, 8]], np.int32)
SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def stage_tasks() -> list[mm.Task]:
    """Two tasks of 2 x 2 (data x model) devices: process 0's devices, then process 1's."""
    mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
    rules = mm.logical_rules(
        batch="data", mlp="model", heads="model", vocab="model", embed=None, seq=None
    )
    return [mm.Task(f"stage{i}", mesh=mesh.task_mesh(stage=i), logical_axes=rules) for i in (0, 1)]


def recorded_reads() -> list[list]:
    """Starts recording every ``CheckpointFiles.read`` of this process as ``[name, [[start,
    stop], ...]]`` (each slice made concrete against the tensor's shape); returns the list."""
    reads: list[list] = []
    read = CheckpointFiles.read

    def recording(self, name, index=(), **kwargs):
        shape = self.tensors[name].shape
        whole = [slice(None)] * len(shape)
        box = [list(s.indices(n)[:2]) for s, n in zip(tuple(index) + tuple(whole[len(index):]),
                                                      shape, strict=True)]  # fmt: skip
        reads.append([name, box])
        return read(self, name, index, **kwargs)

    CheckpointFiles.read = recording
    return reads


def _load():
    return from_pretrained(os.environ["SOURCE"], tasks=stage_tasks())


@scenario
def load_and_save(out: pathlib.Path) -> dict:
    reads = recorded_reads()
    model = _load()
    loaded_reads = list(reads)
    logits = mm.distributed.fetch(mm.jit(lambda m, t: m(t))(model, jnp.asarray(TOKENS)))
    batch = jnp.asarray(np.concatenate([TOKENS, TOKENS[:, :1]], axis=1))
    loss = mm.distributed.fetch(mm.jit(lambda m, b: m.loss(b))(model, batch))
    saved = out / "saved"
    save_pretrained(model, saved, max_shard_bytes=200_000)

    def raising(directory, shards):
        raise OSError(f"disk full writing {sorted(shards)} (a test's failure)")

    if jax.process_index() == 1:  # a second save over the first, failing on process 1
        save_module.write_shards = raising
    try:
        save_pretrained(model, saved, dtype=jnp.bfloat16, overwrite=True)
        error = None
    except Exception as e:  # noqa: BLE001  (recorded for the test to check)
        error = f"{type(e).__name__}: {e}"
    return {
        "reads": loaded_reads,
        "logits": np.asarray(logits, np.float64).tolist(),
        "loss": float(loss),
        "error": error,
    }


@scenario
def save_abandoned(out: pathlib.Path) -> dict:
    """Saves into ``$TARGET``, then again (bfloat16, ``overwrite=True``) while process 1 leaves
    right after writing its shard file, before the step that renames the checkpoint into
    place: killed (``$LEAVE=kill``, SIGKILL) or exiting with status 3 (``$LEAVE=exit``). The
    error process 0 gets is left uncaught, as a script would."""
    target = pathlib.Path(os.environ["TARGET"])
    model = _load()
    save_pretrained(model, target)
    write = save_module.write_shards

    def leaving_after_writing(directory, shards):
        write(directory, shards)
        print("WRITTEN", sorted(shards), flush=True)
        if os.environ["LEAVE"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(3)

    if jax.process_index() == 1:
        save_module.write_shards = leaving_after_writing
    save_pretrained(model, target, dtype=jnp.bfloat16, overwrite=True)  # raises on process 0
    return {}


def main() -> None:
    name, out = sys.argv[1], pathlib.Path(sys.argv[2])
    faulthandler.dump_traceback_later(float(os.environ.get("WORKER_TIMEOUT", "600")), exit=True)
    mm.distributed.initialize()
    result = SCENARIOS[name](out)
    result["process"] = jax.process_index()
    (out / f"rank{jax.process_index()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
