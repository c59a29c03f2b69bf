"""Writes ``eos/``: where transformers' ``generate`` stops on a checkpoint whose
``generation_config.json`` lists several eos ids, as Llama 3 Instruct's does (``[128001,
128008, 128009]``: ``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``; a chat turn ends at
``<|eot_id|>``, which is not its ``tokenizer_config.json``'s ``eos_token``). Not part of the
test suite: run by hand with CPU torch and transformers 5 (never a dependency of mmnnx or its
tests):

    /work/oracle/bin/python tests/transformers_fixtures/make_eos_fixtures.py

The checkpoint is make_fixtures.py's ``llama/`` (its ``config.json`` and ``model.safetensors``)
with the files written here: a character-level ``tokenizer.json`` over its 128 ids,
``tokenizer_config.json`` (``eos_token`` ``<|end_of_text|>``, id 2) and
``generation_config.json`` (``eos_token_id`` ``[2, EOM, EOT]``), where ``EOT`` is an id the
greedy continuation of :data:`PROMPT` reaches (its first new id, from the third on, seen
neither before it nor in the prompt), named ``<|eot_id|>``, and ``EOM`` one it never reaches.
``expected.json``: the prompt's ids and transformers' greedy ``generate`` (its own generation
config, :data:`NEW_TOKENS` at most) on the assembled checkpoint, which ends at ``EOT``.
tests/test_generate.py generates with mmnnx on the same files.
"""

import json
import pathlib
import shutil
import string
import tempfile

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

HERE = pathlib.Path(__file__).parent
OUT = HERE / "eos"
PROMPT = "Hello there"
NEW_TOKENS = 12
SPECIAL = {0: "<unk>", 1: "<|begin_of_text|>", 2: "<|end_of_text|>"}
CHARACTERS = string.printable[:-4] + "".join(map(chr, range(0xC0, 0xC0 + 32)))  # 96 + 32


def tokenizer(names: dict[int, str]) -> Tokenizer:
    """Each of the 128 ids one character (id ``i`` ``CHARACTERS[i - 3]``), but the special
    ``names`` (id: text)."""
    vocab = {names.get(i, CHARACTERS[i - 3]): i for i in range(128)}
    model = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    model.add_special_tokens([AddedToken(names[i], special=True) for i in sorted(names)])
    model.decoder = decoders.Fuse()
    return model


def assemble(folder: pathlib.Path) -> pathlib.Path:
    """``llama/``'s weights and config beside ``folder``'s files, in a directory of its own."""
    base = pathlib.Path(tempfile.mkdtemp()) / "base"
    base.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(HERE / "llama" / name, base)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(folder / name, base)
    return base


def write_eos() -> None:
    model = AutoModelForCausalLM.from_pretrained(HERE / "llama", dtype=torch.float32).eval()
    prompt = tokenizer(SPECIAL).encode(PROMPT).ids
    with torch.no_grad():
        ran = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    eot = next(t for i, t in enumerate(ran) if i >= 2 and t not in prompt + ran[:i] + [0, 1, 2])
    eom = next(t for t in range(3, 128) if t not in prompt + ran)
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir()
    tokenizer(SPECIAL | {eom: "<|eom_id|>", eot: "<|eot_id|>"}).save(str(OUT / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}
    config |= {"bos_token": SPECIAL[1], "eos_token": SPECIAL[2], "unk_token": SPECIAL[0]}
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    GenerationConfig(bos_token_id=1, eos_token_id=[2, eom, eot]).save_pretrained(OUT)

    base = assemble(OUT)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    words = AutoTokenizer.from_pretrained(base)
    ids = words(PROMPT, add_special_tokens=False)["input_ids"]
    assert ids == prompt, (ids, prompt)
    with torch.no_grad():  # the checkpoint's own generation config: its eos ids stop it
        new = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    new = new[0, len(ids) :].tolist()
    assert new[-1] == eot and new == ran[: len(new)] and 2 not in new, (new, ran, eot)
    expected = {
        "prompt": PROMPT,
        "prompt_ids": ids,
        "max_new_tokens": NEW_TOKENS,
        "eos_token_id": [2, eom, eot],
        "generated": new,
        "text": words.decode(ids + new[:-1]),
        "without_stop": ran,
    }
    (OUT / "expected.json").write_text(json.dumps(expected) + "\n")
    print(expected)


if __name__ == "__main__":
    write_eos()
