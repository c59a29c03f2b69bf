"""Every example of the published multimesh.jax pages in ../shared/seeds runs on this layer.

The examples are extracted from the pages (``>>>``/``...`` lines) and run in a fresh Python with
4 CPU devices (they reshape ``jax.devices()`` to 2x2). Changes to their text: the
``multimesh.jax`` imports point at ``multimesh_compat.jax`` (or stay as published after
``install_alias()``), the imports the pages forget (``jax.numpy as jnp``, ``numpy as np``) are
added, and the flax page's stray closing parenthesis in ``model.tabulate(...))`` is removed.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

from tests.flags import COMPILE_FLAGS

SEEDS = pathlib.Path(__file__).resolve().parents[3] / "shared" / "seeds"
REPO = pathlib.Path(__file__).resolve().parents[2]

TABLE = """\
┃ path ┃ module      ┃ inputs        ┃ outputs        ┃ params                               ┃
┡━━━━━━╇━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━╇━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━┩
│      │ Task[Dense] │ float32[16,9] │ float32[16,16] │ mod:                                 │
│      │             │               │                │   params:                            │
│      │             │               │                │     bias: float32[16]                │
│      │             │               │                │     kernel: float32[9,16] P(x, None) │
│      │             │               │                │                                      │
│      │             │               │                │ 160 (640 B)                          │
├──────┼─────────────┼───────────────┼────────────────┼──────────────────────────────────────┤
│      │             │               │          Total │ 160 (640 B)                          │"""


def _example(page: str) -> str:
    """The doctest code of a page; indentation is rebuilt (one page is flattened to one line):
    a line after one ending in ``:`` and ``...`` lines after it form an indented block."""
    text = (SEEDS / page).read_text()
    text = text[text.index(">>>") :]
    text = text[: text.index("Which produces")] if "Which produces" in text else text
    parts = re.split(r"(>>>|\.\.\.)[ ]?", text)
    lines, in_block = [], False
    for marker, content in zip(parts[1::2], parts[2::2], strict=True):
        content = content.strip()
        if not content:
            in_block = False
            continue
        if (lines and lines[-1].endswith(":")) or (marker == "..." and in_block):
            in_block = True
            lines.append("    " + content)
        else:
            in_block = False
            lines.append(content)
    return "\n".join(lines) + "\n"


def _run(code: str, alias: bool) -> str:
    head = "import multimesh_compat; multimesh_compat.install_alias()\n" if alias else ""
    head += "import jax.numpy as jnp\nimport numpy as np\n"
    if not alias:
        code = code.replace("from multimesh.jax", "from multimesh_compat.jax")
    env = {
        **os.environ,
        # the tests' compile flags: the examples check what they print, not speed
        "XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {COMPILE_FLAGS}",
        "JAX_PLATFORMS": "cpu",
        "COLUMNS": "200",
        "PYTHONPATH": str(REPO),
    }
    result = subprocess.run(
        [sys.executable, "-c", head + code],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.skipif(not SEEDS.exists(), reason="seed pages not present")
@pytest.mark.parametrize("alias", [False, True], ids=["import-changed", "install_alias"])
def test_flax_task_page_tabulate(alias):
    code = _example("multimesh.jax.flax.task.txt")
    assert "model.tabulate(jax.random.key(0), x))" in code
    code = code.replace(
        "model.tabulate(jax.random.key(0), x))", "print(model.tabulate(jax.random.key(0), x))"
    )
    out = _run(code, alias)
    assert "Task[Dense] Summary" in out
    out = re.sub(r"\x1b\[[0-9;]*m", "", out)  # Linen colours its table
    rows = "\n".join(line.rstrip() for line in out.splitlines())
    assert TABLE in rows, out
    assert "Total Parameters: 160 (640 B)" in out


@pytest.mark.skipif(not SEEDS.exists(), reason="seed pages not present")
@pytest.mark.parametrize("alias", [False, True], ids=["import-changed", "install_alias"])
def test_parallelize_page(alias):
    code = _example("multimesh.jax.parallelize.txt")
    assert "parallelize(f, init, init)" in code
    code += textwrap.dedent(
        """
        params, batch = sh_init_params(), sh_init_batch()
        out = sh_f(params, batch)
        assert out.tolist() == [i * i for i in range(16)], out
        # no task: everything replicated over all devices (the example's task_f is unused)
        for a in (params, batch, out):
            assert a.sharding.is_fully_replicated and len(a.devices()) == 4, a.sharding
        print("ok")
        """
    )
    assert _run(code, alias).strip().endswith("ok")


@pytest.mark.skipif(not SEEDS.exists(), reason="seed pages not present")
def test_public_api_page_names_and_signatures():
    import inspect

    import multimesh_compat.jax as mj

    text = (SEEDS / "multimesh.jax-public-api.txt").read_text()
    listed = [
        "task",
        "microbatch",
        "parallelize",
        "with_sharding_constraint",
        "register_task",
        "MultiMesh",
        "Task",
        "TaskMesh",
        "autoshard",
        "context",
        "enable_fast_path",
        "enable_recomputation",
        "ignore_transforms",
    ]
    for name in listed:
        assert f"{name}(" in text
        assert callable(getattr(mj, name)), name
    assert list(inspect.signature(mj.microbatch).parameters)[:4] == ["fun", "dim", "size", "argnum"]
    assert {"init_params", "get_input_batch", "initial_batch", "devices"} <= set(
        inspect.signature(mj.parallelize).parameters
    )
    assert {"callback", "task"} <= set(inspect.signature(mj.register_task).parameters)
    t = mj.Task()
    for field in (
        "name",
        "mesh",
        "logical_axes",
        "mesh_slice",
        "extra_axes",
        "split_backprop",
        "loop_dependent_mesh_slice",
    ):
        assert getattr(t, field) is None or getattr(t, field) == (), field
    tm = mj.TaskMesh(devices=range(4), axis_sizes=(4, 1), axis_names=("x", "y"))
    assert tm.place((4, 5, 6, 7)).devices.tolist() == [[4], [5], [6], [7]]
    mesh = mj.MultiMesh(axis_sizes=(2, 4), axis_names=("stage", "x"))
    assert sorted(d.id for d in mesh.slice(stage=1).devices.flat) == [4, 5, 6, 7]
