"""Patch kind for MACE's interaction blocks (every interaction-block class of mace-torch 0.3.x).

Parts: ``conv`` (the e3nn ``conv_tp`` becomes a :class:`FusedConvTP`). Every interaction-block
class calls ``self.conv_tp(node_feats, edge_attrs, tp_weights, edge_index)`` instead of gather +
TP + scatter when the block has a ``conv_fusion`` attribute, so the patch swaps ``conv_tp`` and
sets that attribute; revert puts the original back and removes it. The block's ``forward`` is
not touched.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from mace_accel.ops.conv_tp.spec import spec_from_e3nn
from mace_accel.options import AccelOptions
from mace_accel.patches.conv_tp import FusedConvTP
from mace_accel.patches.registry import PartPlan, SubmodulePatch

INTERACTION_BLOCK_CLASSES = (
    "RealAgnosticInteractionBlock",
    "RealAgnosticResidualInteractionBlock",
    "RealAgnosticDensityInteractionBlock",
    "RealAgnosticDensityResidualInteractionBlock",
    "RealAgnosticAttResidualInteractionBlock",
    "RealAgnosticResidualNonLinearInteractionBlock",
)


def is_e3nn_module(module: torch.nn.Module, name: str) -> bool:
    cls = type(module)
    return cls.__name__ == name and cls.__module__.startswith("e3nn.")


class InteractionBlockPatch(SubmodulePatch):
    """Fuses the parts of each MACE interaction block."""

    name = "interaction_block"

    def applies_to(self, module: torch.nn.Module) -> bool:
        return hasattr(module, "conv_tp") and (
            type(module).__name__ in INTERACTION_BLOCK_CLASSES
            or type(module).__name__.endswith("InteractionBlock"))

    def plan_parts(self, module: torch.nn.Module, options: AccelOptions) -> List[PartPlan]:
        return [self._plan_conv(module, options), *left_parts(module, LEFT_IN_INTERACTION)]

    def _plan_conv(self, module: torch.nn.Module, options: AccelOptions) -> PartPlan:
        if not options.fuses("conv"):
            return PartPlan("conv", reason="not asked for (options.parts)")
        reason = conv_skip_reason(module)
        if reason is not None:
            return PartPlan("conv", reason=reason)
        tp = module.conv_tp
        spec = spec_from_e3nn(tp)
        return PartPlan("conv", children={"conv_tp": lambda: FusedConvTP(tp, spec, options)},
                        detail=spec.describe())

    def _spec(self, module: torch.nn.Module):
        tp = module.conv_tp
        if isinstance(tp, FusedConvTP):
            return tp.spec
        return spec_from_e3nn(tp) if is_e3nn_module(tp, "TensorProduct") else None

    def after_revert(self, module: torch.nn.Module) -> None:
        if "conv_fusion" in module.__dict__:
            del module.conv_fusion

    def after_reattach(self, module: torch.nn.Module) -> None:
        if isinstance(module.conv_tp, FusedConvTP):
            module.conv_fusion = True


# parts of a block that no fused op replaces yet: (part, child modules, what runs instead)
LEFT_IN_INTERACTION = (
    ("radial_mlp", ("conv_tp_weights",),
     "no fused kernel yet; mace's radial MLP runs as torch GEMMs and writes the per-edge TP "
     "weights [E, weight_numel] to memory"),
    ("linears", ("linear_up", "linear"),
     "no fused kernel yet; e3nn o3.Linear runs as torch ops"),
    ("skip", ("skip_tp",),
     "no fused kernel yet; the element-dependent skip tensor product runs as e3nn's"),
)


def left_parts(module: torch.nn.Module, table) -> List[PartPlan]:
    """A "left" :class:`PartPlan` for each part of ``table`` the block has (a record of what
    still runs unfused, and why)."""
    return [PartPlan(part, reason=reason) for part, children, reason in table
            if any(isinstance(getattr(module, c, None), torch.nn.Module) for c in children)]


def conv_skip_reason(module: torch.nn.Module) -> Optional[str]:
    """Why the block's ``conv_tp`` cannot be fused, or None."""
    tp = module.conv_tp
    if hasattr(module, "conv_fusion"):
        return (f"conv_tp is {type(tp).__module__}.{type(tp).__name__}, already fused by "
                "another backend (cuEquivariance/OpenEquivariance); convert the model back "
                "to e3nn with mace's convert_cueq_e3nn / convert_oeq_e3nn first")
    if not is_e3nn_module(tp, "TensorProduct"):
        return f"conv_tp is {type(tp).__module__}.{type(tp).__name__}, not an e3nn TensorProduct"
    reason = spec_from_e3nn(tp).unsupported_reason()
    return f"tensor product not supported by the fused kernels: {reason}" if reason else None


PATCHES = (InteractionBlockPatch(),)
