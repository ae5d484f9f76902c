. scripts/gpu_env.sh >/dev/null 2>&1
SECONDS=0
timeout 300 python3 scripts/bench_lm_anchor.py --out $OUT --config transformer_long --shapes native --windows 4 --steps 4 --warmup 3 > $OUT/long.log 2>&1
echo "long: ${SECONDS}s"; tail -20 $OUT/long.log; SECONDS=0
timeout 250 python3 scripts/bench_transformer_step.py --out $OUT --variants "dense;local,fixed w1024 s64 bs64" > $OUT/step.log 2>&1
echo "step: ${SECONDS}s"; tail -30 $OUT/step.log
