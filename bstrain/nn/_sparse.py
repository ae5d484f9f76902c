"""What every block-sparse module shares: its ``layout`` buffer as the layout it computes with
(taken whenever it was written), and layout tables warmed when the module moves to a device;
and the search for the dense layers ``sparsify`` replaces (``sparsify_candidates``), which linear
and conv layers share."""
from __future__ import annotations

import fnmatch
from collections.abc import Callable

import numpy as np
import torch
import torch._dynamo
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


def _version(buf: torch.Tensor) -> int | None:
    """``buf``'s version counter, which every in-place write bumps (None for an inference tensor,
    which keeps none)."""
    return None if buf.is_inference() else buf._version


@torch._dynamo.assume_constant_result
def _sync_at_trace(module: "BlockLayoutModule") -> int:
    """:meth:`BlockLayoutModule._sync_layout` while torch.compile traces: dynamo calls this for
    real (with the real module and buffer) instead of tracing it, so a layout written before the
    first compiled call is the one the graph is traced with. Under a non-strict export the buffer
    is a fake tensor with no content to read: nothing is done."""
    buf = module._buffers.get("layout")
    if type(buf) is torch.Tensor and not buf.is_meta and not module._layout_in_sync(buf):
        module._take_layout(buf)
    return 0


class BlockLayoutModule(nn.Module):
    """Base of :class:`BlockSparseLinear` and :class:`BlockSparseConv2d`.

    A subclass holds a (C/bs, K/bs) bool layout in its op (host data, with shared tables), a
    persistent ``layout`` buffer (so state dicts carry it), a ``weight`` whose first dim counts
    live blocks, and implements :meth:`_op_layout` (the op's layout), :meth:`_use_layout` (switch
    to a new layout: op and tables) and :meth:`_layout_tables` (the shared tables, warmed on
    ``.to(device)``).

    The ``layout`` buffer is the truth: whatever writes it (``load_state_dict``, a loader that
    assigns or copies tensors, DCP, ``.to()``) changes what the layer computes. The op is switched
    when the layer next runs (or in the load path): a forward compares the buffer's identity and
    version counter with those the op was last built from (host-only), and reads the buffer only
    when they differ. A layout of the weight's live-block count is taken in place (the weight
    Parameter an optimizer holds stays); another count is an error naming the layer, unless
    ``load_state_dict(..., assign=True)`` brings the checkpoint's weight along. A layout of
    another shape (other in/out sizes) is always an error.
    """

    _layout_synced: tuple | None = None     # (the layout buffer the op was built from, its version)

    def _op_layout(self) -> np.ndarray:
        raise NotImplementedError

    def block_layout(self) -> np.ndarray:
        """The (C/bs, K/bs) bool layout the layer computes with: its ``layout`` buffer's."""
        self._sync_layout()
        return self._op_layout()

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

    # --- the layout buffer, the truth -----------------------------------------------------------------
    def _register_layout(self, layout: np.ndarray, device) -> None:
        """The persistent ``layout`` buffer: a copy of ``layout`` (never the host array itself),
        made a normal tensor even under inference_mode (an inference tensor keeps no version
        counter, so each call would have to read it)."""
        with torch.inference_mode(False):
            self.register_buffer("layout", torch.tensor(layout, device=device), persistent=True)
        self._record_layout()

    def _record_layout(self) -> None:
        """Notes the buffer as the one the op is built from (after a write bstrain makes itself)."""
        buf = self._buffers.get("layout")
        self._layout_synced = None if buf is None else (buf, _version(buf))

    def _layout_in_sync(self, buf: torch.Tensor) -> bool:
        synced = self._layout_synced
        return synced is not None and synced[0] is buf and synced[1] is not None and synced[1] == _version(buf)

    def _sync_layout(self) -> None:
        """Switches the op to the buffer's layout if the buffer was replaced or written since the
        op was built from it. The steady state costs an identity and an int compare (no sync); a
        changed buffer is read to the host once. While traced, see :func:`_sync_at_trace`."""
        if torch.compiler.is_compiling():
            _sync_at_trace(self)
            return
        buf = self._buffers.get("layout")
        if buf is None or self._layout_in_sync(buf) or buf.is_meta:
            return
        from bstrain.ops.tables import tracing
        if tracing():                           # a fake tensor: no content; the op's layout is traced
            return
        if buf.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{self._label()}: its layout buffer was written since the layer last ran, and a CUDA "
                               f"graph is being captured (reading it would sync); run the layer once eagerly, or call "
                               f"bstrain.nn.sync_layouts(model), before capturing")
        self._take_layout(buf)

    def _take_layout(self, buf: torch.Tensor) -> None:
        """Reads ``buf`` and switches the op to its layout (checked against the weight first)."""
        version = _version(buf)
        new = np.asarray(buf.detach().to("cpu", torch.bool), dtype=bool)
        old = self._op_layout()
        if new.shape != old.shape:
            raise ValueError(f"{self._label()}: its layout buffer has shape {tuple(new.shape)}, expected {old.shape} "
                             f"(in/out sizes / block size); load a layout of this layer's shape")
        nnz, live = int(new.sum()), int(self.weight.shape[0])
        if nnz == 0:
            raise ValueError(f"{self._label()}: its layout buffer has no live block; load a layout with at least one")
        if nnz != live:
            raise ValueError(f"{self._label()}: its layout buffer has {nnz} live blocks, its weight {live}; load the "
                             f"weight that goes with the layout too, or use load_state_dict(state_dict, assign=True)")
        if not np.array_equal(new, old):
            self._switch_layout(new)
        self._layout_synced = (buf, version)

    def _label(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"

    def _write_layout_buffer(self, layout: np.ndarray) -> None:
        """Writes ``layout`` (the op's, after a switch bstrain made) into the buffer, noted as in sync."""
        buf = self.layout
        new = torch.as_tensor(np.asarray(layout, dtype=bool), device=buf.device).to(buf.dtype)
        if buf.is_inference() and not torch.is_inference_mode_enabled():
            self.layout = new.clone()          # built under inference_mode: a normal tensor now
        else:
            with torch.no_grad():
                buf.copy_(new)
        self._record_layout()

    def __getstate__(self):
        """Copies and pickles keep whether the buffer is in sync (a fresh tensor's version restarts)."""
        state = self.__dict__.copy()
        buf = self._buffers.get("layout")
        state["_layout_synced"] = (buf, buf is not None and self._layout_in_sync(buf))
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        buf, in_sync = self.__dict__.get("_layout_synced") or (None, False)
        self._layout_synced = None
        if in_sync is True and buf is not None and buf is self._buffers.get("layout"):
            self._record_layout()

    # --- the paths that write the buffer ------------------------------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "layout"
        saved = state_dict.get(key)
        if isinstance(saved, torch.Tensor) and not saved.is_meta:
            new = np.asarray(saved.detach().to("cpu", torch.bool), dtype=bool)
            if not self._check_loadable(new, prefix, bool(local_metadata.get("assign_to_params_buffers")), error_msgs):
                return
        buf = self._buffers.get("layout")
        if buf is not None and buf.is_inference() and not torch.is_inference_mode_enabled():
            self.layout = buf.clone()          # built under inference_mode: copy_ would refuse it
        errors = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if len(error_msgs) == errors:
            try:
                self._sync_layout()            # the loaded buffer, taken now
            except ValueError as exc:
                error_msgs.append(f"{prefix.rstrip('.') or type(self).__name__}: {exc}")

    def _check_loadable(self, new: np.ndarray, prefix: str, assign: bool, error_msgs: list) -> bool:
        """Whether the layout ``new`` may be loaded (False, with an error message, if not); with
        assign=True and another live-block count, the weight becomes a placeholder of the new
        shape for the checkpoint's weight to replace."""
        name = prefix.rstrip(".") or type(self).__name__
        old = self._op_layout()
        if new.shape != old.shape:
            error_msgs.append(f"{name}: the checkpoint's layout has shape {new.shape}, this layer's {old.shape} "
                              f"(in/out sizes differ)")
            return False
        nnz = int(new.sum())
        if nnz == int(self.weight.shape[0]):
            return True
        if not assign:
            error_msgs.append(f"{name}: the checkpoint's layout has {nnz} live blocks, this layer's {int(old.sum())}; "
                              f"build the layer with the checkpoint's layout (layout=state_dict['{prefix}layout']) "
                              f"or load with assign=True")
            return False
        if nnz == 0:
            error_msgs.append(f"{name}: the checkpoint's layout has no live block")
            return False
        shape = (nnz,) + tuple(self.weight.shape[1:])       # the checkpoint's weight replaces ours
        self.weight = nn.Parameter(self.weight.new_empty(shape, device="meta"))
        return True

    def _apply(self, fn, recurse: bool = True):
        """``.to()``, ``.cuda()``, ``to_empty()``: the layout tables follow to the new device once. A
        buffer that had no content (meta, to_empty after meta init) gets the op's layout; a real
        one keeps its content, and stays in sync if it was."""
        before = self._buffers.get("layout")
        was_meta = before is not None and before.is_meta
        was_synced = before is not None and self._layout_in_sync(before)
        out = super()._apply(_keeps_block_format(fn), recurse)
        buf = self._buffers.get("layout")
        if buf is not None and not buf.is_meta:
            if was_meta:
                self._write_layout_buffer(self._op_layout())
            elif was_synced:
                self._record_layout()
        dev = self.weight.device
        if dev.type == "cuda":
            self._layout_tables().on(dev)
        return out


def sync_layouts(model: nn.Module) -> int:
    """Has every block-sparse layer of ``model`` take its ``layout`` buffer now (each layer does
    when it next runs eagerly or is traced, and in ``load_state_dict``): for a buffer written by
    assignment or copy after a model was compiled or before it is exported or captured in a
    CUDA graph. Returns the number of layers."""
    layers = [m for m in model.modules() if isinstance(m, BlockLayoutModule)]
    for layer in layers:
        layer._sync_layout()
    return len(layers)


def layout_buffers(module: nn.Module) -> set[int]:
    """The ids of ``module``'s block-sparse layout buffers: state copies that run every step (an
    EMA's buffers, a graph's warm-up snapshot) leave them alone, since bstrain's layout switches
    keep them in step, and a write would make each layer read its buffer again."""
    return {id(m._buffers["layout"]) for m in module.modules()
            if isinstance(m, BlockLayoutModule) and m._buffers.get("layout") is not None}


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
