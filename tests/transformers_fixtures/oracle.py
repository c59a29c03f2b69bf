"""The check the oracle scripts beside this file share: each checkpoint mmnnx saved, loaded in
transformers 5 (or PEFT), its float32 logits compared with mmnnx's and what each script records
of it kept as a verdict JSON. Not part of the test suite: imported by those scripts, run with
the oracle venv (CPU torch, transformers 5, peft)."""

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
import transformers
from make_fixtures import TOKENS
from transformers import AutoModelForCausalLM, PreTrainedModel


def logits(model: torch.nn.Module, tokens: np.ndarray | torch.Tensor) -> np.ndarray:
    """``model``'s logits of ``tokens`` in evaluation mode, as float64:
    ``logits(model, TOKENS).shape == (2, 16, vocab)``."""
    with torch.no_grad():
        return model.eval()(torch.as_tensor(tokens)).logits.numpy().astype(np.float64)


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    """The largest difference of ``ours`` from ``theirs``, relative to the largest of ``theirs``:
    ``relative_error(np.array([1.0, 2.1]), np.array([1.0, 2.0])) == 0.05`` (to rounding)."""
    return float(np.abs(theirs - ours).max() / np.abs(theirs).max())


def in_float32(case: Path, cls: type = AutoModelForCausalLM) -> tuple[PreTrainedModel, dict]:
    """``case`` loaded by ``cls`` in float32 and transformers' loading info (its
    ``missing_keys``, ``unexpected_keys``, ``mismatched_keys``):
    ``model, info = in_float32(case)``."""
    return cls.from_pretrained(case, dtype=torch.float32, output_loading_info=True)


def loaded(case: Path) -> tuple[PreTrainedModel, dict]:
    """``case`` in float32 and its record: the config written, the class transformers picks and
    the tensors it missed, did not expect, or found of another shape:
    ``model, record = loaded(case); record["missing"] == []``."""
    model, info = in_float32(case)
    return model, {
        "config": json.loads((case / "config.json").read_text()),
        "class": type(model).__name__,
        "missing": sorted(info["missing_keys"]),
        "unexpected": sorted(info["unexpected_keys"]),
        "mismatched": sorted(str(k) for k in info["mismatched_keys"]),
    }


def as_saved(case: Path, cls: type = AutoModelForCausalLM) -> tuple[PreTrainedModel, dict]:
    """``case`` loaded in the dtype it was saved in (``dtype="auto"``) and its record: the config
    written and that dtype: ``as_saved(case)[1]["dtype"] == "bfloat16"`` for a bfloat16 save."""
    auto = cls.from_pretrained(case, dtype="auto")
    config = json.loads((case / "config.json").read_text())
    return auto, {"config": config, "dtype": str(auto.dtype).removeprefix("torch.")}


def write_verdict(
    path: Path,
    cases: dict,
    libraries: Sequence[ModuleType] = (transformers, torch),
    sort_keys: bool = False,
) -> None:
    """Writes ``path``: each library's version by name, then ``cases``:
    ``write_verdict(HERE / "verdict.json", {"llama": {"logits_error": 1e-7}})``."""
    verdict = {library.__name__: library.__version__ for library in libraries} | {"cases": cases}
    path.write_text(json.dumps(verdict, indent=2, sort_keys=sort_keys) + "\n")


def check_cases(
    root: Path,
    verdict: Path,
    describe: Callable[[Path], tuple[torch.nn.Module | None, dict]],
    *,
    tokens: np.ndarray | torch.Tensor = TOKENS,
    finish: Callable[[Path, torch.nn.Module, dict], dict] | None = None,
    cases: dict | None = None,
    sort_keys: bool = False,
) -> None:
    """Writes ``verdict``: after ``cases``, the record of each checkpoint ``<case>`` under
    ``root`` with mmnnx's logits of ``tokens`` beside it (``<case>.npy``): what ``describe(case)``
    gives with the float32 model (``None``: none to run), ``logits_error`` (:func:`relative_error`
    of mmnnx's logits from the model's), then what ``finish(case, model, record)`` returns:
    ``check_cases(Path("/tmp/saves"), HERE / "x_verdict.json", loaded)``."""
    cases = dict(cases or {})
    for case in sorted(p for p in root.iterdir() if p.is_dir() and p.with_suffix(".npy").exists()):
        model, record = describe(case)
        if model is not None:
            ours = np.load(case.with_suffix(".npy"))
            record["logits_error"] = relative_error(ours, logits(model, tokens))
            if finish is not None:
                record |= finish(case, model, record)
        cases[case.name] = record
        shown = {k: v for k, v in record.items() if k not in ("config", "files", "tokenizer")}
        print(case.name, shown)
    write_verdict(verdict, cases, sort_keys=sort_keys)
