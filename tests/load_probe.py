"""Loads the load probe's checkpoints (tiny random models of every family, configs drawn from
what transformers 5 accepts, written by ``tests/transformers_fixtures/make_load_probe.py`` with
transformers' own ``save_pretrained``), by hand (about 10 minutes; not part of the suite): each
must be refused with ``CheckpointError`` before anything is built, or give transformers' float32
logits and greedy continuation, and one device's logits on 2 pipeline stages. Prints what breaks
that rule, and the refusals.

Run: python -m tests.load_probe /tmp/load-probe
"""

import pathlib
import sys
import traceback

from tests.flags import set_device_count

if __name__ == "__main__":  # run by hand: 8 devices before JAX starts, never on import
    set_device_count(8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import mmnnx as mm  # noqa: E402
from mmnnx.models import from_pretrained  # noqa: E402
from mmnnx.models.pretrained import CheckpointError  # noqa: E402
from tests.test_transformers_fixtures import relative_error  # noqa: E402
from tests.transformers_fixtures.probe_cases import run_cases  # noqa: E402

F32 = 1e-4  # float32 against float32, relative to the largest logit
_forward = nnx.jit(lambda model, tokens: model(tokens))
_staged_forward = mm.jit(lambda model, tokens: model(tokens))
_STAGES = [mm.Task(f"s{i}", mesh=mm.TaskMesh(devices=range(4 * i, 4 * i + 4))) for i in (0, 1)]


def check(case: pathlib.Path) -> tuple[str, str]:
    """``("ok" | "refused" | "WRONG" | "CRASH", what)`` for one case."""
    want = np.load(case / "expected.npz")
    try:
        model = from_pretrained(case)
    except CheckpointError as e:
        return "refused", str(e).splitlines()[0][:200]
    except Exception:
        return "CRASH", traceback.format_exc(limit=-3)[-600:]
    logits = np.asarray(_forward(model, jnp.asarray(want["tokens"])))
    error = relative_error(logits, want["logits"])
    if not error <= F32:  # NaN too
        return "WRONG", f"logits off by {error:.2e} of the largest"
    prompt = jnp.asarray(want["tokens"][:, : int(want["prompt"])])
    greedy = np.asarray(model.generate(prompt, want["continuation"].shape[1]))
    if not np.array_equal(greedy, want["continuation"]):
        return "WRONG", f"greedy {greedy.tolist()} != transformers' {want['continuation'].tolist()}"
    staged = from_pretrained(case, tasks=_STAGES)
    error = relative_error(_staged_forward(staged, jnp.asarray(want["tokens"])), logits)
    if not error <= F32:
        return "WRONG", f"2 stages' logits off one device's by {error:.2e} of the largest"
    return "ok", f"{error:.1e}"


def _check_and_draw(case: pathlib.Path) -> tuple[str, str]:
    verdict, what = check(case)
    return verdict, what if verdict == "ok" else f"{what}\n    {(case / 'case.json').read_text()}"


if __name__ == "__main__":
    run_cases(pathlib.Path(sys.argv[1]), _check_and_draw)
