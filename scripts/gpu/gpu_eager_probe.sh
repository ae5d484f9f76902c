set -o pipefail
. scripts/gpu/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
for i in 1 2; do
 echo "=== new $i"; python3 scripts/bench/bench_eager_linear.py --repeats 7 2>&1 | grep "^|"
 echo "=== old $i"; (cd .old && PYTHONPATH=$PWD python3 scripts/bench/bench_eager_linear.py --repeats 7 2>&1 | grep "^|")
done
echo "=== new profile"; python3 scripts/bench/bench_eager_linear.py --blocks 64 --repeats 3 --profile 2>&1 | head -60
echo "=== old profile"; (cd .old && PYTHONPATH=$PWD python3 scripts/bench/bench_eager_linear.py --blocks 64 --repeats 3 --profile 2>&1 | head -60)
