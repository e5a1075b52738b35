"""Model surgery: one patch kind per MACE module family, behind one interface.

``find_blocks(model)`` lists ``(path, module, kind)`` for every module some patch kind applies
to, in model order; :func:`mace_accel.accelerate` applies them, :func:`mace_accel.revert`
undoes them. Nothing outside this package knows what a patch swaps.
"""

from __future__ import annotations

from typing import Iterator, List, Tuple

import torch

from mace_accel.patches.registry import PartRecord, PatchKind, PatchRecord


def all_patches() -> Tuple[PatchKind, ...]:
    from mace_accel.patches.edge_features import PATCHES as edge_features
    from mace_accel.patches.interaction_blocks import PATCHES as interaction
    from mace_accel.patches.pair_repulsion import PATCHES as pair_repulsion
    from mace_accel.patches.product_blocks import PATCHES as product
    from mace_accel.patches.readout_blocks import PATCHES as readout

    return (tuple(interaction) + tuple(product) + tuple(edge_features) + tuple(pair_repulsion)
            + tuple(readout))


def find_blocks(model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module, PatchKind]]:
    """Every ``(qualified name, module, patch kind)`` a registered kind applies to."""
    patches = all_patches()
    for path, module in model.named_modules():
        for patch in patches:
            if patch.applies_to(module):
                yield path, module, patch


def link_across_blocks(model: torch.nn.Module, options) -> List[str]:
    """After the blocks are patched: link what spans blocks (the radial MLPs' overlap,
    :mod:`mace_accel.patches.radial.overlap`, and their tables' embedding,
    :mod:`mace_accel.patches.radial.table`); returns a line for the report per link made."""
    from mace_accel.patches.radial import overlap as radial_overlap
    from mace_accel.patches.radial import table as radial_table
    from mace_accel.patches.radial.mlp import FusedRadialMLP

    group = radial_overlap.link(model, options, lambda m: isinstance(m, FusedRadialMLP))
    table = radial_table.link(model, options)
    return [line for line in (None if group is None else group.describe(), table) if line]


__all__ = ["PartRecord", "PatchKind", "PatchRecord", "all_patches", "find_blocks",
           "link_across_blocks"]
