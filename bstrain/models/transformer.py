"""A byte-level transformer language model with block-sparse attention.

Pre-LayerNorm blocks: ``h = h + attn(LN(h))``, ``h = h + ffn(LN(h))``. The attention of each layer
is a :class:`bstrain.nn.BlockSparseAttention` on a causal pattern from :mod:`bstrain.layout`
(causal, local, Sparse Transformer strided or fixed), chosen per layer and, optionally, per head;
the FFN weights may be block-sparse (:class:`BlockSparseLinear`). Positions are learned or
rotary. A stateless model in the trainer's sense: ``forward(x (B, T) int64) -> (B, T, 256)``.

``checkpoint=True`` checkpoints each block's activations (:func:`torch.utils.checkpoint.checkpoint`,
non-reentrant) while autograd records: a block keeps only its inputs, and the backward runs its
forward once more. Dropout inside a block draws the same masks again (the RNG state is saved
and restored around the recompute).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:                  # a torch built without torch.distributed: nothing is ever sharded
    FSDPModule = ()
from torch.utils.checkpoint import checkpoint

from bstrain import layout as layouts
from bstrain.layout import KERNEL_BLOCK_SIZES
from bstrain.nn import BlockSparseAttention, BlockSparseLinear, block_sparse_layouts
from bstrain.ops.bias_act import bias_gelu
from bstrain.ops.residual_norm import add_layer_norm
from bstrain.ops.rotary import apply_rotary, rotary_tables

VOCAB = 256
PATTERNS = ("causal", "local", "strided", "fixed", "dense")


class Positions(str, Enum):
    learned = "learned"
    rotary = "rotary"


class Backend(str, Enum):
    auto = "auto"
    torch = "torch"
    triton = "triton"


@dataclass
class TransformerConfig:
    """Constructor arguments of :class:`SparseTransformer` (the ``model/transformer`` config's keys)."""
    d_model: int = field(default=256, metadata={"help": "width"})
    n_layer: int = field(default=4, metadata={"help": "blocks"})
    n_head: int = field(default=4, metadata={"help": "attention heads (d_model / n_head = head dim)"})
    context: int = field(default=256, metadata={"help": "longest input, in bytes"})
    block_size: int = field(default=32, metadata={"help": "attention block size: 16, 32, 64 or 128"})
    attention: str = field(default="strided", metadata={
        "help": "causal | local | strided | fixed | dense; a comma-separated list is cycled over the layers, "
                "and patterns joined by + inside one entry over the heads (strided+fixed). dense: causal "
                "attention through F.scaled_dot_product_attention, the dense baseline"})
    window: int = field(default=64, metadata={"help": "local: window; strided/fixed: stride (positions)"})
    summary: int = field(default=8, metadata={"help": "fixed: summary positions at the end of each stride"})
    positions: Positions = field(default=Positions.learned, metadata={"help": "learned | rotary"})
    ffn_mult: int = field(default=4, metadata={"help": "FFN width / d_model"})
    ffn_density: float = field(default=1.0, metadata={"help": "< 1: block-sparse FFN weights of this density"})
    ffn_block_size: int = field(default=32, metadata={"help": "block size of sparse FFN weights"})
    layout_seed: int = field(default=0, metadata={"help": "seed of the sparse FFN layouts"})
    backend: Backend = field(default=Backend.auto, metadata={
        "help": "attention backend: auto (the fused kernels on CUDA, PyTorch on CPU) | torch | triton"})
    fused: bool = field(default=True, metadata={
        "help": "fused glue: the stream in the autocast dtype, residual add + layer norm in one op, rotary on "
                "q and k in one op from cached tables (kernels on CUDA); false: plain PyTorch modules"})
    dropout: float = field(default=0.0, metadata={
        "help": "residual dropout while training, in [0, 1): on the embeddings and on each sublayer's output before "
                "it joins the stream (none on the attention probabilities)"})
    checkpoint: bool = field(default=False, metadata={
        "help": "activation checkpointing while training: each block keeps only its inputs and runs its forward "
                "again in the backward (one more forward per block, about a third more compute, for a fraction "
                "of the activation memory)"})


def pattern_mask(name: str, window: int, summary: int):
    """The element mask function of a causal attention pattern; ``"a+b"``: head h takes pattern
    h mod 2 (any number of patterns), a FlexAttention ``mask_mod`` too."""
    fns = [_one_pattern(p, window, summary) for p in name.split("+")]
    if len(fns) == 1:
        return fns[0]

    def per_head(b, h, q_idx, k_idx):
        out = fns[0](b, h, q_idx, k_idx)
        for n, fn in enumerate(fns[1:], 1):
            out = torch.where(h % len(fns) == n, fn(b, h, q_idx, k_idx), out)
        return out
    return per_head


def _one_pattern(name: str, window: int, summary: int):
    if name == "causal":
        return layouts.causal_mask
    if name == "local":
        return layouts.local_mask(window)
    if name == "strided":
        return layouts.strided_mask(window)
    return layouts.fixed_mask(window, summary)


@functools.lru_cache(maxsize=16)
def _pattern_layout(pattern: str, window: int, summary: int, context: int, block_size: int, heads: int | None):
    """(layout, mask_callback) of a pattern at the full context (:func:`bstrain.layout.attention_layout`).
    The mask is evaluated element by element, seconds per layer at a 32k context, so the layers
    (and models) that share a pattern evaluate it once; each module takes a copy of the layout."""
    return layouts.attention_layout(pattern_mask(pattern, window, summary), context, context, block_size, heads=heads)


def rotary(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Rotary position embedding of (B, T, heads·D) activations, per head (D even), recomputed per
    call in fp32: the unfused path (``fused=False``); the fused one is :func:`bstrain.ops.rotary.apply_rotary`."""
    B, T, HD = x.shape
    D = HD // heads
    half = D // 2
    inv = 1.0 / (10000 ** (torch.arange(half, device=x.device, dtype=torch.float32) / half))
    ang = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * inv[None, :]     # (T, half)
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    xh = x.float().view(B, T, heads, D)
    a, b = xh[..., :half], xh[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).view(B, T, HD).to(x.dtype)


class SparseSelfAttention(nn.Module):
    """Causal block-sparse self-attention on one pattern (``attention``, a
    :class:`BlockSparseAttention` over the full context, built once with the module), or dense
    causal attention through SDPA for the pattern "dense"."""

    def __init__(self, cfg: TransformerConfig, pattern: str):
        super().__init__()
        d = cfg.d_model
        self.cfg, self.pattern = cfg, pattern
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.attention = None
        if pattern == "dense":
            return
        if "dense" in pattern.split("+"):
            raise ValueError(f"model.attention: 'dense' takes a whole layer, got {pattern!r}")
        per_head = "+" in pattern
        lay, mask_callback = _pattern_layout(pattern, cfg.window, cfg.summary, cfg.context, cfg.block_size,
                                             cfg.n_head if per_head else None)
        self.attention = BlockSparseAttention(lay.copy(), cfg.block_size, heads=None if per_head else cfg.n_head,
                                              mask_callback=mask_callback, backend=_value(cfg.backend))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(self.attend(h))

    def attend(self, h: torch.Tensor) -> torch.Tensor:
        """The heads' outputs (B, T, d), before the output projection."""
        cfg = self.cfg
        if _value(cfg.positions) == "rotary" and cfg.fused:    # q and k turned in one op, with the bias
            D = cfg.d_model // cfg.n_head
            cos, sin = rotary_tables(cfg.context, D, h.device)
            qkv = apply_rotary(F.linear(h, self.qkv.weight), cos, sin, D, rotated=2 * cfg.n_head, bias=self.qkv.bias,
                               backend=_value(cfg.backend))                # (B, T, 3·d)
        else:
            qkv = self.qkv(h)
        q, k, v = qkv.chunk(3, dim=-1)
        if _value(cfg.positions) == "rotary" and not cfg.fused:
            q, k = rotary(q, cfg.n_head), rotary(k, cfg.n_head)
        if self.attention is None:
            B, T, _ = q.shape
            qh, kh, vh = (t.view(B, T, self.cfg.n_head, -1).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
            return out.transpose(1, 2).reshape(B, T, -1)
        return self.attention(q, k, v)


class Block(nn.Module):
    """A pre-LN block. ``forward(h, r, c) -> (h', r', c')``: the residual stream is h + r + c, where r
    is the output of the sublayer before and c its projection's bias, not yet added (None at the
    first block), so that the adds run fused with the next layer norm (``cfg.fused``; then the
    dense projections run bias-free and their biases ride in the fused ops)."""

    def __init__(self, cfg: TransformerConfig, pattern: str, index: int):
        super().__init__()
        d, f = cfg.d_model, cfg.ffn_mult * cfg.d_model
        self.fused, self.backend, self.dropout = cfg.fused, _value(cfg.backend), cfg.dropout
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SparseSelfAttention(cfg, pattern)
        if cfg.ffn_density < 1:
            kw = dict(block_size=cfg.ffn_block_size, density=cfg.ffn_density)
            self.fc1 = BlockSparseLinear(d, f, seed=cfg.layout_seed + 2 * index, **kw)
            self.fc2 = BlockSparseLinear(f, d, seed=cfg.layout_seed + 2 * index + 1, **kw)
        else:
            self.fc1, self.fc2 = nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, h: torch.Tensor, r: torch.Tensor | None = None, c: torch.Tensor | None = None):
        if not self.fused:
            h = h if r is None else h + r
            h = h + self.drop(self.attn(self.ln1(h)), None)[0]
            return h, self.drop(self.fc2(F.gelu(self.fc1(self.ln2(h)))), None)[0], None
        y, h = add_layer_norm(h, r, self.ln1.weight, self.ln1.bias, self.ln1.eps, residual_bias=c,
                              backend=self.backend)
        proj = self.attn.proj
        a, a_bias = self.drop(F.linear(self.attn.attend(y), proj.weight), proj.bias)      # (B, T, d)
        y, h = add_layer_norm(h, a, self.ln2.weight, self.ln2.bias, self.ln2.eps, residual_bias=a_bias,
                              backend=self.backend)
        if isinstance(self.fc1, BlockSparseLinear):
            f = F.gelu(self.fc1(y))
        else:                                                      # the bias rides into the GELU
            f = bias_gelu(F.linear(y, self.fc1.weight), self.fc1.bias, backend=self.backend)
        if isinstance(self.fc2, BlockSparseLinear):
            return h, *self.drop(self.fc2(f), None)
        r, c = self.drop(F.linear(f, self.fc2.weight), self.fc2.bias)
        if c is not None and isinstance(self, FSDPModule):
            c = c.clone()       # the next block adds it, after FSDP has freed this block's gathered parameters
        return h, r, c

    def drop(self, r: torch.Tensor, c: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Residual dropout of a sublayer's output r (B, T, d) while training; its bias c, not yet
        added, joins it first. Returns (r', c'), as they enter the stream."""
        if not (self.dropout and self.training):
            return r, c
        return F.dropout(r if c is None else r + c.to(r.dtype), self.dropout, training=True), None


def _value(v):
    return getattr(v, "value", v)


class SparseTransformer(nn.Module):
    """Byte-level transformer LM: ``forward(x (B, T) int64) -> logits (B, T, 256)``, T <= context.

    ``SparseTransformer(d_model=..., attention="strided,fixed", ...)`` with
    :class:`TransformerConfig`'s keys as keyword arguments (or ``SparseTransformer(config)``).
    """

    def __init__(self, config: TransformerConfig | None = None, **kwargs):
        super().__init__()
        names = {f.name for f in dataclasses.fields(TransformerConfig)}
        if unknown := sorted(set(kwargs) - names):
            raise TypeError(f"SparseTransformer: unexpected argument {unknown[0]!r}; expected some of "
                            f"{', '.join(sorted(names))}")
        cfg = dataclasses.replace(config or TransformerConfig(), **kwargs)
        self.cfg = cfg = self._check(cfg)
        self.patterns = ["+".join(p.strip() for p in entry.split("+")) for entry in cfg.attention.split(",")]
        d = cfg.d_model
        self.embed = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.zeros(cfg.context, d)) if cfg.positions == Positions.learned else None
        self.blocks = nn.ModuleList(Block(cfg, self.patterns[i % len(self.patterns)], i) for i in range(cfg.n_layer))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)
        self._init_weights()
        self._warm_rotary()

    def _init_weights(self) -> None:
        with torch.no_grad():
            nn.init.normal_(self.embed.weight, std=0.02)
            if self.pos is not None:
                nn.init.normal_(self.pos, std=0.02)
            for blk in self.blocks:            # residual projections scaled down with depth (GPT-2)
                blk.attn.proj.weight.mul_(1 / math.sqrt(2 * self.cfg.n_layer))

    def reset_parameters(self) -> None:
        """Initialises every parameter as the constructor does: for a model built on the meta
        device and then given memory with ``to_empty(device=...)``."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()
        self._init_weights()

    def _warm_rotary(self) -> None:
        """Makes the rotary tables of this model's device now (they are cached per device), so that
        a forward never builds them: not even the first one traced by torch.compile, which would
        otherwise compute them inside the graph at every step."""
        dev = self.head.weight.device
        if self.cfg.positions == Positions.rotary and self.cfg.fused and dev.type != "meta":
            rotary_tables(self.cfg.context, self.cfg.d_model // self.cfg.n_head, dev)

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)                 # .to(), .cuda(), to_empty(): tables follow once
        self._warm_rotary()
        return out

    @staticmethod
    def _check(cfg: TransformerConfig) -> TransformerConfig:
        try:
            cfg.positions = Positions(_value(cfg.positions))
            cfg.backend = Backend(_value(cfg.backend))
        except ValueError:
            raise ValueError(f"model.positions, model.backend: expected one of {[p.value for p in Positions]} and "
                             f"one of {[b.value for b in Backend]}, got {cfg.positions!r}, {cfg.backend!r}") from None
        bad = [p for entry in cfg.attention.split(",") for p in entry.split("+") if p.strip() not in PATTERNS]
        if bad or not cfg.attention.strip():
            raise ValueError(f"model.attention: expected one of {PATTERNS} or a comma-separated list of them, "
                             f"got {cfg.attention!r}")
        for name in ("d_model", "n_layer", "n_head", "context", "window", "ffn_mult"):
            v = getattr(cfg, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model.{name}: expected a positive int, got {v!r}")
        if cfg.d_model % cfg.n_head or (cfg.positions == Positions.rotary and (cfg.d_model // cfg.n_head) % 2):
            raise ValueError(f"model.n_head: expected a divisor of d_model={cfg.d_model} giving an even head dim "
                             f"with rotary positions, got {cfg.n_head}")
        if cfg.block_size not in KERNEL_BLOCK_SIZES or cfg.context % cfg.block_size:
            raise ValueError(f"model.block_size: expected 16, 32, 64 or 128 dividing context={cfg.context}, got "
                             f"{cfg.block_size}")
        if not 0 < cfg.ffn_density <= 1:
            raise ValueError(f"model.ffn_density: expected a fraction in (0, 1], got {cfg.ffn_density}")
        if isinstance(cfg.dropout, bool) or not isinstance(cfg.dropout, (int, float)) or not 0 <= cfg.dropout < 1:
            raise ValueError(f"model.dropout: expected a probability in [0, 1), got {cfg.dropout!r}")
        if not isinstance(cfg.checkpoint, bool):
            raise ValueError(f"model.checkpoint: expected true or false, got {cfg.checkpoint!r}")
        return cfg

    def shard_units(self) -> list[nn.Module]:
        """The blocks FSDP shards one by one (``trainer.strategy=fsdp``): the transformer layers."""
        return list(self.blocks)

    def block_sparse_layouts(self) -> dict[str, np.ndarray]:
        """{name: layout}: each layer's attention layout at the full context, and sparse FFN weights."""
        out = {f"blocks.{i}.attn": np.concatenate(list(blk.attn.attention.op.layout), axis=1)   # heads side by side
               if "+" in blk.attn.pattern else blk.attn.attention.op.layout[0]
               for i, blk in enumerate(self.blocks) if blk.attn.attention is not None}
        out.update(block_sparse_layouts(self))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T) byte ids, T <= context. The attention layers take shorter inputs as the first
        T positions of the context (causal: exact)."""
        B, T = x.shape
        if T > self.cfg.context or T == 0:
            raise ValueError(f"x: expected 1 to context={self.cfg.context} positions, got {T}")
        h = self.embed(x)
        if self.pos is not None:
            h = h + self.pos[:T]
        if self.cfg.dropout and self.training:
            h = F.dropout(h, self.cfg.dropout, training=True)
        if not self.cfg.fused:
            h, r, _ = self.run_blocks(h)
            return self.head(self.norm(h + r))
        dev = h.device.type
        if torch.is_autocast_enabled(dev):      # the stream in the compute dtype: no fp32 round trips
            h = h.to(torch.get_autocast_dtype(dev))
        h, r, c = self.run_blocks(h)
        y, _ = add_layer_norm(h, r, self.norm.weight, self.norm.bias, self.norm.eps, residual_bias=c,
                              backend=_value(self.cfg.backend))
        return self.head(y)

    def run_blocks(self, h: torch.Tensor):
        """The blocks on the stream h (B, T, d); returns the last block's (h, r, c).

        With ``cfg.checkpoint``, while autograd records, each block module is called inside a
        non-reentrant checkpoint: the unit of recomputation is the whole block, hooks included, so
        a block wrapped on its own (FSDP's ``fully_shard``) gathers its weights again for the
        recompute. The RNG state is saved for the replay only when the block draws random numbers
        (dropout while training); without them nothing touches the generators, so the step stays
        capturable in a CUDA graph on any torch."""
        r = c = None
        if not (self.cfg.checkpoint and torch.is_grad_enabled()):
            for blk in self.blocks:
                h, r, c = blk(h, r, c)
            return h, r, c
        draws = bool(self.cfg.dropout) and self.training
        for blk in self.blocks:
            h, r, c = checkpoint(blk, h, r, c, use_reentrant=False, preserve_rng_state=draws)
        return h, r, c

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
