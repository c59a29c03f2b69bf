"""Chat templates, records and rows (mmnnx.train.chat_template / records / examples), checked
against transformers 5's ``apply_chat_template`` on its own saved tokenizers
(tests/transformers_fixtures/make_chat_fixtures.py made them)."""

import json
import pathlib

import numpy as np
import pytest

from mmnnx.cli import main
from mmnnx.train.chat_template import ChatTemplate, ChatTemplateError
from mmnnx.train.examples import Rows
from mmnnx.train.records import DataError, Example, Fields, encode_records, read_records
from mmnnx.train.tokenizers import BPETokenizer, ByteTokenizer, HFTokenizer

CHAT = pathlib.Path(__file__).parent / "transformers_fixtures" / "chat"
EXPECTED = json.loads((CHAT / "expected.json").read_text())
TEMPLATES = ["chatml", "llama3-v4", "generation"]


def checkpoint(name):
    return ChatTemplate.from_checkpoint(CHAT / name), HFTokenizer.from_file(
        CHAT / name / "tokenizer.json"
    )


@pytest.mark.parametrize("name", TEMPLATES)
def test_rendered_ids_equal_transformers(name):
    template, tokenizer = checkpoint(name)
    for chat, case in zip(EXPECTED["conversations"], EXPECTED[name], strict=True):
        for key, prompt in (("without_prompt", False), ("with_prompt", True)):
            text, spans = template.render(chat, add_generation_prompt=prompt)
            assert text == case[key]["text"]
            assert tokenizer.encode(text).tolist() == case[key]["input_ids"]
            assert len(spans) == sum(m["role"] == "assistant" for m in chat)


def test_generation_tag_masks_equal_transformers():
    template, tokenizer = checkpoint("generation")
    records = [(f"c{i}", {"messages": chat}) for i, chat in enumerate(EXPECTED["conversations"])]
    examples = encode_records(records, "chat", tokenizer, template)
    for ex, case in zip(examples, EXPECTED["generation"], strict=True):
        assert ex.ids.tolist() == case["without_prompt"]["input_ids"]
        assert ex.targets.astype(int).tolist() == case["without_prompt"]["assistant_masks"]


@pytest.mark.parametrize("name", ["chatml", "llama3-v4"])
def test_templates_without_tags_target_the_assistant_turns(name):
    template, tokenizer = checkpoint(name)
    chat = EXPECTED["conversations"][1]
    (ex,) = encode_records([("c", {"messages": chat})], "chat", tokenizer, template)
    targeted = tokenizer.decode(ex.ids[ex.targets])
    end = "<|im_end|>\n" if name == "chatml" else "<|eot_id|>"
    assert targeted == "".join(m["content"] + end for m in chat if m["role"] == "assistant")
    all_ = encode_records([("c", {"messages": chat})], "chat", tokenizer, template, train_on="all")
    assert all_[0].targets.all()


def test_completion_records_as_trl_tokenizes_them():
    tokenizer = ByteTokenizer()
    records = [("f:line 1", {"q": "2+2=", "a": "4"})]
    fields = Fields(prompt="q", completion="a")
    (ex,) = encode_records(records, "completion", tokenizer, fields=fields, eos="!")
    assert bytes(ex.ids.tolist()).decode() == "2+2=4!"
    assert ex.targets.tolist() == [False] * 4 + [True, True]


def test_a_completion_whose_first_token_takes_the_prompts_last_space_is_trained_on_whole():
    """TRL starts the completion where the prompt's tokens stop being a prefix of the whole:
    'In the ' + 'beginning' is '... the', ' beginning' whole, but '... the', ' ' alone. The
    targets started at the prompt's token count, so ' beginning' had no loss."""
    bpe = BPETokenizer.train(["In the beginning God created the heaven. "] * 8, vocab_size=300)
    tokenizer = HFTokenizer.from_str(bpe.to_str())
    records = [("f:line 1", {"prompt": "In the ", "completion": "beginning"})]
    (ex,) = encode_records(records, "completion", tokenizer)
    prompt = tokenizer.encode("In the ").tolist()
    assert ex.ids.tolist()[: len(prompt) - 1] == prompt[:-1] != ex.ids.tolist()[: len(prompt)]
    first = len(prompt) - 1  # the token holding ' b...' where the prompt alone has ' '
    assert ex.targets.tolist() == [False] * first + [True] * (len(ex.ids) - first)


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_reads_each_file_type(tmp_path, suffix):
    import pandas as pd

    frame = pd.DataFrame({"prompt": ["a", "b"], "completion": ["x", "y"]})
    path = tmp_path / f"d{suffix}"
    write = {
        ".jsonl": lambda: frame.to_json(path, orient="records", lines=True),
        ".json": lambda: frame.to_json(path, orient="records"),
        ".parquet": lambda: frame.to_parquet(path),
        ".csv": lambda: frame.to_csv(path, index=False),
    }
    write[suffix]()
    got = list(read_records(tmp_path, cache_dir=str(tmp_path / "cache")))
    assert [r for _, r in got] == frame.to_dict("records")
    unit = "line" if suffix == ".jsonl" else "row"
    assert got[1][0] == f"{path}:{unit} 2"


def test_bad_records_name_file_line_and_field(tmp_path):
    template, tokenizer = checkpoint("chatml")
    path = tmp_path / "d.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
        {"messages": [{"role": "wizard", "content": "q"}, {"role": "assistant", "content": "a"}]},
    ]
    path.write_text("\n\n".join(json.dumps(x) for x in lines) + "\n")  # a blank line between
    records = read_records(path, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"d.jsonl:line 3: messages\[0\] has role 'wizard'"):
        encode_records(records, "chat", tokenizer, template)
    with pytest.raises(DataError, match=r"d.jsonl:line 1: no field 'prompt' \(fields: messages\)"):
        encode_records(read_records(path, str(tmp_path / "c2")), "completion", tokenizer)
    failing = ChatTemplate("{{ raise_exception('only user turns') }}", origin="t.jinja")
    with pytest.raises(DataError, match="c: t.jinja: TemplateError: only user turns"):
        encode_records([("c", lines[0])], "chat", tokenizer, failing)
    with pytest.raises(DataError, match="no such data file or directory"):
        list(read_records(tmp_path / "missing"))
    broken = tmp_path / "broken.jsonl"  # the reader said only "An error occurred while ..."
    broken.write_text(json.dumps(lines[0]) + "\n\n" + '{"messages": [{"role": "user"}, \n')
    with pytest.raises(DataError, match=r"broken.jsonl:line 3: not a JSON object \(Expecting"):
        list(read_records(broken, cache_dir=str(tmp_path / "c3")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no data files"):
        list(read_records(tmp_path / "empty"))


@pytest.mark.parametrize(
    "content, reason",
    [(3, r"content is not text"), ([{"type": "text", "text": "q"}], r"content is not text")],
)
def test_a_field_of_another_type_than_earlier_lines_names_its_line(tmp_path, content, reason):
    """Arrow gives each field one type: a content of 3 or of parts after text ones failed the
    whole file ("not a readable json file: Expected object or value"), naming no line."""
    template, tokenizer = checkpoint("chatml")
    good = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    bad = {"messages": [{"role": "user", "content": content}, good["messages"][1]]}
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(bad) + "\n")
    records = read_records(path, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=rf"d.jsonl:line 3: messages\[0\].{reason}"):
        encode_records(records, "chat", tokenizer, template)


@pytest.mark.parametrize(
    "data_format, record, field",
    [
        ("text", {"text": ""}, "text"),
        ("completion", {"prompt": "1+1=", "completion": ""}, "completion"),
    ],
)
def test_a_record_with_no_token_to_train_on_is_refused_where_it_is_read(
    tmp_path, data_format, record, field
):
    # it was read as an example of no target, a row of padding trained on nothing
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({**record, field: "x"}) + "\n\n" + json.dumps(record) + "\n")
    records = read_records(path, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(
        DataError, match=rf"d.jsonl:line 3: field '{field}' gives no token to train on"
    ):
        encode_records(records, data_format, ByteTokenizer())
    if data_format == "completion":  # trained on all tokens, the prompt is something
        (ex,) = encode_records([("r", record)], data_format, ByteTokenizer(), train_on="all")
        assert ex.targets.tolist() == [True] * 4


def test_a_field_other_records_have_and_one_lacks_is_named_missing(tmp_path):
    """datasets fills a field an earlier record has with None: the error said "field
    'completion' is NoneType, not text" for a record without it."""
    path = tmp_path / "d.jsonl"
    records = [{"prompt": "a", "completion": "b"}, {"prompt": "c"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    records = read_records(path, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"d.jsonl:line 2: no field 'completion' \(or it is null\)"):
        encode_records(records, "completion", ByteTokenizer())


def test_a_line_that_is_no_object_is_one_line_of_error_and_nothing_logged(tmp_path, capfd):
    """datasets' JSON reader logged "ERROR:datasets.packaged_modules.json.json:Failed to load
    JSON from file ..." on stderr before mmnnx's one line."""
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n[1, 2]\n")
    with pytest.raises(DataError, match=r"d.jsonl:line 2: not a JSON object \(a list\)"):
        list(read_records(path, cache_dir=str(tmp_path / "cache")))
    assert capfd.readouterr().err == ""


def test_a_message_that_is_not_an_object_is_named_as_such():
    """A message that is a string was named by its text as a role: "messages[0] has role
    'hello'"."""
    template, tokenizer = checkpoint("chatml")
    record = {"messages": ["hello", {"role": "assistant", "content": "a"}]}
    with pytest.raises(DataError, match=r"f:line 1: messages\[0\] is str, not a message"):
        encode_records([("f:line 1", record)], "chat", tokenizer, template)


def test_template_missing_or_rewriting_history(tmp_path):
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        ChatTemplate.from_checkpoint(tmp_path)
    # drops earlier assistant turns, as Qwen3's does with their reasoning
    forgetful = ChatTemplate(
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
        "{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    )
    chat = EXPECTED["conversations"][1]
    with pytest.raises(ChatTemplateError, match=r"\{% generation %\} tags or --train-on all"):
        forgetful.render(chat)


def test_rows_one_per_example_or_packed():
    rng = np.random.default_rng(0)
    examples = [
        Example(rng.integers(1, 99, n).astype(np.int32), rng.random(n) < 0.5, f"e{i}")
        for i, n in enumerate([5, 9, 3, 7, 2, 12])
    ]
    plain, packed = Rows.of(examples, 12), Rows.of(examples, 12, pack=True)
    assert plain.tokens.shape == (6, 12) and len(packed.tokens) < 6
    assert packed.padding_fraction < plain.padding_fraction
    for rows in (plain, packed):  # each example whole in one row, positions from 0
        found = []
        for r in range(len(rows.tokens)):
            for s in range(1, rows.segments[r].max() + 1):
                at = rows.segments[r] == s
                found.append(rows.tokens[r, at].tolist())
                assert rows.positions[r, at].tolist() == list(range(at.sum()))
        assert sorted(found) == sorted(e.ids.tolist() for e in examples)
    batch = packed.batch(np.arange(len(packed.tokens)))
    count = sum(e.targets[1:].sum() for e in examples)
    assert (batch["weights"] > 0).sum() == count
    np.testing.assert_allclose(batch["weights"].sum(), len(packed.tokens), rtol=1e-6)


def test_long_examples_truncated_and_counted_or_refused():
    examples = [Example(np.arange(1, 11, dtype=np.int32), np.ones(10, bool), "f:line 7")]
    rows = Rows.of(examples, 8)
    assert rows.truncated == 1 and rows.tokens[0].tolist() == list(range(1, 9))
    with pytest.raises(DataError, match="f:line 7: 10 tokens, more than the 8"):
        Rows.of(examples, 8, truncate=False)


DPO = CHAT.parent / "dpo"


def sft_run(tmp_path, run, data, *argv):
    """`mmnnx train --init-from` the tiny Llama with its ChatML template, in this process."""
    base = ["train", "--init-from", str(DPO / "policy"), "--data", str(data), "--stages", "2"]
    base += ["--data-axis", "1", "--model-axis", "1", "--devices", "2", "--seq-len", "48"]
    base += ["--batch-size", "4", "--microbatches", "2", "--eval-every", "3", "--log-every", "1"]
    base += ["--eval-batches", "1", "--timeline-step", "0", "--no-tensorboard"]
    return main([*base, "--output-dir", str(tmp_path / run), *argv])


def chat_records(n=40):
    return [
        {
            "messages": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{2 * i}."},
            ]
        }  # fmt: skip
        for i in range(n)
    ]


def test_chat_sft_packed_with_lora_resumes_exactly(tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in chat_records()))
    flags = ["--pack", "--lora-rank", "4", "--checkpoint-every", "3", "--schedule-steps", "6"]
    assert sft_run(tmp_path, "a", data, *flags, "--steps", "3") == 0
    out = capsys.readouterr().out
    assert "data: 38 examples in" in out and "packed" in out
    assert sft_run(tmp_path, "a", data, *flags, "--steps", "6", "--resume") == 0
    assert sft_run(tmp_path, "b", data, *flags, "--steps", "6") == 0
    losses = [
        [
            json.loads(x).get("loss")
            for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()
        ]
        for r in ("a", "b")
    ]
    assert [x for x in losses[0] if x] == [x for x in losses[1] if x]
    capsys.readouterr()
    question = ["--prompt", "What is 3 plus 3?", "--max-new-tokens", "4"]
    assert main(["generate", "--run", str(tmp_path / "b"), *question, "--chat"]) == 0
    reply = capsys.readouterr().out
    assert "What is" not in reply and "<|im_start|>" not in reply


def test_bad_records_exit_2_before_training(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    assert sft_run(tmp_path, "r", bad, "--steps", "1") == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:line 1: messages[0] has role 'robot'" in err
    assert not list((tmp_path / "r").glob("checkpoints/[0-9]*"))  # no step saved
    assert main(["train", "--data", str(bad), "--output-dir", str(tmp_path / "s")]) == 2
    assert "--data-format chat needs --init-from" in capsys.readouterr().err
    # a base without a chat template: train says how to do without one, generate --chat not
    from tests.hf_checkpoints import write_checkpoint  # noqa: PLC0415

    base = write_checkpoint(tmp_path / "plain", num_hidden_layers=1)
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": chat_records(1)[0]["messages"]}) + "\n")
    argv = ["train", "--data", str(chat), "--init-from", str(base), "--stages", "1", "--output-dir"]
    assert main([*argv, str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "has no chat template" in err and "or use --data-format completion or text" in err
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "x" * 80, "completion": "y"}) + "\n" * 1)
    assert sft_run(tmp_path, "t", long, "--no-truncate", "--steps", "1") == 2
    assert "long.jsonl:line 1: " in capsys.readouterr().err


def test_dpo_loss_and_rewards_equal_trl():
    from mmnnx.models import from_pretrained
    from mmnnx.train.preference import dpo_loss, pair_rows

    expected = json.loads((DPO / "expected.json").read_text())
    pairs = [(p["prompt_ids"], p["chosen_ids"], p["rejected_ids"]) for p in expected["pairs"]]
    rows = pair_rows(pairs, max(2 * len(p) + len(c) + len(r) for p, c, r in pairs))
    policy, reference = from_pretrained(DPO / "policy"), from_pretrained(DPO / "reference")
    loss, metrics = dpo_loss(policy, reference, rows, beta=expected["beta"])
    np.testing.assert_allclose(loss, expected["loss"], rtol=1e-5)
    for name, value in metrics.items():  # rewards: differences of ~70-nat float32 sums
        np.testing.assert_allclose(value, expected["metrics"][name], rtol=1e-5, atol=2e-5)


def test_an_eval_fraction_outside_0_1_is_refused():
    from mmnnx.train.examples import ExampleDataset

    ex = [Example(np.arange(1, 6, dtype=np.int32), np.ones(5, bool)) for _ in range(20)]
    with pytest.raises(DataError, match=r"--eval-fraction must be in \(0, 1\), got 1.5"):
        ExampleDataset(ex, seq_len=7, batch_size=4, eval_fraction=1.5)


def test_a_batch_with_no_trained_token_is_skipped_and_counted():
    from mmnnx.train.examples import ExampleDataset

    none = [Example(np.arange(1, 6, dtype=np.int32), np.zeros(5, bool)) for _ in range(30)]
    some = [Example(np.arange(1, 6, dtype=np.int32), np.ones(5, bool)) for _ in range(2)]
    data = ExampleDataset(none + some, seq_len=7, batch_size=2, eval_examples=some)
    batches = [next(data) for _ in range(3)]
    assert all(b["weights"].sum() > 0 for b in batches)  # never a NaN of 0 / 0
    assert data.skipped > 0  # 15 batches an epoch, at most 2 with a trained token


def test_held_out_examples_with_no_trained_token_are_refused():
    """Held-out rows whose trained tokens are all cut off would evaluate to a loss of 0 (and
    the final report divided by it): refused, as training data with none is."""
    from mmnnx.train.examples import ExampleDataset

    some = [Example(np.arange(1, 6, dtype=np.int32), np.ones(5, bool)) for _ in range(20)]
    late = np.zeros(12, bool)
    late[10:] = True  # the trained tokens lie beyond --seq-len + 1 = 8
    cut = [Example(np.arange(1, 13, dtype=np.int32), late) for _ in range(2)]
    with pytest.raises(DataError, match="no held-out example keeps a token to evaluate on"):
        ExampleDataset(some, seq_len=7, batch_size=4, eval_examples=cut)
    ExampleDataset(some, seq_len=11, batch_size=4, eval_examples=cut)


def test_held_out_examples_are_evaluated_once_when_they_fill_fewer_batches_than_asked():
    """5 held-out rows in batches of 2 fill 2 batches: asked for 4, the 2 (rows 0-3), not the
    rows again modulo 5 (which weighed rows 0-3 twice in the reported loss)."""
    from mmnnx.train.examples import ExampleDataset

    rows = [Example(np.arange(1, 3 + i, dtype=np.int32), np.ones(i + 2, bool)) for i in range(5)]
    data = ExampleDataset(rows * 4, seq_len=7, batch_size=2, eval_examples=rows)
    batches = data.eval_batches(4)
    assert len(batches) == 2
    lengths = [int((w > 0).sum()) for b in batches for w in b["weights"]]
    assert sorted(lengths) == [1, 2, 3, 4]  # four different rows, none twice
    assert len(ExampleDataset(rows * 4, seq_len=7, batch_size=8, eval_examples=rows)
               .eval_batches(3)) == 1  # fmt: skip
