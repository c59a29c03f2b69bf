"""Writes ``greedy.json`` beside the Llama, Qwen3 and Qwen3-MoE fixtures (make_fixtures.py's):
transformers' greedy continuation (``generate`` with its key/value cache) of the first
``PROMPT`` tokens of each row of ``TOKENS``, in make_mistral_fixtures.py's format
(``{"prompt": ..., "continuation": ...}``). Not part of the test suite: run by hand with CPU
torch and transformers 5 (never a dependency of mmnnx or its tests):

    /work/oracle/bin/python tests/transformers_fixtures/make_greedy_fixtures.py

tests/test_family_conformance.py decodes the same prompts with mmnnx's key/value cache.
"""

import json
import pathlib

import torch
from make_fixtures import TOKENS
from make_mistral_fixtures import NEW_TOKENS, PROMPT
from transformers import AutoModelForCausalLM

HERE = pathlib.Path(__file__).parent
NAMES = ("llama", "qwen3", "qwen3-moe")


def write_greedy() -> None:
    for name in NAMES:
        model = AutoModelForCausalLM.from_pretrained(HERE / name, dtype=torch.float32).eval()
        prompt = torch.tensor(TOKENS[:, :PROMPT])
        with torch.no_grad():
            generated = model.generate(
                prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
        greedy = {"prompt": prompt.tolist(), "continuation": generated[:, PROMPT:].tolist()}
        (HERE / name / "greedy.json").write_text(json.dumps(greedy) + "\n")
        print(name, greedy)


if __name__ == "__main__":
    write_greedy()
