"""Shared set-up for tests/test_checkpoint.py, and a worker run in fresh processes by those tests.

``python tests/checkpoint_worker.py MODE DIR [ARGS]``, with 8 simulated CPU devices:

- ``resume DIR M OUT``: builds the model from another seed, restores the latest step, trains M more
  steps, writes every state array to ``OUT`` (``.npz``) and prints the losses.
- ``kill DIR N``: trains the two-task model N steps from seed 0 and saves step N (printing the
  losses and a digest of the state), trains one more step and starts saving it, but sleeps just
  before the commit, after printing ``COMMITTING``, so that the parent can kill it there.
- ``write DIR N``: saves a model of about 16 MB as steps 1..N (keeping 2), then prints ``{}``.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # a fresh process: the repository importable, devices before jax
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.flags import set_device_count

    set_device_count(8)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import hashlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import mmnnx as mm  # noqa: E402
from tests.models import TwoStageMLP  # noqa: E402

RULES = mm.logical_rules(batch="data", mlp="model", embed=None)


def tasks(n: int) -> list[mm.Task]:
    """``n`` tasks (2 or 4) over the 8 devices, each a ``("data", "model")`` submesh."""
    mesh = mm.MultiMesh(axis_sizes=(n, 4 // n, 2), axis_names=("stage", "data", "model"))
    return [
        mm.Task(f"stage{i}of{n}", mesh=mesh.task_mesh(stage=i), logical_axes=RULES)
        for i in range(n)
    ]


def build(layout: str, seed: int = 0, **kwargs) -> tuple[nnx.Module, nnx.Optimizer]:
    """The test model and its AdamW optimizer: on one device, on two tasks or on four."""
    with nnx.use_eager_sharding(False):
        model = TwoStageMLP(rngs=nnx.Rngs(seed), **kwargs)
    if layout == "two":
        s0, s1 = tasks(2)
        model = mm.place(model, [("layers/0", s0), ("layers/1|norm|drop", s1)])
    elif layout == "four":
        q0, q1, q2, q3 = tasks(4)
        model = mm.place(model, [("layers/0", q0), ("layers/1", q1), ("norm", q2), ("drop", q3)])
    else:
        assert layout == "one", layout
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)


def batch() -> tuple[jax.Array, jax.Array]:
    return jax.random.normal(jax.random.key(1), (8, 16)), jax.random.normal(
        jax.random.key(2), (8, 16)
    )


def train_step(model, opt, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    opt.update(model, grads)
    return loss


_STEPS: dict[bool, object] = {}


def train(model, opt, steps: int) -> list[float]:
    """``steps`` AdamW steps: ``mm.jit`` for a placed model, ``nnx.jit`` on one device."""
    placed = bool(mm.placement(model))
    if placed not in _STEPS:
        _STEPS[placed] = mm.jit(train_step) if placed else nnx.jit(train_step)
    step = _STEPS[placed]
    x, y = batch()
    return [float(step(model, opt, x, y)) for _ in range(steps)]


def arrays(**nodes) -> dict[str, np.ndarray]:
    """Every Variable's value under ``nodes`` as a host array (typed keys as their key data)."""
    out = {}
    for name, node in nodes.items():
        for path, var in nnx.iter_graph(node):
            if isinstance(var, nnx.Variable):
                value = var.get_value()
                if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
                    value = jax.random.key_data(value)
                out["/".join((name, *map(str, path)))] = np.asarray(value)
    return out


def digest(**nodes) -> str:
    """A hash of every value's bytes, dtype and shape: equal digests are bit-exact state."""
    h = hashlib.sha256()
    for path, value in sorted(arrays(**nodes).items()):
        h.update(f"{path}:{value.dtype}:{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def main(argv: list[str]) -> None:
    from mmnnx.train import Checkpointer
    from mmnnx.train.checkpoint import layout

    mode, directory = argv[0], argv[1]
    if mode == "resume":
        m, out = int(argv[2]), argv[3]
        model, opt = build("two", seed=1)
        with Checkpointer(directory) as ckpt:
            extra = ckpt.restore(model=model, opt=opt)
        losses = train(model, opt, m)
        np.savez(out, **arrays(model=model, opt=opt))
        print(json.dumps({"losses": losses, "extra": extra}), flush=True)
    elif mode == "kill":
        n = int(argv[2])
        model, opt = build("two", seed=0)
        ckpt = Checkpointer(directory)
        losses = train(model, opt, n)
        ckpt.save(n, model=model, opt=opt, extra={"step": n, "seed": 0})
        print(json.dumps({"losses": losses, "digest": digest(model=model, opt=opt)}), flush=True)
        train(model, opt, 1)

        def hang(path, **kwargs):
            print("COMMITTING", path, flush=True)
            time.sleep(600)

        layout.fsync_tree = hang  # every array of the step is written; the rename is not
        ckpt.save(n + 1, model=model, opt=opt, extra={"step": n + 1})
        raise AssertionError("the save should have been killed before it committed")
    elif mode == "write":
        model = nnx.Sequential(*(nnx.Linear(512, 1024, rngs=nnx.Rngs(i)) for i in range(8)))
        with Checkpointer(directory, max_to_keep=2) as ckpt:
            for step in range(1, int(argv[2]) + 1):
                ckpt.save(step, model=model)
        print(json.dumps({}), flush=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
