"""mmnnx.mpmd.run: a lowered program run: the JAX programs its actions compile to
(``programs.py``), the steps emitted from it once (``emit.py``), the interpreter
(``runner.py``), routes between processes, the timers, and what a failing step leaves."""
