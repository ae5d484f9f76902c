# Sourced by the scripts/gpu/gpu_*.sh device scripts: PYTHONPATH for the checkout, the carried
# hydra/omegaconf/antlr4 wheels from .whl/ (bash ../shared/tools/device-wheels.sh stages them;
# name .whl in the call's carry) and $OUT for the logs that come back.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
OUT=${OUT:-/tmp/bstrain-out}; mkdir -p "$OUT"
