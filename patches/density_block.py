"""The Density interaction blocks (mace's ``RealAgnosticDensityInteractionBlock`` and
``RealAgnosticDensityResidualInteractionBlock``: MACE-MPA-0, MP-0b3, OMAT-0, MATPES) with their
density summed without atomics.

mace's forward sums each edge's density term ``tanh(density_fn(edge_feats)^2) * cutoff`` per
receiver with ``scatter_sum`` (float atomics on a GPU: the last bits change from call to call).
:class:`DensityForward`, installed as the instance's ``forward`` (``revert`` puts mace's back:
:func:`~mace_accel.patches.nonlinear_block.remove`), takes the same steps in mace's order with
the fused parts, and sums the density per receiver in a fixed order
(:func:`~mace_accel.patches.nonlinear_block.receiver_sums`). A call with LAMMPS ghost atoms
runs mace's own forward.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from mace_accel.patches.nonlinear_block import (FORWARD_ATTR, BlockForward, convolve,
                                                divide_rows, receiver_sums)

Tensor = torch.Tensor
CLASSES = ("RealAgnosticDensityInteractionBlock", "RealAgnosticDensityResidualInteractionBlock")


class DensityForward(BlockForward):
    """The forward of one Density block, the density summed per receiver in a fixed order."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__(block)
        self.residual = type(block).__name__ == CLASSES[1]

    def fused(self, node_attrs: Tensor, node_feats: Tensor, edge_attrs: Tensor,
              edge_feats: Tensor, edge_index: Tensor,
              cutoff: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
        block = self.block
        n_nodes = node_feats.shape[0]
        sc = block.skip_tp(node_feats, node_attrs) if self.residual else None
        node_feats = block.linear_up(node_feats)
        tp_weights = block.conv_tp_weights(edge_feats)
        squashed = getattr(block.density_fn, "density", None)  # fused: tabulated with its MLP
        edge_density = (squashed(edge_feats) if squashed is not None
                        else torch.tanh(block.density_fn(edge_feats) ** 2))
        if cutoff is not None:
            tp_weights = tp_weights * cutoff
            edge_density = edge_density * cutoff
        density = receiver_sums(edge_density, edge_index, n_nodes)
        message = convolve(block, node_feats, edge_attrs, tp_weights, edge_index)
        message = divide_rows(block.linear(message), density + 1)
        if not self.residual:
            message = block.skip_tp(message, node_attrs)
        return block.reshape(message), sc


def install(block: torch.nn.Module) -> None:
    """Give a Density ``block`` the forward above (where it has fused parts)."""
    if type(block).__name__ in CLASSES:
        block.__dict__[FORWARD_ATTR] = DensityForward(block)

