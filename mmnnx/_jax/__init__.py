"""The fence around JAX's internals: the only package of mmnnx that imports ``jax._src``.

Each module holds one concern and knows JAX only (nothing of mmnnx's IR): ``tracing`` (the
trace state, debug info and source lines, effects, dead-code elimination), ``arrays`` (an
array's per-device arrays and layouts, runtime copies), ``launch`` (a compiled program run
without JAX's per-argument checks), ``compile`` (equal programs compiled once a process, on
whichever devices) and ``runtime`` (the distributed coordination service, whether JAX's
backends started).
A JAX upgrade should change this package only (``mmnnx/_nnx.py`` is its Flax twin). It
imports nothing of mmnnx but ``mmnnx.errors``.
"""
