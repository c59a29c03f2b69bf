"""Examples tokenized as they stream into files on disk: the same rows, batches and resumed
batches as examples held in memory, the files reused while the data is unchanged, and a batch
costing the memory of its rows whatever the dataset's size."""

import json
import tracemalloc
import types

import numpy as np
import pytest

from mmnnx.train import run_data
from mmnnx.train.example_store import ExampleStore, write_examples
from mmnnx.train.examples import ExampleDataset, Rows, _best_fit
from mmnnx.train.records import DataError, Example, encode_records, read_records
from mmnnx.train.tokenizers import ByteTokenizer


def dense_rows(examples, length, pack):
    """The rows as the in-memory layout made them before the examples went to disk."""
    cut = [(e.ids[:length], e.targets[:length]) for e in examples]
    layout = _best_fit([len(i) for i, _ in cut], length) if pack else [[i] for i in range(len(cut))]
    out = [np.zeros((len(layout), length), t) for t in (np.int32, bool, np.int32, np.int32)]
    for r, members in enumerate(layout):
        at = 0
        for s, i in enumerate(members, 1):
            ids, marks = cut[i]
            span = slice(at, at + len(ids))
            out[0][r, span], out[1][r, span], out[2][r, span] = ids, marks, s
            out[3][r, span] = np.arange(len(ids))
            at += len(ids)
    return out


def random_examples(n, seed=0, longest=14):
    rng = np.random.default_rng(seed)
    return [
        Example(rng.integers(1, 99, k).astype(np.int32), rng.random(k) < 0.6, f"d.jsonl:line {i}")
        for i, k in enumerate(rng.integers(1, longest, n))
    ]


def test_stored_rows_and_batches_equal_in_memory_and_resume_exactly(tmp_path):
    examples = random_examples(60)
    store = write_examples(iter(examples), tmp_path / "ex", key="k")
    assert isinstance(store._ids, np.memmap) and store.where(7) == "d.jsonl:line 7"
    for pack in (False, True):
        rows = Rows.of(store, 10, pack=pack)
        dense = dense_rows(examples, 10, pack)
        for got, want in zip(rows.arrays(), dense, strict=True):
            np.testing.assert_array_equal(got, want)
        assert rows.truncated == sum(len(e.ids) > 10 for e in examples)
        assert rows.padding_fraction == float((dense[2] == 0).mean())
    long = next(e for e in examples if len(e.ids) > 10)
    with pytest.raises(DataError, match=f"{long.where}: {len(long.ids)} tokens, more than the 10"):
        Rows.of(store, 10, truncate=False)
    shape = dict(seq_len=9, batch_size=4, pack=True, seed=3)
    memory, disk = ExampleDataset(examples, **shape), ExampleDataset(store, **shape)
    assert memory.summary() == disk.summary()
    for _ in range(5):
        a, b = next(memory), next(disk)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    state = disk.state()
    later = [next(disk)["tokens"] for _ in range(3)]
    resumed = ExampleDataset(write_examples(iter([]), tmp_path / "ex", key="k"), **shape)
    resumed.restore(json.loads(json.dumps(state)))
    assert all(np.array_equal(t, next(resumed)["tokens"]) for t in later)
    for a, b in zip(memory.eval_batches(2), disk.eval_batches(2), strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in a)


def test_run_dataset_streams_records_and_reuses_the_cache(tmp_path, monkeypatch):
    path = tmp_path / "d.jsonl"
    records = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = types.SimpleNamespace(
        data=str(path), eval_data=None, data_format="auto", train_on="completions", pack=True,
        truncate=True, eval_fraction=0.1, text_field="text", prompt_field="prompt",
        completion_field="completion", messages_field="messages",
    )  # fmt: skip
    run = types.SimpleNamespace(
        dataset=data,
        model=types.SimpleNamespace(seq_len=15, init_from=None),
        training=types.SimpleNamespace(batch_size=4, seed=0),
        preference=types.SimpleNamespace(dpo=False),
    )
    encoded = []
    real = run_data.encode_record
    monkeypatch.setattr(
        run_data, "encode_record", lambda *a, **k: encoded.append(1) or real(*a, **k)
    )
    cache = tmp_path / "cache"
    streamed = run_data.run_dataset(run, ByteTokenizer(), [], cache)
    assert len(encoded) == 30 and (cache / "examples" / "ids.bin").is_file()
    old = encode_records(read_records(path), "completion", ByteTokenizer())
    reference = ExampleDataset(old, seq_len=15, batch_size=4, pack=True, eval_fraction=0.1)
    for _ in range(4):
        a, b = next(reference), next(streamed)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert len(run_data.run_dataset(run, ByteTokenizer(), [], cache).rows) == len(streamed.rows)
    assert len(encoded) == 30  # unchanged file: the examples read back, nothing tokenized
    data.train_on = "all"
    run_data.run_dataset(run, ByteTokenizer(), [], cache)
    assert len(encoded) == 60  # an option that changes the tokens: made again
    path.write_text(path.read_text() + json.dumps({"prompt": "x", "completion": "y"}) + "\n")
    assert run_data.run_dataset(run, ByteTokenizer(), [], cache).examples == 28
    assert len(encoded) == 91
    path.write_text(path.read_text() + json.dumps({"prompt": 3}) + "\n")
    with pytest.raises(DataError, match=r"d.jsonl:line 32: field 'prompt' is int"):
        run_data.run_dataset(run, ByteTokenizer(), [], cache)
    assert json.loads((cache / "examples" / "examples.json").read_text())["examples"] == 31


def test_a_batch_reads_its_rows_only_whatever_the_dataset_size(tmp_path, monkeypatch):
    peaks, reads, calls = [], [], []
    read = ExampleStore.read
    monkeypatch.setattr(ExampleStore, "read", lambda *a: calls.append(1) or read(*a))
    for n in (2_000, 20_000):
        store = write_examples(iter(random_examples(n, longest=8)), tmp_path / str(n), key=None)
        data = ExampleDataset(store, seq_len=15, batch_size=8, pack=True)
        next(data)
        window_peaks = []  # Grain's prefetch thread runs ahead by a varying amount: the least of 3
        for _ in range(3):
            tracemalloc.start()
            calls.clear()
            for _ in range(10):
                next(data)
            window_peaks.append(tracemalloc.get_traced_memory()[1])
            tracemalloc.stop()
        peaks.append(min(window_peaks))
        reads.append(len(calls))
    # a packed row of 16 tokens holds at most 16 examples: 10 batches of 8 rows read <= 1280
    assert all(r <= 10 * 8 * 16 for r in reads), reads
    assert peaks[1] < 1.2 * peaks[0] + 10_000, peaks  # an index of all 20k rows: +45 kB
