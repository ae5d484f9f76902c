#!/usr/bin/env bash
# Device calls for issue 23 (dynamic sparsity), on branch issue23 (carry .whl). Logs and tables under $OUT.
#   bash scripts/gpu_issue23.sh tests     the sparsity, graph and DDP tests that failed or are new on the
#                                         GPU, then the whole suite under -n 8 (~8 min)
#   bash scripts/gpu_issue23.sh cost      the update's share of training time at every=100: lstm_enwik8 and the
#                                         sparse-FFN transformer, static / set / rigl, unbalanced and balanced (~6 min)
#   bash scripts/gpu_issue23.sh profile   where one update's host time goes (cProfile; SET and RigL on the LSTM and
#                                         the FFN), then the sparsity, matmul and conv tests under -n 8 (~5 min)
#   CURVES="lstm_static:120 lstm_rigl:120:lstm_static ffn_sparse:120:3600" bash scripts/gpu_issue23.sh curves
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
profile)
  for m in lstm ffn; do for p in set rigl; do
    timeout 120 python3 scripts/profile_update.py --model $m --policy $p --steps 250 > "$OUT/profile_${m}_$p.log" 2>&1
    grep -E "sparsity: step|Error" "$OUT/profile_${m}_$p.log" | tail -3
  done; done
  timeout 300 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_sparsity.py tests/train/test_sparsity.py \
    tests/kernels/test_matmul.py tests/ops/test_matmul.py tests/kernels/test_conv.py tests/ops/test_conv.py \
    tests/nn/test_conv.py tests/nn/test_linear.py 2>&1 | tee "$OUT/pytest_gpu_sparsity.log" \
    | grep -E "^FAILED|passed|failed" | tail -15 ;;
cost)
  [ -n "$TESTS" ] && timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 $TESTS 2>&1 \
    | tee "$OUT/pytest_gpu.log" | grep -E "^FAILED|passed|failed" | tail -8
  timeout ${COST_S:-540} python3 scripts/bench_sparsity.py cost --out "$OUT" --steps ${STEPS:-1000} --models ${MODELS:-lstm,ffn} \
    --policies ${POLICIES:-static,set,rigl,set_balanced,rigl_balanced} 2>&1 \
    | tee "$OUT/cost.log" | grep -E "^(lstm|ffn) |Error" | tail -20
  python3 scripts/bench_sparsity.py report --out "$OUT" | grep "^|" ;;
curves)
  for c in $CURVES; do                  # name:seconds[:max_steps or the name of an earlier curve of this call]
    IFS=: read -r name secs steps <<< "$c"
    case "$steps" in "") extra=() ;; *[!0-9]*) extra=(--max-steps-from "$steps") ;; *) extra=(--max-steps "$steps") ;; esac
    timeout $(( secs + 90 )) python3 scripts/bench_sparsity.py curve --which "$name" --seconds "$secs" \
      "${extra[@]}" --out "$OUT" 2>&1 | tee "$OUT/curve_$name.log" | grep -E "bits/byte|Error" | tail -2
  done
  python3 scripts/bench_sparsity.py report --out "$OUT" | grep "^|" ;;
esac
