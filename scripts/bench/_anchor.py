"""The plain-PyTorch anchor of ``bench_lm_anchor.py``: what a user writes instead of bstrain (issue 33),
and how its step runs at its strongest (issue 41): a GPT between the ``ANCHOR`` rulers (Flex
attention on the same element masks as bstrain's layers), the compile mode, a manual CUDA graph of the
whole step, a compiled optimizer step, Flex's block size and backend (:mod:`scripts.bench._flex`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

from scripts.bench import _flex


# ================================ ANCHOR: what a user writes instead ================================
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D); cos, sin (T, D/2): rotary positions, the halves turned (bstrain's convention)."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(x.dtype)


class AnchorBlock(nn.Module):
    def __init__(self, d: int, heads: int, ffn_mult: int, mask, kernel_options: dict | None = None):
        super().__init__()
        self.heads, self.mask = heads, mask       # a Flex BlockMask, or a (1|H, T, T) bool mask (SDPA, CPU)
        self.kernel_options = kernel_options      # Flex's: its backend (FLASH) and tiles
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, ffn_mult * d), nn.Linear(ffn_mult * d, d)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k = rope(q, cos, sin), rope(k, cos, sin)                                  # (B, H, T, D)
        if isinstance(self.mask, torch.Tensor):
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        else:
            a = flex_attention(q, k, v, block_mask=self.mask, kernel_options=self.kernel_options)
        h = h + self.proj(a.transpose(1, 2).reshape(B, T, d))
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class AnchorGPT(nn.Module):
    """Byte-level GPT: ``forward(x, y) -> mean cross-entropy``, x and y (B, T) bytes; masks cycle over layers."""

    def __init__(self, d: int, n_layer: int, heads: int, context: int, masks: list, ffn_mult: int = 4,
                 kernel_options: dict | None = None):
        super().__init__()
        self.embed = nn.Embedding(256, d)
        self.blocks = nn.ModuleList(AnchorBlock(d, heads, ffn_mult, masks[i % len(masks)], kernel_options)
                                    for i in range(n_layer))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 256)
        half = d // heads // 2
        ang = torch.arange(context, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(half).double() / half)
        self.register_buffer("cos", ang.cos().float(), persistent=False)                # (context, D/2)
        self.register_buffer("sin", ang.sin().float(), persistent=False)
        with torch.no_grad():
            nn.init.normal_(self.embed.weight, std=0.02)
            for blk in self.blocks:
                blk.proj.weight.mul_(1 / math.sqrt(2 * n_layer))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, T = self.embed(x), x.shape[1]
        for blk in self.blocks:
            h = blk(h, self.cos[:T], self.sin[:T])
        return F.cross_entropy(self.head(self.norm(h)).view(-1, 256).float(), y.view(-1))


def anchor_update(params, opt, grad_clip: float) -> None:
    """Clipping and AdamW: what ``torch.compile`` makes one fused kernel set of (``--anchor-opt compiled``)."""
    torch.nn.utils.clip_grad_norm_(params, grad_clip or math.inf)           # 0: no clipping, as bstrain
    opt.step()


def anchor_train_step(model, update, opt, x, y, amp: torch.dtype | None) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=amp, enabled=amp is not None):
        loss = model(x, y)
    loss.backward()
    update()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


class GraphedStep:
    """A whole training step replayed from one CUDA graph, as torch's docs capture a network: the
    first ``warmup`` calls run eagerly on a side stream (compilation; the first loss is a real first
    step), the next captures the step and every call replays it."""

    def __init__(self, step, warmup: int = 3):
        self.step, self.warmup, self.calls, self.graph, self.loss = step, warmup, 0, None, None
        self.stream = torch.cuda.Stream()

    def __call__(self) -> torch.Tensor:
        if self.graph is None and self.calls < self.warmup:
            self.calls += 1
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                loss = self.step()
            torch.cuda.current_stream().wait_stream(self.stream)
            return loss
        if self.graph is None:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.loss = self.step()
        self.graph.replay()
        return self.loss
# ============================================ end of ANCHOR ===========================================


def anchor_masks(m, mode: str, device: torch.device, flex_block: int, reference: bool) -> tuple[list, float]:
    """(one mask per distinct layer entry, mean live-block density over the layers). mode 'layers':
    bstrain's element masks (its pattern_mask of each layer's entry); 'window': a causal window of
    model.window on every layer. reference: (1|H, T, T) bool masks for SDPA instead of BlockMasks."""
    from bstrain import layout as layouts
    from bstrain.models.transformer import pattern_mask
    T = m.context
    entries = [e.strip() for e in m.attention.split(",")] if mode == "layers" else ["window"]
    masks, dens = [], []
    for entry in entries:
        fn = layouts.local_mask(m.window) if entry == "window" else pattern_mask(entry, m.window, m.summary)
        heads = m.n_head if "+" in entry else None
        bm = create_block_mask(fn, None, heads, T, T, device=device, BLOCK_SIZE=flex_block)
        dens.append(1 - bm.sparsity() / 100)
        masks.append(create_mask(fn, 1, heads or 1, T, T, device=device)[0] if reference else bm)
    per_layer = [dens[i % len(dens)] for i in range(m.n_layer)]
    return masks, sum(per_layer) / len(per_layer)


CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")      # torch.compile modes that CUDA-graph by themselves


def anchor_choices(args, device) -> dict:
    """How the anchor's step runs, from --compile, --anchor-graph and --anchor-opt (recorded in every
    anchor row). A manual graph of the whole step needs a compile mode that does not graph itself."""
    cuda = device.type == "cuda"
    compile_mode = args.compile or None
    graph = args.anchor_graph
    if graph == "auto":
        graph = "on" if cuda and compile_mode not in CUDAGRAPH_MODES else "off"
    if graph == "on" and compile_mode in CUDAGRAPH_MODES:
        raise ValueError(f"--anchor-graph on: --compile {compile_mode} CUDA-graphs by itself; use "
                         "--compile max-autotune-no-cudagraphs with a graph of the whole step, or --anchor-graph off")
    if graph == "on" and not cuda:
        graph = "off (CPU)"
    compiled_opt = args.anchor_opt == "compiled" and compile_mode is not None
    adamw = "AdamW fused, capturable" if cuda else "AdamW foreach"
    shown = ("manual CUDA graph of the whole step" if graph == "on" else
             "torch.compile's CUDA graphs" if cuda and compile_mode in CUDAGRAPH_MODES else f"no graph ({graph})")
    return {"compile": compile_mode or "none", "graph": shown,
            "optimizer": f"torch.compile(clip + {adamw})" if compiled_opt else f"eager clip + {adamw}",
            "_graph": graph == "on", "_compiled_opt": compiled_opt}


def make_anchor(cfg, mode: str, flex_block: int, backend: str, device, x, y, args):
    """(step(), info) of the anchor at cfg's model shape, precision and optimizer settings, run as
    :func:`anchor_choices` says. On the CPU its attention is SDPA with the dense mask (Flex has no
    backward there)."""
    from bstrain.configs.schema import Precision
    m, o = cfg.model, cfg.optim
    amp = Precision(cfg.trainer.precision).dtype
    if amp == torch.float16:
        raise ValueError("the anchor runs bf16 or fp32 (fp16 would need a GradScaler)")
    if m.get("dropout", 0) or m.get("checkpoint", False) or m.get("ffn_density", 1.0) < 1 or m.positions != "rotary":
        raise ValueError("the anchor has rotary positions, a dense FFN, no dropout and no activation checkpointing: "
                         "compare it at those settings")
    cuda = device.type == "cuda"
    how = anchor_choices(args, device)
    masks, density = anchor_masks(m, mode, device, flex_block, reference=not cuda)
    flex = _flex.describe(flex_block, backend, how["compile"]) if cuda else {}
    torch.manual_seed(cfg.trainer.seed)
    model = AnchorGPT(m.d_model, m.n_layer, m.n_head, m.context, masks, m.ffn_mult,
                      kernel_options=flex.get("flex_kernel_options")).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True if cuda else None,
                            foreach=None if cuda else True, capturable=cuda)
    compile_mode = None if how["compile"] == "none" else how["compile"]
    net = torch.compile(model, mode=None if compile_mode == "default" else compile_mode) if compile_mode else model
    params = list(model.parameters())
    update = lambda: anchor_update(params, opt, o.grad_clip)            # noqa: E731
    choices = {k: v for k, v in how.items() if not k.startswith("_")} | flex
    if how["_compiled_opt"]:
        update = CompiledOrEager(update, compile_mode, choices)
    step = lambda: anchor_train_step(net, update, opt, x, y, amp)         # noqa: E731
    if how["_graph"]:
        step = GraphedStep(step)
    what = f"{m.attention} w{m.window} s{m.summary}" if mode == "layers" else f"window {m.window}"
    info = {"model": anchor_name(mode, flex_block, backend), "mode": mode, "anchor": choices,
            "attention": f"Flex {backend}, {what}" if cuda else f"SDPA + dense mask, {what} (CPU)",
            "block_size": flex_block, "live_block_density": density, "params": sum(p.numel() for p in params),
            "module": model}
    return step, info


class CompiledOrEager:
    """The update under torch.compile; where its first call fails to compile (Dynamo refusing the
    fused optimizer, say) the eager update instead, and ``choices["optimizer"]`` says so: the anchor
    is measured all the same, and the row records how."""

    def __init__(self, update, mode: str | None, choices: dict):
        self.eager, self.choices, self.first, self.mode, self.compiled = update, choices, True, mode, None

    def __call__(self) -> None:
        if not self.first:
            return self.fn()
        self.first = False
        try:
            self.fn = self.compiled or torch.compile(self.eager, mode=None if self.mode == "default" else self.mode)
            return self.fn()
        except Exception as exc:               # before any state changed: Dynamo fails while it traces
            self.fn = self.eager
            self.choices["optimizer"] += f" -> eager: compile failed ({type(exc).__name__}: {str(exc)[:120]})"
            return self.eager()


def anchor_name(mode: str, flex_block: int, backend: str) -> str:
    return f"anchor ({mode}, Flex block {flex_block}{'' if backend == 'TRITON' else ', ' + backend})"
