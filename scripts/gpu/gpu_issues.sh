# Sourced by scripts/gpu/gpu_check.sh for its issue modes (40, 41, 44): one figure a call.
# step NAME SECONDS CMD...: runs CMD under a timeout, its output to $OUT/NAME.log, the tail printed;
# with DRY_RUN=1 it prints "+ CMD" only.
step() {
  local name=$1 seconds=$2; shift 2
  echo "+ $*"
  [ -n "${DRY_RUN:-}" ] && return 0
  SECONDS=0
  timeout "$seconds" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v "^{" | tail -n "${TAIL:-30}"
  echo "$name: rc ${PIPESTATUS[0]}, ${SECONDS}s"
}

gpus() { [ -n "${NGPU:-}" ] && echo "$NGPU" || python3 -c "import torch; print(torch.cuda.device_count())"; }

machine() {
  [ -n "${DRY_RUN:-}" ] && return 0
  nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  python3 -c "from scripts.bench._flex import flash_status; print(flash_status()[1])"
}

# Issue 40 (one H200): one model of a family's pair (scripts/bench/bench_sparse_weights.py list), trained
# for SECONDS of wall time (default 540: a call has 10 minutes, its start and the evaluation included).
issue_40() {
  machine
  local family=${1:?40 needs FAMILY WHICH: transformer, lstm or convnet, then a model (bench_sparse_weights.py list)}
  local which=${2:?40 needs WHICH: dense, wide, ... (bench_sparse_weights.py list)} seconds=${3:-540}
  step "sparse_weights_${family}_$which" 595 python3 scripts/bench/bench_sparse_weights.py curve --family "$family" \
    --which "$which" --seconds "$seconds" --out "$OUT"
}

# Issue 41 (one H200): the GPU suite, the attention grid with the strongest Flex (one S a call:
# 4096, 8192, 16384, 65536), the glue kernels against torch.compile with % of HBM bandwidth, the LM
# step against the strongest anchor with its whole-step profile (one shape a call).
issue_41() {
  machine
  case "$1" in
    suite) step pytest_gpu 570 python3 -m pytest -m gpu -n 8 -q -p no:cacheprovider tests ;;
    attention) local S=${2:?attention needs S: 4096, 8192, 16384 or 65536}
      step "attention_strong_$S" 570 python3 scripts/bench/bench_attention.py --out "$OUT" --name "attention_strong_$S" \
        --seq "$S" --dims "${DIMS:-64,128}" --layouts "${LAYOUTS:-causal,local,strided,fixed,bigbird}" \
        --flex-blocks 128,64 --flex-compile max-autotune ;;
    glue) step ops_glue 570 python3 scripts/bench/bench_ops.py --parts glue --widths 512,1024 --out "$OUT" ;;
    anchor) local D=${2:?anchor needs D64 or D128}
      step "lm_anchor_strong_$D" 570 python3 scripts/bench/bench_lm_anchor.py --shapes "$D" --profile \
        --name "lm_anchor_strong_$D" --windows 5 --steps 8 --warmup 4 --out "$OUT" ;;
    *) echo "gpu_check.sh 41: expected suite, attention S, glue or anchor D64|D128, got '$1'" >&2; return 2 ;;
  esac
}

# Issue 44 (2 or 4 H200s): the suite on 2 workers and the two-GPU tests, DDP scaling 1 -> 2 (-> 4) of a
# config's default step, transformer_fsdp against its dense twin under FSDP, a DCP checkpoint of 2 GPUs
# resumed on 1 (and 4), RigL under FSDP against one GPU's layouts.
issue_44() {
  machine
  local n; n=$(gpus)
  case "$1" in
    suite) step pytest_gpu_n2 400 python3 -m pytest -m gpu -n 2 -q -p no:cacheprovider tests
      step pytest_two_gpus 170 python3 -m pytest -q -p no:cacheprovider -rs \
        tests/train/test_distributed.py::test_two_gpus_match_one tests/train/test_fsdp.py::test_fsdp_on_two_gpus_matches_ddp ;;
    scaling) local cfg=${2:?scaling needs a config: lstm_enwik8, transformer_enwik8 or convnet_cifar10}
      step "multigpu_scaling_$cfg" 570 python3 scripts/bench/bench_multigpu.py scaling --config "$cfg" \
        --nprocs "$([ "$n" -ge 4 ] && echo 1,2,4 || echo 1,2)" --out "$OUT" ;;
    fsdp) step multigpu_fsdp 570 python3 scripts/bench/bench_multigpu.py fsdp --nproc "$n" \
        --layers "$([ "$n" -ge 4 ] && echo 48 || echo 24)" --out "$OUT" ;;
    resume) step multigpu_resume 570 python3 scripts/bench/bench_multigpu.py resume \
        --to "$([ "$n" -ge 4 ] && echo 1,4 || echo 1)" --out "$OUT" ;;
    rigl) step multigpu_rigl 570 python3 scripts/bench/bench_multigpu.py rigl --out "$OUT" ;;
    *) echo "gpu_check.sh 44: expected suite, scaling CONFIG, fsdp, resume or rigl, got '$1'" >&2; return 2 ;;
  esac
}
