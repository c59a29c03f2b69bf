"""Writes the lm-eval fixture: lm-eval's own ``hf`` model (transformers, CPU torch) on the tiny
Llama of ``dpo/policy``, over the local tasks of ``tests/lm_eval_tasks`` (multiple choice,
generation, rolling log-likelihood). Not part of the test suite: run by hand, from the
repository root, in a venv with CPU torch, transformers 5 and lm-eval (never a dependency of
mmnnx's tests):

    /work/oracle/bin/python tests/transformers_fixtures/make_lm_eval_fixtures.py

It rewrites ``tests/transformers_fixtures/lm_eval.json``: each task's metrics and each
sample's responses (log-likelihoods, greedy flags, generated text). tests/test_evaluation.py
reads it.
"""

import json
import pathlib

import lm_eval
import transformers
from lm_eval.tasks import TaskManager

HERE = pathlib.Path(__file__).parent
TASKS = ["mmnnx_qa", "mmnnx_gen", "mmnnx_text"]


def main() -> None:
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={HERE / 'dpo' / 'policy'},dtype=float32",
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(HERE.parent / "lm_eval_tasks")),
        log_samples=True,
        device="cpu",
        batch_size=1,
    )
    expected = {
        "versions": {"lm_eval": lm_eval.__version__, "transformers": transformers.__version__},
        "results": results["results"],
        "responses": {
            task: [s["filtered_resps"] for s in results["samples"][task]] for task in TASKS
        },
    }
    (HERE / "lm_eval.json").write_text(json.dumps(expected, indent=1, default=str))


if __name__ == "__main__":
    main()
