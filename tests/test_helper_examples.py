"""The examples the private helpers of mmnnx's infrastructure (sharding, modules, distributed,
launcher, _jax, partition) kept in their docstrings, run here as doctests in each module's
namespace: the docstrings say what a helper is, these check what it does.
"""

from __future__ import annotations

import doctest
import importlib
import textwrap

import pytest

# "module:qualname" -> its examples, as doctest reads them
EXAMPLES = {
    "mmnnx._jax.arrays:copier": """
    >>> import numpy as np
    >>> from jax.sharding import SingleDeviceSharding
    >>> a, b = (SingleDeviceSharding(d) for d in jax.devices()[:2])
    >>> move = copier(a, b, 1, np.float32)
    >>> move(jax.device_put(np.ones(3), a)).devices() == {jax.devices()[1]}
    True
    """,
    "mmnnx._jax.arrays:move_to": """
    >>> import numpy as np
    >>> from jax.sharding import SingleDeviceSharding
    >>> a, b = (SingleDeviceSharding(d) for d in jax.devices()[:2])
    >>> move_to(jax.device_put(np.ones(3), a), b).devices() == {jax.devices()[1]}
    True
    """,
    "mmnnx._jax.arrays:array_from_shards": """
    >>> import numpy as np
    >>> from jax.sharding import SingleDeviceSharding
    >>> d = jax.devices()[0]
    >>> x = jax.device_put(np.ones(3, np.float32), d)
    >>> array_from_shards((3,), SingleDeviceSharding(d), {d: x}).shape
    (3,)
    """,
    "mmnnx._jax.arrays:shards_by_device": """
    >>> import numpy as np
    >>> x = jax.device_put(np.ones(3, np.float32), jax.devices()[0])
    >>> list(shards_by_device(x)) == [jax.devices()[0]]
    True
    """,
    "mmnnx._jax.arrays:launchable_as": """
    >>> import numpy as np
    >>> from jax.sharding import NamedSharding
    >>> one = jax.devices()[:1]
    >>> mesh = jax.sharding.Mesh(np.array(one), ("x",))
    >>> x = jax.device_put(np.ones(2), one[0])
    >>> launchable_as(x, NamedSharding(mesh, jax.P())), launchable_as(np.ones(2), x.sharding)
    (True, False)
    """,
    "mmnnx._jax.arrays:is_plain_array": """
    >>> import numpy as np
    >>> is_plain_array(jax.numpy.ones(2)), is_plain_array(np.ones(2))
    (True, False)
    """,
    "mmnnx._jax.arrays:all_plain_arrays": """
    >>> all_plain_arrays([jax.numpy.ones(2), jax.numpy.zeros(1)]), all_plain_arrays([1.0])
    (True, False)
    """,
    "mmnnx._jax.arrays:checks_special_values": """
    >>> checks_special_values()
    False
    """,
    "mmnnx._jax.compile:Recent": """
    >>> recent = Recent(2)
    >>> recent.put("a", 1); recent.put("b", 2); recent.get("a"); recent.put("c", 3)
    1
    >>> recent.get("b") is None, recent.get("a"), len(recent)
    (True, 1, 2)
    """,
    "mmnnx._jax.compile:SharedCompiles": """
    >>> import jax, numpy as np
    >>> clear(); shared = SharedCompiles()
    >>> on = lambda d: jax.sharding.SingleDeviceSharding(d)
    >>> one, two = (jax.jit(lambda x: x + 1, in_shardings=on(d)).lower(np.float32(0))
    ...             for d in jax.devices()[:2])
    >>> shared.compile(one)(jax.device_put(1.0, on(jax.devices()[0]))), len(shared.loaded)
    (Array(2., dtype=float32), 0)
    >>> out = shared.compile(two)(jax.device_put(1.0, on(jax.devices()[1])))
    >>> float(out), out.devices() == {jax.devices()[1]}, len(shared.loaded)
    (2.0, True, 1)
    >>> later = SharedCompiles(); _ = later.compile(one); len(later.reused)
    1
    """,
    "mmnnx._jax.launch:DirectLaunch": """
    >>> import jax, numpy as np
    >>> on = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    >>> x = jax.device_put(np.float32(1), on)
    >>> direct = DirectLaunch.of(jax.jit(lambda x, y: [y + 1]).lower(x, x).compile())
    >>> direct.kept, direct.shardings == (on,)
    ((1,), True)
    >>> direct.launch([x])
    [Array(2., dtype=float32)]
    """,
    "mmnnx._jax.retarget:lowers_without_devices": """
    >>> lowers_without_devices(jax.lax.add_p)
    True
    """,
    "mmnnx._jax.tracing:trace_context": """
    >>> import jax
    >>> with jax.default_matmul_precision("highest"):
    ...     inside = trace_context()
    >>> inside == trace_context()
    False
    """,
    "mmnnx._jax.tracing:tracing": """
    >>> import jax
    >>> tracing(), jax.make_jaxpr(lambda: tracing() or 0)().eqns
    (False, [])
    """,
    "mmnnx._jax.tracing:dce_jaxpr": """
    >>> import jax, jax.numpy as jnp
    >>> closed = jax.make_jaxpr(lambda x, y: (jnp.sin(x), y * 2))(1.0, 2.0)
    >>> kept, reads = dce_jaxpr(closed.jaxpr, [False, True])
    >>> len(kept.eqns), reads
    (1, [False, True])
    """,
    "mmnnx.distributed.homes:homes_of": """
    >>> import jax, jax.numpy as jnp
    >>> from mmnnx.sharding import TaskMesh
    >>> t = Task("t", mesh=TaskMesh(devices=[0, 1]))
    >>> on_t = jax.device_put(jnp.zeros(()), t.sharding())
    >>> [(i, task.name) for i, task in homes_of([on_t, jnp.zeros(())], [0, 1], [t]).items()]
    [(0, 't')]
    """,
    "mmnnx.distributed.initialize:check_collectives_for": """
    >>> import mmnnx as mm
    >>> check_collectives_for([mm.Task("t", mesh=mm.TaskMesh(devices=[0, 1]))])  # one process
    """,
    "mmnnx.launcher.chatter:is_chatter": """
    >>> is_chatter("[Gloo] Rank 1 is connected to 1 peer ranks. "
    ...            "Expected number of connected peer ranks is : 1")
    True
    >>> is_chatter("[Gloo] Rank 0 is NOT connected to: [1]"), is_chatter("42")
    (False, False)
    """,
    "mmnnx.launcher.launch:process_env": """
    >>> env = process_env({}, 1, 2, 1234, 4)
    >>> env["MMNNX_PROCESS_ID"], env["XLA_FLAGS"], env["JAX_PLATFORMS"]
    ('1', '--xla_force_host_platform_device_count=4', 'cpu')
    """,
    "mmnnx.launcher.membership:Membership": """
    >>> job = Membership(3, minimum=2)
    >>> job.failed(2), job.failed(2), job.count  # rank 2 fails twice in a row: dropped
    (False, True, 2)
    >>> job.failed(1), job.failed(1), job.count  # at the minimum: kept
    (False, False, 2)
    """,
    "mmnnx.launcher.membership:Membership.failed": """
    >>> job = Membership(2, minimum=1)
    >>> job.failed(1), job.failed(0), job.failed(0), job.count
    (False, False, True, 1)
    """,
    "mmnnx.launcher.progress:path": """
    >>> path("/tmp/progress", 1)
    '/tmp/progress/rank-1'
    """,
    "mmnnx.launcher.progress:write": """
    >>> import tempfile
    >>> where = tempfile.mkdtemp()
    >>> write(where, 0, Record("loading batch", 7))
    >>> print(read(where, 0))
    loading batch (step 7)
    """,
    "mmnnx.launcher.progress:Watchdog": """
    >>> import tempfile
    >>> where = tempfile.mkdtemp()
    >>> write(where, 1, Record("loading batch", 7))
    >>> print(Watchdog(where, 2, timeout_s=0).stale())
    rank 1 made no progress for 0 s; last: loading batch (step 7)
    """,
    "mmnnx.launcher.python_main:through_runner": """
    >>> through_runner(["python", "-u", "-m", "pkg", "-n", "9"])[2:]  # doctest: +ELLIPSIS
    ['.../run_main.py', '-m', 'pkg', '-n', '9']
    >>> through_runner(["python3", "-i", "-c", "pass"]), through_runner(["mmnnx", "train"])
    (['python3', '-i', '-c', 'pass'], ['mmnnx', 'train'])
    """,
    "mmnnx.launcher.ranks:describe": """
    >>> describe(-9), describe(3)
    ('killed by SIGKILL', 'exit code 3')
    """,
    "mmnnx.launcher.ranks:stopped_groups": """
    >>> stopped_groups([os.getpgrp()])
    set()
    """,
    "mmnnx.launcher.signals:Interrupts": """
    >>> interrupts = Interrupts()
    >>> interrupts.on_signal(signal.SIGTERM, None)
    >>> interrupts.notice.is_set(), interrupts.stop.is_set()
    (True, False)
    >>> interrupts.on_signal(signal.SIGTERM, None)
    >>> interrupts.stop.is_set()
    True
    """,
    "mmnnx.modules.checks:check": """
    >>> check(is_int(0, minimum=1), "MLPConfig.hidden", "an int >= 1", 0)
    Traceback (most recent call last):
    ...
    ValueError: MLPConfig.hidden must be an int >= 1, got 0
    """,
    "mmnnx.modules.embed:Embed.attend": """
    >>> with nnx.use_eager_sharding(False):
    ...     embed = Embed(16, 8, rngs=nnx.Rngs(0))
    >>> embed.attend(jnp.ones((2, 8))).shape
    (2, 16)
    """,
    "mmnnx.modules.expert_parallel:ExpertLayout": """
    >>> from mmnnx.sharding import TaskMesh, logical_rules, place
    >>> from mmnnx.modules.experts import Experts
    >>> rules = logical_rules(batch="data", expert="expert")
    >>> mesh = TaskMesh(devices=range(4), axis_sizes=(2, 2), axis_names=("expert", "data"))
    >>> with nnx.use_eager_sharding(False):
    ...     experts = place(Experts(4, 8, 16, rngs=nnx.Rngs(0)), [(".*", Task("t", mesh=mesh,
    ...                     logical_axes=rules))])
    >>> layout = expert_layout(experts.gate)
    >>> layout.expert_axes, layout.token_axes, layout.size
    (('expert',), ('data', 'expert'), 2)
    """,
    "mmnnx.modules.experts:clamped_swiglu": """
    >>> y = clamped_swiglu(jnp.array([9.0, 9.0, 1.0, -9.0]), 1.702, 7.0)
    >>> [round(v, 3) for v in y.tolist()]  # 8 * 7 * sigmoid(11.9), -6 * 1 * sigmoid(1.7)
    [56.0, -5.075]
    """,
    "mmnnx.modules.experts:grouped_clamped_swiglu": """
    >>> w, b = jnp.ones((2, 3, 4)), jnp.ones((2, 4))
    >>> out = grouped_clamped_swiglu(jnp.ones((3, 3)), w, b, jnp.ones((2, 2, 3)),
    ...                              jnp.ones((2, 3)), jnp.array([1, 1]), alpha=1.0, limit=2.0)
    >>> [round(v, 2) for v in out[:, 0].tolist()]  # 2 * (2 + 1) * 2 * sigmoid(2) + 1
    [11.57, 11.57, 0.0]
    """,
    "mmnnx.modules.experts:grouped_swiglu": """
    >>> w = jnp.ones((2, 3, 4))
    >>> out = grouped_swiglu(jnp.ones((3, 3)), w, w, jnp.ones((2, 4, 3)), jnp.array([1, 1]))
    >>> [round(v, 2) for v in out[:, 0].tolist()]  # 4 * silu(3) * 3, twice, then nothing
    [34.29, 34.29, 0.0]
    """,
    "mmnnx.modules.experts:sort_by_expert": """
    >>> order, inverse, sizes = sort_by_expert(jnp.array([1, 3, 0, 1]), 2)
    >>> order.tolist(), inverse.tolist(), sizes.tolist()
    ([2, 0, 3, 1], [1, 3, 0, 2], [1, 2])
    """,
    "mmnnx.modules.experts:apply_local": """
    >>> w = jnp.ones((2, 3, 4)), jnp.ones((2, 3, 4)), jnp.ones((2, 4, 3))
    >>> idx, keep = jnp.array([[1], [0]]), jnp.array([[True], [False]])
    >>> y = apply_local(jnp.ones((2, 3)), idx, jnp.ones((2, 1)), keep, w)
    >>> [round(v, 2) for v in y[:, 0].tolist()]  # the second token's assignment dropped
    [34.29, 0.0]
    """,
    "mmnnx.modules.latent_attention:LatentAttention.project": """
    >>> config = LatentAttentionConfig(2, kv_lora_rank=8, qk_nope_head_dim=4,
    ...                                qk_rope_head_dim=2, v_head_dim=4)
    >>> with nnx.use_eager_sharding(False):
    ...     attn = config.build(16, rngs=nnx.Rngs(0))
    >>> [a.shape for a in attn.project(jnp.ones((3, 16)), jnp.arange(5, 8))]
    [(3, 2, 6), (3, 1, 8), (3, 1, 2)]
    """,
    "mmnnx.modules.mlp:MLPConfig": """
    >>> MLPConfig(0)
    Traceback (most recent call last):
    ...
    ValueError: MLPConfig.hidden must be an int >= 1, got 0
    """,
    "mmnnx.modules.mlp:gelu_tanh": """
    >>> round(float(gelu_tanh(jnp.array(1.0))), 4)
    0.8412
    """,
    "mmnnx.modules.mlp:gelu_exact": """
    >>> round(float(gelu_exact(jnp.array(1.0))), 4)
    0.8413
    """,
    "mmnnx.modules.routing:route": """
    >>> w, i, _ = route(jnp.log(jnp.array([[0.5, 0.3, 0.2]])), 2)
    >>> i.tolist(), [round(v, 3) for v in w[0].tolist()]
    ([[0, 1]], [0.625, 0.375])
    """,
    "mmnnx.modules.routing:capacity": """
    >>> capacity(1.0, 10, 2, 8), capacity(1.25, 16, 2, 8)
    (3, 5)
    """,
    "mmnnx.modules.routing:capacity_keep": """
    >>> capacity_keep(jnp.array([[0, 1], [0, 2], [0, 1]]), 3, 2).tolist()
    [[True, True], [True, True], [False, True]]
    """,
    "mmnnx.modules.routing:seq_balance_loss": """
    >>> balanced = seq_balance_loss(jnp.array([[0.9, 0.1], [0.1, 0.9]]), jnp.array([[0], [1]]))
    >>> skewed = seq_balance_loss(jnp.array([[0.9, 0.1], [0.9, 0.1]]), jnp.array([[0], [0]]))
    >>> round(float(balanced), 4), round(float(skewed), 4)
    (1.0, 1.8)
    """,
    "mmnnx.partition.measure:shardings_on": """
    >>> import mmnnx as mm
    >>> t = mm.Task("t", mesh=mm.TaskMesh(devices=[0]))
    >>> list(shardings_on(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), t))
    [('bias',), ('kernel',)]
    """,
    "mmnnx.partition.measure:launch_seconds": """
    >>> import mmnnx as mm
    >>> launch_seconds(mm.Task("t", mesh=mm.TaskMesh(devices=[0]))) >= 0
    True
    """,
    "mmnnx.partition.search:splits": """
    >>> list(splits(4, 2))
    [(1, 3), (2, 2), (3, 1)]
    >>> list(splits(3, 2, ends=(False, True)))
    [(1, 2), (2, 1), (3, 0)]
    """,
    "mmnnx.partition.search:equal_split": """
    >>> equal_split(10, 4)
    (3, 3, 2, 2)
    """,
    "mmnnx.sharding.factory:trace_factory": """
    >>> import jax.numpy as jnp
    >>> class Cached(nnx.Module):
    ...     def __init__(self):
    ...         self.w = nnx.Param(jnp.zeros(2))
    ...         self.cache = nnx.data(jnp.ones(3))
    >>> traced = trace_factory(Cached)
    >>> traced.outputs, traced.model.cache.shape
    ([('cache',), ('w',)], (3,))
    """,
    "mmnnx.sharding.fsdp:shard_largest": """
    >>> sizes = {"fsdp": 2, "model": 2}
    >>> shard_largest(PartitionSpec(None, "model"), (16, 64), "fsdp", sizes)
    P('fsdp', 'model')
    >>> shard_largest(PartitionSpec("model"), (64,), "fsdp", sizes)
    P(('model', 'fsdp'),)
    >>> shard_largest(PartitionSpec(), (3, 8, 5), "fsdp", sizes, skip=1)
    P(None, 'fsdp', None)
    >>> shard_largest(PartitionSpec(), (), "fsdp", sizes) is None
    True
    """,
    "mmnnx.sharding.fsdp:ShardLargest": """
    >>> from mmnnx.sharding import TaskMesh
    >>> t = Task("t", mesh=TaskMesh(devices=range(2), axis_names=("fsdp",)))
    >>> with nnx.use_eager_sharding(False):
    ...     layer = nnx.Linear(4, 8, rngs=nnx.Rngs(0))
    >>> ShardLargest(t, "fsdp")("kernel", layer.kernel)
    P(None, 'fsdp')
    """,
    "mmnnx.sharding.place:declared_spec": """
    >>> from mmnnx.sharding import TaskMesh
    >>> from mmnnx.sharding.task import logical_rules
    >>> t = Task("t", mesh=TaskMesh(devices=range(2), axis_names=("model",)),
    ...          logical_axes=logical_rules(mlp="model"))
    >>> init = nnx.with_partitioning(nnx.initializers.ones_init(), ("embed", "mlp"))
    >>> with nnx.use_eager_sharding(False):
    ...     layer = nnx.Linear(2, 4, kernel_init=init, rngs=nnx.Rngs(0))
    >>> declared_spec(t, layer.kernel, "kernel"), declared_spec(t, layer.bias, "bias")
    (P(None, 'model'), P())
    """,
    "mmnnx.sharding.place:plan_placement": """
    >>> from mmnnx.sharding import TaskMesh
    >>> t = Task("t", mesh=TaskMesh(devices=[0]))
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> [path_str(a.path) for a in plan_placement(model, [(".*", t)])]
    ['bias', 'kernel']
    """,
    "mmnnx.sharding.place:place_made": """
    >>> from mmnnx.sharding import TaskMesh
    >>> t = Task("t", mesh=TaskMesh(devices=[0]))
    >>> model = nnx.eval_shape(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> model = place_made(model, [(".*", t)],
    ...                    lambda path, v, s: jax.device_put(jax.numpy.ones(v.shape), s))
    >>> float(model.kernel[...].sum())
    6.0
    """,
    "mmnnx.sharding.place:optimizer_mirrors": """
    >>> import optax
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    >>> [(path_str(m.path), path_str(m.param_path)) for m in optimizer_mirrors(opt, model)][:2]
    [('opt_state/0/mu/bias', 'bias'), ('opt_state/0/mu/kernel', 'kernel')]
    """,
    "mmnnx.sharding.place:check_optimizer_placement": """
    >>> check_optimizer_placement([("x", 1.0)])
    """,
    "mmnnx.sharding.place:misplaced_optimizer_state": """
    >>> import optax
    >>> from mmnnx.sharding import TaskMesh
    >>> s0, s1 = Task("s0", mesh=TaskMesh(devices=[0])), Task("s1", mesh=TaskMesh(devices=[1]))
    >>> model = place(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), [(".*", s0)])
    >>> opt = nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)
    >>> model = place(model, [(".*", s1)])
    >>> [(m.path, m.task.name, m.param_task.name)
    ...  for m in misplaced_optimizer_state([("model", model), ("opt", opt)])][:1]
    [('opt/opt_state/0/trace/bias', 's0', 's1')]
    """,
    "mmnnx.sharding.rules:compile_rules": """
    >>> import jax
    >>> from mmnnx.sharding.task_mesh import TaskMesh
    >>> t = Task("t", mesh=TaskMesh(devices=[0]))
    >>> [r.describe() for r in compile_rules([("layers/0", t)])]
    ["rule 0 ('layers/0' -> task 't')"]
    """,
    "mmnnx.sharding.specs:check_spec": """
    >>> import jax, numpy as np
    >>> mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    >>> check_spec(PartitionSpec("x"), (4,), mesh, "w")
    P('x',)
    """,
}


@pytest.mark.parametrize("where", list(EXAMPLES))
def test_example(where: str) -> None:
    module, name = where.split(":")
    namespace = dict(vars(importlib.import_module(module)))
    test = doctest.DocTestParser().get_doctest(
        textwrap.dedent(EXAMPLES[where]), namespace, where, module, 0
    )
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.failures == 0, f"{where}: {runner.failures} example(s) failed (printed above)"
