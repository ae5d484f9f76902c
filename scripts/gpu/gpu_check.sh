#!/usr/bin/env bash
# One device call: GPU tests, the seed example, then one benchmark or profile.
# Usage: bash scripts/gpu/gpu_check.sh [NAME] [args]     (SKIP_TESTS=1 to skip the tests,
#   TESTS="tests/train ..." to run a subset, e.g. TESTS="-m gpu tests"; NPROC workers, default 8)
#   NAME: any scripts/bench/bench_NAME.py (default matmul), run with args and --out $OUT, e.g.
#     bash scripts/gpu/gpu_check.sh eager --parts host              (issue 19's eager host cost)
#     bash scripts/gpu/gpu_check.sh step --parts mlp --profile      (issue 20's whole steps)
#     bash scripts/gpu/gpu_check.sh transformer_step --eager        (issue 21's 8k step)
#     bash scripts/gpu/gpu_check.sh transformer curve --which sparse --seconds 120
#     bash scripts/gpu/gpu_check.sh sparsity cost --steps 1000      (issue 23: then "sparsity report")
#     bash scripts/gpu/gpu_check.sh lstm scaling --nproc 2          (issue 9, on nvidia-h200-x2)
#   or ncu: Nsight Compute's view of the conv and bsmm kernels (scripts/profile/profile_conv.py, issue 22),
#   the full report in $OUT/ncu.txt and its summary printed.
#   or an issue's figures, one call each (each fits a call's 10 minutes; benchmarks/README.md lists them):
#     bash scripts/gpu/gpu_check.sh 40 FAMILY WHICH [SECONDS]                        (nvidia-h200)
#     bash scripts/gpu/gpu_check.sh 41 suite|attention S|glue|anchor D64|D128        (nvidia-h200)
#     bash scripts/gpu/gpu_check.sh 44 suite|scaling CONFIG|fsdp|resume|rigl         (nvidia-h200-x2 or -x4)
#   each writing its table and JSON (machine and date inside) and its log to $OUT, for benchmarks/;
#   DRY_RUN=1 prints the commands only (NGPU=N stands for the GPU count there).
# The GPU machine lacks hydra-core/omegaconf/antlr4: stage their wheels in .whl/ first
# (bash ../shared/tools/device-wheels.sh) and carry .whl with the call. Logs under $OUT.
set -o pipefail
. "$(dirname "$0")/gpu_env.sh"
if [ "${1:-}" = 40 ] || [ "${1:-}" = 41 ] || [ "${1:-}" = 44 ]; then
  . "$(dirname "$0")/gpu_issues.sh"
  issue_$1 "${2:-suite}" "${@:3}"
  exit
fi
bench=matmul
if [ -n "${1:-}" ] && { [ "$1" = ncu ] || [ -f "scripts/bench/bench_$1.py" ]; }; then bench=$1; shift; fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ -z "$SKIP_TESTS" ]; then
  python3 -m pytest ${TESTS:-tests} -q -n ${NPROC:-8} -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -25
fi
python3 examples/seed_readme.py | tail -1
if [ "$bench" = ncu ]; then
  timeout ${NCU_S:-120} ncu --clock-control none --kernel-name regex:'_conv|_bsmm|xmma|nvjet|cutlass|gemm|conv' \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis python3 scripts/profile/profile_conv.py "$@" > "$OUT/ncu.txt" 2>&1; echo "ncu rc=$?"
  grep -E "^  [_a-zA-Z].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|L1/TEX Cache Throughput|L2 Cache Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|profiled:" "$OUT/ncu.txt" \
    | sed -E 's/ +/ /g' | cut -c1-110 > "$OUT/ncu_summary.txt"; tail -c 3500 "$OUT/ncu_summary.txt"
  exit
fi
python3 "scripts/bench/bench_$bench.py" "$@" --out "$OUT" 2>&1 | tee "$OUT/bench_$bench.log" | grep -v "^sweep"
