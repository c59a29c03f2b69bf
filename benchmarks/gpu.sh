#!/usr/bin/env bash
# One call on a lent GPU machine (about 6 minutes; run from the repository root):
#   1. installs mmnnx --no-deps on the image's JAX, with the wheels the image lacks, carried in
#      .whl/ (grain, array-record, tensorboardX, tomli-w, datasets, dill, multiprocess,
#      portpicker, and orbax-checkpoint at our pin), fetched where pip works with
#        pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl NAME==VERSION
#      and carried to the machine (the device tool's `carry`; .whl/ is not in the repository);
#   2. runs the suite's engine, schedule, checkpoint and pretrained-loader files on the image's
#      JAX (on its CPU, 8 simulated devices, as everywhere: the tests compare numbers), collected
#      explicitly, and says how many ran;
#   3. runs benchmarks/gpu.py on the GPU.
# Writes versions.txt, tests.txt and gpu.json + gpu.log under $OUT (default /tmp/gpu-out).
# Dry run on a machine without a GPU: SMALL=1 benchmarks/gpu.sh (tiny models, 2 rounds, no
# tests; TEST=1 TESTS=tests/test_jit.py runs that file too).
set -u
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
PY=${PY:-python3}
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
$PY -m pip install -q --no-deps --no-index --no-build-isolation . >"$OUT/install.txt" 2>&1 \
  || echo "pip install of mmnnx failed (see install.txt): testing the checkout" >>"$OUT/install.txt"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  $PY -c "import sys, jax, flax, optax, orbax.checkpoint as o; print(sys.version.split()[0], \
'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', \
o.__version__, jax.devices())"
} | tee "$OUT/versions.txt"

TESTS=${TESTS:-"tests/test_pipeline.py tests/test_schedule_registry.py tests/test_train_schedules.py
  tests/test_jit.py tests/test_microbatch.py tests/test_direct_launch.py tests/test_stacks.py
  tests/test_packing.py tests/test_pipeline_state.py tests/test_engine_properties.py
  tests/test_checkpoint.py tests/test_pretrained.py tests/test_pretrained_moe.py
  tests/test_family_conformance.py tests/test_hf_fixtures.py"}
WORKERS=${WORKERS:-$(($(nproc) > 14 ? 14 : $(nproc)))}
if { [ -z "${SMALL:-}" ] || [ -n "${TEST:-}" ]; } && [ -z "${NO_TESTS:-}" ]; then
  # shellcheck disable=SC2086
  timeout "${TEST_TIMEOUT:-170}" env JAX_PLATFORMS=cpu $PY -m pytest -q -n "$WORKERS" \
    -p no:cacheprovider --dist load $TESTS >"$OUT/tests.txt" 2>&1
  echo "tests: exit $? ($(tail -n 1 "$OUT/tests.txt"))" | tee -a "$OUT/versions.txt"
fi

cd benchmarks || exit 1
PYTHONUNBUFFERED=1 timeout "${BENCH_TIMEOUT:-330}" $PY gpu.py --out "$OUT/gpu.json" \
  ${SMALL:+--small --rounds 2} ${GPU_ARGS:-} 2>&1 | tee "$OUT/gpu.log"
