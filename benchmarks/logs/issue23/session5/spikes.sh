. scripts/gpu_env.sh >/dev/null 2>&1
cat > /tmp/spk.py <<'PY'
import sys, os
sys.path.insert(0, "scripts")
from bench_sparsity import WHICH, RUN, config
from bench_lstm import site_packages_glob
from bstrain.train.trainer import train
graph, secs = sys.argv[1], sys.argv[2]
over = [*WHICH["lstm_rigl"], *RUN, f"data.path={site_packages_glob()}", "data.max_bytes=67108864",
        f"trainer.time_limit_s={secs}", f"trainer.run_dir=/tmp/spk_{graph}", "trainer.log_every=1", "trainer.eval_every=0"]
over = [o for o in over if not o.startswith(("trainer.max_steps=", "trainer.cuda_graph=", "trainer.log_every=", "trainer.eval_every="))] + \
       ["trainer.max_steps=11551", f"trainer.cuda_graph={graph}", "trainer.log_every=1", "trainer.eval_every=0"]
train(config(*over))
PY
for g in true false; do
  timeout 150 python3 /tmp/spk.py $g ${SECS_G:-40} > $OUT/spk_$g.log 2>&1
  python3 - $OUT/spk_$g.log <<'PY'
import re, sys
n = 0; bad = []
for line in open(sys.argv[1]):
    m = re.search(r"^step (\d+) loss ([\d.naninf]+) .*grad_norm ([\d.naninf]+)", line)
    if m:
        n = int(m.group(1))
        if not float(m.group(3)) < 3: bad.append((n, m.group(2), m.group(3)))
print(sys.argv[1].split("/")[-1], "steps", n, "spikes (step, loss, grad_norm):", bad[:30])
PY
done
