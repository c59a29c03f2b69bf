"""mmnnx.mpmd.lower: a plan lowered to a typed per-task program (``program.py``) and the passes
over it, ``lower -> pack -> localize -> add_releases``; ``Plan``, what ``step.plan()`` prints."""
