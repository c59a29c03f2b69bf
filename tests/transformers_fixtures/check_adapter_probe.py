"""Loads each adapter ``tests/adapter_probe.py`` wrote in PEFT, onto its base checkpoint in
transformers 5 (float32), and compares the logits with mmnnx's of the adapted model. Not part
of the test suite: run by hand with the oracle venv (CPU torch, transformers 5, peft):

    /work/oracle/bin/python tests/transformers_fixtures/check_adapter_probe.py /tmp/adapter-probe

Prints each adapter whose logits differ by more than 1e-4 of the largest, whose tensors PEFT
did not all load, or that PEFT refuses, and a count; with ``--verdict NAME``, keeps each case's
verdict and ``adapter_config.json`` as ``NAME`` beside this file (``router_adapters_verdict.json``
of tests/test_transformers_fixtures.py's ``save_router_adapters``).
"""

import json
import pathlib
import sys

import numpy as np
import peft
import torch
import transformers
from oracle import in_float32, logits, relative_error, write_verdict
from peft import PeftModel
from probe_cases import run_cases
from safetensors.torch import load_file

F32 = 1e-4


def check(adapter: pathlib.Path) -> tuple[str, str]:
    case = json.loads((adapter / "case.json").read_text())
    base, _ = in_float32(pathlib.Path(case["base"]))
    tokens = np.load(pathlib.Path(case["base"]) / "expected.npz")["tokens"]
    before = logits(base, torch.tensor(tokens, dtype=torch.long))
    try:
        model = PeftModel.from_pretrained(base, adapter)
    except Exception as e:  # what PEFT cannot load is mmnnx's to refuse
        return "PEFT FAILS", f"{type(e).__name__}: {str(e)[:200]} ({case['targets']})"
    stored = load_file(adapter / "adapter_model.safetensors")
    state = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    held = [n for n, t in stored.items() if any(torch.equal(t, v) for v in state.values())]
    if len(held) != len(stored):
        return "WRONG", f"PEFT holds {len(held)} of {len(stored)} tensors ({case['targets']})"
    theirs = logits(model, torch.tensor(tokens, dtype=torch.long))
    ours = np.load(adapter / "logits.npy")
    moved = relative_error(theirs, before)
    error = relative_error(ours, theirs)
    if not error <= F32:  # NaN too
        return "WRONG", f"logits off by {error:.2e} (the adapter moves them {moved:.2e}) {case}"
    return "ok", f"{error:.1e} moved {moved:.1e}"


def main(root: pathlib.Path, verdict_name: str | None = None) -> None:
    seen = run_cases(root, check)
    if verdict_name:
        cases = {
            name: {
                "verdict": verdict,
                "what": what,
                "adapter_config": json.loads((root / name / "adapter_config.json").read_text()),
            }
            for name, (verdict, what) in seen.items()
        }
        write_verdict(pathlib.Path(__file__).parent / verdict_name, cases, (transformers, peft))


if __name__ == "__main__":
    verdict = sys.argv[sys.argv.index("--verdict") + 1] if "--verdict" in sys.argv else None
    main(pathlib.Path(sys.argv[1]), verdict)
