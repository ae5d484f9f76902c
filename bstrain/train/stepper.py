"""How the trainer's steps run: ``trainer.cuda_graph`` parsed once into a :class:`GraphMode`.

``auto`` captures the whole step in one CUDA graph where it can (a CUDA device, a step that can
be captured) and trains eagerly where it cannot, with one log line saying why; ``true`` insists
(a graph or an error); ``false`` trains eagerly.
"""
from __future__ import annotations

from enum import Enum

import torch

from bstrain.errors import UserError
from bstrain.train.graphs import check_graph_config

_SYNONYMS = {"1": "true", "0": "false", "yes": "true", "no": "false", "on": "true", "off": "false"}


class GraphMode(Enum):
    """trainer.cuda_graph: auto | true | false."""
    auto = "auto"
    true = "true"
    false = "false"

    @classmethod
    def parse(cls, value) -> GraphMode:
        """The mode a config value names; YAML and the command line may give a bool or a string
        (1/0, yes/no, on/off too). UserError for anything else."""
        mode = str(getattr(value, "value", value)).strip().lower()
        mode = _SYNONYMS.get(mode, mode)
        if mode not in cls._value2member_map_:
            raise UserError(f"trainer.cuda_graph: expected auto, true or false, got {value!r}")
        return cls(mode)


def graphs_wanted(mode: GraphMode, device: torch.device) -> bool:
    """Whether this run captures its step: ``true`` (UserError where it cannot), or ``auto`` on a
    CUDA device. Whether the model can be captured is found at the first step."""
    if mode is GraphMode.false:
        return False
    reason = check_graph_config(device)
    if reason is not None and mode is GraphMode.true:
        raise UserError(f"trainer.cuda_graph=true: {reason} (auto graphs where it can, false never)")
    return reason is None
