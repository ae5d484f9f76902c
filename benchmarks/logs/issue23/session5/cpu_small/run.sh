# $1 = tag, rest = extra overrides
tag=$1; shift
rm -rf /tmp/exp/$tag
timeout 900 python -m bstrain train config=lstm_enwik8 data.name=bytes "data.path=/opt/dev/lib/python3.11/site-packages/torch/**/*.py" \
  data.max_bytes=8000000 model.hidden=512 model.embed=64 model.density=0.1 model.block_size=32 model.layout=random \
  data.seq_len=32 data.batch_size=32 trainer.precision=fp32 trainer.max_steps=1200 trainer.eval_every=0 trainer.ckpt_every=0 \
  trainer.log_every=1 trainer.progress=false optim.warmup_steps=100 optim.ema=0 trainer.run_dir=/tmp/exp/$tag \
  sparsity.every=100 sparsity.fraction=0.3 sparsity.until=1.0 "$@" > /tmp/exp/$tag.log 2>&1
