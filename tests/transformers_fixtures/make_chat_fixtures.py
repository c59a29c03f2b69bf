"""Writes the chat-template fixtures: tiny tokenizers saved by transformers' own
``save_pretrained`` with three chat templates, and the token ids (and assistant masks)
transformers' ``apply_chat_template`` gives for a few conversations. Not part of the test
suite: run by hand in a venv with CPU torch, transformers 5 and tokenizers (never a
dependency of mmnnx or its tests):

    /work/oracle/bin/python tests/transformers_fixtures/make_chat_fixtures.py

It rewrites ``tests/transformers_fixtures/chat/<template>/`` (the tokenizer as transformers
saves it: ``tokenizer.json``, ``tokenizer_config.json``, and ``chat_template.jinja``, except
for ``llama3-v4`` whose template sits in ``tokenizer_config.json`` as transformers 4 wrote
it) and ``chat/expected.json``: per template and conversation, ``input_ids`` with and without
the generation prompt and, for the template with ``{% generation %}``, ``assistant_masks``.
tests/test_chat.py reads them.
"""

import json
import pathlib
import shutil

import tokenizers
import transformers
from transformers import PreTrainedTokenizerFast

HERE = pathlib.Path(__file__).parent / "chat"

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama 3's template, shortened (no tools): bos_token from the tokenizer, trimmed content.
LLAMA3 = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- endif %}"
)
# ChatML with the assistant's turns marked, as SmolLM3's and TRL's training templates do.
GENERATION = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEMPLATES = {"chatml": CHATML, "llama3-v4": LLAMA3, "generation": GENERATION}
SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|pad|>",
]
CONVERSATIONS = [
    [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
    ],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "  Two plus two?  "},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And times three?"},
        {"role": "assistant", "content": "Twelve, ünïcode ✓."},
    ],
]
CORPUS = [
    "What is the capital of France? Paris. Answer briefly. Two plus two? Four. "
    "And times three? Twelve. You are a helpful assistant. system user assistant"
] * 20


def tokenizer(template: str) -> PreTrainedTokenizerFast:
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|pad|>",
        chat_template=template,
    )


def main() -> None:
    shutil.rmtree(HERE, ignore_errors=True)
    expected = {"transformers": transformers.__version__, "conversations": CONVERSATIONS}
    for name, template in TEMPLATES.items():
        folder = HERE / name
        tok = tokenizer(template)
        tok.save_pretrained(folder)
        if name.endswith("-v4"):  # the template inside tokenizer_config.json, as 4.x wrote it
            (folder / "chat_template.jinja").unlink()
            config = json.loads((folder / "tokenizer_config.json").read_text())
            config["chat_template"] = template
            (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        assert tok.chat_template == template, name
        cases = []
        for chat in CONVERSATIONS:
            case = {}
            for prompt in (False, True):
                out = tok.apply_chat_template(
                    chat,
                    add_generation_prompt=prompt,
                    return_dict=True,
                    return_assistant_tokens_mask="{% generation %}" in template,
                )
                key = "with_prompt" if prompt else "without_prompt"
                case[key] = {"input_ids": list(out["input_ids"])}
                if "assistant_masks" in out:
                    case[key]["assistant_masks"] = list(out["assistant_masks"])
                case[key]["text"] = tok.apply_chat_template(
                    chat, add_generation_prompt=prompt, tokenize=False
                )
            cases.append(case)
        expected[name] = cases
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
