#!/usr/bin/env bash
# One device call on nvidia-h200-x2 for issue 11: the sparse and dense 8k-context LMs side by side
# (SECONDS_EACH, default 140), DDP scaling of the sparse one (1 vs 2 GPUs), then the GPU suite split
# over the two GPUs. Carry .whl. Everything lands in $OUT/results.tgz; the report is printed.
set -o pipefail
. "$(dirname "$0")/gpu_env.sh"
W=/tmp/bst-out; mkdir -p $W
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
SECONDS=0
for which in sparse dense; do
  gpu=$([ $which = sparse ] && echo 0 || echo 1)
  CUDA_VISIBLE_DEVICES=$gpu timeout $(( ${SECONDS_EACH:-140} + 90 )) python3 scripts/bench/bench_transformer.py curve \
    --which $which --seconds "${SECONDS_EACH:-140}" --out $W > $W/curve_$which.log 2>&1 &
done
wait
tail -n 2 $W/curve_sparse.log $W/curve_dense.log; echo "curves: ${SECONDS}s"; SECONDS=0
for n in 1 2; do
  timeout 120 python3 scripts/bench/bench_transformer.py scaling --nproc $n --out $W > $W/scaling_$n.log 2>&1
  tail -n 1 $W/scaling_$n.log
  cp /tmp/bstrain-transformer-runs/scaling_$n/train.log $W/scaling_${n}_train.log 2>/dev/null
done
echo "scaling: ${SECONDS}s"; SECONDS=0
python3 scripts/bench/bench_transformer.py report --out $W | tail -14
CUDA_VISIBLE_DEVICES=0 timeout ${TEST_S:-200} python3 -m pytest tests/kernels tests/ops -q -n 8 -rf -p no:cacheprovider \
  > $W/pytest_0.log 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout ${TEST_S:-200} python3 -m pytest tests --ignore=tests/kernels --ignore=tests/ops -q -n 8 -rf \
  -p no:cacheprovider > $W/pytest_1.log 2>&1 &
wait
echo "tests: ${SECONDS}s"
for f in $W/pytest_0.log $W/pytest_1.log; do grep -E "^(FAILED|ERROR)|passed|failed" $f | tail -12; done
cp /tmp/bstrain-transformer-runs/sparse/train.log $W/sparse_train.log 2>/dev/null
cp /tmp/bstrain-transformer-runs/dense/train.log $W/dense_train.log 2>/dev/null
tar czf $OUT/results.tgz -C $W . && cp $W/transformer.md $W/transformer.png $OUT/ 2>/dev/null; ls $OUT
