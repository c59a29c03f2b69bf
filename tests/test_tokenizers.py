"""Tokenizers: bytes and a trained byte-level BPE, each saved into a folder and loaded back by
``load_tokenizer``; BPE training is the same in every process."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mmnnx.train import BPETokenizer, ByteTokenizer, embedded_text, load_tokenizer, tokenizers
from mmnnx.train.corpus import token_file
from mmnnx.train.data import EMBEDDED
from mmnnx.train.tokenizers import register_tokenizer
from tests.flags import without_device_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TEXT = "In the beginning — ünïcode ✓\n\n  tabs\tand  spaces "


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return BPETokenizer.train([embedded_text()[:100_000]], vocab_size=400)


def test_byte_tokenizer_round_trips_and_saves(tmp_path):
    tok = ByteTokenizer()
    ids = tok.encode(TEXT)
    assert ids.dtype == np.int32 and ids.max() < 256 and tok.decode(ids) == TEXT
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, ByteTokenizer) and loaded.vocab_size == 256


def test_bpe_is_lossless_and_shorter_than_bytes(bpe):
    assert bpe.vocab_size == 400
    sample = embedded_text()[200_000:210_000]  # text it was not trained on
    ids = bpe.encode(sample)
    assert ids.dtype == np.int32 and 256 <= ids.max() < 400  # merges are used
    assert bpe.decode(ids) == sample
    assert len(ids) < 0.6 * len(sample.encode())
    assert bpe.decode(bpe.encode(TEXT)) == TEXT  # characters it never saw: their bytes


def test_bpe_saves_and_loads(bpe, tmp_path):
    bpe.save(tmp_path / "tok")
    assert json.loads((tmp_path / "tok" / "tokenizer.json").read_text()) == {
        "name": "bpe",
        "vocab_size": 400,
    }
    loaded = load_tokenizer(tmp_path / "tok")
    assert isinstance(loaded, BPETokenizer) and loaded.vocab_size == 400
    np.testing.assert_array_equal(loaded.encode(TEXT), bpe.encode(TEXT))
    assert loaded.to_str() == bpe.to_str()


def test_bpe_training_is_the_same_in_every_process():
    """A fresh interpreter (another hash seed) trains the tokenizer this process trains."""
    script = (
        "from mmnnx.train import BPETokenizer, embedded_text\n"
        "print(BPETokenizer.train([embedded_text()[:50_000]], vocab_size=350).to_str(), end='')"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    here = BPETokenizer.train([embedded_text()[:50_000]], vocab_size=350).to_str()
    assert run.stdout == here and '"merges"' in here


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no saved tokenizer in .*missing tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"name": "wordpiece"}')
    with pytest.raises(ValueError, match="names tokenizer 'wordpiece'; known: bpe, bytes"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"name": "bpe"}')
    with pytest.raises(FileNotFoundError, match="has no bpe.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="vocab_size >= 256, got 100"):
        BPETokenizer.train(["abc"], vocab_size=100)


def test_a_checkpoint_with_only_a_sentencepiece_model_says_how_to_convert_it(tmp_path):
    # it said "no such tokenizer file", naming none of what the folder holds
    (tmp_path / "tokenizer.model").write_bytes(b"")
    with pytest.raises(ValueError, match="tokenizer.model, without a tokenizer.json") as raised:
        tokenizers.HFTokenizer.from_file(tmp_path / "tokenizer.json")
    assert f"AutoTokenizer.from_pretrained('{tmp_path}').save_pretrained(" in str(raised.value)


def test_register_tokenizer_makes_a_new_kind_loadable(tmp_path, monkeypatch):
    monkeypatch.setattr(tokenizers, "_LOADERS", dict(tokenizers._LOADERS))  # undone after

    class Upper(ByteTokenizer):
        name = "upper"

        def encode(self, text):
            return super().encode(text.upper())

    register_tokenizer("upper", lambda folder: Upper())
    Upper().save(tmp_path)
    assert load_tokenizer(tmp_path).encode("a").tolist() == [65]


def test_a_bpe_token_file_made_by_pieces_equals_the_text_encoded_whole(bpe, tmp_path):
    tokens = token_file([EMBEDDED], bpe, tmp_path, chunk_bytes=4096)
    np.testing.assert_array_equal(tokens, bpe.encode(embedded_text()))


def test_processes_that_train_different_bpes_stop_before_training(tmp_path):
    """``mmnnx train --tokenizer bpe`` under ``mmnnx launch`` with rank 1 training another
    vocabulary size: every process stops, naming the difference."""
    code = (
        "import os, sys\n"
        "from mmnnx.train.tokenizers import BPETokenizer\n"
        "train = BPETokenizer.train.__func__\n"
        "if os.environ['MMNNX_PROCESS_ID'] == '1':\n"
        "    BPETokenizer.train = classmethod(lambda c, texts, n: train(c, texts, n - 1))\n"
        "from mmnnx.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    train = ["train", "--tokenizer", "bpe", "--vocab-size", "300", "--steps", "1"]
    env = dict(os.environ, XLA_FLAGS=without_device_count(os.environ["XLA_FLAGS"]))
    run = subprocess.run(
        [sys.executable, "-m", "mmnnx", "launch", "-n", "2", "--devices-per-process", "4", "--",
         sys.executable, "-c", code, *train, "--output-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode != 0
    said = run.stdout + run.stderr
    assert "--tokenizer bpe: the BPE each process trained differs between processes 0 and 1" in said
    assert not (tmp_path / "checkpoints").exists()
