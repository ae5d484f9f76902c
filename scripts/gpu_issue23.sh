#!/usr/bin/env bash
# Device calls for issue 23 (dynamic sparsity), on branch issue23 (carry .whl). Logs and tables under $OUT.
#   bash scripts/gpu_issue23.sh tests     the sparsity, graph and DDP tests that failed or are new on the
#                                         GPU, then the whole suite under -n 8 (~8 min)
#   bash scripts/gpu_issue23.sh cost      the update's share of training time at every=100: lstm_enwik8 and the
#                                         sparse-FFN transformer, static / set / rigl, unbalanced and balanced (~6 min)
#   CURVES="lstm_dense:300 lstm_rigl:300" bash scripts/gpu_issue23.sh curves
#                                         equal-wall-time quality runs, one after the other, then the report
set -o pipefail
. "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "${1:-tests}" in
tests)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_sparsity.py tests/train/test_sparsity.py \
    tests/train/test_graphs.py tests/train/test_distributed.py 2>&1 | tee "$OUT/pytest_sparsity.log" \
    | grep -E "^E  |^FAILED|passed|failed" | head -30
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest tests -q -n 8 -p no:cacheprovider -rf 2>&1 \
    | tee "$OUT/pytest_n8.log" | grep -E "^FAILED|passed|failed" | tail -12 ;;
cost)
  timeout ${COST_S:-540} python3 scripts/bench_sparsity.py cost --out "$OUT" --steps ${STEPS:-400} 2>&1 \
    | tee "$OUT/cost.log" | grep -E "^(lstm|ffn) |Error" | tail -20
  python3 scripts/bench_sparsity.py report --out "$OUT" | grep "^|" ;;
curves)
  for c in $CURVES; do
    timeout $(( ${c#*:} + 90 )) python3 scripts/bench_sparsity.py curve --which "${c%%:*}" --seconds "${c#*:}" \
      --out "$OUT" 2>&1 | tee "$OUT/curve_${c%%:*}.log" | tail -1
  done
  python3 scripts/bench_sparsity.py report --out "$OUT" | grep "^|" ;;
esac
