"""mmnnx.mpmd.plan: a traced step planned: stacked layers split over their tasks, every op
coloured with a task, the graph cut into fragments, a microbatch loop cut into pipeline stages
(and their carry, residuals recomputed)."""
