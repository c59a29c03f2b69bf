"""What the probes share (``tests/load_probe.py`` and those beside it, with mmnnx's venv or the
oracle's): each case directory of a probe checked in turn, what is not well printed, and a count
of the verdicts. Imports nothing but the standard library."""

import collections
import pathlib
from collections.abc import Callable


def run_cases(
    root: pathlib.Path,
    check: Callable[[pathlib.Path], tuple[str, str]],
    quiet: tuple[str, ...] = ("ok",),
) -> dict[str, tuple[str, str]]:
    """``check(case)`` (a verdict and what it saw) of every directory in ``root``, in name
    order; those whose verdict is not ``quiet`` printed as they come, the count of each verdict
    at the end: ``run_cases(pathlib.Path("/tmp/load-probe"), check)``."""
    seen = {}
    for case in sorted(p for p in root.iterdir() if p.is_dir()):
        seen[case.name] = verdict, what = check(case)
        if verdict not in quiet:
            print(f"{verdict} {case.name}: {what}", flush=True)
    print(dict(collections.Counter(verdict for verdict, _ in seen.values())))
    return seen
