. scripts/gpu_env.sh >/dev/null 2>&1
SECONDS=0
timeout 250 python3 scripts/bench_attention.py --out $OUT --name attention_128k --seq 131072 --batch 1 --dims 128 --layouts longglobal > $OUT/b128k.log 2>&1
echo "128k: ${SECONDS}s"; tail -3 $OUT/b128k.log; SECONDS=0
timeout 170 python3 scripts/bench_attention.py --out $OUT --name attention_16k_b64 --seq 16384 --dims 64,128 --block 64 --layouts causal,local,bigbird > $OUT/b16k64.log 2>&1
echo "b64: ${SECONDS}s"; tail -3 $OUT/b16k64.log; SECONDS=0
timeout 120 python3 scripts/profile_attention.py --out $OUT > $OUT/prof.log 2>&1
echo "prof: ${SECONDS}s"; tail -3 $OUT/prof.log
grep "^|" $OUT/attention_128k.md | head -20; grep "^|" $OUT/attention_16k_b64.md | head -40; grep "^|" $OUT/attention_profile.md | head -30
