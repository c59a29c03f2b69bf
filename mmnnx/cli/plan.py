"""``mmnnx plan``: the layout that trains a model fastest on a cluster, on paper, from its
``config.json`` alone (``mm.plan_cluster``; docs/planning.md)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import pathlib
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from mmnnx.cli import prologue
from mmnnx.cli.flags import add_fields, typed
from mmnnx.train.options import finite, option, positive, switch

_DEVICES = ("h100", "h200", "h800", "a100", "tpu-v5p", "cpu")


@dataclasses.dataclass(kw_only=True)
class Options:
    init_from: str | None = option(
        None, "a Hugging Face checkpoint directory or its config.json alone",
        metavar="CONFIG_OR_DIR",
    )  # fmt: skip
    run: str | None = option(
        None, "instead of --init-from: the model of an mmnnx train run (its config.toml and "
        "tokenizer), its --batch-size, --seq-len and precision the defaults; the plan's "
        "layout resumes it: mmnnx train --resume --layout-from PLAN", metavar="OUTPUT_DIR",
    )  # fmt: skip
    devices: int = option(dataclasses.MISSING, "accelerators in the cluster", positive,
                          metavar="N")  # fmt: skip
    device: str = option(
        "h100", "the accelerator (%(default)s); cpu: this host's CPU as N simulated devices, "
        "with no published numbers: --flops and --bandwidth required (benchmarks/plan_cpu.py "
        "measures them), --memory by default the host's RAM over N", choices=_DEVICES,
    )  # fmt: skip
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
        "as mmnnx runs; published: once per step beside the compute, memory as "
        "Megatron/torchtitan hold it",
        choices=("engine", "published"),
    )  # fmt: skip
    param_dtype: str = option("float32", "parameters' dtype (%(default)s; --run: the run's)",
                              choices=("float32", "bfloat16"))  # fmt: skip
    dtype: str = option("bfloat16", "compute dtype (%(default)s; --run: the run's)",
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


@contextlib.contextmanager
def config_directory(path: str) -> Iterator[pathlib.Path]:
    """The checkpoint directory of ``path``: itself, or for a ``config.json`` file of another
    name a temporary directory holding it as ``config.json`` (removed after), an error naming a
    file there naming ``path`` instead.

    Example:
        >>> import tempfile
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> with config_directory(str(folder)) as directory:
        ...     directory == folder
        True
    """
    file = pathlib.Path(path)
    if file.is_dir():
        yield file
        return
    if not file.is_file():
        raise FileNotFoundError(f"{path}: no such checkpoint directory or config.json")
    if file.name == "config.json":
        yield file.parent
        return
    from mmnnx.models.pretrained.files import CheckpointError  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="mmnnx-plan-") as folder:
        shutil.copy(file, pathlib.Path(folder, "config.json"))
        try:
            yield pathlib.Path(folder)
        except CheckpointError as e:
            named = str(e).replace(str(pathlib.Path(folder, "config.json")), path)
            raise CheckpointError(named.replace(folder, path)) from None


def run(args: argparse.Namespace) -> int:
    """``mmnnx plan``: the report (or ``--json``) on stdout; a bad file, flag or a cluster
    nothing fits exits 2 in one line."""
    options = typed(Options, args)
    error = functools.partial(prologue.error, "plan")
    from mmnnx.cli.plan_run import PlannedRun, cpu_device  # noqa: PLC0415
    from mmnnx.errors import NoCandidateError  # noqa: PLC0415
    from mmnnx.models.pretrained import CheckpointError, pretrained_config  # noqa: PLC0415
    from mmnnx.partition.cluster import evaluate, parse_layout, plan_cluster  # noqa: PLC0415
    from mmnnx.partition.cost import DEVICES, ENGINE, PUBLISHED, ClusterLayout  # noqa: PLC0415
    from mmnnx.tuning import parse_bytes  # noqa: PLC0415

    if (options.init_from is None) == (options.run is None):
        return error("give the model: --init-from CONFIG_OR_DIR or --run OUTPUT_DIR (one)")
    planned_run = None
    try:
        if options.run is not None:
            planned_run = PlannedRun.read(options.run)
            config = planned_run.config(max_seq_len=options.seq_len)
        else:
            with config_directory(options.init_from) as directory:
                config = pretrained_config(
                    directory, param_dtype=options.param_dtype, dtype=options.dtype,
                    max_seq_len=options.seq_len,
                )  # fmt: skip
    except (FileNotFoundError, CheckpointError, ValueError) as e:
        return error(f"--{'run' if options.run else 'init-from'}: {e}")
    try:
        memory = None if options.memory is None else parse_bytes(options.memory)
    except ValueError as e:
        return error(f"--memory: {e}")
    if options.device == "cpu":
        try:
            device = cpu_device(options.devices, options.flops, options.bandwidth, memory)
        except ValueError as e:
            return error(str(e))
    else:
        given = {"flops": options.flops, "inter_bandwidth": options.bandwidth, "memory": memory}
        given = {k: v for k, v in given.items() if v}
        device = dataclasses.replace(DEVICES[options.device], **given)
    seq = config.max_seq_len
    default_batch = planned_run.run.training.batch_size if planned_run else max(1, 2**22 // seq)
    batch = options.batch or default_batch
    try:
        fixed = parse_layout(options.layout) if options.layout else {}
    except ValueError as e:
        return error(f"--layout: {e}")
    collectives = PUBLISHED if options.collectives == "published" else ENGINE
    trainable = planned_run.trainable if planned_run else 1.0
    if planned_run and "tensor" in fixed and not planned_run.keeps_model(fixed["tensor"], config):
        return error(
            f"--layout tp={fixed['tensor']}: --model-axis {fixed['tensor']} pads the vocabulary "
            f"of the run's tokenizer ({planned_run.vocab_size}) otherwise than its --model-axis "
            f"{planned_run.run.layout.model_axis}: another model"
        )
    workload = {"batch": batch, "seq": seq, "collectives": collectives, "trainable": trainable}
    try:
        if set(fixed) == {f.name for f in dataclasses.fields(ClusterLayout)}:  # nothing searched
            lay = ClusterLayout(**fixed)
            if lay.devices != options.devices:
                return error(
                    f"--layout spans {lay.devices} devices, not --devices {options.devices}"
                )
            step = evaluate(config, lay, device, **workload)
        else:
            step = plan_cluster(config, options.devices, device, fixed=fixed, **workload)
            if planned_run and not planned_run.keeps_model(step.layout.tensor, config):
                tensor = planned_run.run.layout.model_axis  # the vocabulary is padded to it
                print(f"mmnnx plan: --run: --model-axis {step.layout.tensor} would pad the "
                      f"vocabulary otherwise than the run's --model-axis {tensor}: planned "
                      f"with tensor={tensor}", file=sys.stderr)  # fmt: skip
                fixed = {**fixed, "tensor": tensor}
                step = plan_cluster(config, options.devices, device, fixed=fixed, **workload)
    except (NoCandidateError, ValueError) as e:
        return error(str(e))
    print(json.dumps(step.to_json()) if options.json else step)
    return 0
