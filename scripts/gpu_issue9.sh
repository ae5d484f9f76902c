#!/usr/bin/env bash
# Device calls for issue 9 on two GPUs (nvidia-h200-x2); carry .whl (bash ../shared/tools/device-wheels.sh).
#   bash scripts/gpu_issue9.sh curves   model/trainer GPU tests, then the equal-parameter sparse and dense
#                                       runs side by side (SECONDS_EACH each, default 420), one per GPU
#   bash scripts/gpu_issue9.sh rest     the GPU suite under -n 8, DDP scaling (1 vs 2 GPUs), step times
#   bash scripts/gpu_issue9.sh ab       the GPU suite in single processes, and step times before/after issue 9
#   bash scripts/gpu_issue9.sh scaling  DDP scaling alone
#   bash scripts/gpu_issue9.sh suite    the GPU suite in single processes (kernels on GPU 0, the rest on GPU 1)
set -o pipefail
. "$(dirname "$0")/gpu_env.sh"
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
case "${1:-curves}" in
curves)
  CUDA_VISIBLE_DEVICES=0 python3 -m pytest tests/models tests/train/test_trainer.py -q -n 8 -p no:cacheprovider \
    -m gpu 2>&1 | tee "$OUT/pytest_quick.log" | tail -3 || { echo "quick GPU tests failed"; exit 1; }
  for which in sparse dense; do
    gpu=$([ $which = sparse ] && echo 0 || echo 1)
    CUDA_VISIBLE_DEVICES=$gpu python3 scripts/bench_lstm.py curve --which $which --seconds "${SECONDS_EACH:-420}" \
      --out "$OUT" > "$OUT/curve_$which.log" 2>&1 &
  done
  wait
  tail -n 4 "$OUT/curve_sparse.log" "$OUT/curve_dense.log"
  python3 scripts/bench_lstm.py report --out "$OUT" | tail -12
  ;;
rest)
  python3 -m pytest tests -q -n 8 -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -4
  python3 scripts/bench_lstm.py scaling --nproc 1 --out "$OUT" > "$OUT/scaling_1.log" 2>&1; tail -1 "$OUT/scaling_1.log"
  python3 scripts/bench_lstm.py scaling --nproc 2 --out "$OUT" > "$OUT/scaling_2.log" 2>&1; tail -1 "$OUT/scaling_2.log"
  for n in 1 2; do cp /tmp/bstrain-lstm-runs/scaling_$n/train.log "$OUT/scaling_${n}_train.log"; done
  CUDA_VISIBLE_DEVICES=0 python3 scripts/bench_lstm.py steptime --out "$OUT" --batches 64 --block-sizes 32 \
    --densities 0.054,0.105 --modes graph,eager 2>&1 | grep -v "^Blocksparse" | tee "$OUT/steptime.log"
  CUDA_VISIBLE_DEVICES=0 python3 scripts/bench_lstm.py steptime --out "$OUT" --batches 64 --block-sizes 128 \
    --densities 0.064,0.112 --modes graph --append 2>&1 | grep -v "^Blocksparse" | tee -a "$OUT/steptime.log"
  ;;
ab)     # the GPU suite in single processes (GPU 0: kernels; GPU 1: the rest, after the step-time A/B of the
        # trainer before issue 9 (.old, from `git archive a562ef9`, carried) against this one, graph mode)
  CUDA_VISIBLE_DEVICES=0 timeout 420 python3 -m pytest tests/kernels -q -p no:cacheprovider \
    > "$OUT/pytest_single_0.log" 2>&1 &
  ( for tree in .old .; do
      echo "== $tree" >> "$OUT/steptime_ab.log"
      for bs in 32 128; do     # the old layout is random(0.05) | diagonal: 0.0543 at block 32, 0.0637 at 128
        dens=0.05; [ $tree = . ] && dens=$([ $bs = 32 ] && echo 0.0543 || echo 0.0637)
        args="--block-sizes $bs --densities $dens"
        (cd $tree && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$PWD:/tmp/site python3 scripts/bench_lstm.py steptime \
          --out "$OUT/ab_$(basename $PWD)" --batches 64 --modes graph $args 2>&1 | grep "^{" >> "$OUT/steptime_ab.log")
      done
    done
    CUDA_VISIBLE_DEVICES=1 timeout 250 python3 -m pytest tests --ignore=tests/kernels -q -p no:cacheprovider \
      > "$OUT/pytest_single_1.log" 2>&1 ) &
  wait
  cat "$OUT/steptime_ab.log"; tail -n 3 "$OUT/pytest_single_0.log" "$OUT/pytest_single_1.log"
  ;;
scaling)
  python3 scripts/bench_lstm.py scaling --nproc 1 --out "$OUT" > "$OUT/scaling_1.log" 2>&1; tail -1 "$OUT/scaling_1.log"
  python3 scripts/bench_lstm.py scaling --nproc 2 --out "$OUT" > "$OUT/scaling_2.log" 2>&1; tail -1 "$OUT/scaling_2.log"
  for n in 1 2; do cp /tmp/bstrain-lstm-runs/scaling_$n/train.log "$OUT/scaling_${n}_train.log"; done
  ;;
suite)
  CUDA_VISIBLE_DEVICES=0 timeout 540 python3 -m pytest tests/kernels -q -p no:cacheprovider \
    > "$OUT/pytest_single_0.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout 540 python3 -m pytest tests --ignore=tests/kernels -q -p no:cacheprovider \
    > "$OUT/pytest_single_1.log" 2>&1 &
  wait
  tail -n 3 "$OUT/pytest_single_0.log" "$OUT/pytest_single_1.log"
  ;;
esac
