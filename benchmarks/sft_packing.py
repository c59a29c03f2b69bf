"""Packing (issue 71, item 4): trained tokens per second of a small GPT's train step on
instruction examples of mixed lengths, one example a row (padded) against several to a row
(``mmnnx train --pack``: ``Rows.of(..., pack=True)``, ``mm.modules.Packing``).

1,000 random examples, 8 to 120 tokens, long-tailed (most short, as instruction data is), every
token a target; rows of 129 tokens, batches of 16 rows; a GPT of dim 128 and 4 blocks, AdamW,
``nnx.jit`` on one CPU device. Each round trains 12 steps of each layout, the layouts taking
turns; measured: trained tokens (the targets the loss counts) per second of the steps after
the first, and the rows' padding. Median [min-max] over the rounds (``--rounds N``, default 5),
the ratio packed / one-a-row taken per round.

Run: python benchmarks/sft_packing.py [--rounds N]  (writes benchmarks/results/sft_packing.json)
"""

import sys
import time

import jax
import numpy as np
import optax
from flax import nnx
from report import interleaved, publish, ratio_spread, results_path, rounds_option, spread

from mmnnx.models import GPT, GPTConfig
from mmnnx.train.examples import Rows
from mmnnx.train.records import Example

STEPS, BATCH, LENGTH = 12, 16, 129


def examples(n: int = 1000, seed: int = 0) -> list[Example]:
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(3.2, 0.7, n).astype(int), 8, 120)
    return [Example(rng.integers(1, 256, k).astype(np.int32), np.ones(k, bool)) for k in lengths]


@nnx.jit
def step(model, opt, batch):
    loss, grads = nnx.value_and_grad(lambda m: m.loss(batch))(model)
    opt.update(model, grads)
    return loss


def trained_tokens_per_second(rows: Rows) -> float:
    with nnx.use_eager_sharding(False):
        model = GPT(GPTConfig(dim=128, depth=4, max_seq_len=LENGTH - 1), rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    batches = [rows.batch(np.arange(i * BATCH, (i + 1) * BATCH)) for i in range(STEPS)]
    jax.block_until_ready(step(model, opt, batches[0]))  # compiles
    begin = time.perf_counter()
    for batch in batches[1:]:
        loss = step(model, opt, batch)
    jax.block_until_ready(loss)
    seconds = time.perf_counter() - begin
    return sum(int((b["weights"] > 0).sum()) for b in batches[1:]) / seconds


def main(rounds: int) -> None:
    data = examples()
    layouts = {"one a row": Rows.of(data, LENGTH), "packed": Rows.of(data, LENGTH, pack=True)}
    assert all(len(r.tokens) >= STEPS * BATCH for r in layouts.values())
    runs = {name: (lambda r=r: trained_tokens_per_second(r)) for name, r in layouts.items()}
    speeds = interleaved(runs, rounds)
    results = {
        "packing": {
            **{f"{n}: padding": f"{r.padding_fraction:.3f}" for n, r in layouts.items()},
            **{f"{n}: trained tokens/s": spread(s, digits=0) for n, s in speeds.items()},
            "packed / one a row": ratio_spread(speeds["packed"], speeds["one a row"]),
        }
    }
    publish(results, results_path("sft_packing.json"), "sft packing", ("packing",), rounds)


if __name__ == "__main__":
    main(rounds_option(sys.argv))
