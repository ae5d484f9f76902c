#!/usr/bin/env bash
# Device call for issue 22's panel kernel (branch issue22-panel; carry .whl). Logs and tables under $OUT.
#   bash scripts/gpu_issue22.sh     the bsmm kernel tests (panels included) under -n 8, then bench_panels.py
set -o pipefail
. "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_matmul.py tests/ops/test_matmul.py 2>&1 \
  | tee "$OUT/pytest_matmul.log" | grep -E "^E  |^FAILED|passed|failed" | head -20
timeout 200 python3 scripts/bench_panels.py --out "$OUT" 2>&1 | tee "$OUT/panels.log" | grep "^|"
