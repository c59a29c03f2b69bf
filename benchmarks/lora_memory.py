"""Memory per device of LoRA fine-tuning against full fine-tuning: parameters + optimizer state +
gradients, for a Llama-shaped GPT over 2 stages of one device each.

Full fine-tuning (the baseline) trains every ``nnx.Param``: AdamW keeps two moments of each and
a step makes a gradient of each. LoRA (``mm.modules.add_lora``, optimizer and gradients over
``nnx.LoRAParam``, as ``mmnnx train --lora-rank``) keeps the frozen weights, adds the adapters,
and has moments and gradients of the adapters only. With bfloat16 parameters
(``--param-dtype bfloat16``), full fine-tuning keeps float32 master copies in the optimizer
state and makes bfloat16 gradients (``--optimizer-dtype bfloat16``: AdamW's moments in
bfloat16); LoRA's frozen base is bfloat16, its adapters float32.
Bytes are read from the arrays' own shards
on each device: the model's Variables, the optimizer's state, and the gradients one pipelined
step (1F1B, 4 microbatches, ``mmnnx.train.loop.loss_and_grads``) returns. Each row reports the
device holding the most, and its ratio to the baseline's in the same run.

Byte counts do not vary from run to run, so this script measures once (no rounds); its results
file records the machine all the same.

Run: python benchmarks/lora_memory.py  (writes benchmarks/results/lora_memory.json)
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import json  # noqa: E402

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from report import record_run, results_path  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT, GPTConfig  # noqa: E402
from mmnnx.models.stages import stage_rules  # noqa: E402
from mmnnx.modules import add_lora  # noqa: E402
from mmnnx.train import TrainConfig, make_optimizer  # noqa: E402
from mmnnx.train.loop import loss_and_grads  # noqa: E402

RESULTS = results_path("lora_memory.json")
# Llama-shaped (gated MLP without biases, grouped-query attention, untied head), small enough
# to measure in seconds; the ratios depend on the shapes, not on the sizes' scale much.
CONFIG = GPTConfig(
    vocab_size=2048,
    dim=512,
    depth=8,
    num_heads=8,
    num_kv_heads=4,
    mlp_hidden=1536,
    gated_mlp=True,
    mlp_bias=False,
    max_seq_len=64,
)
MODES = {  # name: (LoRA, the parameters' dtype, AdamW's moments' dtype)
    "full fine-tuning": (None, "float32", "float32"),
    "full, bf16 params + fp32 masters": (None, "bfloat16", "float32"),
    "full, bf16 params + fp32 masters, bf16 moments": (None, "bfloat16", "bfloat16"),
    "LoRA r=8, all projections": (dict(rank=8), "float32", "float32"),
    "LoRA r=8, all projections, bf16 base": (dict(rank=8), "bfloat16", "float32"),
    "LoRA r=8, q and v": (dict(rank=8, targets=("q", "v")), "float32", "float32"),
    "LoRA r=64, all projections": (dict(rank=64), "float32", "float32"),
}
STEP = TrainConfig(microbatches=4, schedule="1f1b")


def bytes_per_device(*trees) -> dict[int, int]:
    out: dict[int, int] = {}
    for leaf in jax.tree.leaves(trees):
        if isinstance(leaf, jax.Array):
            for shard in leaf.addressable_shards:
                out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


def measure(lora: dict | None, param_dtype: str, optimizer_dtype: str) -> dict:
    tasks = [mm.Task(f"s{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(2)]
    config = dataclasses.replace(CONFIG, param_dtype=param_dtype)
    # bfloat16 Params are trained through float32 masters; LoRA's adapters are float32
    trained_dtype = param_dtype if lora is None else "float32"
    step = dataclasses.replace(STEP, param_dtype=trained_dtype, optimizer_dtype=optimizer_dtype)

    def factory():
        return GPT(config, rngs=nnx.Rngs(0))

    with nnx.use_eager_sharding(False):
        rules = stage_rules(nnx.eval_shape(factory), tasks, report=False)
    model = mm.init(factory, rules)
    trainable = nnx.Param
    if lora is not None:
        add_lora(model, **lora)
        trainable = nnx.LoRAParam
    opt = nnx.Optimizer(model, make_optimizer(step), wrt=trainable)
    batch = jax.random.randint(jax.random.key(0), (8, CONFIG.max_seq_len + 1), 0, 2048)
    _, grads = mm.jit(loss_and_grads(step, trainable))(model, batch)
    parts = {
        "parameters": bytes_per_device(nnx.state(model)),
        "optimizer state": bytes_per_device(nnx.state(opt, nnx.OptState)),
        "gradients": bytes_per_device(grads),
    }
    devices = sorted(set().union(*parts.values()))
    total = {d: sum(p.get(d, 0) for p in parts.values()) for d in devices}
    largest = max(devices, key=total.get)
    return {
        "largest device": largest,
        **{name: part.get(largest, 0) for name, part in parts.items()},
        "total": total[largest],
        "per device": {str(d): total[d] for d in devices},
        "trained parameters": sum(x.size for x in jax.tree.leaves(nnx.state(model, trainable))),
    }


def main():
    runs = {mode: measure(*how) for mode, how in MODES.items()}
    base = runs["full fine-tuning"]
    for row in runs.values():
        row["total / full fine-tuning"] = round(row["total"] / base["total"], 4)
    config = {f.name: getattr(CONFIG, f.name) for f in dataclasses.fields(CONFIG)}
    results = {"config": {k: v for k, v in config.items() if k != "layers"}, "runs": runs}
    record_run(results, ("runs",), "one run: byte counts, the same in every run")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    table = Table(
        title="bytes per device, largest device (2 stages, Llama-shaped GPT: 8 blocks, dim 512)"
    )
    columns = ("mode", "trained (all devices)", "parameters", "optimizer state", "gradients")
    columns += ("total", "/ full")
    for column in columns:
        table.add_column(column, justify="right")
    for mode, row in runs.items():
        table.add_row(
            mode,
            f"{row['trained parameters']:,}",
            *(f"{row[k]:,} B" for k in ("parameters", "optimizer state", "gradients", "total")),
            f"{row['total / full fine-tuning']:.3f}",
        )
    Console(width=140).print(table)
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
