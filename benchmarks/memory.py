"""Per-device memory of parameters + optimizer state for the reference GPT on 1, 2 and 4 stages.

Target: the device holding the most bytes holds <= 1.15 x (total / stages), i.e. stage_rules
balances the model and nothing is duplicated. Bytes are read from the arrays' own shards on each
device (parameters and AdamW moments; the optimizer step counter is negligible).

State held once (issue 42): after 4 steps of AdamW training, the bytes of every array alive
(``jax.live_arrays()`` after a garbage collection, less those alive before the model was
built) against the model + optimizer state + the batch: for ``nnx.jit`` on one device (the
baseline) and ``mm.jit`` as a plain step on one task, on two tasks, bound with
``mm.cached_partial``, and pipelined over 4 stages (1F1B, M = 4). Target: <= 1.05x, as
``nnx.jit``.

Byte counts do not vary from run to run, so this script measures once (no rounds); its results
file records the machine all the same.

Run: python benchmarks/memory.py  (writes benchmarks/results/memory.json)
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from report import record_run, results_path  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT, GPTConfig  # noqa: E402
from mmnnx.models.stages import stage_rules  # noqa: E402

RESULTS = results_path("memory.json")
CONFIG = GPTConfig(vocab_size=256, dim=256, depth=8, num_heads=8, max_seq_len=128)


def bytes_per_device(*trees) -> dict[int, int]:
    out: dict[int, int] = {}
    for leaf in jax.tree.leaves(trees):
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


def measure(stages: int) -> dict:
    tasks = [mm.Task(f"s{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(stages)]

    def factory():
        return GPT(CONFIG, rngs=nnx.Rngs(0))

    with nnx.use_eager_sharding(False):
        rules = stage_rules(nnx.eval_shape(factory), tasks, report=False)
    model = mm.init(factory, rules)
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    per_device = bytes_per_device(nnx.state(model), nnx.state(opt))
    total = sum(per_device.values())
    largest = max(per_device.values())
    return {
        "stages": stages,
        "total bytes": total,
        "largest device bytes": largest,
        "largest / (total / stages)": largest / (total / stages),
        "per device": {str(k): v for k, v in sorted(per_device.items())},
    }


def _train_step(model, opt, tokens):
    loss, grads = nnx.value_and_grad(lambda m, t: m.loss(t))(model, tokens)
    opt.update(model, grads)
    return loss


def _pipelined_step(model, opt, tokens):
    grad_fn = mm.microbatch(
        nnx.value_and_grad(lambda m, t: m.loss(t)), num=4, reduce="mean", schedule="1f1b"
    )
    loss, grads = grad_fn(model, tokens)
    opt.update(model, grads)
    return loss


def live_after_steps(mode: str, steps: int = 4) -> float:
    """Bytes of the arrays alive after ``steps`` steps in ``mode``, over state + batch."""
    import gc

    gc.collect()
    before = {id(a): a for a in jax.live_arrays()}
    tokens = jax.random.randint(jax.random.key(0), (16, CONFIG.max_seq_len + 1), 0, 256)
    with nnx.use_eager_sharding(False):
        model = GPT(CONFIG, rngs=nnx.Rngs(0))
    if mode != "nnx.jit, one device":
        stages = {"mm.jit, one task": 1, "mm.jit, two tasks": 2, "mm.cached_partial, two tasks": 2}
        count = stages.get(mode, 4)
        tasks = [mm.Task(f"s{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(count)]
        mm.place(model, stage_rules(model, tasks, report=False))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    if mode == "nnx.jit, one device":
        step = nnx.jit(_train_step)
        run = lambda t: step(model, opt, t)  # noqa: E731
    elif mode == "mm.cached_partial, two tasks":
        run = mm.cached_partial(mm.jit(_train_step), model, opt)
    else:
        step = mm.jit(_pipelined_step if mode.startswith("pipelined") else _train_step)
        run = lambda t: step(model, opt, t)  # noqa: E731
    for _ in range(steps):
        loss = run(tokens)
    float(loss)
    del loss
    gc.collect()
    live = sum(a.nbytes for a in jax.live_arrays() if id(a) not in before)
    held = sum(x.nbytes for o in (model, opt) for x in jax.tree.leaves(nnx.state(o)))
    return live / (held + tokens.nbytes)


LIVE_KEY = "live arrays after 4 steps / (state + batch), target <= 1.05"
LIVE_MODES = (
    "nnx.jit, one device",
    "mm.jit, one task",
    "mm.jit, two tasks",
    "mm.cached_partial, two tasks",
    "pipelined mm.jit, 4 stages, 1F1B",
)


def main():
    results = {"config": CONFIG.__dict__, "runs": [measure(s) for s in (1, 2, 4)]}
    results[LIVE_KEY] = {mode: round(live_after_steps(mode), 4) for mode in LIVE_MODES}
    record_run(results, ("runs", LIVE_KEY), "one run: byte counts, the same in every run")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    table = Table(title="parameters + AdamW state per device (reference GPT, 8 blocks, dim 256)")
    for col in ("stages", "total", "largest device", "largest / (total / stages)", "target"):
        table.add_column(col, justify="right")
    for run in results["runs"]:
        table.add_row(
            str(run["stages"]),
            f"{run['total bytes']:,} B",
            f"{run['largest device bytes']:,} B",
            f"{run['largest / (total / stages)']:.3f}",
            "<= 1.15",
        )
    Console().print(table)
    live = Table(title="live arrays after 4 steps / (model + optimizer state + batch)")
    for col in ("step", "ratio", "target"):
        live.add_column(col, justify="right")
    for mode, ratio in results[LIVE_KEY].items():
        live.add_row(mode, f"{ratio:.3f}", "<= 1.05")
    Console().print(live)
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
