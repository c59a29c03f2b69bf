"""Loads what mmnnx's ``save_pretrained`` writes in transformers 5 and keeps the verdict as
``verdict.json`` (read by tests/test_transformers_fixtures.py). Not part of the test suite: run
by hand, the first step with mmnnx's venv, the second with CPU torch and transformers 5:

    /work/main/.venv/bin/python -c "import pathlib, tests.test_transformers_fixtures as t; \\
        t.save_saves(pathlib.Path('/tmp/mmnnx-saves'))"
    /work/oracle/bin/python tests/transformers_fixtures/check_saves.py /tmp/mmnnx-saves

For each checkpoint directory ``<case>`` (with mmnnx's logits for the fixtures' tokens beside
it as ``<case>.npy``) it records the ``config.json`` mmnnx wrote, the dtype transformers
loads it in (``dtype="auto"``), the ``rope_parameters`` transformers resolves, and the largest
difference between transformers' float32 logits from those files and mmnnx's, relative to the
largest logit.
"""

import json
import pathlib
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

HERE = pathlib.Path(__file__).parent


def main(root: pathlib.Path) -> None:
    tokens = torch.tensor(json.loads((HERE / "versions.json").read_text())["tokens"])
    cases = {}
    for case in sorted(p for p in root.iterdir() if p.is_dir() and p.with_suffix(".npy").exists()):
        auto = AutoModelForCausalLM.from_pretrained(case, dtype="auto")
        wide = AutoModelForCausalLM.from_pretrained(case, dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = wide(tokens).logits.numpy().astype(np.float64)
        ours = np.load(case.with_suffix(".npy")).astype(np.float64)
        error = float(np.abs(theirs - ours).max() / np.abs(theirs).max())
        rope = dict(auto.config.rope_parameters)
        cases[case.name] = {
            "config": json.loads((case / "config.json").read_text()),
            "dtype": str(auto.dtype).removeprefix("torch."),
            "rope_parameters": dict(sorted(rope.items())),
            "logits_error": error,
        }
        print(case.name, cases[case.name]["dtype"], rope, f"{error:.2e}")
    verdict = {"transformers": transformers.__version__, "torch": torch.__version__, "cases": cases}
    (HERE / "verdict.json").write_text(json.dumps(verdict, indent=2) + "\n")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
