"""Patch kind for a model's ZBL pair repulsion (mace's ``ZBLBasis``, ``pair_repulsion_fn``:
MACE-MPA-0, OMAT-0, MATPES, MH-1).

Part ``pair_repulsion``: the module becomes a :class:`FusedPairRepulsion`, one op
(:mod:`mace_accel.ops.pair_repulsion`: on CUDA one kernel, each atom summing its received
edges in a fixed order, the edges' slopes kept for the backward) with the original's call
signature and result. The original is kept inside (state dict unchanged, ``revert`` hands it
back)."""

from __future__ import annotations

from typing import List, Optional

import torch

from mace_accel.ops.pair_repulsion import autograd
from mace_accel.ops.pair_repulsion.spec import ZBLSpec, zbl_spec_from_module
from mace_accel.options import AccelOptions
from mace_accel.patches import edge_vectors
from mace_accel.patches.adopt import FusedModule
from mace_accel.patches.edge_features import model_numbers
from mace_accel.patches.registry import RECORD_ATTR, PartPlan, SubmodulePatch

PART = "pair_repulsion"


class FusedPairRepulsion(FusedModule):
    """mace's ``ZBLBasis`` as one op: ``(lengths [E, 1], node_attrs [N, n], edge_index
    [2, E], atomic_numbers) -> [N]`` each atom's repulsion.

    The constants are read again whenever a buffer changes (``load_state_dict``, ``.to()``).
    """

    part = PART

    def __init__(self, original: torch.nn.Module, spec: ZBLSpec, options: AccelOptions) -> None:
        super().__init__(original, options)
        self.spec = spec

    def describe(self) -> str:
        kind = "one kernel" if self.backend == "cuda" else "torch ops"
        return (f"{self.spec.describe()}: each atom's received edges summed in a fixed order "
                f"({kind}), the edges' slopes kept for the backward")

    def start_compiles(self, dtype: torch.dtype, device: torch.device) -> None:
        autograd.start_compiles(self.spec, dtype, device)

    def _current_spec(self) -> ZBLSpec:
        self._reread_spec(lambda: tuple((id(t), t._version) for t in self._buffers.values()),
                          lambda: zbl_spec_from_module(self.sync_original(), self.spec.numbers),
                          "the ZBL pair repulsion")
        return self.spec

    def forward(self, x: torch.Tensor, node_attrs: torch.Tensor, edge_index: torch.Tensor,
                atomic_numbers: Optional[torch.Tensor] = None) -> torch.Tensor:
        elements = edge_vectors.element_index(node_attrs, torch.int64)
        return autograd.repulsion(self._current_spec(), x, elements, edge_index, self.backend)


class PairRepulsionPatch(SubmodulePatch):
    """Fuses a MACE model's ``pair_repulsion_fn``."""

    name = "pair_repulsion"
    record_attr = RECORD_ATTR + "_pair_repulsion"  # the model also keeps the edge features'

    def applies_to(self, module: torch.nn.Module) -> bool:
        return hasattr(module, "interactions") and isinstance(
            module._modules.get("pair_repulsion_fn"), torch.nn.Module)

    def plan_parts(self, module: torch.nn.Module, options: AccelOptions) -> List[PartPlan]:
        if not options.fuses(PART):
            return [PartPlan.not_asked(PART)]
        zbl = module.pair_repulsion_fn
        spec, reason = zbl_spec_from_module(zbl, model_numbers(module))
        if spec is None:
            return [PartPlan(PART, reason=reason)]
        return [PartPlan(PART, children={
            "pair_repulsion_fn": lambda: FusedPairRepulsion(zbl, spec, options)},
            detail=f"pair_repulsion_fn: {spec.describe()}")]

    def fused_children(self, module: torch.nn.Module) -> List[str]:
        return ["pair_repulsion_fn"] if isinstance(module._modules.get("pair_repulsion_fn"),
                                                   FusedPairRepulsion) else []


PATCHES = (PairRepulsionPatch(),)
