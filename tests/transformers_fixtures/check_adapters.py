"""Loads mmnnx's PEFT adapters of the fixtures in PEFT (onto transformers 5) and keeps the
verdict as ``adapters_verdict.json`` (read by tests/test_transformers_fixtures.py). Not part of
the test suite: run by hand, the first step with mmnnx's venv, the second with CPU torch,
transformers 5 and peft:

    /work/main/.venv/bin/python -c "import pathlib, tests.test_transformers_fixtures as t; \\
        t.save_adapters(pathlib.Path('/tmp/mmnnx-adapters'))"
    /work/oracle/bin/python tests/transformers_fixtures/check_adapters.py /tmp/mmnnx-adapters

and ``mmnnx export --adapter`` of every family (written by ``save_family_exports``, see
check_exports.py) into ``family_adapters_verdict.json``:

    /work/oracle/bin/python tests/transformers_fixtures/check_adapters.py /tmp/fam/adapters \\
        family_adapters_verdict.json

For each fixture ``<name>`` it records the adapter's ``target_modules``, how many of its
tensors PEFT put into the model (equal to the file's, read back from the PEFT model's state by
value: ``renamed`` counts those PEFT keeps under another name, as transformers 5 renames
Mixtral's ``block_sparse_moe`` to ``mlp``), the tensors it did not, how much the adapter moves
the fixture's logits, and the largest difference between the logits of the fixture with the
adapter applied by PEFT and mmnnx's logits of its merged export (``<name>-merged.npy``),
relative to the largest logit; also those of the merged export loaded in transformers, with the
tensors transformers missed or did not expect there.
"""

import json
import pathlib
import sys

import numpy as np
import peft
import torch
import transformers
from make_fixtures import TOKENS
from oracle import in_float32, logits, relative_error, write_verdict
from peft import PeftModel
from safetensors.numpy import load_file

HERE = pathlib.Path(__file__).parent


def _holder(tensor: np.ndarray, name: str, lora: dict) -> str | None:
    """The name of the PEFT model's tensor holding ``tensor`` (``name`` first, else by value)."""
    if name in lora and np.array_equal(lora[name], tensor):
        return name
    return next((k for k, v in lora.items() if np.array_equal(v, tensor)), None)


def main(root: pathlib.Path, verdict_name: str = "adapters_verdict.json") -> None:
    cases = {}
    for adapter in sorted(root.glob("*-adapter")):
        name = adapter.name.removesuffix("-adapter")
        ours = np.load(root / f"{name}-merged.npy").astype(np.float64)
        before = logits(in_float32(HERE / name)[0], TOKENS)
        model = PeftModel.from_pretrained(in_float32(HERE / name)[0], adapter)
        peft_logits = logits(model, TOKENS)
        state = {k.replace(".default", ""): v for k, v in model.state_dict().items()}
        stored = load_file(adapter / "adapter_model.safetensors")
        lora = {k: v.numpy() for k, v in state.items() if "lora_" in k}
        placed = {n: _holder(t, n, lora) for n, t in stored.items()}
        missing = sorted(n for n, k in placed.items() if k is None)
        extra = sorted(set(lora) - set(placed.values()))
        merged, info = in_float32(root / f"{name}-merged")
        config = json.loads((adapter / "adapter_config.json").read_text())
        cases[name] = {
            "target_modules": config["target_modules"],
            "target_parameters": config.get("target_parameters"),
            "adapter_tensors": len(stored),
            "loaded": len(stored) - len(missing),
            "renamed": sum(k is not None and k != n for n, k in placed.items()),
            "not_loaded": missing[:8],
            "lora_tensors_not_in_file": extra[:8],
            "adapter_moves_logits": relative_error(peft_logits, before),
            "peft_logits_error": relative_error(ours, peft_logits),
            "merged_logits_error": relative_error(ours, logits(merged, TOKENS)),
            "merged_missing_keys": sorted(info["missing_keys"])[:8],
            "merged_unexpected_keys": sorted(info["unexpected_keys"])[:8],
        }
        print(name, {k: v for k, v in cases[name].items() if not k.startswith("target_")})
    write_verdict(HERE / verdict_name, cases, (transformers, peft, torch))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), *sys.argv[2:3])
