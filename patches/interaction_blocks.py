"""Patch kind for MACE's interaction blocks (every interaction-block class of mace-torch 0.3.x).

Parts: ``conv`` (the e3nn ``conv_tp`` becomes a :class:`FusedConvTP`) and ``radial_mlp``
(``conv_tp_weights`` becomes a :class:`~mace_accel.patches.radial.mlp.FusedRadialMLP`),
``linears`` (``linear_up``, ``linear``) and ``skip`` (``skip_tp``), see
:mod:`mace_accel.patches.linears`. Every interaction-block
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
from mace_accel.ops.irreps_linear.spec import linear_spec, skip_reason, skip_spec
from mace_accel.patches.conv_tp import FOLD_NOTE, FusedConvTP
from mace_accel.patches.fold import fold_reason
from mace_accel.patches.layout import FusedReshapeIrreps, reshape_reason
from mace_accel.patches.linears import FusedLinear, FusedSkip, linear_reason
from mace_accel.patches.radial.mlp import PART as RADIAL
from mace_accel.patches.radial.mlp import FusedRadialMLP
from mace_accel.patches.radial.mlp import spec_or_reason as radial_spec_or_reason
from mace_accel.patches import density_block, nonlinear_block
from mace_accel.patches.registry import PartPlan, SubmodulePatch

# the e3nn linears of the blocks (the non-linear block's residual and output linears too)
LINEARS = ("linear_up", "linear", "linear_res", "linear_1", "linear_2")

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
        conv = self._plan_conv(module, options)
        layer_norm = nonlinear_block.plan_radial(module, options)  # None: not a non-linear block
        radial = self._plan_radial(module, options) if layer_norm is None else layer_norm
        if layer_norm is None:
            if conv.reason is None and radial.reason is None:
                _fold(module, options, conv, radial)
            _plan_density(module, radial, options)
        linears = plan_linears(module, LINEARS, options)
        _plan_reshape(module, linears, options)
        return [conv, radial, linears, self._plan_skip(module, options)]

    def _plan_skip(self, module: torch.nn.Module, options: AccelOptions) -> PartPlan:
        skip = getattr(module, "skip_tp", None)
        if not isinstance(skip, torch.nn.Module):
            return PartPlan("skip", reason="the block has no skip_tp module")
        if not options.fuses("skip"):
            return PartPlan.not_asked("skip")
        if linear_reason(skip) is None:  # the skip of the non-linear blocks is a plain linear
            return PartPlan("skip", children={"skip_tp": lambda: FusedLinear(skip, options)},
                            detail="skip_tp: " + linear_spec(skip).describe())
        reason = skip_reason(skip)
        if reason is not None:
            return PartPlan("skip", reason=reason)
        return PartPlan("skip", children={"skip_tp": lambda: FusedSkip(skip, options)},
                        detail="skip_tp: " + skip_spec(skip).describe())

    def _plan_radial(self, module: torch.nn.Module, options: AccelOptions) -> PartPlan:
        if not options.fuses(RADIAL):
            return PartPlan.not_asked(RADIAL)
        net = getattr(module, "conv_tp_weights", None)
        if not isinstance(net, torch.nn.Module):
            return PartPlan(RADIAL, reason="the block has no conv_tp_weights module")
        spec, reason = radial_spec_or_reason(net)
        if spec is None:
            return PartPlan(RADIAL, reason=reason)
        return PartPlan(RADIAL, children={
            "conv_tp_weights": lambda: FusedRadialMLP(net, spec, options)},
            detail=spec.describe())

    def _plan_conv(self, module: torch.nn.Module, options: AccelOptions) -> PartPlan:
        if not options.fuses("conv"):
            return PartPlan.not_asked("conv")
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
        nonlinear_block.remove(module)  # either block's forward

    def after_reattach(self, module: torch.nn.Module) -> None:
        if isinstance(module.conv_tp, FusedConvTP):
            module.conv_fusion = True
        nonlinear_block.install(module)
        density_block.install(module)


def _fold(module: torch.nn.Module, options: AccelOptions, conv: PartPlan,
          radial: PartPlan) -> None:
    """Fold the radial MLP's last layer into the conv (both plans fused) where the block allows
    it (:func:`~mace_accel.patches.fold.fold_reason`); the plans' details say which."""
    tp, net = module.conv_tp, module.conv_tp_weights
    conv_spec = spec_from_e3nn(tp)
    radial_spec, _ = radial_spec_or_reason(net)
    reason = fold_reason(module)
    if reason is None and radial_spec.hs[-1] != conv_spec.weight_numel:
        reason = (f"the radial MLP gives {radial_spec.hs[-1]} weights per edge, the conv takes "
                  f"{conv_spec.weight_numel}")
    if reason is not None:
        conv.detail += f"; radial MLP's last layer not folded in: {reason}"
        return
    made: dict = {}

    def make_radial() -> FusedRadialMLP:
        if "radial" not in made:
            made["radial"] = FusedRadialMLP(net, radial_spec, options, fold_last=True)
        return made["radial"]

    radial.children = {"conv_tp_weights": make_radial}
    radial.detail = radial_spec.describe(folded=True)
    conv.children = {"conv_tp": lambda: FusedConvTP(tp, conv_spec, options, radial=make_radial())}
    conv.detail += FOLD_NOTE


def _plan_density(module: torch.nn.Module, radial: PartPlan, options: AccelOptions) -> None:
    """The Density blocks' ``density_fn`` (an e3nn ``FullyConnectedNet`` of the radial features
    to one number per edge) joins the ``radial_mlp`` part as a second fused radial MLP (so it
    is looked up in its own table where the block's weights are); the detail says which."""
    net = getattr(module, "density_fn", None)
    if radial.reason is not None or not isinstance(net, torch.nn.Module):
        return
    spec, reason = radial_spec_or_reason(net)
    if spec is None:
        radial.detail += f"; density_fn left: {reason}"
        return
    radial.children["density_fn"] = lambda: FusedRadialMLP(net, spec, options)
    radial.detail += f"; density_fn: MLP {'->'.join(map(str, spec.hs))}"


def _plan_reshape(module: torch.nn.Module, linears: PartPlan, options: AccelOptions) -> None:
    """The block's ``reshape`` (mace's ``reshape_irreps``) joins the ``linears`` part as one
    gather (:mod:`mace_accel.patches.layout`) when the part is fused; the detail says which."""
    reshape = getattr(module, "reshape", None)
    if linears.reason is not None or not isinstance(reshape, torch.nn.Module):
        return
    reason = reshape_reason(reshape)
    if reason is not None:
        linears.detail += f"; reshape left: {reason}"
        return
    linears.children["reshape"] = lambda: FusedReshapeIrreps(reshape, options)
    linears.detail += f"; reshape: {FusedReshapeIrreps.describe_shape(reshape)}"


def plan_linears(module: torch.nn.Module, names, options: AccelOptions) -> PartPlan:
    """Part ``linears``: each e3nn ``o3.Linear`` child of ``names`` becomes a
    :class:`~mace_accel.patches.linears.FusedLinear`; the detail names any left and why."""
    if not options.fuses("linears"):
        return PartPlan.not_asked("linears")
    children, details, left = {}, [], []
    for name in names:
        child = getattr(module, name, None)
        if not isinstance(child, torch.nn.Module):
            continue
        reason = linear_reason(child)
        if reason is not None:
            left.append(f"{name} left: {reason}")
            continue
        children[name] = (lambda c=child: FusedLinear(c, options))
        details.append(f"{name}: {linear_spec(child).describe()}")
    if not children:
        return PartPlan("linears", reason="; ".join(left) or "the block has no linears")
    return PartPlan("linears", children=children, detail="; ".join(details + left))


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
