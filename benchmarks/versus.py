"""This checkout against another one (a commit before a refactor), case by case, in the same run.

Each case is one fresh process of a benchmark's own child mode (``dispatch.py --case``,
``first_call.py --case``), run from each checkout's own ``benchmarks/`` with that checkout first
on ``PYTHONPATH``; the two checkouts take turns (this, other, this, other, ...) over ``--rounds``
rounds (default 5), and each figure is reported as this checkout's over the other's, taken per
round, median [min-max]. A ratio above 1 is this checkout slower.

Cases:
- host time per pipelined launch: a 8-block GPT (dim 64) on 4 one-device stages, 1F1B, M = 8,
  AdamW (``dispatch.py``'s pipelined case): the host thread's CPU time per step over the
  launched programs, called as ``mm.jit`` and as ``mm.cached_partial``, and the step's wall time;
- first call: the 16-block GPT on 4 one-device stages, 1F1B, M = 8 (``first_call.py``'s
  "pipelined" case): trace, plan, compile and run.

Run: python benchmarks/versus.py OTHER_CHECKOUT [--rounds N]
(make one with ``git worktree add /tmp/before COMMIT``). Writes benchmarks/results/versus.json.
"""

import json
import os
import pathlib
import subprocess
import sys

from report import interleaved, publish, ratio_spread, results_path, rounds_option, spread

HERE = pathlib.Path(__file__).resolve().parent.parent
PIPELINED = [4, 8, 1, 8, None, True, False]  # stages, M, devices per task, depth, ... scanned


def _child(checkout: pathlib.Path, script: str, args: list[str], env: dict) -> dict:
    environment = dict(
        os.environ,
        PYTHONPATH=str(checkout),
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        **env,
    )
    out = subprocess.run(
        [sys.executable, str(checkout / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        check=True,
        env=environment,
        cwd=checkout / "benchmarks",
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _dispatch(checkout: pathlib.Path) -> dict:
    run = _child(checkout, "dispatch.py", ["--case", json.dumps(PIPELINED), "--batch", "32"], {})
    return {
        "host time per launch, mm.jit": run["cpu"] / run["launches"],
        "host time per launch, cached_partial": run["bound_cpu"] / run["launches"],
        "step wall time": run["wall"],
    }


def _first_call(checkout: pathlib.Path) -> dict:
    env = {"FIRST_CALL_DEPTH": "16", "FIRST_CALL_MICROBATCHES": "8"}
    return {
        "first call s": _child(checkout, "first_call.py", ["--case", "pipelined"], env)["seconds"]
    }


def compare(other: pathlib.Path, rounds: int) -> dict:
    """Every case under this checkout and ``other``, interleaved over ``rounds`` rounds."""

    def both(case):
        return {"this": lambda: case(HERE), "other": lambda: case(other)}

    out = {}
    for case in (_dispatch, _first_call):
        runs = interleaved(both(case), rounds)
        for key in runs["this"][0]:
            this = [r[key] for r in runs["this"]]
            that = [r[key] for r in runs["other"]]
            scale, unit = (1e3, "ms") if max(this) < 1 else (1.0, "s")
            out[f"{key}: this ({unit})"] = spread(this, scale, 3)
            out[f"{key}: other ({unit})"] = spread(that, scale, 3)
            out[f"{key}: this / other"] = ratio_spread(this, that)
    return out


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("--"):
        raise SystemExit("usage: python benchmarks/versus.py OTHER_CHECKOUT [--rounds N]")
    other = pathlib.Path(sys.argv[1]).resolve()
    rounds = rounds_option(sys.argv)
    results = {"versus": compare(other, rounds), "other checkout": str(other)}
    publish(
        results, results_path("versus.json"), "this checkout against another", ("versus",), rounds
    )
