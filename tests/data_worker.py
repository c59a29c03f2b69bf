"""One process of ``tests/test_data.py``'s sharding test, started by ``mmnnx launch``: the
dataset of the text files in TEXT_DIR (argv[1]) tokenized into a cache shared by every process,
sharded over the processes; writes its rows of the first 3 batches and of 2 evaluation batches
to OUT/rank<i>.npz (argv[2])."""

from __future__ import annotations

import pathlib
import sys

import jax
import numpy as np

import mmnnx as mm
from mmnnx.train import ByteTokenizer, TextDataset


def main(text_dir: str, out: str) -> None:
    mm.distributed.initialize()
    rank, count = jax.process_index(), jax.process_count()
    folder = pathlib.Path(out)
    dataset = TextDataset.from_files(
        text_dir,
        ByteTokenizer(),
        folder / "cache",  # written by every process at once
        seq_len=16,
        batch_size=8,
        seed=5,
        shard_index=rank,
        shard_count=count,
    )
    train = np.stack([next(dataset) for _ in range(3)])
    np.savez(folder / f"rank{rank}.npz", train=train, eval=np.stack(dataset.eval_batches(2)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
