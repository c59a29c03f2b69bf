"""Per-device memory of parameters + optimizer state for the reference GPT on 1, 2 and 4 stages.

Target: the device holding the most bytes holds <= 1.15 x (total / stages), i.e. stage_rules
balances the model and nothing is duplicated. Bytes are read from the arrays' own shards on each
device (parameters and AdamW moments; the optimizer step counter is negligible).

Run: python benchmarks/memory.py  (writes benchmarks/results/memory.json)
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT, GPTConfig  # noqa: E402
from mmnnx.models.stages import stage_rules  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "results" / "memory.json"
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


def main():
    results = {"config": CONFIG.__dict__, "runs": [measure(s) for s in (1, 2, 4)]}
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
    print(f"written to {RESULTS}")


if __name__ == "__main__":
    main()
