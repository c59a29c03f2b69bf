"""Saves each load-probe case mmnnx loads (``tests/load_probe.py``) back with ``save_pretrained``,
by hand (not part of the suite); ``tests/transformers_fixtures/check_export_probe.py`` then loads
each save in transformers and compares its logits with those transformers gave of the case.
Prints the saves refused.

Run: python -m tests.export_probe /tmp/load-probe /tmp/export-probe
"""

import collections
import json
import pathlib
import shutil
import sys

from mmnnx.models import from_pretrained, save_pretrained
from mmnnx.models.pretrained import CheckpointError


def main(root: pathlib.Path, out: pathlib.Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    counts = collections.Counter()
    for case in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            model = from_pretrained(case)
        except CheckpointError:
            counts["not loaded"] += 1
            continue
        try:
            saved = save_pretrained(model, out / case.name)
        except CheckpointError as e:
            counts["REFUSED"] += 1
            print(f"REFUSED {case.name}: {str(e)[:300]}", flush=True)
            continue
        (saved / "case.json").write_text(json.dumps({"base": str(case.resolve())}))
        counts["saved"] += 1
    print(dict(counts))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]))
