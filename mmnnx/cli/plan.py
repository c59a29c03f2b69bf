"""``mmnnx plan``: the layout that trains a model fastest on a cluster, on paper, from its
``config.json`` alone (``mm.plan_cluster``; docs/planning.md)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import shutil
import tempfile
from typing import Any

from mmnnx.cli import prologue
from mmnnx.cli.flags import add_fields, typed
from mmnnx.train.options import finite, option, positive, switch

_DEVICES = ("h100", "h200", "h800", "a100", "tpu-v5p")


@dataclasses.dataclass
class Options:
    init_from: str = option(
        dataclasses.MISSING, "a Hugging Face checkpoint directory or its config.json alone",
        metavar="CONFIG_OR_DIR",
    )  # fmt: skip
    devices: int = option(dataclasses.MISSING, "accelerators in the cluster", positive,
                          metavar="N")  # fmt: skip
    device: str = option("h100", "the accelerator (%(default)s)", choices=_DEVICES)
    memory: str | None = option(None, "override: bytes of memory per device (80GB, 96GiB)",
                                metavar="BYTES")  # fmt: skip
    flops: float | None = option(None, "override: peak dense bf16 FLOP/s per device",
                                 finite(positive=True), metavar="FLOPS")  # fmt: skip
    bandwidth: float | None = option(
        None, "override: bytes/s per device one way across nodes", finite(positive=True),
        metavar="BYTES_PER_S",
    )  # fmt: skip
    seq_len: int | None = option(None, "tokens per sequence (default: the config's context)",
                                 positive, metavar="T")  # fmt: skip
    batch: int | None = option(
        None, "sequences per step, the global batch (default: 4M tokens' worth)", positive,
        metavar="B",
    )  # fmt: skip
    layout: str | None = option(
        None, "evaluate this layout instead of searching, e.g. pp=16,tp=8,dp=64,"
        "schedule=interleaved-1f1b,microbatches=32,remat=full (fields left out are searched)",
        metavar="LAYOUT",
    )  # fmt: skip
    collectives: str = option(
        "engine", "engine: gradients reduced and FSDP weights gathered in every microbatch, "
        "as mmnnx runs; published: once per step, memory as Megatron/torchtitan hold it",
        choices=("engine", "published"),
    )  # fmt: skip
    param_dtype: str = option("float32", "parameters' dtype (%(default)s)",
                              choices=("float32", "bfloat16"))  # fmt: skip
    dtype: str = option("bfloat16", "compute dtype (%(default)s)",
                        choices=("float32", "bfloat16"))  # fmt: skip
    json: bool = switch("--json", "print one JSON object instead of the report")


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "plan",
        help="pick a parallel layout for a cluster, on paper",
        description="Pick the stages, FSDP, tensor and expert axes, schedule, microbatches "
        "and remat that train the model of CONFIG_OR_DIR (a config.json is enough) fastest "
        "on N devices, and print each task's memory, the predicted step, bubble, tokens/s "
        "and MFU with the cost model's assumptions. Example: mmnnx plan --init-from "
        "llama3-70b/config.json --devices 64 --device h100 --seq-len 4096 --batch 128",
    )
    add_fields(parser, dataclasses.fields(Options))


def config_directory(path: str) -> pathlib.Path:
    """The checkpoint directory of ``path``: itself, or for a ``config.json`` file (of any
    name) a directory holding it as ``config.json``.

    Example:
        >>> import tempfile
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> config_directory(str(folder)) == folder
        True
    """
    file = pathlib.Path(path)
    if file.is_dir():
        return file
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint directory or config.json")
    if file.name == "config.json":
        return file.parent
    folder = pathlib.Path(tempfile.mkdtemp(prefix="mmnnx-plan-"))
    shutil.copy(file, folder / "config.json")
    return folder


def run(args: argparse.Namespace) -> int:
    """``mmnnx plan``: the report (or ``--json``) on stdout; a bad file, flag or a cluster
    nothing fits exits 2 in one line."""
    options = typed(Options, args)
    error = functools.partial(prologue.error, "plan")
    from mmnnx.errors import NoCandidateError  # noqa: PLC0415
    from mmnnx.models.pretrained import CheckpointError, pretrained_config  # noqa: PLC0415
    from mmnnx.partition.cluster import evaluate, parse_layout, plan_cluster  # noqa: PLC0415
    from mmnnx.partition.cost import DEVICES, ENGINE, PUBLISHED, ClusterLayout  # noqa: PLC0415
    from mmnnx.tuning import parse_bytes  # noqa: PLC0415

    try:
        folder = config_directory(options.init_from)
        config = pretrained_config(folder, param_dtype=options.param_dtype,
                                   dtype=options.dtype, max_seq_len=options.seq_len)  # fmt: skip
    except (FileNotFoundError, CheckpointError, ValueError) as e:
        return error(f"--init-from: {e}")
    device = DEVICES[options.device]
    overrides = {"flops": options.flops, "inter_bandwidth": options.bandwidth}
    try:
        if options.memory is not None:
            overrides["memory"] = parse_bytes(options.memory)
    except ValueError as e:
        return error(f"--memory: {e}")
    device = dataclasses.replace(device, **{k: v for k, v in overrides.items() if v})
    seq = config.max_seq_len
    batch = options.batch or max(1, 2**22 // seq)
    try:
        fixed = parse_layout(options.layout) if options.layout else {}
    except ValueError as e:
        return error(f"--layout: {e}")
    collectives = PUBLISHED if options.collectives == "published" else ENGINE
    try:
        if _complete(fixed, options.devices):
            step = evaluate(config, ClusterLayout(**fixed), device, batch=batch, seq=seq,
                            collectives=collectives)  # fmt: skip
        else:
            step = plan_cluster(config, options.devices, device, batch=batch, seq=seq,
                                fixed=fixed, collectives=collectives)  # fmt: skip
    except (NoCandidateError, ValueError) as e:
        return error(str(e))
    print(json.dumps(step.to_json()) if options.json else step)
    return 0


def _complete(fixed: dict, devices: int) -> bool:
    """Whether ``--layout`` gives every field (and its axes span ``devices``): evaluated as
    given, nothing searched."""
    from mmnnx.partition.cost import ClusterLayout  # noqa: PLC0415

    every = {f.name for f in dataclasses.fields(ClusterLayout)}
    if set(fixed) != every:
        return False
    span = fixed["stages"] * fixed["data"] * fixed["tensor"] * fixed["expert"]
    if span != devices:
        raise ValueError(f"--layout spans {span} devices, not --devices {devices}")
    return True
