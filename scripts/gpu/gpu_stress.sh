#!/usr/bin/env bash
# One device call: is any kernel result flaky? (issue 8)
#   1. the GPU test suite under 8 pytest workers on one GPU;
#   2. the kernel and op tests again and again, each run with fresh seeds (--repeat), 8 workers,
#      for STRESS_SECONDS; every failure's seed is in $OUT/stress.log;
#   3. every kernel once under compute-sanitizer memcheck (out-of-bounds or misaligned accesses),
#      then once with every output and workspace NaN-filled first (an element nothing writes stays
#      NaN). initcheck is not used: it reports memory written by TMA bulk stores as uninitialised
#      (benchmarks/correctness.md).
# Carry .whl (bash ../shared/tools/device-wheels.sh) for hydra, which the trainer tests need.
set -o pipefail
. "$(dirname "$0")/gpu_env.sh"
STRESS_SECONDS=${STRESS_SECONDS:-180}
STRESS_TESTS=${STRESS_TESTS:-tests/kernels tests/ops/test_matmul.py tests/ops/test_norms.py tests/ops/test_ew.py}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ -z "$SKIP_SUITE" ]; then
  python3 -m pytest tests -q -n 8 -p no:cacheprovider -W ignore 2>&1 | tee "$OUT/pytest_n8.log" | tail -4
fi
runs=0; end=$((SECONDS + STRESS_SECONDS))
while [ $SECONDS -lt $end ]; do
  runs=$((runs + 1))
  python3 -m pytest $STRESS_TESTS -q -n 8 -p no:cacheprovider -W ignore --repeat "${REPEAT:-5}" 2>&1 \
    | grep -E "passed|failed|FAILED|BSTRAIN_TEST_SEED|Error" >> "$OUT/stress.log"
done
echo "stress: $runs runs of --repeat ${REPEAT:-5}: $(grep -c passed "$OUT/stress.log") summaries," \
     "$(grep -h -o '[0-9]* passed' "$OUT/stress.log" | awk '{s+=$1} END {print s}') tests passed," \
     "$(grep -c FAILED "$OUT/stress.log") failures"
grep FAILED "$OUT/stress.log" | head -5
BSTRAIN_POISON_OUTPUTS=0 timeout 300 compute-sanitizer --tool memcheck --print-limit 20 \
  python3 scripts/gpu/sanitize_kernels.py > "$OUT/sanitize_memcheck.log" 2>&1
echo "memcheck: $(grep -E 'ERROR SUMMARY|all kernel|WRONG' "$OUT/sanitize_memcheck.log" | tr '\n' ' ')"
echo "poisoned outputs: $(BSTRAIN_POISON_OUTPUTS=1 python3 scripts/gpu/sanitize_kernels.py | grep -E 'all kernel|WRONG')"
