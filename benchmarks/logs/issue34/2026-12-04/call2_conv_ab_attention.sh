. scripts/gpu/gpu_env.sh >/dev/null 2>&1
W=/tmp/w; mkdir -p $W/new $W/old $W/new2
C="python3 scripts/bench/compare_runs.py"; R=$OUT/remeasure2.md
SECONDS=0
(cd .old/base && PYTHONPATH=$PWD:/tmp/site timeout 40 python3 scripts/bench_conv.py --out $W/old --formats channels_last > $W/old/conv.log 2>&1); echo "conv old: rc=$? ${SECONDS}s"; SECONDS=0
timeout 40 python3 scripts/bench/bench_conv.py --out $W/new --formats channels_last > $W/new/conv.log 2>&1; echo "conv new: rc=$? ${SECONDS}s"; SECONDS=0
timeout 40 python3 scripts/bench/bench_conv.py --out $W/new2 --formats channels_last > $W/new2/conv.log 2>&1; echo "conv new2: rc=$? ${SECONDS}s"; SECONDS=0
$C $W/old/conv.json $W/new/conv.json --key format,method,block,density --value fwd_ms,fb_ms,fwd_gpu_ms,fb_gpu_ms --title "conv, new / old tree, same call" --md $R | tail -1
$C $W/old/conv.json $W/new2/conv.json --key format,method,block,density --value fwd_ms,fb_ms,fwd_gpu_ms,fb_gpu_ms --title "conv, new (2nd run) / old tree" --md $R | tail -1
cp $W/old/conv.json $OUT/conv_old.json; cp $W/new/conv.json $OUT/conv_new.json; cp $W/new2/conv.json $OUT/conv_new2.json
timeout 170 python3 scripts/bench/bench_attention.py --out $W/new --name attention_8k --seq 8192 --dims 64,128 --layouts causal,local,strided --tokens 32768 > $W/att.log 2>&1; echo "attention: rc=$? ${SECONDS}s"
cp $W/new/attention_8k.json $OUT/; tail -3 $W/att.log
$C benchmarks/attention_8k.json $W/new/attention_8k.json --key layout,S,D,block --value ours_fwd_ms,ours_fb_ms --title attention --md $R | tail -1
grep "slower" $R | head -20
