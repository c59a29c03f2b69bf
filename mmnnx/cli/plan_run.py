"""``mmnnx plan --run OUTPUT_DIR`` and ``--device cpu``: planning for the model of an ``mmnnx
train`` run (whose ``--resume --layout-from`` then runs the plan's layout) on this host's CPU
devices as well as on the accelerators of ``mmnnx.partition.cost.DEVICES``."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    """An ``mmnnx train`` run planned for (``mmnnx plan --run``): its options and its
    tokenizer's vocabulary size."""

    run: Any  # RunConfig
    vocab_size: int

    @classmethod
    def read(cls, output_dir: str) -> PlannedRun:
        """The run in ``output_dir``, from its ``config.toml`` and ``tokenizer/``; a
        ``FileNotFoundError`` or ``ValueError`` naming the file for a directory that holds no
        run."""
        from mmnnx.train.config import RunConfig  # noqa: PLC0415
        from mmnnx.train.run_config import CONFIG_FILE, read_config  # noqa: PLC0415
        from mmnnx.train.tokenizers import load_tokenizer  # noqa: PLC0415

        folder = pathlib.Path(output_dir)
        for needed in (CONFIG_FILE, "tokenizer"):
            if not (folder / needed).exists():
                raise FileNotFoundError(f"{folder / needed} is missing: not an mmnnx train run")
        run = RunConfig.of(read_config(folder / CONFIG_FILE))
        if run.preference.dpo:
            raise ValueError(
                f"{folder} is a --dpo run: mmnnx plan models a step of next-token training (a "
                "DPO step's pairs and its reference's forward are not modelled: its plan would "
                "say less memory and time than the run takes)"
            )
        return cls(run, load_tokenizer(folder / "tokenizer").vocab_size)

    @property
    def trainable(self) -> float:
        """The share of the run's weights it trains: ``0`` for a ``--lora-rank`` run (its
        frozen base; the adapters are not charged), else ``1``."""
        return 0.0 if self.run.model.lora_rank else 1.0

    def config(self, *, max_seq_len: int | None = None, model_axis: int | None = None) -> Any:
        """The run's ``GPTConfig`` (with another ``max_seq_len`` or ``--model-axis``)."""
        from mmnnx.train.run_model import model_config  # noqa: PLC0415

        lay, model = self.run.layout, self.run.model
        lay = dataclasses.replace(lay, model_axis=model_axis or lay.model_axis)
        model = dataclasses.replace(model, seq_len=max_seq_len or model.seq_len)
        return model_config(dataclasses.replace(self.run, layout=lay, model=model), self.vocab_size)

    def keeps_model(self, model_axis: int, config: Any) -> bool:
        """Whether ``--model-axis model_axis`` builds ``config``, the run's model (a model
        trained from scratch pads its vocabulary to a multiple of the axis).

        Example:
            >>> from mmnnx.train.config import RunConfig
            >>> run = PlannedRun(RunConfig.of({"dim": 32, "heads": 4, "model_axis": 2}), 257)
            >>> config = run.config()
            >>> config.vocab_size, run.keeps_model(2, config), run.keeps_model(4, config)
            (258, True, False)
        """
        return self.config(max_seq_len=config.max_seq_len, model_axis=model_axis) == config


def cpu_device(devices: int, flops: float | None, bandwidth: float | None,
               memory: int | None) -> Any:  # fmt: skip
    """This host's CPU as ``devices`` simulated devices for the cost model: ``flops`` (FLOP/s
    each device reaches on the model, so efficiency 1) and ``bandwidth`` (bytes/s between two
    of them) measured by the user, also the update's memory bandwidth (on one host a transfer
    between simulated devices is a copy in the same memory), ``memory`` by default the host's
    RAM shared by the devices, all in one node.

    Example:
        >>> cpu_device(8, 2e9, 1e9, None).node_size
        8
        >>> cpu_device(8, None, 1e9, None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: --device cpu has no published numbers: give --flops and --bandwidth ...
    """
    from mmnnx.partition.cost import DeviceSpec  # noqa: PLC0415

    if flops is None or bandwidth is None:
        raise ValueError(
            "--device cpu has no published numbers: give --flops and --bandwidth "
            "(benchmarks/plan_cpu.py measures them)"
        )
    if memory is None:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // devices
    return DeviceSpec(name="cpu", flops=flops, memory=memory, memory_bandwidth=bandwidth,
                      intra_bandwidth=bandwidth, inter_bandwidth=bandwidth, node_size=devices,
                      efficiency=1.0)  # fmt: skip
