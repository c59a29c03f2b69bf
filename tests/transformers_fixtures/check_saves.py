"""Loads what mmnnx's ``save_pretrained`` writes in transformers 5 and keeps the verdict as
``verdict.json`` (read by tests/test_transformers_fixtures.py). Not part of the test suite: run
by hand, the first step with mmnnx's venv, the second with CPU torch and transformers 5:

    /work/main/.venv/bin/python -c "import pathlib, tests.test_transformers_fixtures as t; \\
        t.save_saves(pathlib.Path('/tmp/mmnnx-saves'))"
    /work/oracle/bin/python tests/transformers_fixtures/check_saves.py /tmp/mmnnx-saves

For each checkpoint directory ``<case>`` (with mmnnx's logits for the fixtures' tokens beside
it as ``<case>.npy``) it records the ``config.json`` mmnnx wrote, the dtype transformers
loads it in (``dtype="auto"``), the ``rope_parameters`` transformers resolves, and the largest
difference between transformers' float32 logits from those files and mmnnx's, relative to the
largest logit.
"""

import pathlib
import sys

from oracle import as_saved, check_cases, in_float32
from transformers import PreTrainedModel

HERE = pathlib.Path(__file__).parent


def describe(case: pathlib.Path) -> tuple[PreTrainedModel, dict]:
    """``case`` in float32 and its record: config, dtype and resolved ``rope_parameters``."""
    auto, record = as_saved(case)
    rope = dict(sorted(auto.config.rope_parameters.items()))
    return in_float32(case)[0], {**record, "rope_parameters": rope}


if __name__ == "__main__":
    check_cases(pathlib.Path(sys.argv[1]), HERE / "verdict.json", describe)
