"""Writes a PEFT adapter for each load-probe case mmnnx loads (``tests/load_probe.py``), by hand
(not part of the suite): LoRA on a random choice of the model's ``Linear`` layers, its ``b``
drawn (not zero) so that it moves the logits, written with ``save_adapter``, beside mmnnx's
logits of the adapted model (``logits.npy``). ``tests/transformers_fixtures/check_adapter_probe.py``
then loads each in PEFT onto transformers and compares. Prints the adapters refused.

Run: python -m tests.adapter_probe /tmp/load-probe /tmp/adapter-probe
"""

import collections
import json
import pathlib
import random
import shutil
import sys

from tests.flags import set_device_count

if __name__ == "__main__":  # run by hand: 8 devices before JAX starts, never on import
    set_device_count(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from mmnnx.models import from_pretrained, save_adapter  # noqa: E402
from mmnnx.models.pretrained import CheckpointError  # noqa: E402
from mmnnx.modules import Linear, add_lora  # noqa: E402

_forward = nnx.jit(lambda model, tokens: model(tokens))


def write(case: pathlib.Path, out: pathlib.Path) -> tuple[str, str]:
    try:
        model = from_pretrained(case)
    except CheckpointError as e:
        return "not loaded", str(e)[:100]
    names = sorted({str(p[-1]) for p, m in nnx.iter_graph(model) if isinstance(m, Linear)})
    r = random.Random(case.name)
    targets = r.sample(names, r.randint(1, len(names)))
    model = add_lora(model, rank=2, alpha=r.choice([2.0, 8.0]), targets=targets)
    key = jax.random.key(1)
    for _, m in nnx.iter_graph(model):
        if isinstance(m, Linear) and m.lora is not None:
            key, k = jax.random.split(key)
            m.lora.b[...] = 0.3 * jax.random.normal(k, m.lora.b.shape, m.lora.b.dtype)
    tokens = np.load(case / "expected.npz")["tokens"]
    try:
        save_adapter(model, out, dtype=jnp.float32)  # as computed, bfloat16 bases too
    except CheckpointError as e:
        return "REFUSED", f"{targets}: {str(e)[:300]}"
    np.save(out / "logits.npy", np.asarray(_forward(model, jnp.asarray(tokens))))
    (out / "case.json").write_text(json.dumps({"base": str(case.resolve()), "targets": targets}))
    return "written", str(targets)


def main(root: pathlib.Path, out: pathlib.Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    counts = collections.Counter()
    for case in sorted(p for p in root.iterdir() if p.is_dir()):
        verdict, what = write(case, out / case.name)
        counts[verdict] += 1
        if verdict == "REFUSED":
            print(f"{verdict} {case.name}: {what}", flush=True)
    print(dict(counts))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
