"""bfloat16 against float32 on the demo: `mmnnx train` with its defaults (the reference GPT, 2
stages x (2 data x 2 model) on 8 simulated CPU devices, 1F1B, 4 microbatches, 300 steps) run
twice in fresh processes, `--dtype float32` then `--dtype bfloat16` (compute in bfloat16,
parameters and AdamW state float32), the same seed and data.

Target (issue 43): the same loss curve shape; bfloat16's final evaluation loss within 5% of
float32's. Recorded: both runs' evaluation losses at every evaluation, their ratio, and the
steady tokens/s each run reported (on CPU bfloat16 is emulated: its speed says nothing of an
accelerator's).

Losses, not timings: one run of each (no rounds); the results file records the machine.

Run: python benchmarks/precision.py [--steps N]  (writes benchmarks/results/precision.json)
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from report import record_run, results_path
from rich.console import Console
from rich.table import Table

RESULTS = results_path("precision.json")
DTYPES = ("float32", "bfloat16")


def train(dtype: str, steps: int, directory: pathlib.Path) -> dict:
    """One demo run in a fresh process; its evaluation losses and throughput."""
    out = directory / dtype
    command = [sys.executable, "-m", "mmnnx", "train", "--dtype", dtype, "--steps", str(steps)]
    command += ["--output-dir", str(out), "--no-tensorboard"]
    began = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=dict(os.environ))
    seconds = time.perf_counter() - began
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    trained = [r for r in rows if "tokens_per_s" in r]
    return {
        "eval_losses": evals,
        "final_eval_loss": evals[-1][1],
        "tokens_per_s": trained[-1]["tokens_per_s"],
        "wall_s": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps of each run (300)")
    steps = parser.parse_args().steps
    with tempfile.TemporaryDirectory() as directory:
        runs = {dtype: train(dtype, steps, pathlib.Path(directory)) for dtype in DTYPES}
    ratio = runs["bfloat16"]["final_eval_loss"] / runs["float32"]["final_eval_loss"]
    results = {
        "steps": steps,
        "runs": runs,
        "final_eval_ratio": ratio,
        "target": "bfloat16 final eval loss within 5% of float32's",
        "met": abs(ratio - 1) <= 0.05,
    }
    record_run(results, ("runs",), "one run: losses of two seeded training runs, not a timing")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    table = Table(title=f"demo, {steps} steps: evaluation loss by compute dtype")
    table.add_column("step")
    for dtype in DTYPES:
        table.add_column(dtype, justify="right")
    table.add_column("bf16 / fp32", justify="right")
    for (step, fp32), (_, bf16) in zip(
        runs["float32"]["eval_losses"], runs["bfloat16"]["eval_losses"], strict=True
    ):
        table.add_row(str(step), f"{fp32:.4f}", f"{bf16:.4f}", f"{bf16 / fp32:.3f}")
    table.add_row(
        "tokens/s",
        *(f"{runs[d]['tokens_per_s']:,.0f}" for d in DTYPES),
        "",
    )
    Console().print(table)
    print(f"final eval loss bf16 / fp32 = {ratio:.3f} (target within 5%: {results['met']})")


if __name__ == "__main__":
    main()
