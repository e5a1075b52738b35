"""Patch kinds for the e3nn linears outside the interaction and product blocks: the readouts
(``LinearReadoutBlock.linear``, ``NonLinearReadoutBlock.linear_1`` / ``linear_2``) and the node
embedding (``LinearNodeEmbeddingBlock.linear``).

Part ``linears``: each becomes a :class:`~mace_accel.patches.linears.FusedLinear`. They are
small (one energy per node from 128 or 16 channels, the one-hot embedding), but e3nn runs each
as a GEMM and a scaling forward and a GEMM, a scaling and a zero-filled slice gradient backward:
in a small system's call every launch costs more than its work. Here each is one kernel per
pass. The non-linear readout's gate stays e3nn's; a multi-head one (MACE-MH-1) gets a forward
of its own (:class:`HeadMaskedReadout`): mace's ``mask_head`` copies a host number into a
device tensor, which a CUDA graph cannot capture.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

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

    def after_reattach(self, module: torch.nn.Module) -> None:
        if type(module).__name__ == "NonLinearReadoutBlock" \
                and int(getattr(module, "num_heads", 1)) > 1:
            module.__dict__["forward"] = HeadMaskedReadout(module)

    def after_revert(self, module: torch.nn.Module) -> None:
        if isinstance(module.__dict__.get("forward"), HeadMaskedReadout):
            del module.__dict__["forward"]


def mask_heads(x: torch.Tensor, heads: torch.Tensor, num_heads: int) -> torch.Tensor:
    """mace's ``mask_head``: of ``x [N, H * k]`` (head-major blocks of ``k`` columns) keep each
    node's own head's block, zero the others (the same values), without a host copy."""
    keep = torch.arange(num_heads, device=x.device) == heads.reshape(-1, 1)
    return (x.view(x.shape[0], num_heads, -1) * keep.unsqueeze(-1).to(x.dtype)).view(x.shape)


class HeadMaskedReadout:
    """The forward of a multi-head ``NonLinearReadoutBlock`` (installed on the instance): mace's
    steps, its head mask by :func:`mask_heads`."""

    def __init__(self, block: torch.nn.Module) -> None:
        self.block = block

    def __call__(self, x: torch.Tensor, heads: Optional[torch.Tensor] = None) -> torch.Tensor:
        block = self.block
        x = block.non_linearity(block.linear_1(x))
        if block.num_heads > 1 and heads is not None:
            x = mask_heads(x, heads, block.num_heads)
        return block.linear_2(x)


class NodeEmbeddingPatch(_LinearsPatch):
    """MACE's node embedding (one-hot elements to the first node features)."""

    name = "node_embedding"
    classes = ("LinearNodeEmbeddingBlock",)
    children = ("linear",)


PATCHES = (ReadoutBlockPatch(), NodeEmbeddingPatch())
