#!/usr/bin/env bash
# One device call for the attention kernels: the benchmark, then the GPU tests (or a tile sweep
# first with TUNE=1). Usage: bash scripts/gpu/gpu_attention.sh [seq list] [dims] [layouts]
# (carry .whl; logs under $OUT; TESTS="..." picks the tests, default the whole suite)
set -o pipefail
. "$(dirname "$0")/gpu_env.sh"
SEQ=${1:-4096,8192,16384}; DIMS=${2:-64,128}; LAYOUTS=${3:-causal,local,strided,fixed}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ -n "$TUNE" ]; then
  timeout ${TUNE_S:-260} python3 scripts/tune/tune_attention.py --out "$OUT" --seq "${SEQ%%,*}" --dims "$DIMS" \
    --budget-s $(( ${TUNE_S:-260} - 30 )) 2>&1 | tee "$OUT/tune.log" | grep -v "^{"
fi
SECONDS=0
timeout ${BENCH_S:-330} python3 scripts/bench/bench_attention.py --out "$OUT" --seq "$SEQ" --dims "$DIMS" \
  --layouts "$LAYOUTS" 2>&1 | tee "$OUT/bench.log" | grep "^|"
echo "bench: ${SECONDS}s"; SECONDS=0
timeout ${TEST_S:-200} python3 -m pytest -q -n 8 -p no:cacheprovider ${TESTS:-tests} 2>&1 | tee "$OUT/pytest.log" | tail -8
echo "tests: ${SECONDS}s"
