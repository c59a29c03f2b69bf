"""mmnnx.launcher: ``mmnnx launch``, a program of its own that starts N local processes of a
command and watches them (:mod:`~mmnnx.launcher.launch`; one attempt of it:
:mod:`~mmnnx.launcher.ranks`; the lines it leaves out: :mod:`~mmnnx.launcher.chatter`).

It imports only the standard library and the environment variable names of :mod:`mmnnx._env`:
nothing of JAX or of the per-process runtime (:mod:`mmnnx.distributed`).
"""
