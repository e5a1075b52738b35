"""Patch kind for MACE's product blocks (``EquivariantProductBasisBlock``, every 0.3.x variant).

Part ``symmetric_contraction``: the block's mace ``SymmetricContraction`` becomes a
:class:`FusedSymmetricContraction`, one op per pass for all output irreps and correlation orders
(:mod:`mace_accel.ops.symmetric_contraction`), generated from the module's own U matrices. It
keeps mace's call ``(node_feats [N, C, D], node_attrs [N, Z])`` and output ``[N, C * sum M]``, so
the block's ``forward`` is not touched. The element weights are gathered by
``argmax(node_attrs)``: mace's node attributes are one-hot (the verification at ``accelerate``
time compares with the original on a real structure; ``check_indices=True`` checks it per call).
A contraction the kernels cannot take (cuEquivariance's, mixed multiplicities, external
weights) is left as it is, and the record says why.
"""

from __future__ import annotations

from typing import List

import torch

from mace_accel.errors import InputError, UnsupportedModelError
from mace_accel.ops.symmetric_contraction import autograd
from mace_accel.ops.symmetric_contraction.spec import SCSpec, spec_from_mace
from mace_accel.options import AccelOptions
from mace_accel.patches.adopt import FusedModule
from mace_accel.patches.edge_vectors import element_index
from mace_accel.patches.interaction_blocks import plan_linears
from mace_accel.patches.linears import check_one_hot
from mace_accel.patches.registry import PartPlan, SubmodulePatch

PART = "symmetric_contraction"


class FusedSymmetricContraction(FusedModule):
    """mace's ``SymmetricContraction`` as one fused op per pass.

    Args:
        original: the product block's ``SymmetricContraction``.
        spec: its :class:`~mace_accel.ops.symmetric_contraction.spec.SCSpec`.
        options: backend, index checks.
    """

    part = PART
    register_spec = staticmethod(autograd.register_spec)

    def __init__(self, original: torch.nn.Module, spec: SCSpec, options: AccelOptions) -> None:
        super().__init__(original, options)
        self._use_spec(spec)
        self.irreps_in = getattr(original, "irreps_in", None)
        self.irreps_out = getattr(original, "irreps_out", None)

    def describe(self) -> str:
        return self.spec.describe()

    def _buffers_seen(self) -> tuple:
        """What the spec (its U matrices, baked into the kernels) was read from: each buffer's
        identity and version (``load_state_dict`` or ``copy_`` bumps it, ``.to()`` makes a new
        tensor)."""
        return tuple((id(t), t._version) for t in self.contractions.buffers())

    def start_compiles(self, dtype: torch.dtype, device: torch.device) -> None:
        autograd.start_compiles(self._key, dtype, device)

    def _current_key(self) -> str:
        """The registry key of the spec as the buffers are now: read again from the module
        when they changed since the last call (a state dict with other U matrices gets kernels
        of its own), never a stale one."""
        self._reread_spec(self._buffers_seen, lambda: _contraction_spec(self.sync_original()),
                          "the symmetric contraction")
        return self._key

    def weights(self) -> List[torch.Tensor]:
        """The element-indexed weights ``[Z, K, C]`` in the op's order (live parameters)."""
        return [w for contraction in self.contractions
                for w in (contraction.weights_max, *contraction.weights)]

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``[N, C * sum(2L+1)]``: the product basis of ``x [N, C, D]`` for elements
        ``y [N, Z]`` (one-hot node attributes)."""
        s = self.spec
        if x.dim() != 3 or tuple(x.shape[1:]) != (s.num_features, s.num_components):
            raise InputError(f"node_feats must have shape [n_nodes, {s.num_features}, "
                             f"{s.num_components}] for {s.describe()}, got {tuple(x.shape)}")
        if y.dim() != 2 or y.shape[0] != x.shape[0] or y.shape[1] != s.num_elements:
            raise InputError(f"node_attrs must have shape [{x.shape[0]}, {s.num_elements}], got "
                             f"{tuple(y.shape)}")
        if self.options.check_indices:
            check_one_hot(y, "symmetric contraction")
        key = self._current_key()
        elem = element_index(y)
        weights = [w.to(x.dtype) for w in self.weights()]
        return autograd.symmetric_contraction(key, x, elem, weights, self.backend)


class ProductBlockPatch(SubmodulePatch):
    """Fuses the symmetric contraction of each MACE product block."""

    name = "product_block"

    def applies_to(self, module: torch.nn.Module) -> bool:
        return hasattr(module, "symmetric_contractions") and (
            type(module).__name__ == "EquivariantProductBasisBlock"
            or type(module).__name__.endswith("ProductBasisBlock"))

    def plan_parts(self, module: torch.nn.Module, options: AccelOptions) -> List[PartPlan]:
        return [self._plan_contraction(module, options),
                plan_linears(module, ("linear",), options)]

    def _plan_contraction(self, module: torch.nn.Module, options: AccelOptions) -> PartPlan:
        if not options.fuses(PART):
            return PartPlan.not_asked(PART)
        original = module.symmetric_contractions
        spec, reason = _spec_or_reason(module)
        if spec is None:
            return PartPlan(PART, reason=reason)
        return PartPlan(PART, children={
            "symmetric_contractions": lambda: FusedSymmetricContraction(original, spec, options)},
            detail=spec.describe())


def _spec_or_reason(module: torch.nn.Module):
    """``(SCSpec, None)`` for a product block the kernels take, else ``(None, reason)``."""
    sc = module.symmetric_contractions
    cueq = getattr(module, "cueq_config", None)
    if cueq is not None and getattr(cueq, "enabled", False) and (
            getattr(cueq, "optimize_all", False) or getattr(cueq, "optimize_symmetric", False)):
        return None, ("the product block runs cuEquivariance's symmetric contraction; convert "
                      "the model back to e3nn with mace's convert_cueq_e3nn first")
    return _contraction_spec(sc)


def _contraction_spec(sc: torch.nn.Module):
    """``(SCSpec, None)`` of a mace ``SymmetricContraction`` the kernels take, else
    ``(None, reason)``."""
    if type(sc).__name__ != "SymmetricContraction" or \
            not isinstance(getattr(sc, "contractions", None), torch.nn.ModuleList):
        return None, (f"symmetric_contractions is {type(sc).__module__}.{type(sc).__name__}, "
                      "not mace's SymmetricContraction (or one rewritten by torch.fx, as "
                      "mace.tools.compile.simplify does)")
    for contraction in sc.contractions:
        if not hasattr(contraction, "weights_max"):
            return None, "a contraction has external weights (internal_weights=False)"
    try:
        spec = spec_from_mace(sc)
    except UnsupportedModelError as exc:
        return None, str(exc)
    return spec, None


PATCHES = (ProductBlockPatch(),)

