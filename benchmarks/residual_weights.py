"""Residual bytes per microbatch, and how many of them are weights: the values each stage's
forward saves for its backward (held once per microbatch in flight), for the demo's GPT
(``mmnnx train``'s defaults: dim 128, 4 blocks, 64 tokens, batch 16 in 4 microbatches, 1F1B)
on 2 stages of one device each, with float32 or bfloat16 parameters computing in float32 or
bfloat16, its blocks unrolled or stacked for ``nnx.scan`` (``--scan-layers``).

"Of weights" are the saved values that do not depend on the microbatch
(``mmnnx.mpmd.plan.residuals``): weights, or values of weights alone, such as the bfloat16
casts a forward computing in bfloat16 makes of float32 weights. Held once per microbatch in
flight, they need not be: a backward can remake them from the weights it reads anyway. Peak:
the most bytes of per-microbatch values a task holds during one step (``mm.jit``'s
``memory_profile``: residuals, activations and cotangents, every microbatch in flight).

Byte counts do not vary from run to run, so this script measures once (no rounds); its results
file records the machine all the same.

Run: python benchmarks/residual_weights.py  (writes benchmarks/results/residual_weights.json)
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from report import record_run, results_path  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT, GPTConfig, stage_rules  # noqa: E402
from mmnnx.mpmd.plan.residuals import saved_residuals  # noqa: E402

RESULTS = results_path("residual_weights.json")
CONFIG = GPTConfig(vocab_size=256, dim=128, depth=4, num_heads=4, max_seq_len=64)
BATCH, MICROBATCHES = 16, 4
PRECISIONS = {  # name: (compute dtype, parameter dtype)
    "float32": ("float32", "float32"),
    "bf16 compute, fp32 params": ("bfloat16", "float32"),
    "bf16 compute, bf16 params": ("bfloat16", "bfloat16"),
}


def step(model, opt, tokens):
    grad_fn = mm.microbatch(
        nnx.value_and_grad(lambda m, t: m.loss(t)), num=MICROBATCHES, schedule="1f1b"
    )
    loss, grads = grad_fn(model, tokens)
    opt.update(model, grads)
    return loss


def measure(dtype: str, param_dtype: str, scan: bool) -> dict:
    """One configuration's residuals per stage (planned only) and peaks (one step run)."""
    config = dataclasses.replace(CONFIG, dtype=dtype, param_dtype=param_dtype, scan_layers=scan)
    with nnx.use_eager_sharding(False):
        model = GPT(config, rngs=nnx.Rngs(0))
    tasks = [mm.Task(f"stage{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(2)]
    mm.place(model, stage_rules(model, tasks, report=False))
    opt = nnx.Optimizer(model, optax.sgd(0.0), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(0), (BATCH, CONFIG.max_seq_len + 1), 0, 256)
    jitted = mm.jit(step)
    jitted.plan(model, opt, tokens)
    ((executable, _),) = jitted._cache.values()
    saved = saved_residuals(executable.graph, executable.plan.pipeline)
    peaks = jitted.memory_profile(model, opt, tokens)
    return {
        f"stage{s}": {
            "residual_bytes": r.nbytes,
            "of_weights_bytes": sum(
                int(jax.numpy.dtype(d).itemsize) * int(jax.numpy.prod(jax.numpy.array(shape)))
                for shape, d in r.invariant
            ),
            "of_weights": [f"{d}{list(shape)}" for shape, d in r.invariant],
            "peak_bytes": peaks[f"stage{s}"][0],
        }
        for s, r in saved.items()
    }


def main() -> None:
    results: dict = {"config": dataclasses.asdict(CONFIG) | {"batch": BATCH}, "runs": {}}
    for layers, scan in (("unrolled", False), ("scanned", True)):
        for name, (dtype, param_dtype) in PRECISIONS.items():
            results["runs"][f"{layers}, {name}"] = measure(dtype, param_dtype, scan)
    results["config"].pop("layers", None)
    record_run(results, ("runs",), "once: byte counts, not timings")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2, default=str) + "\n")
    table = Table(title="bytes each forward saves per microbatch (stage 0 / stage 1)")
    for column in ("run", "residuals", "of weights", "peak held"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for run, stages in results["runs"].items():

        def both(key: str, stages: dict = stages) -> str:
            return " / ".join(f"{stages[s][key]:,}" for s in sorted(stages))

        table.add_row(run, both("residual_bytes"), both("of_weights_bytes"), both("peak_bytes"))
    Console().print(table)


if __name__ == "__main__":
    main()
