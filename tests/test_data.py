"""Training data: text files streamed in chunks into a token file, and the Grain pipeline of
windows over it (deterministic, sharded, resumable)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mmnnx.train.corpus import text_chunks, token_file
from mmnnx.train.data import ByteTokenizer, TextDataset, embedded_text, load_text
from tests.flags import without_device_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "In the beginning — ünïcode ✓"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and ids.max() < 256
    assert tok.decode(ids) == text


def test_embedded_text():
    text = embedded_text()
    assert 300_000 < len(text.encode()) < 500_000
    assert text.startswith("In the beginning God created the heaven and the earth.")


def test_load_text(tmp_path):
    (tmp_path / "a.txt").write_text("one")
    (tmp_path / "b.txt").write_text("two")
    assert load_text(tmp_path) == "one\ntwo"
    assert load_text([tmp_path / "b.txt"]) == "two"
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_text(tmp_path / "missing.txt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no \\*.txt files"):
        load_text(tmp_path / "empty")


def make(**kw):
    return TextDataset.from_text(embedded_text(), seq_len=32, batch_size=8, **kw)


def test_batches_are_windows_of_the_text():
    ds = make()
    batch = next(ds)
    assert batch.shape == (8, 33)
    tokens = ds.tokens
    for row in batch:  # each row is a contiguous window of the training text
        start = np.flatnonzero(tokens[: len(tokens) - 33] == row[0])
        assert any(np.array_equal(tokens[s : s + 33], row) for s in start)


def test_deterministic_and_resumable():
    a, b = make(seed=3), make(seed=3)
    first = [next(a) for _ in range(5)]
    np.testing.assert_array_equal(np.stack(first), np.stack([next(b) for _ in range(5)]))
    state = a.state()
    expected = [next(a) for _ in range(3)]
    resumed = make(seed=3)
    resumed.restore(state)
    for e in expected:
        np.testing.assert_array_equal(next(resumed), e)
    assert not np.array_equal(next(make(seed=4)), first[0])


def test_epochs_cover_all_windows_then_reshuffle():
    ds = TextDataset(np.arange(60), seq_len=4, batch_size=2, eval_fraction=1 / 3)
    epoch = np.concatenate([next(ds) for _ in range(ds.batches_per_epoch)])
    assert sorted(epoch[:, 0].tolist()) == [0, 5, 10, 15, 20, 25, 30, 35]
    second = np.concatenate([next(ds) for _ in range(ds.batches_per_epoch)])
    assert sorted(second[:, 0].tolist()) == sorted(epoch[:, 0].tolist())


def test_eval_batches_are_fixed_and_held_out():
    ds = make()
    e1, e2 = ds.eval_batches(3), ds.eval_batches(3)
    for x, y in zip(e1, e2, strict=True):
        np.testing.assert_array_equal(x, y)
    split = int(len(ds.tokens) * 0.95)
    held_out = ds.tokens[split:]
    row = e1[0][0]
    assert any(np.array_equal(held_out[i : i + 33], row) for i in range(len(held_out) - 32))


def test_eval_batches_never_repeat_a_held_out_window():
    # the held-out windows were taken again, modulo their count, to fill the batches asked for
    ds = TextDataset(np.arange(1000), seq_len=7, batch_size=4)  # 50 held out: 6 windows of 8
    (batch,) = ds.eval_batches(3)
    assert batch[:, 0].tolist() == [950, 958, 966, 974]
    # fewer held-out windows than a batch: one batch, taking them again in turn (a tiny text)
    (batch,) = TextDataset(np.arange(1000), seq_len=7, batch_size=8).eval_batches(3)
    assert batch[:, 0].tolist() == [950, 958, 966, 974, 982, 990, 950, 958]


def test_errors():
    with pytest.raises(ValueError, match="fewer than one batch"):
        TextDataset(np.arange(100), seq_len=50, batch_size=4)
    with pytest.raises(ValueError, match="eval_fraction"):
        TextDataset(np.arange(100), seq_len=4, batch_size=1, eval_fraction=0)


def test_state_is_json_and_an_older_state_is_refused():
    ds = make(seed=1)
    next(ds), next(ds)
    state = json.loads(json.dumps(ds.state()))  # as a checkpoint's extra keeps it
    expected = next(ds)
    resumed = make(seed=1)
    resumed.restore(state)
    np.testing.assert_array_equal(next(resumed), expected)
    with pytest.raises(ValueError, match="not a Grain iterator's state"):
        resumed.restore({"position": 2})


def test_shards_together_give_the_one_shard_batch():
    whole = make(seed=2)
    shards = [make(seed=2, shard_index=i, shard_count=4) for i in range(4)]
    for _ in range(3):
        batch, parts = next(whole), [next(s) for s in shards]
        for i, part in enumerate(parts):
            assert part.shape == (2, 33)
            np.testing.assert_array_equal(part, batch[i::4])
    for b, batch in enumerate(whole.eval_batches(2)):
        for i, s in enumerate(shards):
            np.testing.assert_array_equal(s.eval_batches(2)[b], batch[i::4])
    with pytest.raises(ValueError, match="batch_size 8 is not divisible by shard_count 3"):
        make(shard_count=3)
    with pytest.raises(ValueError, match="shard_index must be in"):
        make(shard_index=2, shard_count=2)


def test_shards_over_two_processes(tmp_path):
    """Two real processes (``mmnnx launch``), each its own shard of the one-process batches,
    both tokenizing the text into the same cache at once."""
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"{i}.txt").write_text(f"file {i}: " + embedded_text()[i * 5000 : (i + 1) * 5000])
    env = dict(os.environ, XLA_FLAGS=without_device_count(os.environ["XLA_FLAGS"]))
    worker = [sys.executable, "-m", "tests.data_worker", str(texts), str(tmp_path)]
    run = subprocess.run(
        [sys.executable, "-m", "mmnnx", "launch", "-n", "2", "--", *worker],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    one = TextDataset.from_text(load_text(texts), seq_len=16, batch_size=8, seed=5)
    train = np.stack([next(one) for _ in range(3)])
    evals = np.stack(one.eval_batches(2))
    for rank in range(2):
        rows = np.load(tmp_path / f"rank{rank}.npz")
        assert rows["train"].shape == (3, 4, 17)
        np.testing.assert_array_equal(rows["train"], train[:, rank::2])
        np.testing.assert_array_equal(rows["eval"], evals[:, rank::2])


def test_text_chunks_stream_the_files_at_line_ends(tmp_path):
    lines = [f"line {i} ünïcode ✓\n" for i in range(500)]
    (tmp_path / "a.txt").write_text("".join(lines[:300]))
    (tmp_path / "b.txt").write_text("".join(lines[300:]).rstrip("\n"))
    chunks = list(text_chunks(tmp_path, chunk_bytes=256))
    assert "".join(chunks) == "".join(lines[:300]) + "\n" + "".join(lines[300:]).rstrip("\n")
    assert len(chunks) > 20 and all(c.endswith("\n") for c in chunks[:-1])
    assert max(len(c) for c in chunks) < 256 + 2 * len(lines[-1])


def test_a_byte_that_is_not_utf8_is_named_with_its_offset(tmp_path):
    data = ("é" * 300).encode() + b"\xff" + b"tail"
    (tmp_path / "bad.txt").write_bytes(data)
    with pytest.raises(ValueError, match=r"bad.txt is not UTF-8: byte 600 is b'\\xff'"):
        list(text_chunks(tmp_path / "bad.txt", chunk_bytes=7))  # cuts between é's bytes


class _Recording(ByteTokenizer):
    """Bytes, noting the length of each text it is given."""

    def __init__(self):
        self.lengths = []

    def encode(self, text):
        self.lengths.append(len(text))
        return super().encode(text)


def test_token_file_is_tokenized_by_chunks_and_read_from_disk(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_text(embedded_text()[i * 40_000 : (i + 1) * 40_000])
    tokenizer = _Recording()
    tokens = token_file(corpus, tokenizer, tmp_path / "cache", chunk_bytes=4096)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    assert max(tokenizer.lengths) < 4096 + 200 and len(tokenizer.lengths) > 30  # never whole
    np.testing.assert_array_equal(tokens, ByteTokenizer().encode(load_text(corpus)))
    made = (tmp_path / "cache" / "tokens.bin").stat().st_mtime_ns
    again = _Recording()
    np.testing.assert_array_equal(token_file(corpus, again, tmp_path / "cache", 4096), tokens)
    assert again.lengths == []  # reused
    assert (tmp_path / "cache" / "tokens.bin").stat().st_mtime_ns == made
    with open(tmp_path / "cache" / "tokens.bin", "r+b") as f:  # zeroed by a crash, say
        f.write(bytes(len(tokens) * tokens.itemsize))
    with pytest.warns(UserWarning, match="tokens.bin does not have the checksum it was written"):
        made_again = token_file(corpus, again, tmp_path / "cache", 4096)
    np.testing.assert_array_equal(made_again, ByteTokenizer().encode(load_text(corpus)))
    assert again.lengths  # tokenized again, not read as token 0 throughout
    (corpus / "0.txt").write_text("changed\n" * 100)
    changed = token_file(corpus, again, tmp_path / "cache", 4096)
    assert again.lengths and ByteTokenizer().decode(changed[:8]) == "changed\n"
    cache = tmp_path / "cache"
    ds = TextDataset.from_files(corpus, ByteTokenizer(), cache, 4096, seq_len=32, batch_size=8)
    assert isinstance(ds.tokens, np.memmap)
    for row in next(ds):  # windows of the token file
        starts = np.flatnonzero(changed[: len(changed) - 33] == row[0])
        assert any(np.array_equal(changed[s : s + 33], row) for s in starts)


def test_a_vocabulary_past_uint16_gets_an_int32_token_file(tmp_path):
    class Wide(ByteTokenizer):
        vocab_size = 200_000

        def encode(self, text):
            return super().encode(text) * 1000  # "~" (126) is 126,000: past uint16

    (tmp_path / "a.txt").write_text("~" * 100)
    tokens = token_file(tmp_path / "a.txt", Wide(), tmp_path / "cache")
    assert tokens.dtype == np.int32 and tokens.tolist() == [126_000] * 100
