#!/usr/bin/env bash
# One device call for the convolution (issue 12): the conv GPU tests, the kernel sweep, then the
# benchmark. Usage: bash scripts/gpu/gpu_conv.sh   (carry .whl; logs and tables under $OUT)
set -o pipefail
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
SECONDS=0
[ "${TEST_S:-150}" != 0 ] && timeout ${TEST_S:-150} python3 -m pytest tests/kernels/test_conv.py tests/models/test_convnet.py tests/ops/test_conv.py \
  -q -n 8 -rf -p no:cacheprovider 2>&1 | tee "$OUT/pytest_conv.log" | grep -E "^(FAILED|ERROR)|passed|failed"
echo "tests: ${SECONDS}s"; SECONDS=0
[ "${TUNE_S:-200}" != 0 ] && timeout ${TUNE_S:-200} python3 scripts/tune/tune_conv.py --out "$OUT" --paths ${PATHS:-tma} --budget-s $(( ${TUNE_S:-200} - 20 )) 2>&1 \
  | tee "$OUT/tune_conv.log" | grep -E "^best|dense"
echo "tune: ${SECONDS}s"; SECONDS=0
timeout ${BENCH_S:-150} python3 scripts/bench/bench_conv.py --out "$OUT" --configs "$OUT/tune_conv.json" 2>&1 | tee "$OUT/bench_conv.log" | grep "^|"
echo "bench: ${SECONDS}s"
