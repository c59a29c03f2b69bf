"""One process of the multi-process checkpoint tests of tests/test_pretrained_processes.py.

``python -m tests.pretrained_worker SCENARIO[,SCENARIO...] OUT_DIR`` (from the repository root,
under ``mmnnx launch -n 2 --devices-per-process 4`` or started by hand with the launcher's
environment): joins the run, then runs each SCENARIO in turn (one process start for several:
JAX's import and start-up are most of a short scenario's time), each writing what it saw to
``OUT_DIR/SCENARIO/rank{i}.json``.

- ``load_and_save``: loads the checkpoint in ``$SOURCE`` onto two stages of 2 x 2 (data x
  model) devices, one stage per process; every tensor slice this process read
  (``CheckpointFiles.read`` recorded), the pipelined logits and loss of an ``mm.jit`` step
  (fetched), then ``save_pretrained`` into ``OUT_DIR/load_and_save/saved``, then a second save
  over it (bfloat16, ``overwrite=True``) while process 1's writing raises: the error each
  process got.
- ``train_moe``: loads the Qwen3-MoE checkpoint in ``$MOE_SOURCE`` onto two stages of 2 x 2
  (expert x data) devices, 4 experts a device (EP 2), records the slices read, trains it
  ``MOE_STEPS`` AdamW steps pipelined (1F1B, 2 microbatches; the losses fetched), then writes it
  with ``save_pretrained`` into ``OUT_DIR/train_moe/trained``.
- ``save_abandoned`` (last: it ends the processes): prints ``ABANDONED SCENARIO STARTED AT
  <time.monotonic()>``, loads ``$SOURCE`` as ``load_and_save`` does, saves into ``$TARGET``,
  then saves again while process 1 leaves right after writing its shard file (``$LEAVE``:
  ``kill``, SIGKILL, or ``exit``, status 3), before the step that renames the checkpoint into
  place; process 0 is left to find out on its own.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import pathlib
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import mmnnx as mm
from mmnnx.models import from_pretrained, save_pretrained
from mmnnx.models.pretrained import save as save_module
from mmnnx.models.pretrained.files import CheckpointFiles

TOKENS = np.array([[3, 17, 250, 9, 101, 77, 5, 42], [1, 2, 3, 4, 5, 6, 7, 8]], np.int32)
MOE_BATCH = np.random.default_rng(0).integers(0, 376, (4, 9)).astype(np.int32)
MOE_STEPS, MOE_MICROBATCHES, MOE_LR = 2, 2, 1e-3
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


def expert_stage_tasks() -> list[mm.Task]:
    """Two tasks of 2 x 2 (expert x data) devices, process 0's then process 1's: a MoE layer's
    experts split over ``expert`` (EP 2), the batch over ``data``."""
    mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "expert", "data"))
    rules = mm.logical_rules(batch="data", expert="expert")
    return [mm.Task(f"stage{i}", mesh=mesh.task_mesh(stage=i), logical_axes=rules) for i in (0, 1)]


def moe_step(model, opt, batch):
    """One AdamW step of ``model.loss`` (its routers' auxiliary loss included) pipelined over
    ``MOE_MICROBATCHES`` microbatches (1F1B; loss and gradients their mean); returns the
    loss."""
    grad_fn = mm.microbatch(
        nnx.value_and_grad(lambda m, b: m.loss(b)),
        num=MOE_MICROBATCHES,
        reduce="mean",
        schedule="1f1b",
    )
    loss, grads = grad_fn(model, batch)
    opt.update(model, grads)
    return loss


@contextlib.contextmanager
def recorded_reads():
    """Records every ``CheckpointFiles.read`` of this process as ``[name, [[start, stop],
    ...]]`` (each slice made concrete against the tensor's shape) into the list it yields,
    until the block ends."""
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
    try:
        yield reads
    finally:
        CheckpointFiles.read = read


def _load():
    return from_pretrained(os.environ["SOURCE"], tasks=stage_tasks())


@scenario
def load_and_save(out: pathlib.Path) -> dict:
    with recorded_reads() as reads:
        model = _load()
    logits = mm.distributed.fetch(mm.jit(lambda m, t: m(t))(model, jnp.asarray(TOKENS)))
    batch = jnp.asarray(np.concatenate([TOKENS, TOKENS[:, :1]], axis=1))
    loss = mm.distributed.fetch(mm.jit(lambda m, b: m.loss(b))(model, batch))
    saved = out / "saved"
    save_pretrained(model, saved, max_shard_bytes=200_000)

    def raising(directory, shards):
        raise OSError(f"disk full writing {sorted(shards)} (a test's failure)")

    write = save_module.write_shards
    if jax.process_index() == 1:  # a second save over the first, failing on process 1
        save_module.write_shards = raising
    try:
        save_pretrained(model, saved, dtype=jnp.bfloat16, overwrite=True)
        error = None
    except Exception as e:  # noqa: BLE001  (recorded for the test to check)
        error = f"{type(e).__name__}: {e}"
    finally:
        save_module.write_shards = write
    return {
        "reads": reads,
        "logits": np.asarray(logits, np.float64).tolist(),
        "loss": float(loss),
        "error": error,
    }


@scenario
def train_moe(out: pathlib.Path) -> dict:
    with recorded_reads() as reads:
        model = from_pretrained(os.environ["MOE_SOURCE"], tasks=expert_stage_tasks())
    opt = nnx.Optimizer(model, optax.adamw(MOE_LR), wrt=nnx.Param)
    step = mm.jit(moe_step)
    losses = [
        float(mm.distributed.fetch(step(model, opt, jnp.asarray(MOE_BATCH))))
        for _ in range(MOE_STEPS)
    ]
    save_pretrained(model, out / "trained")
    gate = model.blocks[2 * jax.process_index() + 1].mlp.experts.gate[...]  # a layer of its own
    experts = sorted({s.data.shape[0] for s in gate.addressable_shards})
    return {"reads": reads, "losses": losses, "experts_per_device": experts}


@scenario
def save_abandoned(out: pathlib.Path) -> dict:
    """Prints when it starts (``time.monotonic()``: one clock for every process of the
    machine), loads ``$SOURCE``, saves into ``$TARGET``, then again (bfloat16,
    ``overwrite=True``) while process 1 leaves right after writing its shard file, before the
    step that renames the checkpoint into place: killed (``$LEAVE=kill``, SIGKILL) or exiting
    with status 3 (``$LEAVE=exit``). The error process 0 gets is left uncaught, as a script
    would."""
    print(f"ABANDONED SCENARIO STARTED AT {time.monotonic()}", flush=True)
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
    names, out = sys.argv[1].split(","), pathlib.Path(sys.argv[2])
    faulthandler.dump_traceback_later(float(os.environ.get("WORKER_TIMEOUT", "600")), exit=True)
    mm.distributed.initialize()
    for name in names:
        (out / name).mkdir(exist_ok=True)
        result = SCENARIOS[name](out / name)
        result["process"] = jax.process_index()
        (out / name / f"rank{jax.process_index()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
