"""Loading a Hugging Face checkpoint onto pipeline stages: each process's host memory and time,
``mm.models.from_pretrained`` against building the model eagerly and placing it.

The checkpoint: a random Llama-shaped one (``LlamaForCausalLM``, dim 1024, 16 layers, 16 heads
of 64 with 4 key/value heads, MLP 2816, vocabulary 16384, untied; 214 M parameters, 0.80 GiB
of float32 in shards of at most 192 MiB with their index), written once into a temporary
directory. Two processes (``mmnnx launch -n 2 --devices-per-process 1``), one stage of one CPU
device each (``stage_rules``: the embedding and layers 0-7 on process 0, layers 8-15, the norm
and the head on process 1), alternating over the rounds (A, B, A, B, ...), each a fresh pair of
processes:
- ``from_pretrained(dir, tasks=...)``: the model built abstractly, each process reading only
  its own stage's tensors, slice by slice, straight onto its device;
- the baseline: ``GPT(config, rngs=...)`` built eagerly (the whole model in each process's
  memory), then ``mm.place`` onto the same stages.
Measured in each process: the rise of its resident memory's high-water mark during the load
(``VmHWM`` reset through ``/proc/self/clear_refs`` just before, minus ``VmRSS`` then; it counts
the checkpoint's file pages mapped while they are read, and a CPU device's buffers, which are
host memory), its anonymous and file-backed parts at their peaks (sampled every 2 ms), and the
load's wall time. Targets: each process's rise <= its own share of the parameters (the bytes on
its device) + the largest tensor; ``from_pretrained`` no slower than the baseline.

Run: python benchmarks/pretrained_load.py [--rounds N] (starts the processes itself).
Writes benchmarks/results/pretrained_load.json.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

from report import interleaved, publish, ratio_spread, ratios, results_path, rounds_option, spread

HERE = pathlib.Path(__file__).parent
RESULTS = results_path("pretrained_load.json")
MIB = 2**20
SHARD_BYTES = 192 * MIB
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "vocab_size": 16384,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def _shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor of the checkpoint and its shape, in transformers' order."""
    d, f, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    q = CONFIG["num_attention_heads"] * CONFIG["head_dim"]
    kv = CONFIG["num_key_value_heads"] * CONFIG["head_dim"]
    out = {"model.embed_tokens.weight": (v, d)}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
        }
    return out | {"model.norm.weight": (d,), "lm_head.weight": (v, d)}


def write_checkpoint(directory: pathlib.Path) -> int:
    """Writes the random checkpoint into ``directory`` one shard at a time; returns its bytes."""
    import numpy as np

    from mmnnx.models.pretrained.files import INDEX, shard_name, write_shards

    rng = np.random.default_rng(0)
    groups: list[list[str]] = [[]]
    size = 0
    shapes = _shapes()
    for name, shape in shapes.items():
        nbytes = 4 * int(np.prod(shape))
        if size + nbytes > SHARD_BYTES and size:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map = {}
    for i, names in enumerate(groups):
        file = shard_name(i, len(groups))
        tensors = {}
        for name in names:
            shape = shapes[name]
            tensors[name] = (
                1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
                if len(shape) == 1
                else 0.02 * rng.standard_normal(shape, dtype=np.float32)
            )
        write_shards(directory, {file: tensors})
        weight_map |= dict.fromkeys(names, file)
        del tensors
    total = sum(4 * int(np.prod(s)) for s in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    return total


def _status() -> dict[str, int]:
    """This process's memory counters from ``/proc/self/status``, in bytes."""
    out = {}
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def worker(mode: str, source: str, out: str) -> None:
    """One process's load (``mode``: ``load`` or ``eager``), measured; writes rank{i}.json."""
    import gc

    import jax
    from flax import nnx

    import mmnnx as mm
    from mmnnx.models import GPT, from_pretrained, stage_rules
    from mmnnx.models.pretrained.families import FAMILIES

    mm.distributed.initialize()
    tasks = [mm.Task(f"stage{i}", mesh=mm.TaskMesh(devices=[i])) for i in range(2)]
    config = FAMILIES["LlamaForCausalLM"].gpt_config(CONFIG, source)

    def load():
        return from_pretrained(source, tasks=tasks)

    def eager():
        with nnx.use_eager_sharding(False):
            model = GPT(config, rngs=nnx.Rngs(0))
        return mm.place(model, stage_rules(model, tasks, report=False))

    gc.collect()
    pathlib.Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now
    base = _status()
    peaks = {"RssAnon": base["RssAnon"], "RssFile": base["RssFile"]}
    done = threading.Event()

    def sample():
        while not done.is_set():
            now = _status()
            for key in peaks:
                peaks[key] = max(peaks[key], now[key])
            time.sleep(0.002)

    watcher = threading.Thread(target=sample)
    watcher.start()
    start = time.perf_counter()
    model = {"load": load, "eager": eager}[mode]()
    leaves = jax.tree.leaves(nnx.state(model))
    jax.block_until_ready([x for x in leaves if x.is_fully_addressable])
    seconds = time.perf_counter() - start
    done.set()
    watcher.join()
    after = _status()
    own = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.replica_id == 0)
    result = {
        "rise": (after["VmHWM"] - base["VmRSS"]) / MIB,
        "anon rise": (peaks["RssAnon"] - base["RssAnon"]) / MIB,
        "file peak": (peaks["RssFile"] - base["RssFile"]) / MIB,
        "own": own / MIB,
        "largest": max(x.nbytes for x in leaves) / MIB,
        "total": sum(x.nbytes for x in leaves) / MIB,
        "seconds": seconds,
    }
    pathlib.Path(out, f"rank{jax.process_index()}.json").write_text(json.dumps(result))


def _launch(mode: str, source: pathlib.Path) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, "-m", "mmnnx", "launch", "-n", "2", "--devices-per-process", "1",
            "--", sys.executable, __file__, "--worker", mode, str(source), out,
        ]  # fmt: skip
        done = subprocess.run(command, env=env, timeout=600, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{mode} failed:\n{done.stdout[-6000:]}{done.stderr[-3000:]}")
        return [json.loads(pathlib.Path(out, f"rank{i}.json").read_text()) for i in (0, 1)]


def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        source = pathlib.Path(tmp) / "llama"
        source.mkdir()
        started = time.perf_counter()
        total = write_checkpoint(source)
        print(f"checkpoint: {total / 2**30:.2f} GiB in {time.perf_counter() - started:.1f} s")
        runs = interleaved(
            {"load": lambda: _launch("load", source), "eager": lambda: _launch("eager", source)},
            rounds,
        )
    results = {}
    for p in (0, 1):
        load = [r[p] for r in runs["load"]]
        eager = [r[p] for r in runs["eager"]]
        bound = [x["own"] + x["largest"] for x in load]
        results[f"process {p}"] = {
            "own share MiB (parameters on its device)": f"{load[0]['own']:.1f}",
            "largest tensor MiB": f"{load[0]['largest']:.1f}",
            "from_pretrained: peak resident rise MiB": spread([x["rise"] for x in load], digits=1),
            "  anonymous part at its peak MiB": spread([x["anon rise"] for x in load], digits=1),
            "  file pages mapped at their peak MiB": spread(
                [x["file peak"] for x in load], digits=1
            ),
            "eager GPT + mm.place: peak resident rise MiB": spread(
                [x["rise"] for x in eager], digits=1
            ),
            "from_pretrained rise / (own share + largest tensor) (target <= 1)": spread(
                ratios([x["rise"] for x in load], bound)
            ),
            "from_pretrained rise / eager + place rise": ratio_spread(
                [x["rise"] for x in load], [x["rise"] for x in eager]
            ),
        }
    load_s = [max(x["seconds"] for x in r) for r in runs["load"]]  # the slower process
    eager_s = [max(x["seconds"] for x in r) for r in runs["eager"]]
    results["time"] = {
        "model (float32) MiB": f"{runs['load'][0][0]['total']:.1f}",
        "from_pretrained s (slower process)": spread(load_s),
        "eager GPT + mm.place s (slower process)": spread(eager_s),
        "from_pretrained / eager + place (target <= 1)": ratio_spread(load_s, eager_s),
    }
    results["layout"] = (
        "2 processes x 1 CPU device, one stage each (mmnnx launch -n 2 --devices-per-process 1)"
    )
    publish(results, RESULTS, "pretrained_load", ("process 0", "process 1", "time"), rounds)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(*sys.argv[2:5])
    else:
        main(rounds_option(sys.argv))
