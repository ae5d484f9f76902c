#!/usr/bin/env bash
# One device call for issue 21 (carry .whl). In order, each part only when its variable is set:
#   TESTS        pytest arguments, run under -n ${NPROC:-8} (e.g. "-m gpu tests/ops")
#   STEP         arguments of scripts/bench_transformer_step.py (e.g. "--eager"; "all" for none)
#   CURVES       "name:seconds name:seconds ...": bench_transformer.py curve runs, one after the other
#   EXTRA        any shell command
# Logs and result files under $OUT.
set -o pipefail
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ -n "$TESTS" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest $TESTS -q -n ${NPROC:-8} -p no:cacheprovider --maxfail=30 2>&1 \
    | tee "$OUT/pytest.log" | grep -v "^SKIPPED\|^  \|warnings.warn\|^$" | tail -40
fi
if [ -n "$STEP" ]; then
  [ "$STEP" = all ] && STEP=""
  timeout ${STEP_TIMEOUT:-300} python3 scripts/bench_transformer_step.py $STEP ${VARIANTS:+--variants "$VARIANTS"} \
    --out "$OUT" 2>&1 | tee "$OUT/step.log" | grep -v "^{" | tail -40
fi
for c in $CURVES; do
  name=${c%%:*}; secs=${c##*:}
  timeout $((secs + 120)) python3 scripts/bench_transformer.py curve --which "$name" --seconds "$secs" \
    --eval-every ${EVAL_EVERY:-200} --out "$OUT" --runs /tmp/curves 2>&1 | tee "$OUT/curve_$name.log" | tail -2
  cp /tmp/curves/$name/train.log "$OUT/train_$name.log" 2>/dev/null
done
if [ -n "$EXTRA" ]; then
  eval "$EXTRA" 2>&1 | tee "$OUT/extra.log" | tail -40
fi
