"""Several processes: a pipelined GPT step in two processes against the same layout in one.

The model of issue 41: a GPT (vocab 256, dim 64, 4 blocks, 4 heads, 32 tokens) in two stages of
4 CPU devices each (batch over their 'data' axis), AdamW, 8 microbatches of 1F1B, called through
``mm.cached_partial``. Two configurations, each in processes of its own, alternating over the
rounds (A, B, A, B, ...):
- one process of 8 devices holding both stages;
- ``mmnnx launch -n 2 --devices-per-process 4``: one stage per process.
Each reports its steady step time (median of 5 blocks of 5 steps, each block ended by reading
the loss), and the two-process run also times a hop across the stage boundary (a 4 MiB float32
activation to the other process and its answer back, between three elementwise programs)
through ``mm.jit`` and hand-written around ``jax.experimental.transfer`` (offer + pull, the same
programs, no mmnnx), alternating. Reported: each as the median of the rounds with min-max, and
the ratios (targets: step <= 1.2x one process; hop <= 1.2x hand-written).

Checkpoints: each process of the two-process run saves a larger GPT (dim 256, 8 blocks, vocab
4096) with its AdamW state, and reports how far its resident memory rose above what it was
before the save (sampled every 2 ms while saving) against its own share of the state (the bytes
of the shards on its devices) and the largest array. Target: process 0's rise <= its own share
plus one array (before each process wrote its own part, process 0 received everyone's state).

What blocks: ``--profile`` runs the two-process GPT once more under ``cProfile`` in each
process and prints, per rank, the functions with the most own time over the timed steps
(waiting for a received value shows as ``block_until_ready``; waiting for the loss as ``fetch``).

Predicted (``--predicted``, section ``predicted``): ``benchmarks/pipeline.py``'s model (four
elementwise parts of 12 layers, two per rank, M = 8) with its two ranks on devices 0 and 4, one
per process under ``mmnnx launch``, for GPipe, 1F1B, ZB-H1, interleaved 1F1B and ZB-V: the step
time ``mm.schedules.simulate`` predicts from each round's in-pipeline durations (an
``overlapped_timeline`` of every process's tasks, taken right after the round's step), the
link between the processes measured through the runner's route (``measure_transfers``) with
each boundary's bytes, the host's time per launch (``measure_launch_cost``, the two processes'
mean) and each process's host issuing its own programs (the receiving one waiting for each
value, the sending one offering it as soon as it has launched its producer), against the
measured step (both processes start together and it ends when both have their results).
Target: within 10% for every schedule (medians over the rounds). Reported beside it: the same
prediction as if one host launched both ranks (no waits), and with neither transfers nor
launches.

Run: python benchmarks/multiprocess.py [--rounds N] [--profile | --predicted] (starts the
processes itself). Writes benchmarks/results/multiprocess.json (``--predicted``: its
``predicted`` section only).
"""

import functools
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from report import (
    interleaved,
    median,
    own_results,
    publish,
    ratio_spread,
    results_path,
    rounds_option,
    spread,
)

HERE = pathlib.Path(__file__).parent
RESULTS = results_path("multiprocess.json")
MICROBATCHES = 8
ROWS, WIDTH = 1024, 1024  # the hop's activation: 4 MiB of float32


def _median_time(fn, repeats: int = 5, per_block: int = 5) -> float:
    """Median seconds per call of ``fn`` over ``repeats`` blocks of ``per_block`` calls, each
    block ended by waiting for the last call's result."""
    import jax

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(per_block):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / per_block)
    return statistics.median(times)


def gpt_step_time(measure=_median_time):
    """Steady seconds per step of the two-stage GPT, wherever its stages' devices are, as
    ``measure`` (called with the step) returns them."""
    import jax
    import optax
    from flax import nnx

    import mmnnx as mm
    from mmnnx.models import GPT, GPTConfig, stage_rules

    rules = mm.logical_rules(batch="data")
    tasks = [
        mm.Task(
            f"t{i}",
            mesh=mm.TaskMesh(devices=range(4 * i, 4 * i + 4), axis_names=("data",)),
            logical_axes=rules,
        )
        for i in range(2)
    ]
    config = GPTConfig(vocab_size=256, dim=64, depth=4, num_heads=4, max_seq_len=32)
    with nnx.use_eager_sharding(False):
        model = GPT(config, rngs=nnx.Rngs(0))
    model = mm.place(model, stage_rules(model, tasks, report=False))
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    tokens = jax.random.randint(jax.random.key(0), (32, 33), 0, 256)

    @mm.jit
    def train_step(model, opt, tokens):
        grad_fn = mm.microbatch(
            nnx.value_and_grad(lambda m, t: m.loss(t)),
            num=MICROBATCHES,
            reduce="mean",
            schedule="1f1b",
        )
        loss, grads = grad_fn(model, tokens)
        opt.update(model, grads)
        return loss

    step = mm.cached_partial(train_step, model, opt)
    for _ in range(3):
        float(mm.distributed.fetch(step(tokens)))

    def read_loss():  # every process reads the loss: the block's steps are over everywhere
        return jax.numpy.asarray(mm.distributed.fetch(step(tokens)))

    return measure(read_loss)


def hop_times() -> dict[str, float]:
    """Seconds per 4 MiB round trip (to the other process and back) through mm.jit and by hand
    over the transfer server, alternating blocks; rank 0 waits for the answer."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import SingleDeviceSharding

    import mmnnx as mm
    from mmnnx.distributed.transport import transport

    s0 = mm.Task("s0", mesh=mm.TaskMesh(devices=[0]))
    s1 = mm.Task("s1", mesh=mm.TaskMesh(devices=[4]))

    class Scale(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.full((WIDTH,), 1.01))

    a, b = mm.place(Scale(), [(".*", s0)]), mm.place(Scale(), [(".*", s1)])
    x = jnp.ones((ROWS, WIDTH))

    @mm.jit
    def round_trip(a, b, x):
        there = jnp.tanh(a.w[...] * x)  # on s0
        back = jnp.tanh(b.w[...] * there)  # on s1
        return jnp.tanh(a.w[...] * back)  # on s0

    def through_mmnnx():
        return [o for o in [round_trip(a, b, x)] if o.is_fully_addressable]

    me = jax.process_index()
    d0, d1 = jax.devices()[0], jax.devices()[4]
    layer = jax.jit(lambda w, h: jnp.tanh(w * h))
    wa, wb = a.w.get_value(), b.w.get_value()
    x0 = jax.device_put(x, d0) if me == 0 else None

    def spec(device):
        return jax.ShapeDtypeStruct(
            (ROWS, WIDTH), jnp.float32, sharding=SingleDeviceSharding(device)
        )

    def by_hand():
        if me == 0:
            transport().send(1, [layer(wa, x0)])
            (back,) = transport().receive(1, [spec(d0)])
            return [layer(wa, back)]
        (there,) = transport().receive(0, [spec(d1)])
        transport().send(0, [layer(wb, there)])
        return []

    samples: dict[str, list[float]] = {"mm.jit": [], "by hand": []}
    for _ in range(10):
        for name, fn in (("mm.jit", through_mmnnx), ("by hand", by_hand)):
            fn()  # warm
            samples[name].append(_median_time(fn, repeats=3, per_block=5))
            mm.distributed.fetch(jnp.zeros(()))
    return {name: statistics.median(times) for name, times in samples.items()}


PREDICTED_SCHEDULES = ("gpipe", "1f1b", "zero-bubble-h1", "interleaved-1f1b", "zero-bubble-v")


def _together(step, *args) -> float:
    """Seconds of one call of ``step`` started by every process together (after a gather) and
    ended once every process has its results (the next gather); this process's count."""
    import mmnnx as mm

    mm.distributed.gather(0)
    start = time.perf_counter()
    own_results(step(*args))
    mm.distributed.gather(0)
    return time.perf_counter() - start


def predicted(rounds: int) -> dict:
    """The ``predicted`` section (see the module docstring), on every process alike."""
    from pipeline import build_quarters, predicted_from

    import mmnnx as mm

    built = {}
    for name in PREDICTED_SCHEDULES:
        step, model, x = build_quarters(MICROBATCHES, name, devices=(0, 4))
        schedule = step.plan(model, x).pipeline.schedule
        launch = mm.schedules.measure_launch_cost(step, model, x, calls=1)  # warms it up too
        launch = statistics.mean(mm.distributed.gather(launch))
        transfers = mm.schedules.measure_transfers(step, model, x)
        built[name] = (step, model, x, schedule, transfers.simulate_options(schedule, launch))

    def one_round(step, model, x) -> tuple[float, list]:
        return _together(step, model, x), step.overlapped_timeline(model, x)

    runs = interleaved(
        {name: functools.partial(one_round, *b[:3]) for name, b in built.items()}, rounds
    )
    steps = mm.distributed.gather({name: [t for t, _ in got] for name, got in runs.items()})
    out, medians = {}, {}
    for name, (_, _, _, schedule, options) in built.items():
        t_step = [max(ts) for ts in zip(*(s[name] for s in steps), strict=True)]

        paired = [(events, t) for (_, events), t in zip(runs[name], t_step, strict=True)]
        one_host = {**options, "processes": None}
        per_round = {
            "predicted / measured step": [
                predicted_from(e, schedule, **options) / t for e, t in paired
            ],
            "predicted as one host / measured step": [
                predicted_from(e, schedule, **one_host) / t for e, t in paired
            ],
            "predicted without transfers or launches / measured step": [
                predicted_from(e, schedule) / t for e, t in paired
            ],
        }
        out[f"{name}: step ms"] = spread(t_step, 1e3, 1)
        out[f"{name}: ms per transfer over the link"] = {
            f"{kind}{stage}": round(seconds * 1e3, 2)
            for (kind, stage), seconds in sorted(options["transfer_costs"].items())
        }
        out[f"{name}: host ms per launch"] = round(options["launch_cost"] * 1e3, 3)
        for measure, values in per_round.items():
            out[f"{name}: {measure}"] = spread(values, digits=3)
            medians[f"{name}: {measure}"] = median(values)
    out["target: every prediction within 10% (medians)"] = all(
        abs(v - 1) <= 0.1 for k, v in medians.items() if k.endswith(": predicted / measured step")
    )
    return out


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def save_memory() -> dict[str, float]:
    """This process's resident memory rise while saving a larger GPT and its AdamW state, its
    own share of that state and the largest array, in MiB."""
    import threading

    import jax
    import optax
    from flax import nnx

    import mmnnx as mm
    from mmnnx.models import GPT, GPTConfig, stage_rules
    from mmnnx.train import Checkpointer

    tasks = [mm.Task(f"t{i}", mesh=mm.TaskMesh(devices=range(4 * i, 4 * i + 4))) for i in range(2)]
    config = GPTConfig(vocab_size=4096, dim=256, depth=8, num_heads=4, max_seq_len=32)
    with nnx.use_eager_sharding(False):
        model = GPT(config, rngs=nnx.Rngs(0))
    model = mm.place(model, stage_rules(model, tasks, report=False))
    opt = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
    leaves = jax.tree.leaves((nnx.state(model), nnx.state(opt)))
    own = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.replica_id == 0)
    largest = max(x.nbytes for x in leaves)
    total = sum(x.nbytes for x in leaves)
    with tempfile.TemporaryDirectory() as directory, Checkpointer(directory) as ckpt:
        ckpt.save(0, model=model, opt=opt)  # warm: Orbax, TensorStore and the writer set up
        base, peak, done = _resident_bytes(), [0], threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], _resident_bytes())
                time.sleep(0.002)

        watcher = threading.Thread(target=sample)
        watcher.start()
        ckpt.save(1, model=model, opt=opt)
        done.set()
        watcher.join()
    mib = 2**20
    return {
        "rise": (max(peak[0], base) - base) / mib,
        "own": own / mib,
        "largest": largest / mib,
        "total": total / mib,
    }


def _profiled(fn, top: int = 8) -> tuple[float, list[dict]]:
    """``fn()`` under cProfile: its result and the ``top`` functions by own time."""
    import cProfile
    import pstats

    profile = cProfile.Profile()
    result = profile.runcall(fn)
    stats = pstats.Stats(profile).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return result, [
        {"function": f"{pathlib.Path(file).name}:{line} {name}", "own s": round(own, 3),
         "calls": calls}
        for (file, line, name), (_, calls, own, _, _) in rows
    ]  # fmt: skip


def worker(out_dir: str, profile: bool = False, predicting: int = 0) -> None:
    import jax

    import mmnnx as mm

    mm.distributed.initialize()
    if predicting:
        result = predicted(predicting)
        pathlib.Path(out_dir, f"rank{jax.process_index()}.json").write_text(json.dumps(result))
        return
    if profile:
        seconds, top = gpt_step_time(lambda step: _profiled(lambda: _median_time(step)))
        result = {"step": seconds, "profile": top}
        pathlib.Path(out_dir, f"rank{jax.process_index()}.json").write_text(json.dumps(result))
        return
    result = {"step": gpt_step_time()}
    if jax.process_count() > 1:
        result["hop"] = hop_times()
        result["save"] = save_memory()
    pathlib.Path(out_dir, f"rank{jax.process_index()}.json").write_text(json.dumps(result))


def _run(command: list[str], env: dict, out: str) -> list[dict]:
    done = subprocess.run(command, env=env, timeout=900, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-6000:]}{done.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(pathlib.Path(out).glob("rank*.json"))]


def main(rounds: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    one_env = dict(env, XLA_FLAGS="--xla_force_host_platform_device_count=8")

    def one_process() -> dict:
        with tempfile.TemporaryDirectory() as alone:
            (single,) = _run([sys.executable, __file__, "--worker", alone], one_env, alone)
        return single

    def two_processes() -> list[dict]:
        with tempfile.TemporaryDirectory() as together:
            return _run(
                [sys.executable, "-m", "mmnnx", "launch", "-n", "2", "--devices-per-process",
                 "4", "--", sys.executable, __file__, "--worker", together],
                env,
                together,
            )  # fmt: skip

    runs = interleaved({"one": one_process, "two": two_processes}, rounds)
    one = [r["step"] for r in runs["one"]]
    two = [max(x["step"] for x in ranks) for ranks in runs["two"]]
    hop = [ranks[0]["hop"]["mm.jit"] for ranks in runs["two"]]  # rank 0 waits for the round trip
    by_hand = [ranks[0]["hop"]["by hand"] for ranks in runs["two"]]
    saves = [ranks[0]["save"] for ranks in runs["two"]]
    results = {
        "gpt": {
            "layout": "2 stages x 4 CPU devices (batch over 'data'), 1F1B, M = 8",
            "rounds": rounds,
            "one process ms": spread(one, 1e3),
            "two processes ms": spread(two, 1e3),
            "two processes / one process (target <= 1.2)": ratio_spread(two, one),
        },
        "hop": {
            "4 MiB round trip, mm.jit ms": spread(hop, 1e3),
            "4 MiB round trip, by hand over jax.experimental.transfer ms": spread(by_hand, 1e3),
            "mm.jit / by hand (target <= 1.2)": ratio_spread(hop, by_hand),
        },
        "checkpoint": {
            "state MiB (GPT dim 256, 8 blocks, AdamW)": f"{saves[0]['total']:.1f}",
            "process 0's own share MiB; largest array MiB": (
                f"{saves[0]['own']:.1f}; {saves[0]['largest']:.1f}"
            ),
            "process 0's resident rise while saving, MiB": spread([x["rise"] for x in saves]),
            "rise <= own share + largest array": all(
                x["rise"] <= x["own"] + x["largest"] for x in saves
            ),
        },
    }
    publish(results, RESULTS, "multiprocess", ("gpt", "hop", "checkpoint"), rounds)


def profile() -> None:
    """Prints each rank's functions with the most own time over a two-process GPT run."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as together:
        ranks = _run(
            [sys.executable, "-m", "mmnnx", "launch", "-n", "2", "--devices-per-process",
             "4", "--", sys.executable, __file__, "--worker", together, "--profile"],
            env,
            together,
        )  # fmt: skip
    for rank, result in enumerate(ranks):
        print(f"rank {rank}: {result['step'] * 1e3:.1f} ms per step (profiled)")
        for row in result["profile"]:
            print(f"  {row['own s']:8.3f} s  {row['calls']:7d} calls  {row['function']}")


def main_predicted(rounds: int) -> None:
    """Runs the ``predicted`` section under ``mmnnx launch`` and writes it into the results
    file, the other sections kept."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as together:
        ranks = _run(
            [sys.executable, "-m", "mmnnx", "launch", "-n", "2", "--devices-per-process",
             "4", "--", sys.executable, __file__, "--worker", together, "--predicting",
             str(rounds)],
            env,
            together,
        )  # fmt: skip
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results["predicted"] = ranks[0]
    publish(results, RESULTS, "multiprocess", ("predicted",), rounds)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        predicting = "--predicting" in sys.argv
        rounds = int(sys.argv[sys.argv.index("--predicting") + 1]) if predicting else 0
        worker(sys.argv[2], profile="--profile" in sys.argv, predicting=rounds)
    elif "--profile" in sys.argv:
        profile()
    elif "--predicted" in sys.argv:
        main_predicted(rounds_option(sys.argv))
    else:
        main(rounds_option(sys.argv))
