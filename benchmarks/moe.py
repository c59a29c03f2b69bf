"""Expert parallelism against data parallelism and one SPMD mesh: a mixture-of-experts GPT
trained as ``mmnnx train`` trains it, on the 8 simulated CPU devices of this machine.

Sections:
- ``layouts``: a 4-block GPT whose every block is a mixture of 8 SwiGLU experts (top-2,
  dropless), AdamW, a batch of 16 sequences of 64 tokens, laid out three ways: (a) PP2 x EP4, 2
  pipeline stages (1F1B, M = 4), each an ``expert`` axis of 4 splitting its experts and its
  tokens (``run_tasks(2, 1, 1, expert_axis=4)``, as ``--stages 2 --data-axis 1 --expert-axis
  4``); (b) PP2 x DP4, the baseline, the same stages with a ``data`` axis of 4 and every
  expert on every device of its stage (``--expert-axis 1``); (c) EP8, one task of 8 devices,
  no pipeline, the experts split over all 8 and the whole batch in one step. Step time
  (interleaved rounds, ratios against (b) per round); the expert weights' bytes per device and
  the parameters + AdamW state of the device holding the most (byte counts, read from the
  arrays' shards); and per stage, the forward + backward of one microbatch timed alone
  (``step.timeline``, ``mm.schedules.measured_costs``: what ``--schedule auto`` simulates
  with), EP4's against DP4's: what the exchange costs a stage.
- ``exchange``: one MoE layer's forward (1024 tokens of width 64, 8 experts of hidden 128,
  top-2) on an expert axis of 4 (tokens to their experts and back by ``all_to_all``) against
  the same layer's local compute, on a data axis of 4 with every expert on every device (each
  device its quarter of the tokens, its experts all at hand, nothing exchanged: the same 4
  devices on the same 2 cores), and against the exchange alone: the layer's three
  ``all_to_all`` calls on buffers of the same shapes (rows to the experts, their expert ids,
  rows back) under ``jax.shard_map``. XLA:CPU has no ``ragged_all_to_all``: each device sends
  each other one room for all its assignments, so the exchanged buffers and the expert matmuls
  run over EP x the rows of a ragged exchange.

On this machine the 8 devices share 2 cores: no layout gets more compute than another, so the
step-time ratios say what each layout adds (exchanges, padding, pipeline bubble), not what
more devices would buy.

Run: python benchmarks/moe.py [--only SECTION ...] [--rounds N]  (writes
benchmarks/results/moe.json)
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402
from report import (  # noqa: E402
    interleaved,
    only_sections,
    per_call,
    ratio_spread,
    results_path,
    rounds_option,
    run_sections,
    spread,
)

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT, GPTConfig  # noqa: E402
from mmnnx.modules import MoE, MoEConfig  # noqa: E402
from mmnnx.mpmd.schedules import measured_costs  # noqa: E402
from mmnnx.train import TrainConfig, make_optimizer  # noqa: E402
from mmnnx.train.generation import run_tasks  # noqa: E402
from mmnnx.train.loop import make_steps  # noqa: E402
from mmnnx.train.run_model import run_placement  # noqa: E402

RESULTS = results_path("moe.json")
CONFIG = GPTConfig(
    vocab_size=256,
    dim=64,
    depth=4,
    num_heads=4,
    max_seq_len=64,
    experts=8,
    experts_per_token=2,
    expert_hidden=128,
)
BATCH, MICROBATCHES, STEPS_PER_SAMPLE = 16, 4, 3
LAYOUTS = {  # name: (stages, data axis, expert axis)
    "PP2 x EP4": (2, 1, 4),
    "PP2 x DP4 (baseline)": (2, 4, 1),
    "EP8 (one SPMD mesh)": (1, 1, 8),
}
BASELINE = "PP2 x DP4 (baseline)"


@dataclasses.dataclass
class Run:
    """One layout's model, optimizer, train step (bound) and its unbound step."""

    model: GPT
    opt: nnx.Optimizer
    run: mm.cached_partial
    step: mm.jit


def build(stages: int, data: int, expert: int) -> Run:
    tasks = run_tasks(stages, data, 1, expert)
    model = mm.init(lambda: GPT(CONFIG, rngs=nnx.Rngs(0)), run_placement(CONFIG, tasks))
    config = TrainConfig(microbatches=MICROBATCHES if stages > 1 else 1, schedule="1f1b")
    opt = nnx.Optimizer(model, make_optimizer(config), wrt=nnx.Param)
    step, _ = make_steps(config)
    return Run(model=model, opt=opt, run=mm.cached_partial(step, model, opt), step=step)


def device_bytes(tree, where=lambda path: True) -> int:
    """The most bytes any device holds of ``tree``'s arrays whose path ``where`` accepts."""
    per_device: dict = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(leaf, jax.Array) and where(jax.tree_util.keystr(path)):
            for shard in leaf.addressable_shards:
                per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    return max(per_device.values())


def layouts(rounds: int) -> dict:
    tokens = jax.random.randint(jax.random.key(0), (BATCH, CONFIG.max_seq_len + 1), 0, 256)
    runs = {name: build(*sizes) for name, sizes in LAYOUTS.items()}
    for r in runs.values():
        jax.block_until_ready(r.run(tokens))  # compiles

    def stage_costs(r: Run) -> float:
        costs = measured_costs(r.step.timeline(r.model, r.opt, tokens))
        return max(costs[("F", s)] + costs[("B", s)] for s in (0, 1))

    pipelined = {n: r for n, r in runs.items() if n != "EP8 (one SPMD mesh)"}
    for r in pipelined.values():
        r.step.timeline(r.model, r.opt, tokens)  # its own programs compiled
    candidates = {
        n: per_call(lambda r=r: r.run(tokens), STEPS_PER_SAMPLE, jax.block_until_ready)
        for n, r in runs.items()
    }
    candidates |= {("stage", n): (lambda r=r: stage_costs(r)) for n, r in pipelined.items()}
    samples = interleaved(candidates, rounds)
    out = {}
    for name, r in runs.items():
        state = (nnx.state(r.model), nnx.state(r.opt))
        out[f"{name}: step ms"] = spread(samples[name], 1e3, 1)
        if name != BASELINE:
            out[f"{name}: step / baseline's"] = ratio_spread(samples[name], samples[BASELINE])
        out[f"{name}: expert weights, bytes/device"] = device_bytes(
            nnx.state(r.model), lambda p: "experts" in p
        )
        out[f"{name}: params + AdamW state, bytes on the fullest device"] = device_bytes(state)
    ep, dp = ("stage", "PP2 x EP4"), ("stage", BASELINE)
    out["slowest stage's F + B per microbatch, PP2 x EP4: ms"] = spread(samples[ep], 1e3, 2)
    out["slowest stage's F + B per microbatch, PP2 x DP4: ms"] = spread(samples[dp], 1e3, 2)
    out["stage F + B, EP4 / DP4"] = ratio_spread(samples[ep], samples[dp])
    return out


TOKENS, EP = 1024, 4


def exchange(rounds: int) -> dict:
    def layer():
        with nnx.use_eager_sharding(False):
            moe = MoEConfig(CONFIG.expert_hidden, CONFIG.experts, 2)
            return MoE(CONFIG.dim, moe, rngs=nnx.Rngs(0))

    task, data_task = run_tasks(1, 1, 1, EP)[0], run_tasks(1, EP, 1, 1)[0]
    placed = mm.place(layer(), [(".*", task)])
    replicated = mm.place(layer(), [(".*", data_task)])
    x = jax.random.normal(jax.random.key(1), (TOKENS, CONFIG.dim))
    mesh = task.jax_mesh
    x_ep = jax.device_put(x, NamedSharding(mesh, PartitionSpec(("data", "expert"))))
    x_dp = jax.device_put(x, NamedSharding(data_task.jax_mesh, PartitionSpec("data")))
    forward = nnx.jit(lambda m, x: m(x))

    rows = TOKENS // EP * 2  # a device's assignments: the padded buffer per destination
    spec = PartitionSpec("expert")

    def swaps(send, ids):
        def swap(a):
            return jax.lax.all_to_all(a, "expert", 0, 0, tiled=True)

        received, _ = swap(send), swap(ids)
        return swap(received)  # the rows back, as many

    exchange_only = jax.jit(
        jax.shard_map(swaps, mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=False)
    )
    send = jax.device_put(jnp.ones((EP * EP, rows, CONFIG.dim)), NamedSharding(mesh, spec))
    ids = jax.device_put(jnp.zeros((EP * EP, rows), jnp.int32), NamedSharding(mesh, spec))
    candidates = {
        "ep": per_call(lambda: forward(placed, x_ep), 10, jax.block_until_ready),
        "local": per_call(lambda: forward(replicated, x_dp), 10, jax.block_until_ready),
        "exchange": per_call(lambda: exchange_only(send, ids), 10, jax.block_until_ready),
    }
    for candidate in candidates.values():
        candidate()  # compiles
    samples = interleaved(candidates, rounds)
    return {
        "MoE layer forward, EP4 over 4 devices: ms": spread(samples["ep"], 1e3, 3),
        "the same layer with every expert on every device, DP4 (local compute): ms": spread(
            samples["local"], 1e3, 3
        ),
        "its all_to_alls alone (3 of a padded buffer each): ms": spread(
            samples["exchange"], 1e3, 3
        ),
        "EP4 layer / DP4 layer": ratio_spread(samples["ep"], samples["local"]),
        "all_to_alls / EP4 layer": ratio_spread(samples["exchange"], samples["ep"]),
        "rows each device sends each other one (dropless padding)": rows,
    }


SECTIONS = {"layouts": layouts, "exchange": exchange}


def main(only: list[str] | None, rounds: int):
    run_sections(SECTIONS, RESULTS, "moe", only, str(jax.devices()[0]), rounds)


if __name__ == "__main__":
    main(only_sections(sys.argv), rounds_option(sys.argv))
