"""Where `mm.predict_memory` and the GPU part ways, and where a GPU launch's host time goes: the
two questions `gpu.py`'s first run on an H200 left (benchmarks/HISTORY.md, 2026-11-28).

- ``memory``: the reference GPT's one-device train step (``gpu.py``'s, batch 8) compiled by
  ``jax.jit`` over ``(graphdef, state)``: XLA's own account of it (arguments, outputs, aliased,
  temporaries) beside the prediction's terms, on whatever platform this runs (the CPU's
  account, run here, is the one the prediction was calibrated on);
- ``launch``: the host model of ``gpu.py`` on 4 virtual stages, 20 steps of
  ``mm.cached_partial`` under ``cProfile``: the functions taking the most host time per launch.

Run: python benchmarks/gpu_probe.py [--only memory|launch] [--out FILE]
"""

import argparse
import cProfile
import io
import json
import pstats

import jax
import optax
from flax import nnx
from gpu import HOST, REFERENCE, _config, _model, _setup, _tokens

import mmnnx as mm


def memory(batch: int = 8) -> dict:
    """XLA's account of the one-device step against ``mm.predict_memory``'s terms."""
    config = _config(REFERENCE)
    model = _model(config)
    opt = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
    graphdef, state = nnx.split((model, opt))

    def step(state, tokens):
        m, o = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(lambda m, t: m.loss(t))(m, tokens)
        o.update(m, grads)
        return loss, nnx.state((m, o))

    tokens = jax.ShapeDtypeStruct((batch, config.max_seq_len + 1), "int32")
    compiled = jax.jit(step, donate_argnums=0).lower(state, tokens).compile()
    analysis = compiled.memory_analysis()
    xla = {
        name: getattr(analysis, f"{name}_size_in_bytes", None)
        for name in ("argument", "output", "alias", "temp", "generated_code")
    }
    predicted = mm.predict_memory(config, mm.MemoryLayout(), batch=batch).worst
    terms = ("parameters", "gradients", "optimizer", "packed_weights", "activations",
             "transfers", "workspace", "update", "peak")  # fmt: skip
    return {
        "platform": jax.devices()[0].platform,
        "batch": batch,
        "xla bytes": xla,
        "predicted bytes": {t: getattr(predicted, t) for t in terms},
    }


def launch(steps: int = 20) -> dict:
    """The host's functions per launch of a pipelined step, from ``cProfile``."""
    config = _config(HOST)
    tokens = _tokens(config, 32)
    model, opt, step = _setup("mm", ("interleaved-1f1b", 4, "loop"), config, 16)
    bound = mm.cached_partial(step, model, opt)
    jax.block_until_ready(bound(tokens))
    program = step.plan(model, opt, tokens).program
    launches = sum(type(a).__name__ in ("Run", "Zeros") for a in program.actions)
    profile = cProfile.Profile()
    for _ in range(steps):
        profile.enable()
        out = bound(tokens)
        profile.disable()
        jax.block_until_ready(out)
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text).sort_stats("tottime")
    stats.print_stats(25)
    total = sum(row[2] for row in stats.stats.values())  # tottime over every function
    return {
        "launches per step": launches,
        "host us per launch (profiled)": round(total / steps / launches * 1e6, 1),
        "top functions by own time": text.getvalue().splitlines()[:45],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("memory", "launch"))
    parser.add_argument("--out", default="gpu_probe.json")
    args = parser.parse_args()
    out = {}
    for name, section in (("memory", memory), ("launch", launch)):
        if args.only in (None, name):
            out[name] = section()
            print(name, json.dumps(out[name], indent=1), flush=True)
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
