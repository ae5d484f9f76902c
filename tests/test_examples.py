"""The examples do what they say: examples/seed_readme.py, and what the README's blocks promise in
their comments beyond what they print (tests/test_readme.py runs every block and checks prints)."""
from __future__ import annotations

import runpy
import sys
from pathlib import Path

import numpy as np
import torch

from tests.test_readme import readme_block, run_block

REPO = Path(__file__).parents[1]


def readme(containing: str) -> dict:
    """The namespace after running the one README block that contains ``containing``."""
    return run_block(*readme_block(containing))


def test_seed_readme_example_runs(capsys):
    runpy.run_path(str(REPO / "examples" / "seed_readme.py"), run_name="__main__")
    out = capsys.readouterr().out
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert "y (64, 4096), dW (" in out and f"on {device}" in out


def test_seed_doc_op_library_example_runs():
    """docs/seed.md's op library block: dropout's mask is bit-packed uint8 and drops the same elements
    again; the cross-entropy is fp32 per row from fp16 logits; the layer norms normalise (per segment);
    shapes as commented."""
    from tests.test_readme import SEED_DOC, python_blocks
    (line, code), = [b for b in python_blocks(SEED_DOC) if "bs.softmax_cross_entropy(" in b[1]]
    ns = run_block(line, code, SEED_DOC)
    x, y_drop, y_same, mask = ns["x"], ns["y_drop"], ns["y_same"], ns["mask"]
    assert mask.dtype == torch.uint8 and mask.numel() == -(-x.numel() // 8)       # one bit per element
    torch.testing.assert_close(y_same, y_drop)
    kept = y_drop != 0
    torch.testing.assert_close(y_drop[kept], x[kept] / 0.8)
    assert ns["loss"].dtype == torch.float32 and ns["loss"].shape == (8,)
    ref = torch.nn.functional.cross_entropy(ns["logits"].float(), ns["labels"], reduction="none")
    torch.testing.assert_close(ns["loss"], ref)
    assert ns["vectors"].shape == (4, 10, 64)
    bs = ns["bs"]
    seg = bs.layer_norm(x, ns["g"], ns["beta"], axis=1, segments=4, relu=True)
    ref = torch.nn.functional.layer_norm(x.view(8, 4, 128), (128,), eps=1e-6).clamp_min(0).view(8, 512)
    torch.testing.assert_close(seg, ref, atol=1e-5, rtol=1e-5)


def test_seed_doc_conv_example_runs():
    """The seed's BlocksparseConv block (docs/seed.md): the shapes in its comments, and l2_normalize gives each
    block's filter unit norm per output channel."""
    from tests.test_readme import SEED_DOC, python_blocks, run_block
    (line, code), = [b for b in python_blocks(SEED_DOC) if "bs.BlocksparseConv(" in b[1]]
    ns = run_block(line, code, SEED_DOC)
    conv, F, x = ns["conv"], ns["F"], ns["x"]
    assert conv.blocks == 3 and x.shape == (16, 8, 32, 32)
    assert all(f.shape == (4, 4, 3, 3) for f in F)                  # (output, input, kh, kw) channels
    assert ns["eb"].shape[0] == 8 and ns["y"].shape == (16, 8, 32, 32)
    for f in F:
        torch.testing.assert_close(f.square().sum(dim=(1, 2, 3)), torch.ones(4))


def test_readme_block_sparse_conv2d_example():
    """BlockSparseConv2d: the output shapes in the comments, a dense weight that is zero outside
    the live blocks, a to_dense() that computes the same, and sparsify swapping an nn.Conv2d."""
    ns = readme("BlockSparseConv2d(64, 128, 3")
    conv, w = ns["conv"], ns["w"]
    assert ns["y"].shape == (2, 128, 16, 16) and ns["z"].shape == (128, 16, 16)
    live = torch.as_tensor(np.repeat(np.repeat(conv.block_layout(), 16, 0), 16, 1)).T      # (K, C)
    assert w.shape == (128, 64, 3, 3) and not w[~live].any()
    x = torch.randn(2, 64, 16, 16)
    torch.testing.assert_close(ns["dense"](x), conv(x), atol=1e-4, rtol=1e-4)
    assert type(ns["pruned"]).__name__ == type(ns["cnn"][2]).__name__ == "BlockSparseConv2d"
    assert ns["out"].shape == (4, 256, 16, 16) and ns["out"].dtype == torch.bfloat16


def test_readme_attention_example():
    """BlockSparseAttention takes both layouts of q/k/v and a shorter T, and FlexAttention's block
    mask of the same mask function has the same live blocks as attention_layout."""
    ns = readme("BlockSparseAttention.from_mask(")
    assert ns["y"].shape == (2, 512, 128) and ns["y4"].shape == (2, 4, 384, 32)
    flex_blocks = ns["block_mask"].to_dense()[0, 0].numpy().astype(bool)
    np.testing.assert_array_equal(flex_blocks, ns["lay"].astype(bool))


def test_seed_doc_lstm_step_example():
    """docs/seed.md's recurrent step with gradient grouping gives the recurrent weight the gradient it
    has without grouping."""
    from tests.test_readme import SEED_DOC, python_blocks
    (line, code), = [b for b in python_blocks(SEED_DOC) if "recurrent.grad_group()" in b[1]]
    ns = run_block(line, code, SEED_DOC)
    grouped = ns["recurrent"].weight.grad.clone()
    recurrent, norm, bs, gates_in = ns["recurrent"], ns["norm"], ns["bs"], ns["gates_in"]
    recurrent.weight.grad = None
    c, h = torch.zeros(4, 256), torch.zeros(4, 256)
    for t in range(gates_in.shape[0]):
        c, h = bs.fused_lstm_gates(c, norm(gates_in[t] + recurrent(h)), forget_bias=1.0)
    h.square().sum().backward()
    torch.testing.assert_close(grouped, recurrent.weight.grad, atol=1e-5, rtol=1e-4)


def test_readme_own_model_is_the_example():
    """The README's ConvLM is examples/my_lm.py's: same parameters, same outputs."""
    ns = readme("class ConvLM(")
    sys.path.insert(0, str(REPO / "examples"))
    try:
        from my_lm import ConvLM
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    ours = ns["ConvLM"](width=64)
    torch.manual_seed(0)
    theirs = ConvLM(width=64)
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(ours(x), theirs(x))
