"""Trains one step of each load-probe case mmnnx loads (``tests/load_probe.py``) on one device
and pipelined over 2 stages (1F1B, 4 microbatches), by hand (not part of the suite): the loss
and every gradient must agree (to 1e-4 of each one's largest, and 1e-6 of all). Prints those that do
not, and a count.

Run: python -m tests.train_probe /tmp/load-probe
"""

import pathlib
import sys
import traceback

from tests.flags import set_device_count

if __name__ == "__main__":  # run by hand: 8 devices before JAX starts, never on import
    set_device_count(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from mmnnx.models import from_pretrained  # noqa: E402
from mmnnx.models.pretrained import CheckpointError  # noqa: E402
from tests.load_probe import _STAGES  # noqa: E402
from tests.test_family_conformance import _one_device_step, _pipelined_step  # noqa: E402
from tests.transformers_fixtures.probe_cases import run_cases  # noqa: E402


def check(case: pathlib.Path) -> tuple[str, str]:
    jax.clear_caches()  # each case compiles its own programs: 70 of them held run out of memory
    try:
        model = from_pretrained(case)
    except CheckpointError:
        return "not loaded", ""
    tokens = np.load(case / "expected.npz")["tokens"]
    tokens = np.concatenate([tokens, tokens[:, ::-1]] * 2)[:, :9]  # 8 rows: 4 microbatches of 2
    loss, grads = _one_device_step(model, tokens)
    try:
        got_loss, got_grads = _pipelined_step(from_pretrained(case, tasks=_STAGES), tokens)
    except Exception:
        return "CRASH", traceback.format_exc(limit=-2)[-500:]
    if not abs(float(got_loss) - float(loss)) <= 1e-5 * abs(float(loss)):
        return "WRONG", f"loss {float(got_loss)} != {float(loss)}"
    flat, got = nnx.to_flat_state(grads), dict(nnx.to_flat_state(got_grads))
    largest = max(float(np.abs(np.asarray(v[...])).max()) for _, v in flat)
    for path, want in flat:
        want, have = np.asarray(want[...]), np.asarray(jax.device_get(got[path][...]))
        # a gradient that is rounding noise (a top-1 router's, whose weight is 1) is held to
        # 1e-6 of the model's largest
        if not np.abs(have - want).max() <= 1e-4 * np.abs(want).max() + 1e-6 * largest:
            return "WRONG", f"gradient {'/'.join(map(str, path))} off"
    return "ok", ""


if __name__ == "__main__":
    run_cases(pathlib.Path(sys.argv[1]), check, quiet=("ok", "not loaded"))
