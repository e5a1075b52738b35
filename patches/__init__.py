"""Model surgery: one module per MACE block family, plus the registry that drives them.

``find_blocks(model)`` lists ``(path, module, patch)`` for every module some patch matches;
:func:`mace_accel.accelerate` applies them, :func:`mace_accel.revert` undoes them.
"""

from __future__ import annotations

from typing import Iterator, Tuple

import torch

from mace_accel.patches.registry import BlockPatch, PatchRecord


def all_patches() -> Tuple[BlockPatch, ...]:
    from mace_accel.patches.interaction_blocks import PATCHES as interaction

    return tuple(interaction)


def find_blocks(model: torch.nn.Module) -> Iterator[Tuple[str, torch.nn.Module, BlockPatch]]:
    """Every ``(qualified name, module, patch)`` a registered patch matches, in model order."""
    patches = all_patches()
    for path, module in model.named_modules():
        for patch in patches:
            if patch.matches(module):
                yield path, module, patch


__all__ = ["BlockPatch", "PatchRecord", "all_patches", "find_blocks"]
