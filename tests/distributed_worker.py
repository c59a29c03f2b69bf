"""One process of a multi-process test (started by tests/test_distributed.py via mmnnx launch).

``python tests/distributed_worker.py SCENARIO OUT_DIR``: joins the run, runs SCENARIO and, on
every process, writes what it computed (fetched to host) to ``OUT_DIR/rank{i}.json``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import mmnnx as mm

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def readme_model():
    """The README's two-task model (two tensor-parallel Linear layers, one per stage)."""
    mesh = mm.MultiMesh(axis_sizes=(2, 2, 2), axis_names=("stage", "data", "model"))
    rules = mm.logical_rules(batch="data", mlp="model", embed=None)
    stage0 = mm.Task("stage0", mesh=mesh.slice(stage=0), logical_axes=rules)
    stage1 = mm.Task("stage1", mesh=mesh.slice(stage=1), logical_axes=rules)

    def make_model():
        tp = lambda names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)  # noqa: E731
        return nnx.Sequential(
            nnx.Linear(64, 256, kernel_init=tp(("embed", "mlp")), rngs=nnx.Rngs(0)),
            nnx.Linear(256, 64, kernel_init=tp(("mlp", "embed")), rngs=nnx.Rngs(1)),
        )

    return mm.init(make_model, [("layers/0", stage0), ("layers/1", stage1)])


def readme_batch():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 64)), jnp.float32)
    return x, jnp.sin(x)


@scenario
def two_task(steps: int = 3, pipelined: str | None = None):
    """The README's train step (or its pipelined form) for a few steps: losses and parameters."""
    model = readme_model()
    opt = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

    def loss_fn(m, x, y):
        return jnp.mean((m(x) - y) ** 2)

    @mm.jit
    def train_step(model, opt, x, y):
        if pipelined is None:
            loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        else:
            grad_fn = mm.microbatch(
                nnx.value_and_grad(loss_fn),
                num=4,
                argnums=(1, 2),
                reduce="mean",
                schedule=pipelined,
            )
            loss, grads = grad_fn(model, x, y)
        opt.update(model, grads)
        return loss

    x, y = readme_batch()
    losses = [float(mm.distributed.fetch(train_step(model, opt, x, y))) for _ in range(steps)]
    params = mm.distributed.fetch(nnx.state(model, nnx.Param))
    return {
        "losses": losses,
        "params": {k: np.asarray(v).tolist() for k, v in _flat(params).items()},
        "transfers": len(train_step.plan(model, opt, x, y).transfers),
    }


@scenario
def pipelined_1f1b():
    return two_task(pipelined="1f1b")


def _flat(state) -> dict[str, np.ndarray]:
    return {
        "/".join(str(k) for k in path): np.asarray(v.get_value() if hasattr(v, "get_value") else v)
        for path, v in nnx.to_flat_state(state)
    }


def main() -> None:
    name, out = sys.argv[1], pathlib.Path(sys.argv[2])
    faulthandler.dump_traceback_later(float(os.environ.get("WORKER_TIMEOUT", "600")), exit=True)
    mm.distributed.initialize()
    result = SCENARIOS[name]()
    result["process"] = jax.process_index()
    result["processes"] = jax.process_count()
    (out / f"rank{jax.process_index()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
