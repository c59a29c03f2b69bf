import numpy as np
import pytest

from mmnnx.train.data import ByteTokenizer, TextDataset, embedded_text, load_text


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


def test_errors():
    with pytest.raises(ValueError, match="fewer than one batch"):
        TextDataset(np.arange(100), seq_len=50, batch_size=4)
    with pytest.raises(ValueError, match="eval_fraction"):
        TextDataset(np.arange(100), seq_len=4, batch_size=1, eval_fraction=0)
