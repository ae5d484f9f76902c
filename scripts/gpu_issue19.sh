#!/usr/bin/env bash
# One device call for issue 19: the whole suite on the GPU under -n 8 and the GPU tests alone, then the
# eager host cost of conv and attention (scripts/bench_eager.py --parts host). Carry .whl.
set -o pipefail
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-330} python3 -m pytest ${TESTS:-tests} -q -n 8 -p no:cacheprovider -x --maxfail=20 2>&1 \
    | tee "$OUT/pytest_n8.log" | tail -30
  if [ -n "$GPU_ALONE" ]; then
    timeout 150 python3 -m pytest tests -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu_alone.log" | tail -8
  fi
fi
if [ -z "$SKIP_BENCH" ]; then
  python3 scripts/bench_eager.py --parts host --out "$OUT" 2>&1 | tee "$OUT/bench_eager_host.log" | tail -12
fi
