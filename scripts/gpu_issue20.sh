#!/usr/bin/env bash
# One device call for issue 20 (carry .whl): GPU tests under -n 8 (TESTS, default the GPU-marked
# ones), then scripts/bench_step.py with BENCH's arguments (e.g. "--parts mlp --profile"), then
# any EXTRA command. Logs under $OUT.
set -o pipefail
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest ${TESTS:--m gpu tests} -q -n ${NPROC:-8} -p no:cacheprovider \
    --maxfail=30 2>&1 | tee "$OUT/pytest.log" | grep -v "^SKIPPED\|^  \|warnings.warn\|^$" | tail -45
fi
if [ -n "$BENCH" ]; then
  timeout ${BENCH_TIMEOUT:-300} python3 scripts/bench_step.py $BENCH --out "$OUT" 2>&1 | tee "$OUT/bench_step.log" \
    | grep -v "^ *[0-9]* *[0-9.]* *[0-9.]* *[0-9.]* *[0-9.]* .*{built-in\|^$" | tail -${BENCH_TAIL:-90}
fi
if [ -n "$EXTRA" ]; then
  eval "$EXTRA" 2>&1 | tee "$OUT/extra.log" | tail -40
fi
