"""``mmnnx train --layout-from PLAN.json``: the layout ``mmnnx plan --json`` chose (stages, data,
FSDP, tensor and expert axes, model stages per task, schedule, microbatches, remat) as the
``mmnnx train`` options that run it. Each field of the plan's layout names its option
(``ClusterLayout.train_options``); all are options a resumed run may change, so a run trained
under one layout resumes under the plan's (docs/planning.md)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Mapping, Set
from typing import Any

from mmnnx.train.config import flag
from mmnnx.train.run_config import ConfigError, option_value


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlannedLayout:
    """A plan's layout as train ``options`` (by option name), the ``batch`` and ``seq_len`` it
    was planned for, and the ``path`` it was read from."""

    options: dict[str, Any]
    batch: int | None
    seq_len: int | None
    path: str

    def flags(self) -> str:
        """The plan's layout as ``mmnnx train`` flags.

        Example:
            >>> PlannedLayout(options={"stages": 4, "remat": "dots"}, batch=8, seq_len=16,
            ...               path="p.json").flags()
            '--stages 4 --remat dots'
        """
        return " ".join(flag(name, value) for name, value in self.options.items())

    def conflict(self, values: Mapping[str, Any], given: Set[str]) -> str | None:
        """The first option ``given`` on the command line with another value than the plan's,
        in a line.

        Example:
            >>> plan = PlannedLayout(options={"stages": 4}, batch=8, seq_len=16, path="p.json")
            >>> plan.conflict({"stages": 2}, {"stages"})
            '--stages 2 on the command line, but p.json plans --stages 4; leave one out'
        """
        for name, value in self.options.items():
            if name in given and values[name] != value:
                return (
                    f"{flag(name, values[name])} on the command line, but {self.path} plans "
                    f"{flag(name, value)}; leave one out"
                )
        return None

    def workload_problem(self, batch_size: int, seq_len: int) -> str | None:
        """Why the run's ``batch_size`` sequences of ``seq_len`` tokens are not what the plan
        was made for, in a line (its microbatches divide the batch it was planned for).

        Example:
            >>> plan = PlannedLayout(options={}, batch=8, seq_len=16, path="p.json")
            >>> plan.workload_problem(8, 16) is None, plan.workload_problem(16, 16)[:45]
            (True, '--layout-from p.json: planned for 8 sequences')
        """
        if (self.batch, self.seq_len) in ((batch_size, seq_len), (None, None)):
            return None
        return (
            f"--layout-from {self.path}: planned for {self.batch} sequences of {self.seq_len} "
            f"tokens a step, but the run trains {flag('batch_size', batch_size)} of "
            f"{flag('seq_len', seq_len)}; plan for the run (mmnnx plan --run OUTPUT_DIR) or give "
            "mmnnx plan --batch and --seq-len"
        )


def read_plan(path: str) -> PlannedLayout:
    """The layout of the plan ``path`` (``mmnnx plan --json``'s output) as train options.

    Raises:
        ConfigError: the file is missing or not JSON, holds no ``layout`` object, or a field
            of it is missing, of the wrong type or a value its train flag refuses (a schedule
            or remat policy it does not know); the message names the file and the field.

    Example:
        >>> import tempfile
        >>> plan = pathlib.Path(tempfile.mkdtemp(), "plan.json")
        >>> layout = {"stages": 4, "data": 2, "tensor": 1, "expert": 1, "fsdp": 2,
        ...           "virtual_stages": 1, "schedule": "1f1b", "microbatches": 4, "remat": "dots"}
        >>> _ = plan.write_text(json.dumps({"layout": layout, "batch": 8, "seq_len": 16}))
        >>> options = read_plan(str(plan)).options
        >>> options["stages"], options["data_axis"], options["fsdp_axis"], options["remat"]
        (4, 2, 2, 'dots')
    """
    from mmnnx.partition.cost import TRAIN_OPTION, ClusterLayout  # noqa: PLC0415

    try:
        plan = json.loads(pathlib.Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"--layout-from {path}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--layout-from {path}: not JSON ({e})") from None
    layout = plan.get("layout") if isinstance(plan, dict) else None
    if not isinstance(layout, dict):
        raise ConfigError(
            f"--layout-from {path}: no 'layout' object (write it with mmnnx plan --json)"
        )
    where = f"--layout-from {path}: layout"
    try:
        planned = ClusterLayout.of_json(layout, where=where)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    fields = {f.metadata[TRAIN_OPTION]: f.name for f in dataclasses.fields(planned)}
    options = {  # each value as its flag takes it: a schedule or remat of no flag's choices
        name: option_value(name, value, f"{where}: {fields[name]}")
        for name, value in planned.train_options().items()
    }
    return PlannedLayout(
        options=options, batch=plan.get("batch"), seq_len=plan.get("seq_len"), path=path
    )
