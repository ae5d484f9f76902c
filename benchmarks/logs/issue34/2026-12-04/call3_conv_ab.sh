. scripts/gpu/gpu_env.sh >/dev/null 2>&1
W=/tmp/w3; C="python3 scripts/bench/compare_runs.py"
for i in 1 2; do
  mkdir -p $W/old$i $W/new$i
  (cd .old/base && PYTHONPATH=$PWD:/tmp/site timeout 40 python3 scripts/bench_conv.py --out $W/old$i --formats channels_last --backends grouped,dense,triton > /dev/null 2>&1)
  timeout 40 python3 scripts/bench/bench_conv.py --out $W/new$i --formats channels_last --backends grouped,dense,triton > /dev/null 2>&1
  cp $W/old$i/conv.json $OUT/conv_old$i.json; cp $W/new$i/conv.json $OUT/conv_new$i.json
  $C $W/old$i/conv.json $W/new$i/conv.json --key format,method,block,density --value fwd_ms,fb_ms,fwd_gpu_ms,fb_gpu_ms --title "conv pair $i" | tail -1
done
