"""``install_alias``: multimesh imports resolve to this layer, opt-in only."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import multimesh_compat


def test_alias_imports_resolve_to_compat():
    import multimesh_compat.jax as mj
    import multimesh_compat.jax.flax as mjf

    assert "multimesh" not in sys.modules  # importing the package installs nothing
    multimesh_compat.install_alias()
    try:
        import multimesh.jax
        from jax_plugins.multimesh import init
        from multimesh.jax import task
        from multimesh.jax.flax import shard_axes
        from multimesh.jax.flax import task as flax_task

        assert multimesh.jax is mj and task is mj.task and init is mj.init
        assert flax_task is mjf.task and shard_axes is mjf.shard_axes
    finally:
        multimesh_compat.uninstall_alias()
    assert "multimesh.jax" not in sys.modules


def test_alias_before_jax_import_and_mmnnx_has_no_side_effect():
    code = textwrap.dedent(
        """
        import sys
        import mmnnx  # importing mmnnx must not install the alias
        assert "multimesh" not in sys.modules
        try:
            import multimesh.jax
            raise SystemExit("alias without install_alias")
        except ImportError:
            pass
        import multimesh_compat
        multimesh_compat.install_alias()
        from jax_plugins.multimesh import init
        init(cpus=2)
        import jax
        assert len(jax.devices()) == 2, jax.devices()
        from multimesh.jax import task, mjit
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
