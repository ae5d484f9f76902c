. scripts/gpu_env.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
SECONDS=0
timeout 360 python3 -m pytest tests/train tests/kernels/test_attention.py tests/ops/test_transformer.py tests/ops/test_transformer_mods.py tests/nn/test_attention.py tests/nn/test_attention_mods.py tests/models/test_transformer.py tests/test_readme.py tests/ops/test_capture.py -m gpu -q -n 8 -p no:cacheprovider > $OUT/pytest1.log 2>&1
echo "pytest: ${SECONDS}s"; tail -15 $OUT/pytest1.log; SECONDS=0
timeout 200 python3 scripts/bench_attention.py --out $OUT --name attention_4k --seq 4096 --dims 64,128 > $OUT/b4k.log 2>&1
echo "4k: ${SECONDS}s"; tail -5 $OUT/b4k.log
grep "^|" $OUT/attention_4k.md | head -40
