"""lm-eval through mmnnx's model (mmnnx.train.evaluation): the same metrics, log-likelihoods
and generations as lm-eval's own ``hf`` model gives on the same checkpoint (fixture made by
tests/transformers_fixtures/make_lm_eval_fixtures.py with transformers and lm-eval)."""

import functools
import json
import pathlib

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")  # the optional extra: mmnnx[eval]

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "transformers_fixtures"
EXPECTED = json.loads((FIXTURES / "lm_eval.json").read_text())
TASKS = ["mmnnx_qa", "mmnnx_gen", "mmnnx_text"]


TASKS_DIR = ROOT / "tests" / "lm_eval_tasks"


@functools.cache
def task_manager():
    """lm-eval's index of its tasks and ours, built once (4 s each time)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR))


@pytest.fixture
def indexed_once(monkeypatch):
    """``mmnnx eval`` builds its ``TaskManager(include_path=...)`` as it would, but given
    tests/lm_eval_tasks it gets the index already built (``task_manager()``) rather than reading
    lm-eval's thousands of task files again: the same tasks, 4 s less each call. The folders it
    was asked for are listed in the fixture's value."""
    import lm_eval.tasks

    built, asked = lm_eval.tasks.TaskManager, []

    def manager(include_path=None, **kwargs):
        asked.append(include_path)
        if include_path and not kwargs and pathlib.Path(include_path).resolve() == TASKS_DIR:
            return task_manager()
        return built(include_path=include_path, **kwargs)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", manager)
    return asked


def evaluate(tasks=TASKS, limit=None, **model_args):
    from mmnnx.train.evaluation import MmnnxLM

    return lm_eval.simple_evaluate(
        model=MmnnxLM(**model_args),
        tasks=tasks,
        task_manager=task_manager(),
        log_samples=True,
        limit=limit,
    )


def test_equal_to_lm_evals_hf_model(monkeypatch):
    monkeypatch.chdir(ROOT)  # the tasks name their data relative to the repository
    results = evaluate(pretrained=str(FIXTURES / "dpo" / "policy"))
    for task in TASKS:
        for metric, value in EXPECTED["results"][task].items():
            if isinstance(value, float):
                np.testing.assert_allclose(results["results"][task][metric], value, rtol=1e-5)
        got = [s["filtered_resps"] for s in results["samples"][task]]
        for ours, theirs in zip(got, EXPECTED["responses"][task], strict=True):
            for a, b in zip(ours, theirs, strict=True):
                if isinstance(b, list):  # (log-likelihood, greedy)
                    np.testing.assert_allclose(a[0], b[0], rtol=1e-5)
                    assert a[1] == b[1]
                elif isinstance(b, str):
                    assert a == b
                else:
                    np.testing.assert_allclose(a, b, rtol=1e-5)


def test_mmnnx_eval_of_a_run_equals_its_export(tmp_path, monkeypatch, capsys, indexed_once):
    from mmnnx.cli import main

    monkeypatch.chdir(ROOT)
    run, out = tmp_path / "run", tmp_path / "exported"
    data = tmp_path / "d.jsonl"
    data.write_text(
        "".join(json.dumps({"text": "Two plus two? Four. " * 3}) + "\n" for _ in range(20))
    )
    flags = ["--init-from", str(FIXTURES / "dpo" / "policy"), "--data", str(data), "--steps", "2"]
    flags += ["--stages", "1", "--data-axis", "1", "--model-axis", "1", "--devices", "1"]
    flags += ["--seq-len", "32", "--batch-size", "2", "--microbatches", "2", "--lr", "1e-2"]
    assert main(["train", *flags, "--output-dir", str(run), "--timeline-step", "0"]) == 0
    assert main(["export", "--run", str(run), "--output", str(out)]) == 0
    capsys.readouterr()  # `mmnnx eval` itself: the walkthrough in tests/test_docs_examples.py
    ours = evaluate(["mmnnx_qa"], 2, run=str(run))["samples"]["mmnnx_qa"]
    exported = evaluate(["mmnnx_qa"], 2, pretrained=str(out))["samples"]["mmnnx_qa"]
    for a, b in zip(ours, exported, strict=True):
        for (ll, greedy), (ll_exported, greedy_exported) in zip(
            a["filtered_resps"], b["filtered_resps"], strict=True
        ):
            np.testing.assert_allclose(ll, ll_exported, rtol=1e-5)
            assert greedy == greedy_exported
    unknown = ["--tasks", "no_such_task", "--include-path", "tests/lm_eval_tasks"]
    assert main(["eval", "--run", str(run), *unknown]) == 2
    assert "no lm-eval task no_such_task" in capsys.readouterr().err
    assert indexed_once == ["tests/lm_eval_tasks"]  # lm-eval's tasks and ours
    broken = tmp_path / "tasks"
    broken.mkdir()
    (broken / "broken.yaml").write_text("task: broken\ndataset_path: json\n  bad: [x\n")
    flags = ["--tasks", "broken", "--include-path", str(broken)]
    assert main(["eval", "--run", str(run), *flags]) == 2
    said = capsys.readouterr().err
    assert f"--include-path: {broken / 'broken.yaml'}: line 3, column 6: mapping values" in said


def test_a_perplexity_task_of_a_run_with_no_bos_or_eos_exits_2_in_one_line(
    tmp_path, monkeypatch, capsys, indexed_once
):
    # the rolling windows' first token is predicted after bos (or eos): with neither it was a
    # TypeError traceback (lm-eval's own hf model fails on such a checkpoint too)
    from mmnnx.cli import main

    monkeypatch.chdir(ROOT)
    run = tmp_path / "bytes"
    flags = ["--dim", "16", "--depth", "1", "--heads", "2", "--seq-len", "8", "--steps", "1"]
    flags += ["--stages", "1", "--data-axis", "1", "--model-axis", "1", "--devices", "1"]
    flags += ["--batch-size", "2", "--microbatches", "1", "--eval-batches", "1"]
    flags += ["--no-tensorboard", "--timeline-step", "0"]  # the smallest run there is
    assert main(["train", *flags, "--output-dir", str(run)]) == 0
    capsys.readouterr()
    tasks = ["--tasks", "mmnnx_text", "--include-path", "tests/lm_eval_tasks", "--limit", "1"]
    assert main(["eval", "--run", str(run), *tasks]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after lm-eval's own progress bars
    assert last.startswith("mmnnx eval: error: --tasks mmnnx_text: a perplexity task"), last
    assert indexed_once == ["tests/lm_eval_tasks"]


def test_generation_stops_where_transformers_generate_stops(tmp_path):
    """lm-eval's hf model generates with transformers' generate, which stops at any id of the
    checkpoint's generation_config.json eos_token_id (Llama 3 Instruct's turn ends at
    <|eot_id|>, not its eos_token); mmnnx's stopped at the eos token only, and went on past
    it. tests/transformers_fixtures/eos/ lists [2, 3, 83]; greedy decoding reaches 83."""
    import types

    from mmnnx.train.evaluation import MmnnxLM
    from tests.test_generate import eos_checkpoint

    base, expected = eos_checkpoint(tmp_path)
    lm = MmnnxLM(pretrained=str(base))
    request = types.SimpleNamespace(
        args=(expected["prompt"], {"until": [], "max_gen_toks": expected["max_new_tokens"]})
    )
    reply = lm.tokenizer.decode(expected["generated"][:-1], skip_special_tokens=True)
    assert lm.generate_until([request]) == [reply]


def test_generation_stops_where_lm_evals_hf_model_stops(tmp_path, monkeypatch):
    """lm-eval's hf model stops where transformers' generate stops (the generation config's
    eos ids: config.json's without generation_config.json, none where that file has none) and
    where the text, special tokens kept, shows an `until` string, to which it adds the
    tokenizer's eos text; it keeps the stop token, decoded without special tokens (a plain
    character's stays). mmnnx's stopped at tokenizer_config.json's eos token (its id, not its
    text) without generation_config.json, left out a plain stop token, and went past a
    special-token `until` (decoded away before the cut). cases.json: lm-eval's replies."""
    import types

    from mmnnx.train import chat_template
    from mmnnx.train.evaluation import MmnnxLM
    from tests.test_generate import EOS_CASES, eos_variant

    reads = []
    read = chat_template._tokenizer_config
    monkeypatch.setattr(chat_template, "_tokenizer_config", lambda f: reads.append(f) or read(f))
    for i, case in enumerate(EOS_CASES["cases"]):
        base, expected = eos_variant(tmp_path / str(i), case)
        reads.clear()
        lm = MmnnxLM(pretrained=str(base))
        assert reads == [str(base)], case["name"]  # tokenizer_config.json read once
        for request in case["lm_eval"]:
            kwargs = {"until": list(request["until"]), "max_gen_toks": expected["max_new_tokens"]}
            got = lm.generate_until([types.SimpleNamespace(args=(expected["prompt"], kwargs))])
            assert got == [request["text"]], (case["name"], request)
