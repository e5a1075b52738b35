"""Patch for MACE's interaction blocks: the e3nn ``conv_tp`` becomes a :class:`FusedConvTP`.

Every interaction-block class of mace-torch 0.3.x calls
``self.conv_tp(node_feats, edge_attrs, tp_weights, edge_index)`` instead of gather + TP +
scatter when the block has a ``conv_fusion`` attribute. So the patch swaps ``conv_tp`` and sets
that attribute; revert puts the original back and removes it. The block's ``forward`` is not
touched.
"""

from __future__ import annotations

from typing import Optional

import torch

from mace_accel.spec import spec_from_e3nn
from mace_accel.patches.conv_tp import FusedConvTP
from mace_accel.patches.registry import BlockPatch, PatchRecord

INTERACTION_BLOCK_CLASSES = (
    "RealAgnosticInteractionBlock",
    "RealAgnosticResidualInteractionBlock",
    "RealAgnosticDensityInteractionBlock",
    "RealAgnosticDensityResidualInteractionBlock",
    "RealAgnosticAttResidualInteractionBlock",
    "RealAgnosticResidualNonLinearInteractionBlock",
)


def _is_e3nn_tp(module: torch.nn.Module) -> bool:
    cls = type(module)
    return cls.__name__ == "TensorProduct" and cls.__module__.startswith("e3nn.")


class InteractionConvPatch(BlockPatch):
    """Fuses ``conv_tp`` of each MACE interaction block."""

    name = "interaction_conv_tp"

    def matches(self, module: torch.nn.Module) -> bool:
        return hasattr(module, "conv_tp") and (
            type(module).__name__ in INTERACTION_BLOCK_CLASSES
            or type(module).__name__.endswith("InteractionBlock")
        )

    def skip_reason(self, module: torch.nn.Module) -> Optional[str]:
        tp = module.conv_tp
        if isinstance(tp, FusedConvTP):
            return "already accelerated"
        if hasattr(module, "conv_fusion"):
            return (f"conv_tp is {type(tp).__module__}.{type(tp).__name__}, already fused by "
                    "another backend (cuEquivariance/OpenEquivariance); convert the model back "
                    "to e3nn with mace's convert_cueq_e3nn / convert_oeq_e3nn first")
        if not _is_e3nn_tp(tp):
            return (f"conv_tp is {type(tp).__module__}.{type(tp).__name__}, not an e3nn "
                    "TensorProduct")
        reason = spec_from_e3nn(tp).unsupported_reason()
        return f"tensor product not supported by the fused kernels: {reason}" if reason else None

    def apply(self, path: str, module: torch.nn.Module, backend: str,
              **options) -> PatchRecord:
        original = module.conv_tp
        spec = spec_from_e3nn(original)
        self.reattach(module, FusedConvTP(original, spec, backend=backend, **options))
        return PatchRecord(path=path, block=type(module).__name__, patch=self.name,
                           spec=spec, backend=backend)

    def revert(self, module: torch.nn.Module) -> FusedConvTP:
        fused = module.conv_tp
        module.conv_tp = fused.sync_original()
        if "conv_fusion" in module.__dict__:
            del module.conv_fusion
        return fused

    def reattach(self, module: torch.nn.Module, state: FusedConvTP) -> None:
        module.conv_tp = state
        module.conv_fusion = True


PATCHES = (InteractionConvPatch(),)
