"""multimesh_compat: the multimesh.jax API on stock JAX, through mmnnx (work in progress)."""
