"""What every block-sparse module shares: its layout in the state dict, one adoption path for a
loaded layout, and layout tables warmed when the module moves to a device; and the search for the
dense layers ``sparsify`` replaces (``sparsify_candidates``), which linear and conv layers share."""
from __future__ import annotations

import fnmatch
from collections.abc import Callable

import numpy as np
import torch
from torch import nn


def size_arg(name: str, value, block_size: int) -> int:
    """``value`` (a Python or numpy int, as nn.Linear takes) as an int, if it is a positive
    multiple of ``block_size``; a ValueError naming ``name`` otherwise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value <= 0 \
            or value % block_size:
        raise ValueError(f"{name}: expected a positive multiple of block_size={block_size}, got {value!r}")
    return int(value)


def bias_arg(bias, layer: str) -> bool:
    """``bias`` as nn.Linear and nn.Conv2d take it (True/False, or 0/1); a TypeError otherwise (a
    block size given in its place, say)."""
    if isinstance(bias, (bool, np.bool_)) or (isinstance(bias, (int, np.integer)) and bias in (0, 1)):
        return bool(bias)
    raise TypeError(f"bias: expected True or False ({layer}'s bias argument), got {bias!r}")


def layout_of(norms: torch.Tensor | None, density: float | None, layout):
    """The layout a ``from_dense`` keeps: ``layout`` as given, or, with ``density``, the
    round(density·blocks) blocks of largest ``norms`` ((C/bs, K/bs) block norms of the dense
    weight): magnitude pruning at block granularity. ``norms`` may be None when a layout is given."""
    from bstrain import layout as layouts
    if layout is not None and density is not None:
        raise ValueError("layout, density: expected one of them, got both")
    if layout is not None:
        return layout
    if density is None:
        raise ValueError("layout: expected a layout or a density, got neither")
    if norms.is_meta:
        raise ValueError("keep_weights: a model on the meta device has no weights to keep the largest blocks of; "
                         "pass keep_weights=False (a drawn layout) or a layout")
    keep = min(norms.numel(), max(1, round(layouts.check_density(density) * norms.numel())))
    chosen = np.zeros(tuple(norms.shape), dtype=bool)
    chosen.flat[norms.flatten().argsort(descending=True, stable=True)[:keep].cpu().numpy()] = True
    return chosen


def _keeps_block_format(fn):
    """``fn`` for ``Module._apply``, where a memory format (``model.to(memory_format=
    torch.channels_last)``, which a whole convnet takes) does not apply to a conv layer's 5-D
    (nnz, bs, bs, kh, kw) weight: its device and dtype change, its layout stays contiguous."""
    def apply(t):
        if t.dim() != 5:
            return fn(t)
        try:
            return fn(t)
        except RuntimeError as exc:
            if "channels_last" not in str(exc):
                raise
            flat = fn(t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]))      # 4-D: the format applies
            return flat.contiguous().view(t.shape)
    return apply


class BlockLayoutModule(nn.Module):
    """Base of :class:`BlockSparseLinear` and :class:`BlockSparseConv2d`.

    A subclass holds a (C/bs, K/bs) bool layout, a persistent ``layout`` buffer (so state dicts
    carry it), a ``weight`` whose first dim counts live blocks, and implements
    :meth:`block_layout`, :meth:`_use_layout` (switch to a new layout: op and tables) and
    :meth:`_layout_tables` (the shared tables, warmed on ``.to(device)``).

    Loading a state dict whose layout differs replaces this module's layout, so weights always
    meet the layout they were trained on. The weight Parameter is kept (an optimizer may hold
    it) when the live-block count is the same; another count is an error naming the layer,
    unless ``load_state_dict(..., assign=True)`` asks for the checkpoint's tensors. A layout of
    another shape (other in/out sizes) is always an error.
    """

    def block_layout(self) -> np.ndarray:
        raise NotImplementedError

    def _use_layout(self, layout: np.ndarray) -> bool:
        """Switches to ``layout``; True when the op's tables were rewritten in place (graphs made
        before stay valid)."""
        raise NotImplementedError

    def _switch_layout(self, layout: np.ndarray) -> bool:
        """:meth:`_use_layout`, then the new tables made on the weight's GPU at once (as ``.to()``
        does), so that a graph traced later finds them instead of building them inside the trace.
        True when the switch was made in place."""
        in_place = bool(self._use_layout(layout))
        if self.weight.device.type == "cuda":
            self._layout_tables().on(self.weight.device)
        return in_place

    def _filled(self, dense: nn.Module) -> nn.Module:
        """``dense`` (the nn twin of this layer, built by ``to_dense``) with this layer's weights."""
        with torch.no_grad():
            dense.weight.copy_(self.dense_weight())
            if self.bias is not None:
                dense.bias.copy_(self.bias)
        return dense

    def _layout_tables(self):
        raise NotImplementedError

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "layout"
        if key in state_dict:
            new = np.asarray(state_dict[key].detach().cpu(), dtype=bool)
            if not self._adopt(new, prefix, bool(local_metadata.get("assign_to_params_buffers")), error_msgs):
                return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _adopt(self, new: np.ndarray, prefix: str, assign: bool, error_msgs: list) -> bool:
        """Takes ``new`` as this module's layout; False (with an error message) if it cannot."""
        name = prefix.rstrip(".") or type(self).__name__
        old = self.block_layout()
        if new.shape != old.shape:
            error_msgs.append(f"{name}: the checkpoint's layout has shape {new.shape}, this layer's {old.shape} "
                              f"(in/out sizes differ)")
            return False
        if np.array_equal(new, old):
            return True
        nnz = int(new.sum())
        if nnz != int(old.sum()) and not assign:
            error_msgs.append(f"{name}: the checkpoint's layout has {nnz} live blocks, this layer's {int(old.sum())}; "
                              f"build the layer with the checkpoint's layout (layout=state_dict['{prefix}layout']) "
                              f"or load with assign=True")
            return False
        if not new.any():
            error_msgs.append(f"{name}: the checkpoint's layout has no live block")
            return False
        self._switch_layout(new)
        if nnz != self.weight.shape[0]:            # assign=True: the checkpoint's weight replaces ours
            shape = (nnz,) + tuple(self.weight.shape[1:])
            self.weight = nn.Parameter(self.weight.new_empty(shape, device="meta"))
        return True

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.cuda()``, ``to_empty()``: the layout tables follow to the new device once, and
        the layout buffer is rewritten from the host layout (to_empty leaves it uninitialised)."""
        out = super()._apply(_keeps_block_format(fn), recurse)
        dev = self.weight.device
        if dev.type != "meta" and not self.layout.is_meta:
            self._write_layout_buffer(self.block_layout())
            if dev.type == "cuda":
                self._layout_tables().on(dev)
        return out

    # The ``layout`` buffer mirrors the layout the module computes with (its op's), so that state
    # dicts, DDP and FSDP carry it; a state dict always holds that layout (a write into the buffer
    # is not taken: ``load_state_dict`` is how a module takes another layout).
    def _write_layout_buffer(self, layout: np.ndarray) -> None:
        buf = self.layout
        new = torch.as_tensor(np.asarray(layout, dtype=bool), device=buf.device).to(buf.dtype)
        if buf.is_inference() and not torch.is_inference_mode_enabled():
            self.layout = new.clone()          # built under inference_mode: a normal tensor now
            return
        with torch.no_grad():
            buf.copy_(new)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        key = prefix + "layout"
        buf = self._buffers.get("layout")
        if not keep_vars and key in destination and buf is not None and not buf.is_meta \
                and not torch.compiler.is_compiling():
            destination[key] = torch.as_tensor(self.block_layout(), device=buf.device).to(buf.dtype)


def _check_untied(name: str, layer: nn.Module, layer_names: list[str], owners: dict[int, list[str]]) -> None:
    """A ValueError naming ``name`` when a parameter of ``layer`` is also registered in another
    module (tied weights): a block-sparse copy would have a parameter of its own, untying them."""
    own = set(layer_names)
    for param_name, p in layer.named_parameters(recurse=False):
        others = [q for q in owners[id(p)] if q.rpartition(".")[0] not in own]
        if others:
            raise ValueError(
                f"{name}: expected parameters of its own, got {layer_names[0]}.{param_name} tied to "
                f"{' and '.join(others)}; a block-sparse copy would untie them (one sparse, one dense). Leave it "
                f"out of include or untie them first; two layers that compute the same can be one module "
                f"registered under both names, which sparsify replaces everywhere")


def sparsify_candidates(model: nn.Module, include: str | Callable[[str, nn.Module], bool], block_size: int,
                        checks: dict[type, Callable[[str, nn.Module, int], None]]
                        ) -> tuple[list[tuple[str, nn.Module]], list[tuple[nn.Module, list[str], str]]]:
    """The layers of ``model`` that :func:`sparsify` replaces, found per module object: a layer
    registered under several names (two attributes, twice in a ModuleList, under two parents) is
    chosen when ``include`` chooses any of its names, and then every registration is replaced.

    Args:
        include: a glob on qualified names or a function ``(name, layer) -> bool``.
        checks: {layer type: check(name, layer, block_size)}, a check raising a ValueError that
            starts with ``name`` when the layer cannot be converted; only layers of exactly
            these types (not subclasses) are candidates.
    Returns ``(chosen, problems)``: every (name, layer) registration of the convertible chosen
    layers, in module order; and (layer, names, why) of each chosen layer that cannot be
    converted: its check failed, or a parameter of it is tied to another module's.
    """
    if not (callable(include) or isinstance(include, str)):
        raise TypeError(f"include: expected a glob (str) or a function (name, layer) -> bool, "
                        f"got {type(include).__name__}")
    match = include if callable(include) else (lambda name, _m: fnmatch.fnmatchcase(name, include))
    registrations = [(name, m) for name, m in model.named_modules(remove_duplicate=False)
                     if name and type(m) in checks]
    layers: dict[int, tuple[nn.Module, list[str]]] = {}     # id(layer) -> (layer, every name of it)
    for name, m in registrations:
        layers.setdefault(id(m), (m, []))[1].append(name)
    owners: dict[int, list[str]] = {}                          # id(parameter) -> every qualified name of it
    for param_name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(param_name)
    ok, problems = set(), []
    for layer, layer_names in layers.values():
        if not any(match(name, layer) for name in layer_names):
            continue
        label = layer_names[0] + (f" (also {', '.join(layer_names[1:])})" if len(layer_names) > 1 else "")
        try:
            checks[type(layer)](label, layer, block_size)
            _check_untied(label, layer, layer_names, owners)
        except ValueError as exc:
            problems.append((layer, layer_names, str(exc)))
        else:
            ok.add(id(layer))
    return [(name, m) for name, m in registrations if id(m) in ok], problems
