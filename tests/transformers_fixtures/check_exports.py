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

from oracle import check_cases, in_float32
from transformers import AutoTokenizer, GenerationConfig, PreTrainedModel

HERE = pathlib.Path(__file__).parent
SMALL = ("config.json", "generation_config.json", "tokenizer_config.json")


def describe(case: pathlib.Path) -> tuple[PreTrainedModel, dict]:
    """``case`` in float32 and the tensors transformers missed, did not expect or found of
    another shape."""
    model, info = in_float32(case)
    return model, {
        "architecture": type(model).__name__,
        "missing_keys": sorted(info["missing_keys"]),
        "unexpected_keys": sorted(info["unexpected_keys"]),
        "mismatched_keys": [list(map(str, k)) for k in info["mismatched_keys"]],
    }


def finish(case: pathlib.Path, model: PreTrainedModel, seen: dict) -> dict:
    """What transformers reads of ``case``'s tokenizer, generation defaults and small files,
    and ``checks``: each expectation of ``<case>.json`` (and of ``seen``), true when met."""
    expected = json.loads(case.with_suffix(".json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(case)
    text = expected["text"]
    ids = tokenizer.encode(text, add_special_tokens=False)
    chat = None
    if tokenizer.chat_template is not None:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    generation = GenerationConfig.from_pretrained(case)
    tok = {
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
    }
    checks = {
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
    return {
        "tokenizer": tok,
        "generation": {
            "bos_token_id": generation.bos_token_id,
            "eos_token_id": generation.eos_token_id,
            "temperature": generation.temperature,
        },
        "files": {
            name: json.loads((case / name).read_text()) for name in SMALL if (case / name).exists()
        },
        "checks": checks,
    }


if __name__ == "__main__":
    verdict = sys.argv[2] if len(sys.argv) > 2 else "exports_verdict.json"
    check_cases(pathlib.Path(sys.argv[1]), HERE / verdict, describe, finish=finish)
