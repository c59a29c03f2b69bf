"""Loads mmnnx's PEFT adapters of the fixtures in PEFT (onto transformers 5) and keeps the
verdict as ``adapters_verdict.json`` (read by tests/test_transformers_fixtures.py). Not part of
the test suite: run by hand, the first step with mmnnx's venv, the second with CPU torch,
transformers 5 and peft:

    /work/main/.venv/bin/python -c "import pathlib, tests.test_transformers_fixtures as t; \\
        t.save_adapters(pathlib.Path('/tmp/mmnnx-adapters'))"
    /work/oracle/bin/python tests/transformers_fixtures/check_adapters.py /tmp/mmnnx-adapters

For each fixture ``<name>`` it records the adapter's ``target_modules``, how many of its
tensors PEFT put into the model (equal to the file's, read back from the PEFT model's state),
the tensors it did not, and the largest difference between the logits of the fixture with the
adapter applied by PEFT and mmnnx's logits of its merged export (``<name>-merged.npy``),
relative to the largest logit; also those of the merged export loaded in transformers.
"""

import json
import pathlib
import sys

import numpy as np
import peft
import torch
import transformers
from peft import PeftModel
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM

HERE = pathlib.Path(__file__).parent


def _error(model, tokens, ours) -> float:
    with torch.no_grad():
        theirs = model(tokens).logits.numpy().astype(np.float64)
    return float(np.abs(theirs - ours).max() / np.abs(theirs).max())


def main(root: pathlib.Path) -> None:
    tokens = torch.tensor(json.loads((HERE / "versions.json").read_text())["tokens"])
    cases = {}
    for adapter in sorted(root.glob("*-adapter")):
        name = adapter.name.removesuffix("-adapter")
        ours = np.load(root / f"{name}-merged.npy").astype(np.float64)
        base = AutoModelForCausalLM.from_pretrained(HERE / name, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, adapter).eval()
        state = {k.replace(".default", ""): v for k, v in model.state_dict().items()}
        stored = load_file(adapter / "adapter_model.safetensors")
        loaded = [
            n for n, t in stored.items() if n in state and np.array_equal(state[n].numpy(), t)
        ]
        missing = sorted(set(stored) - set(loaded))
        extra = sorted(k for k in state if "lora_" in k and k not in stored)
        merged = AutoModelForCausalLM.from_pretrained(root / f"{name}-merged", dtype=torch.float32)
        config = json.loads((adapter / "adapter_config.json").read_text())
        cases[name] = {
            "target_modules": config["target_modules"],
            "target_parameters": config.get("target_parameters"),
            "adapter_tensors": len(stored),
            "loaded": len(loaded),
            "not_loaded": missing[:8],
            "lora_tensors_not_in_file": extra[:8],
            "peft_logits_error": _error(model, tokens, ours),
            "merged_logits_error": _error(merged.eval(), tokens, ours),
        }
        print(name, {k: v for k, v in cases[name].items() if not k.startswith("target_")})
    verdict = {
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "torch": torch.__version__,
        "cases": cases,
    }
    (HERE / "adapters_verdict.json").write_text(json.dumps(verdict, indent=2) + "\n")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
