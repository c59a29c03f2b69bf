"""The partition planner (``mm.schedules.partition``) against the equal split and against the
best split, measured.

Two stages on single devices (0 and 1), 1F1B with M microbatches, a full train step (gradients
through ``mm.microbatch``, then AdamW's update), ``--xla_cpu_multi_thread_eigen=false`` (as the
issue's overhead harness).

- ``gpt``: the reference GPT (``mmnnx.models.GPT``) with a large vocabulary (16384), whose head
  and loss (a vocabulary-sized matmul and softmax on the last stage) weigh as several blocks:
  the planned split's step time against the equal split's (the same number of blocks per
  stage), per round (target: planned >= 15% faster, ratio equal / planned >= 1.15), and the
  ratio the planner predicts. On this machine the two stages of this model do not overlap:
  XLA:CPU runs a program without a loop inline, in the thread that launches it, and its larger
  kernels take both cores, so the step takes about the sum of both stages' work whatever the
  split (measured here: two loop-free 512x512 matmul programs on two devices take 2.1-2.4x
  one's time; the GPT's stages, timed in the running pipeline, each slow down about 2x);
- ``unequal``: a stack of residual MLP blocks of unequal widths (three 8x wider than the
  other five), each block's rows in chunks of 16 in a ``lax.scan`` (as benchmarks/pipeline.py's
  stages: small kernels, a loop, so the two stages' programs run at once, one core each): the
  same comparison (target: >= 1.15);
- ``best``: the stack of ``unequal`` cut every way the planner may cut it over the two
  stages (8 splits: 7, and its read-in alone on the first stage), each split's step measured;
  the planned split's step time against the fastest one's (target: within 5%, planned / best
  <= 1.05).

- ``gpt_processes``: the ``gpt`` comparison with a core per stage: each stage in a process of
  its own (``mmnnx launch -n 2 --devices-per-process 1``), each process pinned to one core
  before its JAX backend starts (where the machine has two), so the stages' programs run at
  once; each sample the slowest process's median step (7 blocks of 3 steps ended by reading
  the loss).

Every timing is taken in interleaved rounds (``--rounds N``, default 5; the candidates of a
section take turns in each round) and reported as the median [min-max] over the rounds, a
ratio taken per round; targets are checked on the medians.

Run: python benchmarks/partition.py [--only SECTION ...] [--rounds N] (sections: the keys of
``SECTIONS``; with ``--only``, their results replace theirs in the file and the others stay).
Writes benchmarks/results/partition.json.
"""

import os

_flags = os.environ.get("XLA_FLAGS", "")
for _flag in ("--xla_force_host_platform_device_count=8", "--xla_cpu_multi_thread_eigen=false"):
    if _flag.split("=")[0] not in _flags:
        _flags += " " + _flag
os.environ["XLA_FLAGS"] = _flags.strip()

import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import pinned  # noqa: E402
from flax import nnx  # noqa: E402
from report import (  # noqa: E402
    interleaved,
    median,
    only_sections,
    per_call,
    ratio_spread,
    ratios,
    results_path,
    rounds_option,
    run_sections,
    spread,
)

import mmnnx as mm  # noqa: E402
from mmnnx.models import GPT, GPTConfig, split_rules  # noqa: E402
from mmnnx.partition.search import equal_split  # noqa: E402

RESULTS = results_path("partition.json")
M = 4
STEPS = 3  # per sample: their median, each step waited for (one step's time, as predicted)
GPT_CONFIG = GPTConfig(vocab_size=16384, dim=128, depth=8, num_heads=4, max_seq_len=64)
GPT_BATCH = (8, 65)
WIDTHS = (2048, 2048, 2048, 256, 256, 256, 256, 256)
DIM, ROWS = 128, 256


CHUNK = 16


class Block(nnx.Module):
    """``x + down(gelu(up(x)))`` of hidden size ``width``, over chunks of ``CHUNK`` rows in a
    ``lax.scan``."""

    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(DIM, width, rngs=rngs)
        self.down = nnx.Linear(width, DIM, rngs=rngs)

    def __call__(self, x):
        def chunk(carry, h):
            return carry, h + self.down(jax.nn.gelu(self.up(h)))

        _, out = jax.lax.scan(chunk, None, x.reshape(-1, CHUNK, DIM))
        return out.reshape(x.shape)


class Stack(nnx.Module):
    """Residual MLP blocks of the given widths, a linear read-in and a squared-error loss."""

    def __init__(self, widths=WIDTHS, *, rngs: nnx.Rngs):
        self.embed = nnx.Linear(DIM, DIM, rngs=rngs)
        self.blocks = nnx.List([Block(w, rngs=rngs) for w in widths])

    def loss(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return jnp.mean((h - x) ** 2)


def loss_fn(model, batch):
    return model.loss(batch)


def tasks():
    return [mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(2)]


def train_step():
    @mm.jit
    def step(model, opt, batch):
        grad_fn = mm.microbatch(nnx.value_and_grad(loss_fn), num=M, reduce="mean", schedule="1f1b")
        loss, grads = grad_fn(model, batch)
        opt.update(model, grads)
        return loss

    return step


def runner(factory, rules, batch):
    """A sample of the step time of the model ``factory`` makes placed by ``rules``."""
    model = mm.init(factory, rules)
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    step = train_step()
    jax.block_until_ready(step(model, opt, batch))  # compiled

    def sample() -> float:
        return median([per_call(lambda: step(model, opt, batch), 1, jax.block_until_ready)()
                       for _ in range(STEPS)])  # fmt: skip

    return sample


def plan_for(factory, batch):
    """The model ``factory`` builds, abstract, and the planner's result for it (1F1B, M)."""
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(factory)
    result = mm.schedules.partition(
        abstract, loss_fn, batch, tasks(), optimizer=optax.adamw(1e-3), schedules="1f1b",
        microbatches=M,
    )  # fmt: skip
    return abstract, result


def planned_against_equal(factory, batch, rounds: int) -> dict:
    """The planner's split against the equal one, each step timed in interleaved rounds."""
    abstract, result = plan_for(factory, batch)
    equal = equal_split(len(abstract.blocks), 2)
    out = interleaved(
        {
            "planned": runner(factory, result.rules, batch),
            "equal": runner(factory, split_rules(abstract, tasks(), equal), batch),
        },
        rounds,
    )
    predicted_equal = result.equal.predicted_seconds if result.equal else None
    speedup = median([e / p for e, p in zip(out["equal"], out["planned"], strict=True)])
    return {
        "planned split (blocks per stage)": "/".join(map(str, result.sizes)),
        "equal split": "/".join(map(str, equal)),
        "planned step ms": spread(out["planned"], 1e3),
        "equal step ms": spread(out["equal"], 1e3),
        "equal / planned (target >= 1.15)": ratio_spread(out["equal"], out["planned"]),
        "predicted equal / planned": (
            f"{predicted_equal / result.predicted_seconds:.2f}" if predicted_equal else "-"
        ),
        "target met": speedup >= 1.15,
    }


def gpt(rounds: int) -> dict:
    return planned_against_equal(_gpt, _gpt_batch(), rounds)


def unequal(rounds: int) -> dict:
    batch = jax.random.normal(jax.random.key(0), (ROWS, DIM))
    return planned_against_equal(lambda: Stack(rngs=nnx.Rngs(0)), batch, rounds)


def best(rounds: int) -> dict:
    """Every split of ``Stack`` over two stages measured; the planner's against the fastest."""
    batch = jax.random.normal(jax.random.key(0), (ROWS, DIM))

    def factory():
        return Stack(rngs=nnx.Rngs(0))

    abstract, result = plan_for(factory, batch)
    every = sorted({c.sizes for c in result.candidates})  # every split the planner may choose
    runners = {s: runner(factory, split_rules(abstract, tasks(), s), batch) for s in every}
    out = interleaved(runners, rounds)
    medians = {s: median(t) for s, t in out.items()}
    fastest = min(medians, key=medians.get)
    planned = tuple(result.sizes)
    ratio = medians[planned] / medians[fastest]
    return {
        "planned split": "/".join(map(str, planned)),
        "fastest split measured": "/".join(map(str, fastest)),
        **{f"step ms, split {'/'.join(map(str, s))}": spread(out[s], 1e3) for s in every},
        "planned / fastest (target <= 1.05)": ratio_spread(out[planned], out[fastest]),
        "target met": ratio <= 1.05,
    }


def gpt_processes(rounds: int) -> dict:
    """``gpt``'s planned and equal splits, each stage in a process of its own pinned to a core."""
    abstract, result = plan_for(_gpt, _gpt_batch())
    splits_ = {"planned": tuple(result.sizes), "equal": equal_split(len(abstract.blocks), 2)}
    out = interleaved(
        {name: lambda s=s: _in_two_processes(s) for name, s in splits_.items()}, rounds
    )
    return {
        "layout": "one process per stage, one device and one core each (pinned)",
        "planned split (blocks per stage)": "/".join(map(str, splits_["planned"])),
        "planned step ms": spread(out["planned"], 1e3),
        "equal step ms": spread(out["equal"], 1e3),
        "equal / planned (target >= 1.15)": ratio_spread(out["equal"], out["planned"]),
        "predicted equal / planned": (
            f"{result.equal.predicted_seconds / result.predicted_seconds:.2f}"
            if result.equal
            else "-"
        ),
        "target met": median(ratios(out["equal"], out["planned"])) >= 1.15,
    }


def _gpt():
    return GPT(GPT_CONFIG, rngs=nnx.Rngs(0))


def _gpt_batch():
    return jax.random.randint(jax.random.key(0), GPT_BATCH, 0, GPT_CONFIG.vocab_size)


def _in_two_processes(sizes) -> float:
    """The slowest process's median step time of ``_gpt`` split as ``sizes`` over two processes
    (one stage each, each pinned to its own core where there are two)."""
    return max(pinned.launch(__file__, ["--worker", "/".join(map(str, sizes))]))


def _worker(split: str) -> None:
    """One process of :func:`_in_two_processes`: its stage's median step, handed back."""
    pinned.pin_to_own_core()
    mm.distributed.initialize()
    with nnx.use_eager_sharding(False):
        model = _gpt()
    sizes = tuple(int(n) for n in split.split("/"))
    model = mm.place(model, split_rules(model, tasks(), sizes))
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    step = mm.cached_partial(train_step(), model, opt)
    batch = _gpt_batch()
    for _ in range(3):
        float(mm.distributed.fetch(step(batch)))
    block = per_call(lambda: step(batch), 3, lambda loss: float(mm.distributed.fetch(loss)))
    pinned.write_result(median([block() for _ in range(7)]))


SECTIONS = {"gpt": gpt, "unequal": unequal, "best": best, "gpt_processes": gpt_processes}


def main(only: list[str] | None, rounds: int):
    """Runs every section, or those in ``only`` (their results replace theirs in the file)."""
    run_sections(SECTIONS, RESULTS, "partition", only, str(jax.devices()[0]), rounds)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2])
    else:
        main(only_sections(sys.argv), rounds_option(sys.argv))
