"""``mmnnx export``: write the model of a run ``mmnnx train`` wrote as a Hugging Face checkpoint
or its LoRA adapters in PEFT's layout."""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any

from mmnnx.cli import prologue
from mmnnx.cli.flags import add_fields, typed
from mmnnx.train.options import integer, option, switch


@dataclasses.dataclass
class Options:
    run: str = option(dataclasses.MISSING, "the run's --output-dir", metavar="DIR")
    output: str = option(
        dataclasses.MISSING, "the directory to write (it must not exist)", metavar="OUT"
    )
    merge_lora: bool = switch(
        "--merge-lora",
        "write the whole model, each LoRA adapter merged into its kernel (W + alpha/r B A): "
        "what a LoRA run exports by default",
    )
    adapter: bool = switch(
        "--adapter",
        "write the LoRA adapters alone, in PEFT's layout (adapter_model.safetensors and "
        "adapter_config.json), for the --init-from checkpoint",
    )
    dtype: str | None = option(
        None,
        "the dtype of the tensors written (default: the --init-from checkpoint's; float32 for "
        "a run trained from scratch)",
        choices=("bfloat16", "float32"),
    )
    quantized: bool = switch(
        "--quantized",
        "write the weights the --init-from checkpoint had quantized (its quantization_config: "
        "FP8 blocks, MXFP4 experts) quantized again, the rest in --dtype",
    )
    step: int | None = option(
        None, "the checkpoint step to export (default: the newest)", integer(0), metavar="N"
    )
    overwrite: bool = switch("--overwrite", "replace OUT if it exists")


def add_parser(commands: Any) -> None:
    export = commands.add_parser(
        "export",
        help="write a run's model as a Hugging Face checkpoint, or its LoRA adapters",
        description="Rebuild the model of run directory DIR from DIR/config.toml (and its "
        "--init-from config.json), restore its newest checkpoint (or --step N) onto the run's "
        "own tasks and write it into OUT: a Hugging Face checkpoint (config.json, safetensors "
        "shards and index, tokenizer.json), LoRA adapters merged, or with --adapter the "
        "adapters alone in PEFT's layout. A run trained from scratch is written as "
        "LlamaForCausalLM (it needs --gated-mlp). Under `mmnnx launch -n N` each process writes "
        "its own tasks' tensors. Example: mmnnx export --run runs/ft --output runs/ft-hf",
    )
    add_fields(export, dataclasses.fields(Options))


def run(args: argparse.Namespace) -> int:
    """``mmnnx export``: what was written, in one line; status 2 and one line if it cannot."""
    options, error = typed(Options, args), functools.partial(prologue.error, "export")
    if options.merge_lora and options.adapter:
        return error("--merge-lora and --adapter exclude each other: pick one")
    if options.quantized and options.adapter:
        return error("--quantized and --adapter exclude each other: adapters are not quantized")
    from mmnnx.train.generation import RunError, read_run_config  # noqa: PLC0415

    try:
        config = read_run_config(options.run)
    except RunError as e:
        return error(f"--run: {e}")
    if options.merge_lora and not config.model.lora_rank:
        return error(
            f"--merge-lora: the run in {options.run} has no LoRA adapters to merge (it was not "
            "trained with --lora-rank); leave it out to export the model"
        )
    prologue.start(config.layout.devices)  # under `mmnnx launch`: each writes its own tensors
    import jax  # noqa: PLC0415  (after XLA_FLAGS)

    from mmnnx.models import CheckpointError  # noqa: PLC0415
    from mmnnx.train.export import export_run  # noqa: PLC0415

    try:
        done = export_run(
            options.run,
            options.output,
            adapter=options.adapter,
            dtype=options.dtype,
            quantized=options.quantized,
            step=options.step,
            overwrite=options.overwrite,
        )
    except (RunError, CheckpointError, *prologue.unrestorable()) as e:
        return error(str(e))
    except OSError as e:  # a place that cannot be written
        return error(f"--output {options.output}: cannot write there ({e.strerror or e})")
    if jax.process_index() == 0:
        what = "LoRA adapters (PEFT)" if done.adapter else done.architecture
        print(f"mmnnx export: {done.directory}: {what}, from step {done.step} of {options.run}")
    return 0
