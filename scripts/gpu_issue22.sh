#!/usr/bin/env bash
# Device calls for issue 22 (carry .whl). Logs and tables under $OUT.
#   bash scripts/gpu_issue22.sh measure   the small-block bsmm (tiled and random layouts, panels on and off),
#                                         the LSTM pair's graphed step, the ResNet step profile, and ncu's
#                                         view of the conv and bsmm kernels (~8 min)
#   bash scripts/gpu_issue22.sh tests     the bsmm and conv kernel tests under -n 8
set -o pipefail
. "$(dirname "$0")/gpu_env.sh" >/dev/null 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
SECONDS=0
case "${1:-measure}" in
tests)
  timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_matmul.py tests/ops/test_matmul.py \
    tests/kernels/test_conv.py tests/ops/test_conv.py 2>&1 | tee "$OUT/pytest_kernels.log" | grep -E "^E  |^FAILED|passed|failed" | head -20 ;;
measure)
  timeout 120 ncu --clock-control none --kernel-name regex:'_conv|_bsmm|xmma|nvjet|cutlass|gemm|conv' \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis python3 scripts/profile_conv.py > "$OUT/ncu.txt" 2>&1; echo "ncu rc=$? ${SECONDS}s"
  timeout 110 python3 scripts/bench_panels.py --out "$OUT" > "$OUT/panels.log" 2>&1; echo "panels rc=$? ${SECONDS}s"
  for p in 0 1; do
    BSTRAIN_BSMM_PANEL=$p timeout 120 python3 scripts/bench_lstm.py pair --out "$OUT" --tag "panels=$p" > "$OUT/pair_$p.log" 2>&1
    echo "pair panels=$p rc=$? ${SECONDS}s"
  done
  timeout 100 python3 scripts/bench_convnet_speed.py --profile --out "$OUT" > "$OUT/convnet_profile.log" 2>&1; echo "convnet rc=$? ${SECONDS}s"
  grep -E "^  [_a-zA-Z].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|L1/TEX Cache Throughput|L2 Cache Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|profiled:" "$OUT/ncu.txt" \
    | sed -E 's/ +/ /g' | cut -c1-110 > "$OUT/ncu_summary.txt"; tail -c 3500 "$OUT/ncu_summary.txt"
  grep "^|" "$OUT/panels.log"; grep -h "^| panels" "$OUT"/pair_*.log; grep -E "graph .* ms, GPU" "$OUT/convnet_profile.log" ;;
esac
