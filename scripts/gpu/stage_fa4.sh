#!/usr/bin/env bash
# On the GPU machine: flash-attn-4 for Flex's FLASH backend, from the two halves that
# scripts/gpu/fetch_fa4.sh made here (about 100 MB of wheels: more than one call carries), over two
# calls that follow each other at once (a machine goes back 30 s after a call; the first half waits in
# $FA4_PARTS, default /tmp/fa4-parts, which lives as long as the machine):
#   call 1, carry [".fa4/a"]:         bash scripts/gpu/stage_fa4.sh a
#   call 2, carry [".fa4/b", ".whl"]: bash scripts/gpu/stage_fa4.sh b && bash scripts/gpu/gpu_check.sh 41 ...
# b joins the halves, checks the SHA-256, installs the wheels into the machine's python3 (or, where
# that is read-only, into /tmp/fa4-site, which scripts/gpu/gpu_env.sh puts on PYTHONPATH), and checks
# flex_attention with kernel_options={"BACKEND": "FLASH"} on a tiny causal case, forward and backward,
# against float64 SDPA. FA4_NO_INSTALL=1: join and check the archive only (the CPU test).
# PyPI's versions and sizes (2026-12-05): the header of scripts/gpu/fetch_fa4.sh.
set -euo pipefail
half=${1:?usage: stage_fa4.sh a|b}
PARTS=${FA4_PARTS:-/tmp/fa4-parts}
mkdir -p "$PARTS"
[ -d ".fa4/$half" ] || { echo "stage_fa4.sh $half: .fa4/$half is missing: name it in the call's carry" >&2; exit 1; }
cp ".fa4/$half"/* "$PARTS/"
if [ "$half" = a ]; then
  echo "stage_fa4.sh a: $(du -b "$PARTS"/fa4.tar.part00 | cut -f1) bytes waiting in $PARTS; now call 2 (stage_fa4.sh b)"
  exit 0
fi
[ -f "$PARTS/fa4.tar.part00" ] || { echo "stage_fa4.sh b: the first half is not in $PARTS: this machine did not run" \
  "stage_fa4.sh a (it went back between the calls); run both calls again, one right after the other" >&2; exit 1; }
cat "$PARTS/fa4.tar.part00" "$PARTS/fa4.tar.part01" > "$PARTS/fa4.tar"
[ "$(sha256sum "$PARTS/fa4.tar" | cut -d' ' -f1)" = "$(cat "$PARTS/SHA256")" ] \
  || { echo "stage_fa4.sh b: the joined archive's SHA-256 differs: the halves come from different fetches" >&2; exit 1; }
rm -rf "$PARTS/wheels" && mkdir -p "$PARTS/wheels" && tar -xf "$PARTS/fa4.tar" -C "$PARTS/wheels"
ls "$PARTS/wheels"
[ -n "${FA4_NO_INSTALL:-}" ] && exit 0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$PARTS"/wheels/*.whl 2>/dev/null \
  || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fa4-site \
       "$PARTS"/wheels/*.whl
[ -d /tmp/fa4-site ] && export PYTHONPATH=/tmp/fa4-site${PYTHONPATH:+:$PYTHONPATH}
python3 - <<'PY'
import torch, torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
torch.manual_seed(0)
q, k, v = (torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn_like(q)
bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, 256, 256, device="cuda")
out = torch.compile(flex_attention)(q, k, v, block_mask=bm, kernel_options={"BACKEND": "FLASH"})
got = [out, *torch.autograd.grad(out, (q, k, v), g)]
q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
want = [ref, *torch.autograd.grad(ref, (q64, k64, v64), g.double())]
errs = [float((a.double() - b).norm() / b.norm()) for a, b in zip(got, want)]
print("Flex FLASH, causal 256 x 64: rel. error out, dq, dk, dv", " ".join(f"{e:.1e}" for e in errs))
assert all(e < 2e-2 for e in errs), errs
PY
echo "stage_fa4.sh: flash-attn-4 installed; Flex BACKEND=FLASH runs"
