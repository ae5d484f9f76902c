"""A layer's layout and tables at an update: the switch to its new layout (its tables rewritten
in place where they can take it), and an ``also`` copy's products kept on the layer's tables."""
from __future__ import annotations

import numpy as np
from torch import nn


def _switch(layer: nn.Module, new: np.ndarray) -> bool:
    """Switches ``layer`` (its weight already moved) to ``new``: op, tables and layout buffer.
    True when its tables were rewritten in place."""
    in_place = layer._switch_layout(new)
    if hasattr(layer, "_write_layout_buffer"):                              # a module's layout buffer
        layer._write_layout_buffer(new)
    return in_place


def _share_tables(twin: nn.Module, layer: nn.Module) -> None:
    """A twin's product reads the layer's private tables (its layout always follows the layer's:
    one rewrite serves both); other twins (convolutions) get private tables of their own."""
    from bstrain.ops.matmul import BlocksparseMatMul
    mine, theirs = getattr(twin, "op", twin), getattr(layer, "op", layer)
    if isinstance(mine, BlocksparseMatMul) and isinstance(theirs, BlocksparseMatMul):
        if mine._tables is not theirs._tables:
            mine.share_tables(theirs)
    elif hasattr(mine, "make_private"):
        mine.make_private()
