"""mmnnx.train: what a training run needs on top of ``mm.jit``: text data, Orbax checkpoints of
task-placed state, and the training loop.

Example:
    >>> from mmnnx.train import ByteTokenizer, Checkpointer, TrainConfig
    >>> ByteTokenizer().encode("a").tolist(), Checkpointer.__name__, TrainConfig().schedule
    ([97], 'Checkpointer', '1f1b')
"""

from mmnnx.train.checkpoint import (
    CheckpointCorruptError,
    CheckpointDirectoryBusyError,
    Checkpointer,
    CheckpointMismatchError,
    NoReadableCheckpointError,
    Resumed,
    Skipped,
)
from mmnnx.train.config import RunConfig, gpt_config, train_config
from mmnnx.train.corpus import text_chunks, token_file
from mmnnx.train.data import DataStateError, TextDataset, embedded_text, load_text
from mmnnx.train.generation import LoadedRun, RunError, continue_text, load_run
from mmnnx.train.loop import FitResult, TrainConfig, fit, make_optimizer
from mmnnx.train.router_metrics import RouterMetrics, router_metrics
from mmnnx.train.run_config import ConfigError, read_config, resolved_config, write_config
from mmnnx.train.tokenizers import (
    BPETokenizer,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)
from mmnnx.train.wandb_writer import WandbStartError, WandbWriter

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "CheckpointCorruptError",
    "CheckpointDirectoryBusyError",
    "CheckpointMismatchError",
    "ConfigError",
    "DataStateError",
    "Checkpointer",
    "FitResult",
    "HFTokenizer",
    "LoadedRun",
    "NoReadableCheckpointError",
    "Resumed",
    "RouterMetrics",
    "RunConfig",
    "RunError",
    "Skipped",
    "TextDataset",
    "Tokenizer",
    "TrainConfig",
    "WandbStartError",
    "WandbWriter",
    "continue_text",
    "embedded_text",
    "fit",
    "gpt_config",
    "load_run",
    "load_text",
    "load_tokenizer",
    "make_optimizer",
    "read_config",
    "resolved_config",
    "router_metrics",
    "write_config",
    "text_chunks",
    "train_config",
    "token_file",
]
