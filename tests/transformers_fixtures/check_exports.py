"""Loads what ``mmnnx export`` writes in transformers 5 (model, tokenizer, generation defaults)
and keeps the verdict as ``exports_verdict.json`` (read by tests/test_transformers_fixtures.py).
Not part of the test suite: run by hand, the first step with mmnnx's venv, the second with CPU
torch and transformers 5:

    /work/main/.venv/bin/python -c "import conftest, pathlib, \\
        tests.test_transformers_fixtures as t; t.save_exports(pathlib.Path('/tmp/mmnnx-exports'))"
    /work/oracle/bin/python tests/transformers_fixtures/check_exports.py /tmp/mmnnx-exports

and, for ``mmnnx export`` of every family (the whole run and the LoRA run merged; their
adapters: check_adapters.py), into ``family_exports_verdict.json``:

    /work/main/.venv/bin/python -c "import conftest, pathlib, \\
        tests.test_transformers_fixtures as t; t.save_family_exports(pathlib.Path('/tmp/fam'))"
    /work/oracle/bin/python tests/transformers_fixtures/check_exports.py /tmp/fam \\
        family_exports_verdict.json

For each export ``<case>`` (beside it ``<case>.npy``, mmnnx's logits from it, and ``<case>.json``,
a sample text, the ids the run's tokenizer gives it and what should be read) it records the
tensors ``AutoModelForCausalLM.from_pretrained`` missed or did not expect, the largest
difference between its float32 logits and mmnnx's relative to the largest logit, what
``AutoTokenizer.from_pretrained`` read (class, ids with and without special tokens, special
tokens, chat template applied), the ``GenerationConfig`` read, the small JSON files written,
and ``checks``: each expectation, true when met.
"""

import json
import pathlib
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

HERE = pathlib.Path(__file__).parent
SMALL = ("config.json", "generation_config.json", "tokenizer_config.json")


def main(root: pathlib.Path, verdict_name: str = "exports_verdict.json") -> None:
    tokens = torch.tensor(json.loads((HERE / "versions.json").read_text())["tokens"])
    cases = {}
    for case in sorted(p for p in root.iterdir() if p.is_dir() and p.with_suffix(".npy").exists()):
        expected = json.loads(case.with_suffix(".json").read_text())
        model, info = AutoModelForCausalLM.from_pretrained(
            case, dtype=torch.float32, output_loading_info=True
        )
        with torch.no_grad():
            theirs = model.eval()(tokens).logits.numpy().astype(np.float64)
        ours = np.load(case.with_suffix(".npy")).astype(np.float64)
        tokenizer = AutoTokenizer.from_pretrained(case)
        text = expected["text"]
        ids = tokenizer.encode(text, add_special_tokens=False)
        chat = None
        if tokenizer.chat_template is not None:
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}], tokenize=False
            )
        generation = GenerationConfig.from_pretrained(case)
        seen = {
            "architecture": type(model).__name__,
            "missing_keys": sorted(info["missing_keys"]),
            "unexpected_keys": sorted(info["unexpected_keys"]),
            "mismatched_keys": [list(map(str, k)) for k in info["mismatched_keys"]],
            "logits_error": float(np.abs(theirs - ours).max() / np.abs(theirs).max()),
            "tokenizer": {
                "class": type(tokenizer).__name__,
                "ids": ids,
                "ids_with_special_tokens": tokenizer.encode(text),
                "decoded": tokenizer.decode(ids),
                "bos_token": tokenizer.bos_token,
                "eos_token": tokenizer.eos_token,
                "bos_token_id": tokenizer.bos_token_id,
                "eos_token_id": tokenizer.eos_token_id,
                "chat_template": tokenizer.chat_template,
                "chat": chat,
            },
            "generation": {
                "bos_token_id": generation.bos_token_id,
                "eos_token_id": generation.eos_token_id,
                "temperature": generation.temperature,
            },
            "files": {
                name: json.loads((case / name).read_text())
                for name in SMALL
                if (case / name).exists()
            },
        }
        tok = seen["tokenizer"]
        seen["checks"] = {
            "all_tensors_loaded": not (seen["missing_keys"] or seen["unexpected_keys"]),
            "no_shape_mismatch": not seen["mismatched_keys"],
            "logits_equal": seen["logits_error"] < 1e-5,
            "same_ids": ids == expected["ids"],
            "decodes_back": tok["decoded"] == text,
            "bos_token": tok["bos_token"] == expected["bos_token"],
            "eos_token": tok["eos_token"] == expected["eos_token"],
            "bos_added_as_the_base": (
                tok["ids_with_special_tokens"][:1] == [tok["bos_token_id"]]
                if expected["bos_token"]
                else tok["ids_with_special_tokens"] == ids
            ),
            "chat_template": tok["chat_template"] == expected["chat_template"],
            "generation_eos": generation.eos_token_id == expected["eos_token_id"],
        }
        cases[case.name] = seen
        print(case.name, seen["checks"], f"{seen['logits_error']:.2e}")
    verdict = {"transformers": transformers.__version__, "torch": torch.__version__, "cases": cases}
    (HERE / verdict_name).write_text(json.dumps(verdict, indent=2) + "\n")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), *sys.argv[2:3])
