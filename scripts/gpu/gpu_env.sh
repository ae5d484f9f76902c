# Sourced by the scripts/gpu/gpu_*.sh device scripts: PYTHONPATH for the checkout, the carried
# hydra/omegaconf/antlr4 wheels from .whl/ (bash ../shared/tools/device-wheels.sh stages them;
# name .whl in the call's carry) and $OUT for the logs that come back.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVLink multicast stays off (KINDS.md: it can put the host's shared GPUs out of service)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# flash-attn-4 where scripts/gpu/stage_fa4.sh had to install it beside the read-only python3
[ -d /tmp/fa4-site ] && export PYTHONPATH=$PYTHONPATH:/tmp/fa4-site
OUT=${OUT:-/tmp/bstrain-out}; mkdir -p "$OUT"
