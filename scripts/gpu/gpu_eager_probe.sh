#!/usr/bin/env bash
# One device call (issue 32): bench_eager_linear.py in this tree and in .old, side by side, twice, then
# a host profile of each. .old: the commit to compare (git archive), carried, with this tree's scripts/
# copied in (cp -r scripts .old/), since each script imports the package of the tree it sits in.
set -o pipefail
. scripts/gpu/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
for i in 1 2; do
 echo "=== new $i"; python3 scripts/bench/bench_eager_linear.py --repeats 7 2>&1 | grep "^|"
 echo "=== old $i"; (cd .old && PYTHONPATH=$PWD python3 scripts/bench/bench_eager_linear.py --repeats 7 2>&1 | grep "^|")
done
echo "=== new profile"; python3 scripts/bench/bench_eager_linear.py --blocks 64 --repeats 3 --profile 2>&1 | head -60
echo "=== old profile"; (cd .old && PYTHONPATH=$PWD python3 scripts/bench/bench_eager_linear.py --blocks 64 --repeats 3 --profile 2>&1 | head -60)
