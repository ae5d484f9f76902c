. scripts/gpu/gpu_env.sh >/dev/null 2>&1
C="python3 scripts/bench/compare_runs.py"; R=$OUT/remeasure.md
T0=$SECONDS; SECONDS=0
timeout 270 python3 -m pytest tests -m gpu -q -n 8 -p no:cacheprovider > $OUT/pytest_gpu.log 2>&1
echo "pytest: rc=$? ${SECONDS}s"; tail -4 $OUT/pytest_gpu.log; grep -E "^(FAILED|ERROR)" $OUT/pytest_gpu.log | head -20; SECONDS=0
timeout 75 python3 scripts/bench/bench_attention.py --out $OUT --name attention_8k --seq 8192 --dims 64,128 --layouts causal,local,strided --tokens 32768 > $OUT/att.log 2>&1; echo "attention: rc=$? ${SECONDS}s"; SECONDS=0
$C benchmarks/attention_8k.json $OUT/attention_8k.json --key layout,S,D,block --value ours_fwd_ms,ours_fb_ms --title attention --md $R | tail -1
timeout 50 python3 scripts/bench/bench_transformer_step.py --out $OUT --variants "dense;local,fixed w1024 s64 bs64" > $OUT/step.log 2>&1; echo "step: rc=$? ${SECONDS}s"; SECONDS=0
$C benchmarks/transformer_step.json $OUT/transformer_step.json --key variant --value graph_ms,gpu_ms --title transformer_step --md $R | tail -1
timeout 70 python3 scripts/bench/bench_matmul.py --quick --out $OUT > $OUT/matmul.log 2>&1; echo "matmul: rc=$? ${SECONDS}s"; SECONDS=0
$C benchmarks/matmul.csv $OUT/matmul.csv --key dtype,M,bs,density,op --value ours_us --title matmul --md $R | tail -1
timeout 50 python3 scripts/bench/bench_conv.py --out $OUT --formats channels_last > $OUT/conv.log 2>&1; echo "conv: rc=$? ${SECONDS}s"; SECONDS=0
$C benchmarks/conv.json $OUT/conv.json --key format,method,block,density --value fwd_ms,fb_ms,fwd_gpu_ms,fb_gpu_ms --title conv --md $R | tail -1
timeout 45 python3 scripts/bench/bench_lstm.py steptime --out $OUT --batches 64 --block-sizes 32 --densities 0.054,0.105 --modes graph > $OUT/lstm.log 2>&1; echo "lstm: rc=$? ${SECONDS}s"
$C benchmarks/lstm_steptime.json $OUT/lstm_steptime.json --key batch,seq,graph,block,density --value sparse_ms,dense_ms --title lstm --md $R | tail -1
grep "slower" $R | head -20
