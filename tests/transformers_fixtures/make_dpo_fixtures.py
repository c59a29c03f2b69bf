"""Writes the DPO fixture: TRL's ``DPOTrainer`` loss and rewards for a tiny Llama policy
against a reference of other weights, on four preference pairs. Not part of the test suite:
run by hand in a venv with CPU torch, transformers 5 and TRL (never a dependency of mmnnx or
its tests):

    /work/oracle/bin/python tests/transformers_fixtures/make_dpo_fixtures.py

It rewrites ``tests/transformers_fixtures/dpo/``: ``policy/`` and ``reference/`` (tiny
``LlamaForCausalLM`` checkpoints saved by transformers, with the ``chat/chatml`` tokenizer),
``pairs.jsonl`` (prompt, chosen, rejected), ``chat_pairs.jsonl`` (the same as messages) and
``expected.json``: the ids TRL tokenized each pair into (``pairs``, ``chat_pairs``), TRL's
loss, rewards, margins and accuracy at ``beta`` 0.5. tests/test_dpo.py reads them.
"""

import json
import pathlib
import shutil

import datasets
import torch
import transformers
import trl
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

HERE = pathlib.Path(__file__).parent
OUT = HERE / "dpo"
BETA = 0.5
PAIRS = [
    {"prompt": "What is the capital of France?", "chosen": " Paris.", "rejected": " Rome."},
    {"prompt": "Two plus two?", "chosen": " Four.", "rejected": " Four. Or five, maybe."},
    {"prompt": "Answer briefly.", "chosen": " Yes.", "rejected": " No"},
    {"prompt": "And times three?", "chosen": " Twelve.", "rejected": " Twelve, you are a help."},
]
CHAT_PAIRS = [  # conversational: rendered with the ChatML template
    {
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}],
        "chosen": [{"role": "assistant", "content": good}],
        "rejected": [{"role": "assistant", "content": bad}],
    }
    for q, good, bad in (
        ("What is the capital of France?", "Paris.", "Rome."),
        ("Two plus two?", "Four.", "Five, maybe."),
    )
]


def model(seed: int, vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).eval()


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(HERE / "chat" / "chatml")
    policy, reference = model(0, len(tokenizer)), model(1, len(tokenizer))
    for name, m in (("policy", policy), ("reference", reference)):
        m.save_pretrained(OUT / name)
        tokenizer.save_pretrained(OUT / name)
    (OUT / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    args = trl.DPOConfig(
        output_dir=str(OUT / "trl"),
        beta=BETA,
        per_device_train_batch_size=len(PAIRS),
        report_to=[],
        use_cpu=True,
        bf16=False,
        max_length=None,
        dataset_num_proc=None,
    )
    trainer = trl.DPOTrainer(
        model=policy,
        ref_model=reference,
        args=args,
        train_dataset=datasets.Dataset.from_list(PAIRS),
        processing_class=tokenizer,
    )
    batch = next(iter(trainer.get_train_dataloader()))
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    metrics = {k: sum(v) / len(v) for k, v in trainer._metrics["eval"].items()}
    rows = trainer.train_dataset
    expected = {
        "versions": {"transformers": transformers.__version__, "trl": trl.__version__},
        "beta": BETA,
        "pairs": [
            {k: rows[i][k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
            for i in range(len(rows))
        ],
        "loss": float(loss),
        "metrics": metrics,
    }
    chat = trl.DPOTrainer(
        model=policy,
        ref_model=reference,
        args=args,
        train_dataset=datasets.Dataset.from_list(CHAT_PAIRS),
        processing_class=tokenizer,
    ).train_dataset
    expected["chat_pairs"] = [
        {k: chat[i][k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
        for i in range(len(chat))
    ]
    (OUT / "chat_pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in CHAT_PAIRS))
    shutil.rmtree(OUT / "trl", ignore_errors=True)
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1))


if __name__ == "__main__":
    main()
