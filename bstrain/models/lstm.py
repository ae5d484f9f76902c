"""Byte-level multiplicative LSTM with deep updates and block-sparse recurrent weights.

The seed's recipe (Gray, Radford & Kingma, "GPU kernels for block-sparse weights", 2017):
per timestep t, with x_t the embedded byte and h the previous hidden state,

    m      = LN(x_t·W_xm) ⊙ LN(h·W_hm)                   multiplicative input
    m      = ReLU(LN(m·W_d))  for d = 1 .. depth-1        deep updates (internal steps)
    gates  = x_t·W_xg + LN4(m·W_mg)                       LN4: layer norm per gate segment
    c, h   = fused_lstm_gates(c, gates)                   gate order i, u, f, o

All recurrent matrices (W_hm, W_d, W_mg) are block-sparse on small-world layouts, or dense
``nn.Linear`` when ``sparse=False`` (the same code otherwise). Layer norm follows each recurrent
matmul unless ``layer_norm=False``. The input projections are dense (the input is small).

On CUDA a step launches one kernel per line above: the first line is layer_norm's fused ``mul``,
the last two are :func:`bstrain.ops.lstm_cell.fused_lstm_cell`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bstrain import layout as layouts
from bstrain.nn import BlockSparseLinear, block_sparse_layouts
from bstrain.ops import ew, norms
from bstrain.ops.embed import embedding_lookup
from bstrain.ops.grouping import param_grad_group
from bstrain.ops.lstm_cell import fused_lstm_cell

VOCAB = 256


class Layout(str, Enum):
    """Layout families of the recurrent weights."""
    barabasi_albert = "barabasi_albert"
    watts_strogatz = "watts_strogatz"
    random = "random"


class Init(str, Enum):
    """Init of the square recurrent weights."""
    identity = "identity"
    uniform = "uniform"


@dataclass
class LSTMConfig:
    """Constructor arguments of :class:`SparseLSTM` (the ``model/lstm`` config's keys)."""
    hidden: int = field(default=256, metadata={"help": "hidden units H"})
    embed: int = field(default=64, metadata={"help": "byte embedding width"})
    depth: int = field(default=2, metadata={"help": "internal steps per timestep (deep updates), >= 1"})
    sparse: bool = field(default=True, metadata={"help": "block-sparse recurrent weights; false: dense nn.Linear"})
    block_size: int = field(default=32, metadata={"help": "block size of the sparse weights: 8-128"})
    density: float = field(default=0.4, metadata={"help": "fraction of live blocks of the recurrent weights"})
    layout: Layout = field(default=Layout.random, metadata={
        "help": "random (exact density, diagonal included) | barabasi_albert | watts_strogatz (small-world "
                "graphs, whose density is only approximately the requested one)"})
    layout_seed: int = field(default=0, metadata={"help": "seed of the layouts"})
    layer_norm: bool = field(default=True, metadata={"help": "layer norm after each recurrent matmul"})
    init: Init = field(default=Init.identity, metadata={"help": "identity | uniform: init of square recurrent "
                                                                 "weights"})


def _random_with_diagonal(n: int, density: float, seed: int) -> np.ndarray:
    """Exactly max(n, round(density·n²)) live blocks: the diagonal, the rest uniform off it."""
    lay = np.eye(n, dtype=bool)
    extra = int(round(density * n * n)) - n
    if extra > 0:
        off = np.flatnonzero(~lay.ravel())
        lay.ravel()[np.random.default_rng(seed).choice(off, size=min(extra, len(off)), replace=False)] = True
    return lay


def small_world_layout(n: int, density: float, kind: str, seed: int) -> np.ndarray:
    """(n, n) layout with ``density`` live blocks, the diagonal (self-loops) included.

    ``random`` gives the requested count exactly (at least the diagonal: density >= 1/n).
    ``barabasi_albert`` and ``watts_strogatz`` are graphs whose density is set by an integer
    degree, so they only approach the request; a realised density more than 25% away from it
    warns, naming both and the fix.
    """
    kind = getattr(kind, "value", kind)
    layouts.check_density(density)
    if kind == "random":                        # any n: the diagonal, then the rest at random
        lay = _random_with_diagonal(n, density, seed)
    elif kind not in ("barabasi_albert", "watts_strogatz"):
        raise ValueError(f"model.layout: expected barabasi_albert, watts_strogatz or random, got {kind!r}")
    elif n < 4:                                 # too few blocks for a graph: use them all
        lay = layouts.dense((n, n))
    elif kind == "barabasi_albert":
        m = int(np.clip(round((density * n - 1) / 2), 1, n - 1))       # ~2m links + self per row
        lay = layouts.barabasi_albert(n, m, seed=seed)
    else:
        k = int(np.clip(2 * round((density * n - 1) / 2), 2, n - 1 - (n - 1) % 2))
        lay = layouts.watts_strogatz(n, k, 0.1, seed=seed)
    real = float(lay.mean())
    if abs(real - density) > 0.25 * density:
        warnings.warn(f"model.density: asked for {density:g}, but the {kind} layout of {n}x{n} blocks has density "
                      f"{real:.3f} ({_why_not(kind, n)}); {_fix(kind, n)}", stacklevel=2)
    return lay


def _why_not(kind: str, n: int) -> str:
    if kind == "random":
        return f"it keeps the diagonal: at least 1/{n}"
    return "too few blocks for a graph: all live" if n < 4 else "a graph's density follows from its integer degree"


def _fix(kind: str, n: int) -> str:
    """What gives the requested density: more blocks, or (for a graph) the random layout."""
    more = f"more blocks per side than {n} (a larger model.hidden or a smaller model.block_size)"
    return f"ask for {more}" if kind == "random" else f"model.layout=random gives it down to 1/{n}, or ask for {more}"


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype; no call at all when it is already (an eager .to costs microseconds of host time)."""
    return x if x.dtype == dtype else x.to(dtype)


def shared_cast(param: torch.Tensor, dtype: torch.dtype):
    """A per-timestep accessor of ``param`` in ``dtype`` whose timestep gradients are summed in fp32.

    Each use casts anew (``.to``, whose backward hands the use's gradient to the fp32 parameter):
    one cast node shared by all timesteps would sum their gradients in bf16 first. Only the
    PyTorch path uses it (on CUDA the kernels take the fp32 parameters as they are), where a small
    cast costs less host time than an autograd.Function that views a copy cast once.
    """
    if param.dtype == dtype:
        return lambda: param
    return lambda: param.to(dtype)


class _Norm(nn.Module):
    """Layer norm over features (optionally per segment), casting its params to x's dtype."""

    def __init__(self, features: int, segments: int = 1, enabled: bool = True, relu: bool = False):
        super().__init__()
        self.enabled, self.segments, self.relu = enabled, segments, relu
        self.g = nn.Parameter(torch.ones(features)) if enabled else None
        self.b = nn.Parameter(torch.zeros(features)) if enabled else None

    def reset_parameters(self) -> None:
        if self.enabled:
            with torch.no_grad():
                self.g.fill_(1.0)
                self.b.zero_()

    def cast(self, dtype: torch.dtype, device: torch.device):
        """(g, b) accessors in ``dtype``, their timestep gradients summed in fp32 (:func:`shared_cast`). None on
        CUDA, where the layer-norm kernel takes the fp32 parameters with 16-bit x as they are
        (fp32 math, fp32 dg/db: nothing to cast either way)."""
        if not self.enabled or device.type == "cuda":
            return None
        return shared_cast(self.g, dtype), shared_cast(self.b, dtype)

    def forward(self, x: torch.Tensor, params=None) -> torch.Tensor:
        if not self.enabled:
            return torch.relu(x) if self.relu else x
        if x.is_cuda:                # the kernel path: fp32 params, x's dtype out, autocast does not apply
            return norms.layer_norm(x, self.g, self.b, axis=1, relu=self.relu, segments=self.segments)
        if params is None:
            g, b = self.g.to(x.dtype), self.b.to(x.dtype)
        else:
            g, b = params[0](), params[1]()
        # in x's dtype: autocast would run torch's layer norm in fp32 and return fp32, adding casts
        with torch.autocast(x.device.type, enabled=False):
            return norms.layer_norm(x, g, b, axis=1, relu=self.relu, segments=self.segments)


class SparseLSTM(nn.Module):
    """mLSTM language model over bytes. forward(x (B, T) int64, state) -> (logits (B, T, 256), state).

    ``SparseLSTM(hidden=..., density=...)`` with :class:`LSTMConfig`'s keys as keyword arguments
    (or ``SparseLSTM(LSTMConfig(...))``). A stateful model in the trainer's sense: it has
    ``init_state(batch_size, device)`` and carries (c, h) from batch to batch.
    """

    def __init__(self, config: LSTMConfig | None = None, **kwargs):
        super().__init__()
        names = {f.name for f in dataclasses.fields(LSTMConfig)}
        if unknown := sorted(set(kwargs) - names):
            raise TypeError(f"SparseLSTM: unexpected argument {unknown[0]!r}; expected some of "
                            f"{', '.join(sorted(names))}")
        cfg = dataclasses.replace(config or LSTMConfig(), **kwargs)
        try:
            cfg.layout = Layout(getattr(cfg.layout, "value", cfg.layout))
            cfg.init = Init(getattr(cfg.init, "value", cfg.init))
        except ValueError:
            raise ValueError(f"model.layout, model.init: expected one of {[k.value for k in Layout]} and one of "
                             f"{[k.value for k in Init]}, got {cfg.layout!r}, {cfg.init!r}") from None
        if cfg.depth < 1 or cfg.hidden % cfg.block_size:
            raise ValueError(f"model: expected depth >= 1 and hidden a multiple of block_size, got "
                             f"depth={cfg.depth}, hidden={cfg.hidden}, block_size={cfg.block_size}")
        self.cfg = cfg
        H, E = cfg.hidden, cfg.embed
        self.embedding = nn.Parameter(torch.randn(VOCAB, E) * 0.1)
        self.w_x = nn.Linear(E, 5 * H, bias=False)                    # -> x·W_xm (H) and x·W_xg (4H)
        self.w_hm = self._recurrent(H, H, 0, square=True)
        self.deep = nn.ModuleList(self._recurrent(H, H, d, square=True) for d in range(1, cfg.depth))
        self.w_mg = self._recurrent(H, 4 * H, cfg.depth, square=False)
        ln = cfg.layer_norm
        self.norm_xm, self.norm_hm = _Norm(H, enabled=ln), _Norm(H, enabled=ln)
        self.norm_deep = nn.ModuleList(_Norm(H, enabled=ln, relu=True) for _ in range(1, cfg.depth))
        self.norm_gates = _Norm(4 * H, segments=4, enabled=ln)
        self.gate_bias = nn.Parameter(torch.zeros(4 * H))
        self.head = nn.Linear(H, VOCAB)
        # on the kernel path (CUDA), fuse each step's layer norms with their neighbours (_fused_steps);
        # False runs the same math op by op (tests and benchmarks compare the two)
        self.fused = True

    def _recurrent(self, fan_in: int, fan_out: int, index: int, square: bool) -> nn.Module:
        cfg = self.cfg
        if not cfg.sparse:
            dense = nn.Linear(fan_in, fan_out, bias=False)
            if square and cfg.init == Init.identity:
                nn.init.eye_(dense.weight)
            return dense
        n = fan_in // cfg.block_size
        lay = small_world_layout(n, cfg.density, cfg.layout, cfg.layout_seed + index)
        if not square:
            lay = np.tile(lay, (1, fan_out // fan_in))                  # same pattern for each gate
        layer = BlockSparseLinear(fan_in, fan_out, layout=lay, block_size=cfg.block_size, bias=False)
        if square and cfg.init == Init.identity:
            with torch.no_grad():
                layer.weight.copy_(layer.op.identity_init())
        return layer

    def reset_parameters(self) -> None:
        """Initialises every parameter as the constructor does: for a model built on the meta
        device and then given memory with ``to_empty(device=...)``."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()
        with torch.no_grad():
            self.embedding.normal_(0.0, 0.1)
            self.gate_bias.zero_()
            if self.cfg.init == Init.identity:
                for layer in (self.w_hm, *self.deep):
                    if isinstance(layer, BlockSparseLinear):
                        layer.weight.copy_(layer.op.identity_init())
                    else:
                        nn.init.eye_(layer.weight)

    def sparse_layers(self) -> list[BlockSparseLinear]:
        return [m for m in self.modules() if isinstance(m, BlockSparseLinear)]

    def shard_units(self) -> list[nn.Module]:
        """No blocks of its own for FSDP (``trainer.strategy=fsdp``): the recurrent layers run at every
        timestep, and a unit of each would gather its weight and reduce its gradient once per
        timestep; the whole model is one unit (gathered once a step, reduced once)."""
        return []

    def block_sparse_layouts(self) -> dict[str, np.ndarray]:
        """{layer name: (C/bs, K/bs) layout}: shown in the run header and TensorBoard."""
        return dict(block_sparse_layouts(self))

    def init_state(self, batch_size: int, device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.zeros(batch_size, self.cfg.hidden, device=device, dtype=dtype)
        return z, z.clone()

    def forward(self, x: torch.Tensor, state=None):
        """x: (B, T) bytes; state: (c, h) each (B, H) or None. Returns logits (B, T, 256), (c, h).

        Each recurrent weight's dW is computed for ``group_size`` timesteps per launch, as
        :func:`bstrain.nn.set_grad_group` set it (the trainer: ``trainer.group_size``).
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype.is_floating_point or x.dtype.is_complex:
            raise ValueError(f"x: expected a (batch, time) tensor of byte ids, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}"
                             f"{' of ' + str(x.dtype) if isinstance(x, torch.Tensor) else ''}")
        B, T = x.shape
        H = self.cfg.hidden
        if state is not None and (len(state) != 2 or any(s.shape != (B, H) for s in state)):
            raise ValueError(f"state: expected (c, h), each ({B}, {H}) for this batch, got "
                             f"{[tuple(s.shape) for s in state] if isinstance(state, (tuple, list)) else state!r}")
        # time-major (T, B, .) so that every per-timestep slice below is contiguous
        emb = embedding_lookup(self.embedding, x.t())                       # (T, B, E)
        if torch.is_autocast_enabled(x.device.type):
            emb = emb.to(torch.get_autocast_dtype(x.device.type))
        w_x = self.w_x.weight                                               # (5H, E): rows [:H] -> m, [H:] -> gates
        xm = F.linear(emb, w_x[:H])                                         # (T, B, H)
        xg = F.linear(emb, w_x[H:])                                         # (T, B, 4H)
        dt = xg.dtype
        c, h = state if state is not None else self.init_state(B, x.device, dt)
        c, h = c.to(dt), h.to(dt)
        xm = self.norm_xm(xm.reshape(T * B, H)).reshape(T, B, H)           # no recurrence: all T at once
        # per-timestep views by unbind: its backward stacks the T gradients once, where indexing
        # [t] would build and add a full-size gradient at every timestep
        xm_t, xg_t = xm.unbind(0), xg.unbind(0)
        outputs = []
        with contextlib.ExitStack() as stack:
            for layer in self.sparse_layers():
                stack.enter_context(layer.grad_group())
            steps = self._fused_steps if self.fused and self.cfg.layer_norm and ew.use_kernels(xg) else self._steps
            c, h = steps(xm_t, xg_t, c, h, outputs)
        hs = torch.stack(outputs)                                           # (T, B, H)
        return self.head(hs).transpose(0, 1), (c, h)                        # (B, T, 256)

    def _steps(self, xm_t, xg_t, c, h, outputs):
        """The time loop op by op (the PyTorch path; on the kernel path without layer norm, or with
        ``fused`` off). Appends each step's h to outputs; returns the last (c, h)."""
        dt, device = h.dtype, h.device
        # parameters in dt, their per-step gradients summed in fp32
        p_hm, p_gates = self.norm_hm.cast(dt, device), self.norm_gates.cast(dt, device)
        p_deep = [norm.cast(dt, device) for norm in self.norm_deep]
        # the gates kernel adds an fp32 bias to 16-bit gates as it is
        bias = (lambda: self.gate_bias) if device.type == "cuda" else shared_cast(self.gate_bias, dt)
        for t in range(len(xm_t)):
            m = xm_t[t] * self.norm_hm(_as(self.w_hm(h), dt), p_hm)                   # (B, H)
            for w_d, norm, p in zip(self.deep, self.norm_deep, p_deep):
                m = norm(_as(w_d(m), dt), p)
            gates = xg_t[t] + self.norm_gates(_as(self.w_mg(m), dt), p_gates)        # (B, 4H)
            c, h = ew.fused_lstm_gates(c, gates, bias=bias())
            outputs.append(h)
        return c, h

    def _fused_steps(self, xm_t, xg_t, c, h, outputs):
        """The kernel path's time loop, one launch each way per matmul, per LN(h·W_hm)·xm (layer_norm's
        mul), per deep update's LN + ReLU and per LN4 + input add + gates (fused_lstm_cell): six a
        step forward at depth 2. The layer-norm parameters and the gate bias take their gradients
        once a sequence (ParamGradGroup): no per-step reduction or accumulation launches in
        backward. The matmul outputs are in h's dtype already (the autocast dtype, or the model's)."""
        hm, cell = self.norm_hm, self.norm_gates
        g_hm = param_grad_group(hm.g, hm.b)
        g_cell = param_grad_group(cell.g, cell.b, self.gate_bias, rows=(0, 1, 1))
        deep = [(w_d, norm.g, norm.b, param_grad_group(norm.g, norm.b)) for w_d, norm in zip(self.deep, self.norm_deep)]
        for t in range(len(xm_t)):
            m = norms.layer_norm(self.w_hm(h), hm.g, hm.b, mul=xm_t[t], grad_group=g_hm)      # (B, H)
            for w_d, g, b, group in deep:
                m = norms.layer_norm(w_d(m), g, b, relu=True, grad_group=group)
            c, h = fused_lstm_cell(c, self.w_mg(m), xg_t[t], cell.g, cell.b, self.gate_bias, grad_group=g_cell)
            outputs.append(h)
        return c, h

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
