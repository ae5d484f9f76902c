#!/usr/bin/env bash
# Here, on a machine with PyPI: the flash-attn-4 wheels for the GPU machine (cp312, linux x86_64),
# packed and split in two halves under .fa4/ (git-ignored), each small enough to travel with the
# working tree in one device call (64 MiB a call; the tree is about 11 MB). Then, on the GPU machine,
# two calls right after each other (it stays warm 30 s): scripts/gpu/stage_fa4.sh a, then b.
#
#   bash scripts/gpu/fetch_fa4.sh                 # FA4_VERSION=4.0.0b40 to pin; FA4_WHEELS=DIR: wheels already here
#   carry [".fa4/a"]:        bash scripts/gpu/stage_fa4.sh a
#   carry [".fa4/b", ".whl"]: bash scripts/gpu/stage_fa4.sh b && bash scripts/gpu/gpu_check.sh 41 attention 8192
#
# What PyPI had on 2026-12-05 (pip download --no-deps --python-version 3.12 --platform manylinux_2_28_x86_64
# --only-binary=:all:; flash-attn-4 is a pre-release, so --pre): 100.5 MB in all:
#   flash-attn-4 4.0.0b40 (py3-none-any, 0.57 MB)     nvidia-cutlass-dsl 4.8.1 (10 KB: names the libs)
#   nvidia-cutlass-dsl-libs-base 4.8.1 (3.1 MB)       nvidia-cutlass-dsl-libs-cu13 4.8.1 (92.0 MB; torch there is cu130)
#   quack-kernels 0.6.5 (0.73 MB)                     apache-tvm-ffi 0.1.15.post2 (3.3 MB)
#   torch-c-dlpack-ext 0.1.5 (0.9 MB)                 (einops, typing_extensions: already on the machine)
# Not known until a GPU call: whether this flash-attn-4 beta fits torch 2.11's Flex FLASH template (it was
# built against newer torch); stage_fa4.sh b's check says, and the benchmarks fall back to Triton and say so.
set -euo pipefail
VERSION=${FA4_VERSION:-}
mkdir -p .fa4/wheels .fa4/a .fa4/b
grep -qx '/.fa4/' .gitignore 2>/dev/null || { echo "fetch_fa4.sh: .fa4/ is not in .gitignore: run from the repo root" >&2; exit 1; }
if [ -n "${FA4_WHEELS:-}" ]; then
  cp "$FA4_WHEELS"/*.whl .fa4/wheels/
else
  P="--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
  python3 -m pip download -q --no-deps --pre --only-binary=:all: --python-version 3.12 --implementation cp $P -d .fa4/wheels \
    "flash-attn-4${VERSION:+==$VERSION}" "nvidia-cutlass-dsl>=4.6.2" "apache-tvm-ffi>=0.1.11,<0.2" torch-c-dlpack-ext \
    "quack-kernels>=0.5.3"
  cutlass=$(ls .fa4/wheels | sed -n 's/^nvidia_cutlass_dsl-\([^-]*\)-.*/\1/p')
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P -d .fa4/wheels \
    "nvidia-cutlass-dsl-libs-base==$cutlass" "nvidia-cutlass-dsl-libs-cu13==$cutlass"
fi
rm -f .fa4/a/* .fa4/b/*
tar -cf .fa4/fa4.tar -C .fa4/wheels .
sha=$(sha256sum .fa4/fa4.tar | cut -d' ' -f1)
split -n 2 -d .fa4/fa4.tar .fa4/fa4.tar.part
mv .fa4/fa4.tar.part00 .fa4/a/ && mv .fa4/fa4.tar.part01 .fa4/b/
echo "$sha" | tee .fa4/a/SHA256 > .fa4/b/SHA256
rm .fa4/fa4.tar
ls -l .fa4/wheels | awk 'NR > 1 {printf "  %6.1f MB  %s\n", $5 / 1e6, $9}'
du -b .fa4/a .fa4/b | awk '{printf "half %s: %.1f MB\n", $2, $1 / 1e6}'
