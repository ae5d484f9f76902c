#!/usr/bin/env bash
# One device call for the attention kernels: tile sweep, benchmark with the swept tiles, GPU tests.
# Usage: bash scripts/gpu_attention.sh [seq] [dims] [layouts]   (carry .whl; logs under $OUT)
set -o pipefail
. "$(dirname "$0")/gpu_env.sh"
SEQ=${1:-8192}; DIMS=${2:-64,128}; LAYOUTS=${3:-causal,strided}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout ${TUNE_S:-260} python3 scripts/tune_attention.py --out "$OUT" --seq "$SEQ" --dims "$DIMS" \
  --budget-s $(( ${TUNE_S:-260} - 30 )) 2>&1 | tee "$OUT/tune.log" | grep -v "^{"
timeout ${BENCH_S:-170} python3 scripts/bench_attention.py --out "$OUT" --seq "$SEQ" --dims "$DIMS" \
  --layouts "$LAYOUTS" --tiles "$OUT/tune_attention.json" 2>&1 | tee "$OUT/bench.log" | grep "^|"
timeout ${TEST_S:-120} python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_attention.py \
  tests/ops/test_transformer.py 2>&1 | tee "$OUT/pytest.log" | tail -6
