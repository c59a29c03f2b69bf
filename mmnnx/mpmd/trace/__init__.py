"""mmnnx.mpmd.trace: a step traced to the engine's flat IR (``ir.Graph``), with its mesh
fallbacks (``trace_step``); what an ``mm.jit`` trace records (regions, microbatch groups), task
regions and sharding constraints, control flow split while tracing."""
