"""BlocksparseConv / BlocksparseDeconv / cwise_linear against float64 references built here:
a dense filter assembled element by element, TensorFlow's SAME padding worked out per dim, the
deconv as the adjoint (vector-Jacobian product) of that convolution, and edge bias by position."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bstrain.ops.conv import BlocksparseConv, BlocksparseDeconv, cwise_linear
from tests.conftest import DTYPE_IDS, assert_close, fresh_seed


def ref_filter(op, fs, transposed=False):
    """Dense (K, C, *TRS) (deconv: (C, K, *TRS)) float64 filter, block by block, element by element."""
    shape = ([op.C, op.K] if transposed else [op.K, op.C]) + op.TRS
    w = torch.zeros(shape, dtype=torch.float64)
    for f, (cs, ks) in zip(fs, op.BCK):
        f = f.detach().double()
        for i, c in enumerate(cs):
            for j, k in enumerate(ks):
                if transposed:
                    w[c, k] += f[i, j]
                else:
                    w[k, c] += f[j, i]
    return w


def tf_pads(TRS, DHW, strides, dilates, padding):
    pads = []
    for s, w, st, dl in zip(TRS, DHW, strides, dilates):
        eff = dl * (s - 1) + 1
        if padding == "SAME":
            out = math.ceil(w / st)
            total = max((out - 1) * st + eff - w, 0)
            pads.append((total // 2, total - total // 2))
        elif padding == "VALID":
            pads.append((0, 0))
        else:
            pads.append((padding, padding))
    return pads


def ref_conv(x, w, TRS, strides, dilates, padding):
    pads = tf_pads(TRS, list(x.shape[2:]), strides, dilates, padding)
    xp = F.pad(x, [p for pair in reversed(pads) for p in pair])
    return {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[len(TRS)](xp, w, stride=strides, dilation=dilates)


def ref_deconv(y, w, TRS, MPQ, strides, dilates, padding):
    """The adjoint of ref_conv (input size MPQ, weight (C_out=deconv in, K=deconv out)) applied to y."""
    z = torch.zeros([y.shape[0], w.shape[1]] + list(MPQ), dtype=y.dtype, requires_grad=True)
    out = ref_conv(z, w, TRS, strides, dilates, padding)
    assert out.shape == y.shape, (out.shape, y.shape)
    return torch.autograd.grad(out, z, y, create_graph=True)[0]


def edge_ids(TRS, in_size, out_size, strides, dilates, padding, transposed):
    """Per output position, the id of its pattern of taps in the padding (first-seen order)."""
    pads = tf_pads(TRS, out_size if transposed else in_size, strides, dilates, padding)
    ids, seen = [], {}
    for pos in np.ndindex(*out_size):
        key = []
        for taps in np.ndindex(*TRS):
            outside = False
            for d, (p, t) in enumerate(zip(pos, taps)):
                if transposed:      # forward conv: input position p, output q with q*st = p + pb - t*dl
                    num = p + pads[d][0] - t * dilates[d]
                    outside |= num % strides[d] == 0 and not 0 <= num // strides[d] < in_size[d]
                else:
                    x = p * strides[d] - pads[d][0] + t * dilates[d]
                    outside |= not 0 <= x < in_size[d]
            if outside:
                key.append(taps)
        ids.append(seen.setdefault(tuple(key), len(seen)) if key else -1)
    return np.array(ids), len(seen)


def random_bck(C, K, seed, equal=True, overlap=True):
    rng = np.random.default_rng(seed)
    blocks = []
    if equal:
        cb, kb = 2, 3
        for ci in range(C // cb):
            for ki in range(K // kb):
                if rng.random() < 0.5 or (ci == 0 and ki == 0):
                    blocks.append((list(range(ci * cb, (ci + 1) * cb)), list(range(ki * kb, (ki + 1) * kb))))
        if overlap:                         # a second block onto the same output channels
            blocks.append((rng.permutation(C)[:cb].tolist(), list(range(kb))))
    else:
        for _ in range(4):
            cs = rng.permutation(C)[:rng.integers(1, C + 1)].tolist()
            ks = rng.permutation(K)[:rng.integers(1, K + 1)].tolist()
            blocks.append((cs, ks))
        blocks.append(([C - 1], [K - 1]))
    return blocks


GEOMS = [  # (TRS, DHW, strides, dilates, padding)
    ((3,), (9,), (1,), (1,), "SAME"),
    ((4,), (10,), (2,), (1,), "SAME"),              # even filter and stride: asymmetric padding
    ((3, 3), (7, 6), (1, 1), (1, 1), "SAME"),
    ((2, 3), (8, 7), (2, 1), (1, 2), "SAME"),
    ((3, 3), (9, 8), (2, 2), (1, 1), "VALID"),
    ((3, 2), (6, 7), (1, 2), (2, 1), 1),
    ((2, 3, 2), (4, 5, 4), (1, 2, 1), (1, 1, 2), "SAME"),
]


def _check(op, fs, x, eb, y, ref_fn, transposed):
    """y = op(fs, x, eb) against ref_fn(x, dense filter) + edge bias: output and every gradient."""
    w = ref_filter(op, fs, transposed).requires_grad_()
    xr = x.detach().double().requires_grad_()
    ref = ref_fn(xr, w)
    out_size = list(ref.shape[2:])
    ids, n = edge_ids(op.TRS, op.DHW if not transposed else op.DHW, out_size, op.strides, op.dilates,
                      op.padding[0] if isinstance(op.padding[0], str) else op.padding[0], transposed)
    assert n == op.edge_bias_shape[1]
    ebr = eb.detach().double().requires_grad_()
    table = torch.cat([ebr, torch.zeros(op.K, 1, dtype=torch.float64)], 1)
    ref = ref + table[:, torch.as_tensor(ids)].view([1, op.K] + out_size)
    assert_close(y, ref, None, y.dtype, "out")
    g = torch.randn_like(ref)
    got = torch.autograd.grad(y, [x, eb, *fs], g.to(y.dtype))
    want_x, want_w, want_eb = torch.autograd.grad(ref, [xr, w, ebr], g)
    assert_close(got[0], want_x, None, y.dtype, "dI")
    assert_close(got[1], want_eb, None, y.dtype, "d edge bias")
    for b, (cs, ks) in enumerate(op.BCK):          # a block's gradient: the dense gradient at its entries
        i, j = (cs, ks) if transposed else (ks, cs)
        want = want_w[torch.as_tensor(i)[:, None], torch.as_tensor(j)[None, :]]
        assert_close(got[2 + b], want, None, y.dtype, f"dF[{b}]")


def _inputs(op, N, dtype):
    fs = [torch.randn(op.f_shape(b), dtype=dtype).requires_grad_() for b in range(op.blocks)]
    x = torch.randn(op.i_shape(N), dtype=dtype).requires_grad_()
    eb = torch.randn(op.edge_bias_shape, dtype=dtype).requires_grad_()
    return fs, x, eb


@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: f"{len(g[0])}d-{g[4]}-s{'x'.join(map(str, g[2]))}")
@pytest.mark.parametrize("backend,equal", [("dense", False), ("grouped", True), ("dense", True)])
def test_conv_matches_the_dense_reference(geom, backend, equal):
    TRS, DHW, strides, dilates, padding = geom
    op = BlocksparseConv(random_bck(6, 9, fresh_seed(), equal=equal), TRS, DHW, strides=strides, dilates=dilates,
                         padding=padding, edge_bias=True, backend=backend)
    fs, x, eb = _inputs(op, 2, torch.float64)
    y = op(fs, x, edge_bias=eb)
    assert list(y.shape) == op.o_shape(2)
    _check(op, fs, x, eb, y, lambda xr, w: ref_conv(xr, w, list(TRS), strides, dilates, padding), False)


@pytest.mark.parametrize("geom", GEOMS, ids=lambda g: f"{len(g[0])}d-{g[4]}-s{'x'.join(map(str, g[2]))}")
@pytest.mark.parametrize("backend,equal", [("dense", False), ("grouped", True)])
def test_deconv_is_the_adjoint_of_the_conv(geom, backend, equal):
    TRS, DHW, strides, dilates, padding = geom
    fwd = BlocksparseConv([([0], [0])], TRS, DHW, strides=strides, dilates=dilates, padding=padding)
    # the deconv takes the conv's output size back to its input size
    op = BlocksparseDeconv(random_bck(6, 9, fresh_seed(), equal=equal), TRS, fwd.MPQ, MPQ=DHW, strides=strides,
                           dilates=dilates, padding=padding, edge_bias=True, backend=backend)
    assert op.o_shape(2)[2:] == list(DHW) and op.f_shape(0)[:2] == [len(op.BCK[0][0]), len(op.BCK[0][1])]
    fs, x, eb = _inputs(op, 2, torch.float64)
    y = op(fs, x, edge_bias=eb)
    assert list(y.shape) == op.o_shape(2)
    _check(op, fs, x, eb, y, lambda xr, w: ref_deconv(xr, w, list(TRS), list(DHW), strides, dilates, padding), True)


def test_grouped_deconv_with_a_stacked_filter_and_flat_l2_normalize():
    bck = [([0, 1], [0, 1, 2]), ([2, 3], [3, 4, 5]), ([0, 3], [0, 1, 2])]
    de = BlocksparseDeconv(bck, (3, 3), (4, 5), strides=(2, 2), backend="grouped")
    stacked = torch.randn(de.f_shape(), dtype=torch.float64)
    x = torch.randn(de.i_shape(2), dtype=torch.float64)
    want = ref_deconv(x, ref_filter(de, list(stacked.unbind(0)), True), [3, 3], de.MPQ, [2, 2], [1, 1], "SAME")
    torch.testing.assert_close(de(stacked, x), want.detach())
    flat = stacked.reshape(-1)
    normed_flat, normed_stacked = de.l2_normalize(flat), de.l2_normalize(stacked)     # each in its input's form
    assert normed_flat.shape == flat.shape and normed_stacked.shape == stacked.shape
    torch.testing.assert_close(normed_flat, normed_stacked.reshape(-1))
    with pytest.raises(ValueError, match="'grouped' needs blocks of one size"):
        BlocksparseConv([([0], [0, 1]), ([0, 1], [1])], (3,), (5,), backend="grouped")
    with pytest.raises(ValueError, match="MPQ: the deconv's output"):
        BlocksparseDeconv([([0], [0])], (5,), (1,), MPQ=(2,), padding="VALID")


def test_deconv_default_output_size():
    op = BlocksparseDeconv([([0, 1], [0, 1, 2])], (3, 3), (5, 4), strides=(2, 2))
    assert op.MPQ == [10, 8] and op.o_shape(3) == [3, 3, 10, 8]
    op = BlocksparseDeconv([([0], [0])], (3,), (5,), strides=(2,), padding="VALID")
    assert op.MPQ == [11]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
def test_low_precision_against_float64(dtype):
    op = BlocksparseConv(random_bck(8, 9, fresh_seed(), overlap=False), (3, 3), (8, 8), edge_bias=True,
                         backend="grouped")
    fs, x, eb = _inputs(op, 3, dtype)
    _check(op, fs, x, eb, op(fs, x, edge_bias=eb), lambda xr, w: ref_conv(xr, w, [3, 3], [1, 1], [1, 1], "SAME"), False)


def test_stacked_and_flat_filters_and_the_seeds_3d_defaults():
    bck = [([0, 1], [2, 3]), ([2, 3], [0, 1]), ([1, 2], [0, 1])]
    op = BlocksparseConv(bck, (3, 3), (6, 6), strides=(1, 1, 1), dilates=(1, 1, 1))
    assert op.f_shape() == [3, 2, 2, 3, 3] and op.fixed_block_size
    stacked = torch.randn(op.f_shape(), dtype=torch.float64)
    x = torch.randn(op.i_shape(2), dtype=torch.float64)
    y = op(stacked, x)
    torch.testing.assert_close(op(list(stacked.unbind(0)), x), y)
    torch.testing.assert_close(op(stacked.reshape(-1), x), y)
    uneven = BlocksparseConv([([0], [0, 1]), ([0, 1], [1])], (3,), (5,))
    assert uneven.f_shape() == [uneven.sizeF] and uneven.sizeF == (2 + 2) * 3


def test_grouped_path_skips_gathers_for_grouped_layouts():
    groups = [(list(range(4 * g, 4 * g + 4)), list(range(4 * g, 4 * g + 4))) for g in range(4)]
    op = BlocksparseConv(groups, (3, 3), (6, 6), backend="grouped")
    assert op._gather_plan(torch.device("cpu")) == (None, None)
    fs, x, _ = _inputs(BlocksparseConv(groups, (3, 3), (6, 6), edge_bias=True), 2, torch.float64)
    torch.testing.assert_close(op(fs, x), F.conv2d(x, torch.cat(fs), padding=1, groups=4))


def test_l2_normalize():
    bck = random_bck(6, 9, fresh_seed(), overlap=False)
    op = BlocksparseConv(bck, (3, 3), (6, 6))
    fs = [torch.randn(op.f_shape(b), dtype=torch.float64) for b in range(op.blocks)]
    for f, n in zip(op.l2_normalize(fs), fs):
        torch.testing.assert_close(f, n / n.flatten(1).norm(dim=1).view(-1, 1, 1, 1))
    op = BlocksparseConv([([0, 1], [2, 3, 4]), ([2, 3, 5], [0, 1])], (3, 3), (6, 6))     # no shared outputs
    fs = [torch.randn(op.f_shape(b), dtype=torch.float64) for b in range(op.blocks)]
    gain = torch.rand(5, dtype=torch.float64)
    out, off = op.l2_normalize(fs, gain=gain), 0
    for f, n in zip(out, fs):
        g = gain[off:off + n.shape[0]].view(-1, 1, 1, 1)
        off += n.shape[0]
        torch.testing.assert_close(f, g * n / n.flatten(1).norm(dim=1).view(-1, 1, 1, 1))
    de = BlocksparseDeconv(bck, (3, 3), (6, 6))
    fs = [torch.randn(de.f_shape(b), dtype=torch.float64) for b in range(de.blocks)]
    for f, n in zip(de.l2_normalize(fs), fs):       # per deconv output channel: dim 1
        torch.testing.assert_close(f, n / n.transpose(0, 1).flatten(1).norm(dim=1).view(1, -1, 1, 1))
    overlapping = BlocksparseConv([([0], [0]), ([1], [0])], (1,), (3,))
    with pytest.raises(ValueError, match="gain: not supported"):
        overlapping.l2_normalize([torch.ones(1, 1, 1)] * 2, gain=torch.ones(2))


def test_cwise_linear():
    x = torch.randn(2, 5, 3, 4, dtype=torch.float64, requires_grad=True)
    a = torch.randn(1, 5, 1, 1, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(cwise_linear(x, a, b), a * x + b.view(1, 5, 1, 1))
    torch.testing.assert_close(cwise_linear(x, a, b, relu=True, bias_first=True),
                               torch.relu((x + b.view(1, 5, 1, 1)) * a))
    torch.testing.assert_close(cwise_linear(x, bias=b), x + b.view(1, 5, 1, 1))
    torch.testing.assert_close(cwise_linear(x, gain=a, bias=b, relu=True), torch.relu(a * x + b.view(1, 5, 1, 1)))
    with pytest.warns(DeprecationWarning, match="gain= and bias="):
        torch.testing.assert_close(cwise_linear(x, b=b), x + b.view(1, 5, 1, 1))
    assert torch.autograd.gradcheck(lambda x, a, b: cwise_linear(x, a, b), (x, a, b))
    with pytest.raises(ValueError, match="expected gain, bias or both"):
        cwise_linear(x)
    with pytest.raises(ValueError, match="gain: expected 5 values"):
        cwise_linear(x, torch.ones(4))


@pytest.mark.parametrize("call,err,match", [
    (lambda: BlocksparseConv([([0, -1], [0])], (3,), (5,)), ValueError, "negative channel index"),
    (lambda: BlocksparseConv([([0, 0], [0])], (3,), (5,)), ValueError, "repeats a channel index"),
    (lambda: BlocksparseConv([], (3,), (5,)), ValueError, "non-empty sequence"),
    (lambda: BlocksparseConv([([0], [0])], (3,), (5,), padding="FULL"), ValueError, "padding: expected 'SAME'"),
    (lambda: BlocksparseConv([([0], [0])], (3, 3), (5,)), ValueError, "DHW: expected 2 value"),
    (lambda: BlocksparseConv([([0], [0])], (7,), (5,), padding="VALID"), ValueError, "does not fit"),
    (lambda: BlocksparseConv([([0], [0])], (3,), (5,), strides=(0,)), ValueError, "strides: expected values >= 1"),
    (lambda: BlocksparseConv([([0], [0])], (3,), (5,), MPQ=(4,)), ValueError, "MPQ: the convolution"),
    (lambda: BlocksparseDeconv([([0], [0])], (3,), (5,), strides=(2,), MPQ=(12,)), ValueError, "MPQ: a convolution"),
    (lambda: BlocksparseConv([([0], [0])], (3,), (5,), backend="cudnn"), ValueError, "backend: expected"),
])
def test_bad_construction(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_bad_calls():
    op = BlocksparseConv([([0, 1], [0]), ([2], [1])], (3,), (5,))
    fs = [torch.randn(op.f_shape(b)) for b in range(2)]
    x = torch.randn(2, 3, 5)
    with pytest.raises(ValueError, match=r"F\[1\]: expected shape \[1, 1, 3\]"):
        op([fs[0], torch.randn(1, 2, 3)], x)
    with pytest.raises(ValueError, match="F: expected 2 per-block filters"):
        op(fs[:1], x)
    with pytest.raises(ValueError, match=r"I: expected shape \(N, 3, 5\)"):
        op(fs, torch.randn(2, 4, 5))
    with pytest.raises(TypeError, match=r"F\[0\]: expected torch.float64"):
        op(fs, x.double())
    with pytest.raises(ValueError, match="built with edge_bias=False"):
        op(fs, x, edge_bias=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="edge_bias: expected a tensor on meta"):
        BlocksparseConv([([0], [0])], (3,), (5,), edge_bias=True)([torch.ones(1, 1, 3, device="meta")],
                                                                  torch.ones(1, 1, 5, device="meta"),
                                                                  edge_bias=torch.zeros(1, 2))
    with pytest.raises(ValueError, match="edge_bias: expected shape"):
        BlocksparseConv([([0], [0])], (3,), (5,), edge_bias=True)([torch.ones(1, 1, 3)], torch.ones(1, 1, 5),
                                                                  edge_bias=torch.zeros(3, 3))


def test_seed_ops_share_their_index_tables():
    """The seed ops' index tensors come from bstrain.ops.tables (family "conv_blocks"): built with
    the op, shared by equal ops, one copy per device, and uncached meta copies for shape runs."""
    bck = [([0, 1], [2, 3]), ([2, 3], [0, 1])]
    a = BlocksparseConv(bck, (3, 3), (6, 6), edge_bias=True)
    b = BlocksparseConv(bck, (3, 3), (6, 6), edge_bias=True)
    assert a._tables is b._tables and a._tables.family == "conv_blocks"
    cpu = torch.device("cpu")
    assert a._dense_index(cpu)[0] is b._dense_index(cpu)[0]           # no per-call rebuild
    assert BlocksparseDeconv(bck, (3, 3), (6, 6))._tables is not a._tables
    fs = torch.randn(a.f_shape(), device="meta")
    assert a.dense_filter(fs).shape == (4, 4, 3, 3)
    assert a(fs, torch.empty(2, 4, 6, 6, device="meta")).shape == (2, 4, 6, 6)
