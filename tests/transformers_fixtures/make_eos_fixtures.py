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

``cases.json`` (:func:`write_cases`): where transformers stops when the checkpoint has no
``generation_config.json`` (it builds one from ``config.json``, ``_from_model_config``: its
``eos_token_id``, else that of its ``decoder``, ``generator`` or ``text_config``, a
multimodal Gemma 3's) or one without ``eos_token_id`` (nowhere), never at the
``tokenizer_config.json``'s ``eos_token``. Each case is the assembled checkpoint
with its ``generation_config.json`` replaced (or removed), ``config.json``'s ``eos_token_id``
set and the ``eos_token`` named (:func:`cases`); recorded: the ``eos_token_id`` transformers'
generation config holds, its greedy ``generate`` (the checkpoint's own config), and what
lm-eval's ``hf`` model (it adds the tokenizer's eos text to a request's ``until``) returns for
each ``until`` of :data:`UNTIL` (so the venv needs lm-eval too: ``pip install lm-eval==0.4.13``;
tests/test_evaluation.py compares mmnnx's lm-eval model).
``multimodal``: a tiny random ``Gemma3ForConditionalGeneration`` whose eos ids are in
``config.json``'s ``text_config`` (as transformers writes it: none at the top) or also at the
top, without ``generation_config.json``: its ``config.json`` and where ``generate`` stops (no
weights: mmnnx reads only the config of it).
"""

import json
import pathlib
import shutil
import string
import tempfile

import torch
import transformers
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


UNTIL = ([], ["<|eot_id|>"], [""])
"""The ``until`` of the lm-eval requests recorded for each case: none (the eos text alone), a
special token's text (lm-eval stops when the text, specials kept, shows it), and the empty
string."""


def cases(eom: int, eot: int) -> list[dict]:
    """The variations of ``eos/``'s checkpoint (``generation_config``: the file's content,
    ``None``: no file; ``config_eos_token_id``: ``config.json``'s, ``None`` written as null;
    ``eos_token``: ``tokenizer_config.json``'s). Greedy decoding reaches ``eot`` (3rd new token)
    and the plain character id 10 (2nd); neither ``eom`` nor 2 (``<|end_of_text|>``)."""
    end, turn = SPECIAL[2], "<|eot_id|>"
    return [
        {
            "name": "no generation_config.json: config.json's eos_token_id",
            "generation_config": None,
            "config_eos_token_id": [eom, eot],
            "eos_token": end,
        },
        {
            "name": "no generation_config.json, config.json's eos never reached: not the "
            "tokenizer's eos_token",
            "generation_config": None,
            "config_eos_token_id": 2,
            "eos_token": turn,
        },
        {
            "name": "no generation_config.json, config.json's eos_token_id null",
            "generation_config": None,
            "config_eos_token_id": None,
            "eos_token": turn,
        },
        {
            "name": "generation_config.json without eos_token_id: nowhere",
            "generation_config": {"bos_token_id": 1},
            "config_eos_token_id": eot,
            "eos_token": turn,
        },
        {
            "name": "no eos reached: a special token's text among until stops lm-eval alone",
            "generation_config": {"bos_token_id": 1, "eos_token_id": eom},
            "config_eos_token_id": 2,
            "eos_token": end,
        },
        {
            "name": "generation_config.json's eos_token_id a plain character's id",
            "generation_config": {"bos_token_id": 1, "eos_token_id": [eom, 10]},
            "config_eos_token_id": 2,
            "eos_token": end,
        },
    ]


def variant(case: dict) -> pathlib.Path:
    """The assembled checkpoint with ``case``'s files."""
    base = assemble(OUT)
    (base / "generation_config.json").unlink()
    if case["generation_config"] is not None:
        (base / "generation_config.json").write_text(json.dumps(case["generation_config"]))
    for name, key, value in [
        ("config.json", "eos_token_id", case["config_eos_token_id"]),
        ("tokenizer_config.json", "eos_token", case["eos_token"]),
    ]:
        content = json.loads((base / name).read_text())
        (base / name).write_text(json.dumps(content | {key: value}))
    return base


def lm_eval_texts(base: pathlib.Path, prompt: str) -> list[dict]:
    """lm-eval's ``hf`` model's ``generate_until`` on ``base``, one request per :data:`UNTIL`."""
    import types  # noqa: PLC0415

    from lm_eval.models.huggingface import HFLM  # noqa: PLC0415

    lm = HFLM(pretrained=str(base), dtype="float32", device="cpu", batch_size=1)
    texts = []
    for until in UNTIL:
        request = types.SimpleNamespace(
            args=(prompt, {"until": list(until), "max_gen_toks": NEW_TOKENS, "do_sample": False})
        )
        texts.append({"until": list(until), "text": lm.generate_until([request])[0]})
    return texts


def multimodal(text_eos: list[int], top_eos: list[int] | None) -> dict:
    """A tiny ``Gemma3ForConditionalGeneration`` (seed 0), saved by transformers, its
    ``generation_config.json`` removed, ``text_config``'s ``eos_token_id`` ``text_eos`` and the
    top-level one ``top_eos`` (``None``: none, as transformers writes it); its ``config.json``
    and the greedy ``generate`` of :data:`MM_PROMPT` with its own generation config."""
    from transformers import (  # noqa: PLC0415
        AutoModelForImageTextToText,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
    )

    text = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 48}
    text |= {"num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}
    text |= {"head_dim": 16, "max_position_embeddings": 64, "sliding_window": 4}
    text |= {"bos_token_id": 2, "eos_token_id": text_eos, "pad_token_id": 0}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
    vision |= {"num_attention_heads": 2, "image_size": 28, "patch_size": 14}
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=1,
        image_token_index=127,
        boi_token_index=125,
        eoi_token_index=126,
    )
    torch.manual_seed(0)
    base = pathlib.Path(tempfile.mkdtemp()) / "gemma3"
    Gemma3ForConditionalGeneration(config).save_pretrained(base)
    (base / "generation_config.json").unlink()
    saved = json.loads((base / "config.json").read_text())
    assert "eos_token_id" not in saved and saved["text_config"]["eos_token_id"] == text_eos
    if top_eos is not None:
        saved["eos_token_id"] = top_eos
        (base / "config.json").write_text(json.dumps(saved, indent=2))
    model = AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        new = model.generate(torch.tensor([MM_PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False)[
            0, len(MM_PROMPT) :
        ].tolist()
    return {
        "class": type(model).__name__,
        "config": saved,
        "stops_at": model.generation_config.eos_token_id,
        "generated": new,
    }


MM_PROMPT = [2, 10, 20, 30, 40, 50]


def write_cases() -> None:
    expected = json.loads((OUT / "expected.json").read_text())
    eom, eot = expected["eos_token_id"][1:]
    assert expected["without_stop"][1] == 10 and eot == expected["without_stop"][2]
    prompt, ids = expected["prompt"], expected["prompt_ids"]
    recorded = []
    for case in cases(eom, eot):
        base = variant(case)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        with torch.no_grad():
            new = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
        stops = model.generation_config.eos_token_id
        case |= {"stops_at": stops, "generated": new[0, len(ids) :].tolist()}
        case["lm_eval"] = lm_eval_texts(base, prompt)
        recorded.append(case)
        print(case)
    # multimodal: the unstopped greedy run first, then eos ids it reaches / never reaches
    ran = multimodal([1], None)["generated"]
    reached = next(t for i, t in enumerate(ran) if i >= 2 and t not in MM_PROMPT + ran[:i])
    never = next(t for t in range(3, 120) if t not in MM_PROMPT + ran)
    mm = {
        "prompt_ids": MM_PROMPT,
        "without_stop": ran,
        "text_config": multimodal([never, reached], None),
        "top_level": multimodal([never], [reached, 1]),
    }
    assert mm["text_config"]["generated"][-1] == reached, mm
    assert mm["top_level"]["generated"][-1] == reached, mm
    print(mm["text_config"]["stops_at"], mm["top_level"]["stops_at"])
    import lm_eval  # noqa: PLC0415

    versions = {"transformers": transformers.__version__, "lm_eval": lm_eval.__version__}
    out = {"versions": versions, "cases": recorded, "multimodal": mm}
    (OUT / "cases.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    write_eos()
    write_cases()
