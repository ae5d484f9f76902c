#!/usr/bin/env bash
# One device call: GPU tests, the seed example, then a benchmark.
# Usage: bash scripts/gpu_check.sh [matmul|ops|lstm|eager|eager_linear|attention|conv] [bench args]   (SKIP_TESTS=1 to skip the tests,
# TESTS="tests/train ..." to run a subset)
# The GPU machine lacks hydra-core/omegaconf/antlr4: stage their wheels in .whl/ first
# (bash ../shared/tools/device-wheels.sh) and carry .whl with the call.
set -o pipefail
. "$(dirname "$0")/gpu_env.sh"
bench=matmul
case "${1:-}" in matmul|ops|lstm|eager|eager_linear|attention|conv) bench=$1; shift ;; esac
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ -z "$SKIP_TESTS" ]; then
  python3 -m pytest ${TESTS:-tests} -q -n 8 -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -25
fi
python3 examples/seed_readme.py | tail -1
python3 "scripts/bench_$bench.py" --out "$OUT" "$@" 2>&1 | tee "$OUT/bench_$bench.log" | grep -v "^sweep"
