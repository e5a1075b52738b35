"""Patch kinds for the e3nn linears outside the interaction and product blocks: the readouts
(``LinearReadoutBlock.linear``, ``NonLinearReadoutBlock.linear_1`` / ``linear_2``) and the node
embedding (``LinearNodeEmbeddingBlock.linear``).

Part ``linears``: each becomes a :class:`~mace_accel.patches.linears.FusedLinear`. They are
small (one energy per node from 128 or 16 channels, the one-hot embedding), but e3nn runs each
as a GEMM and a scaling forward and a GEMM, a scaling and a zero-filled slice gradient backward:
in a small system's call every launch costs more than its work. Here each is one kernel per
pass. The blocks' ``forward`` is not touched (the non-linear readout's gate stays e3nn's).
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from mace_accel.options import AccelOptions
from mace_accel.patches.interaction_blocks import plan_linears
from mace_accel.patches.registry import PartPlan, SubmodulePatch


class _LinearsPatch(SubmodulePatch):
    """Fuses the e3nn linears named :attr:`children` of the blocks of :attr:`classes`."""

    classes: Tuple[str, ...] = ()
    children: Tuple[str, ...] = ()

    def applies_to(self, module: torch.nn.Module) -> bool:
        cls = type(module)
        return cls.__name__ in self.classes and cls.__module__.startswith("mace.")

    def plan_parts(self, module: torch.nn.Module, options: AccelOptions) -> List[PartPlan]:
        return [plan_linears(module, self.children, options)]


class ReadoutBlockPatch(_LinearsPatch):
    """MACE's readout blocks (per-node energies of each interaction's features)."""

    name = "readout_block"
    classes = ("LinearReadoutBlock", "NonLinearReadoutBlock")
    children = ("linear", "linear_1", "linear_2")


class NodeEmbeddingPatch(_LinearsPatch):
    """MACE's node embedding (one-hot elements to the first node features)."""

    name = "node_embedding"
    classes = ("LinearNodeEmbeddingBlock",)
    children = ("linear",)


PATCHES = (ReadoutBlockPatch(), NodeEmbeddingPatch())
