"""Preference tuning from the CLI (``mmnnx train --dpo``): pairs tokenized as TRL 1.16's
``DPOTrainer`` tokenizes them (tests/transformers_fixtures/make_dpo_fixtures.py made the
fixture), bad pairs refused by file and line, and runs that resume exactly, export and
generate; the loss itself equals TRL's in tests/test_chat_data.py."""

import json
import math

import numpy as np
import pytest

from mmnnx.cli import main
from mmnnx.train.chat_template import ChatTemplate
from mmnnx.train.pairs import PairDataset, encode_pair
from mmnnx.train.records import DataError, read_records
from mmnnx.train.tokenizers import ByteTokenizer, HFTokenizer
from tests.test_chat_data import DPO

EXPECTED = json.loads((DPO / "expected.json").read_text())


def test_pairs_tokenize_as_trl_text_and_chat():
    tokenizer = HFTokenizer.from_file(DPO / "policy" / "tokenizer.json")
    template = ChatTemplate.from_checkpoint(DPO / "policy")
    eos = "<|end_of_text|>"  # the fixture tokenizer's eos_token, which TRL appends to text
    for name, expected in (("pairs", EXPECTED["pairs"]), ("chat_pairs", EXPECTED["chat_pairs"])):
        records = list(read_records(DPO / f"{name}.jsonl"))
        pairs = [encode_pair(w, r, tokenizer, template, eos=eos) for w, r in records]
        got = [
            {"prompt_ids": p.prompt, "chosen_ids": p.chosen, "rejected_ids": p.rejected}
            for p in pairs
        ]
        assert got == expected


def test_bad_pairs_name_file_line_and_field(tmp_path, capsys):
    tok = ByteTokenizer()
    same = {"prompt": "q", "chosen": " a", "rejected": " a"}
    with pytest.raises(DataError, match="f:line 3: fields 'chosen' and 'rejected' are identical"):
        encode_pair("f:line 3", same, tok)
    with pytest.raises(DataError, match="f:line 1: no field 'rejected'"):
        encode_pair("f:line 1", {"prompt": "q", "chosen": "a"}, tok)
    chat = {"prompt": [{"role": "user", "content": "q"}], "chosen": [], "rejected": []}
    with pytest.raises(DataError, match="chat pairs need the tokenizer's chat template"):
        encode_pair("f:line 2", chat, tok)
    pairs = [encode_pair(f"f:line {i}", {"prompt": "q" * n, "chosen": "ab", "rejected": "c"}, tok)
             for i, n in enumerate([1] * 6 + [7, 9])]  # fmt: skip
    data = PairDataset(pairs, seq_len=15, batch_size=4, eval_pairs=pairs[:1])
    assert (data.truncated, data.dropped) == (1, 1)  # 7 + 2 > 8 cut to 8; 9 leaves no room
    assert "1 cut to length, 1 dropped" in data.summary()
    with pytest.raises(DataError, match="f:line 6: prompt and completion of 9 and 8 tokens"):
        PairDataset(pairs, seq_len=15, batch_size=4, truncate=False, eval_pairs=pairs[:1])
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(same) + "\n" for _ in range(2)))
    flags = ["train", "--dpo", "--data", str(bad), "--output-dir", str(tmp_path / "r")]
    assert main(flags) == 2
    assert (
        "bad.jsonl:line 1: fields 'chosen' and 'rejected' are identical" in capsys.readouterr().err
    )
    assert main(["train", "--dpo", "--output-dir", str(tmp_path / "s")]) == 2
    assert "--dpo needs --data PAIRS" in capsys.readouterr().err


def pairs_file(tmp_path, n=24):
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": f"{i} plus {i}?", "chosen": f" {2 * i}.", "rejected": f" {2 * i + 1}?"}
            for i in range(n)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def dpo_run(tmp_path, run, *argv):
    base = ["train", "--init-from", str(DPO / "policy"), "--data", str(pairs_file(tmp_path))]
    base += ["--dpo", "--dpo-beta", "0.5", "--stages", "2", "--data-axis", "1"]
    base += ["--model-axis", "1", "--devices", "2", "--seq-len", "31", "--batch-size", "4"]
    base += ["--microbatches", "2", "--eval-every", "2", "--log-every", "1", "--eval-batches"]
    base += ["1", "--timeline-step", "0", "--no-tensorboard", "--schedule-steps", "3"]
    return main([*base, "--output-dir", str(tmp_path / run), *argv])


def rows(tmp_path, run):
    return [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]


def test_full_dpo_against_the_frozen_initial_model_resumes_exactly(tmp_path, capsys):
    assert dpo_run(tmp_path, "a", "--steps", "2", "--checkpoint-every", "2") == 0
    assert dpo_run(tmp_path, "a", "--steps", "3", "--resume") == 0
    assert dpo_run(tmp_path, "b", "--steps", "3") == 0
    a, b = rows(tmp_path, "a"), rows(tmp_path, "b")
    assert [r.get("loss") for r in a] == [r.get("loss") for r in b]
    first = b[1]  # the policy is the reference: every reward 0, the loss log 2
    assert first["loss"] == pytest.approx(math.log(2)) and first["rewards/margins"] == 0
    assert b[-1]["loss"] < first["loss"] and b[-1]["rewards/accuracies"] > 0
    assert {"rewards/chosen", "rewards/rejected", "logps/chosen"} <= set(b[-1])
    capsys.readouterr()
    assert main(["export", "--run", str(tmp_path / "b"), "--output", str(tmp_path / "m")]) == 0
    from mmnnx.models import from_pretrained

    exported, initial = from_pretrained(tmp_path / "m"), from_pretrained(DPO / "policy")
    moved = np.abs(exported.head.kernel[...] - initial.head.kernel[...]).max()
    assert moved > 0  # the policy exported, not the reference it was compared with


def test_lora_dpo_holds_no_second_copy():
    """The reference under LoRA is the policy's own Variables viewed with the adapters off (the
    walkthrough in docs/training.md trains and evaluates such a run from the CLI)."""
    from flax import nnx

    from mmnnx.models import from_pretrained
    from mmnnx.modules import add_lora
    from mmnnx.train.preference import PreferenceModel

    policy = add_lora(from_pretrained(DPO / "policy"), rank=2)
    policy.blocks[0].attn.q.lora.b[...] = np.ones_like(policy.blocks[0].attn.q.lora.b[...])
    model = PreferenceModel(policy, beta=0.1)
    assert list(nnx.state(model)) == ["policy"]
    assert model.reference.blocks[0].attn.q.kernel is policy.blocks[0].attn.q.kernel
    tokens = np.arange(8)[None]
    base = from_pretrained(DPO / "policy")
    np.testing.assert_allclose(model.reference(tokens), base(tokens), rtol=1e-6)
    assert not np.allclose(model(tokens), base(tokens))


def test_held_out_pairs_are_evaluated_once_when_they_fill_fewer_batches_than_asked():
    tok = ByteTokenizer()
    pairs = [encode_pair(f"f:line {i}", {"prompt": "q" * (i + 1), "chosen": "ab", "rejected": "c"},
                         tok) for i in range(5)]  # fmt: skip
    data = PairDataset(pairs * 2, seq_len=15, batch_size=2, eval_pairs=pairs)
    batches = data.eval_batches(4)
    assert len(batches) == 2  # 5 pairs fill 2 batches of 2, none evaluated twice
    firsts = [tuple(row) for b in batches for row in b[next(iter(b))]]
    assert len(set(firsts)) == len(firsts) == 4
