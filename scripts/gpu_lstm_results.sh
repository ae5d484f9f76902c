#!/usr/bin/env bash
# One device call on two GPUs (nvidia-h200-x2) for the sparse-LSTM results of benchmarks/lstm.md:
# GPU tests of the model and trainer first (stop if they fail), then the equal-parameter sparse and
# dense runs side by side (one per GPU, SECONDS each), then the step-time table on GPU 0 while the
# rest of the GPU tests run on GPU 1. Carry .whl (bash ../shared/tools/device-wheels.sh).
set -o pipefail
. "$(dirname "$0")/gpu_env.sh"
SECONDS_EACH=${SECONDS_EACH:-300}
nvidia-smi --query-gpu=index,name,memory.used --format=csv
CUDA_VISIBLE_DEVICES=0 python3 -m pytest tests/models tests/train/test_trainer.py -q -n 8 -p no:cacheprovider \
  2>&1 | tee "$OUT/pytest_quick.log" | tail -4 || { echo "quick GPU tests failed"; exit 1; }
CUDA_VISIBLE_DEVICES=0 python3 scripts/bench_lstm.py curve --which sparse --seconds "$SECONDS_EACH" --out "$OUT" \
  > "$OUT/curve_sparse.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 python3 scripts/bench_lstm.py curve --which dense --seconds "$SECONDS_EACH" --out "$OUT" \
  > "$OUT/curve_dense.log" 2>&1 &
wait
tail -n 3 "$OUT/curve_sparse.log" "$OUT/curve_dense.log"
CUDA_VISIBLE_DEVICES=1 python3 -m pytest tests -q -n 8 -p no:cacheprovider > "$OUT/pytest.log" 2>&1 &
CUDA_VISIBLE_DEVICES=0 python3 scripts/bench_lstm.py steptime --out "$OUT" --batches 64 --block-sizes 32,128 \
  2>&1 | grep -v "^Blocksparse" | tee "$OUT/steptime.log"
wait
tail -n 3 "$OUT/pytest.log"
python3 scripts/bench_lstm.py report --out "$OUT" | tail -30
