"""Loads each checkpoint ``tests/export_probe.py`` saved in transformers 5 (float32) and compares
its logits with transformers' of the case it was loaded from (``expected.npz``), and the tensors
transformers missed (but those of no elements) or did not expect. Not part of the test suite:
run by hand with the oracle venv (CPU torch, transformers 5):

    /work/oracle/bin/python tests/transformers_fixtures/check_export_probe.py /tmp/export-probe

Prints each save that differs, and a count.
"""

import json
import pathlib
import sys

import numpy as np
import torch
from oracle import in_float32, logits, relative_error
from probe_cases import run_cases

F32 = 1e-4


def check(saved: pathlib.Path) -> tuple[str, str]:
    base = pathlib.Path(json.loads((saved / "case.json").read_text())["base"])
    want = np.load(base / "expected.npz")
    try:
        model, info = in_float32(saved)
    except Exception as e:
        return "TRANSFORMERS FAILS", f"{type(e).__name__}: {str(e)[:300]}"
    keys = {k: sorted(map(str, info[k])) for k in ("missing_keys", "unexpected_keys")}
    # a tensor of no elements (DeepSeek-V3's shared experts where it has none) is not written
    state = model.state_dict()
    keys["missing_keys"] = [k for k in keys["missing_keys"] if state[k].numel()]
    if any(keys.values()):
        return "WRONG", f"tensors {keys}"
    try:
        theirs = logits(model, torch.tensor(want["tokens"], dtype=torch.long))
    except Exception as e:
        return "TRANSFORMERS FAILS", f"{type(e).__name__}: {str(e)[:300]}"
    error = relative_error(theirs, want["logits"])
    if not error <= F32:  # NaN too
        return "WRONG", f"logits off by {error:.2e}"
    return "ok", f"{error:.1e}"


if __name__ == "__main__":
    run_cases(pathlib.Path(sys.argv[1]), check)
