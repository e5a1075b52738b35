"""``FusedConvTP``: the module that replaces an interaction block's e3nn ``conv_tp``.

It takes MACE's fused call ``(node_feats, edge_attrs, tp_weights, edge_index)`` and returns the
message ``[n_nodes, irreps_out.dim]`` (gather by sender, TP, scatter-sum to receiver) in one op
(:mod:`mace_accel.ops.conv_tp.autograd`). The original e3nn module is kept inside and its
tensors adopted (:class:`~mace_accel.patches.adopt.FusedModule`).
"""

from __future__ import annotations

from typing import Optional

import torch

from mace_accel.errors import InputError
from mace_accel.ops.conv_tp import autograd, folded
from mace_accel.ops.conv_tp.spec import TPSpec
from mace_accel.ops.graph import graph_from_edge_index
from mace_accel.options import AccelOptions
from mace_accel.patches.adopt import FusedModule
from mace_accel.patches.radial.mlp import FusedRadialMLP


# what the report adds to a conv with the radial MLP's last layer folded in
FOLD_NOTE = "; the radial MLP's last layer folded in"


class FusedConvTP(FusedModule):
    """Fused gather + tensor product + scatter-sum for one interaction block.

    Args:
        original: the block's e3nn ``o3.TensorProduct``.
        spec: its frozen :class:`~mace_accel.ops.conv_tp.spec.TPSpec`.
        options: backend, determinism, index checks.
        radial: the block's fused radial MLP when its last layer is folded in here
            (``fold_last``): the block then hands this module the MLP's hidden activations
            ``[E, hidden]`` as ``tp_weights``, and the last layer runs here, its per-edge
            output recomputed in the backward when large (:mod:`mace_accel.ops.conv_tp.folded`).
            Held as a plain reference: it stays the block's child.
    """

    part = "conv"
    register_spec = staticmethod(autograd.register_spec)

    def __init__(self, original: torch.nn.Module, spec: TPSpec, options: AccelOptions,
                 radial: Optional[FusedRadialMLP] = None) -> None:
        super().__init__(original, options)
        self._use_spec(spec)
        self.irreps_in1 = getattr(original, "irreps_in1", None)
        self.irreps_in2 = getattr(original, "irreps_in2", None)
        self.irreps_out = getattr(original, "irreps_out", None)
        self.weight_numel = spec.weight_numel
        object.__setattr__(self, "radial", radial)  # not a child: no second state-dict entry

    def describe(self) -> str:
        if self.radial is not None:
            return self.spec.describe() + FOLD_NOTE
        return self.spec.describe()

    def start_compiles(self, dtype: torch.dtype, device: torch.device) -> None:
        autograd.start_compiles(self._key, dtype, device, self.options.deterministic)

    def forward(self, node_feats: torch.Tensor, edge_attrs: torch.Tensor,
                tp_weights: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        """Message ``[n_nodes, dim_out]``.

        Args:
            node_feats: ``[n_nodes, dim_in1]``; edge_attrs: ``[n_edges, dim_in2]``;
            tp_weights: ``[n_edges, weight_numel]`` (``[n_edges, hidden]`` when the radial
            MLP's last layer is folded in); edge_index: ``[2, n_edges]`` (sender, receiver).
        """
        # the radial MLP's route for this call says whether it handed over its hidden
        # activations [E, hidden] (its last layer folded in here) or the full TP weights
        route = None if self.radial is None else self.radial.route_for(tp_weights)
        hidden = route is not None and not route.full_output
        self._check(node_feats, edge_attrs, tp_weights, edge_index,
                    self.radial.hs[-2] if hidden else self.spec.weight_numel)
        graph = graph_from_edge_index(edge_index, node_feats.shape[0], self.options.check_indices)
        run = dict(backend=self.options.backend, deterministic=self.options.deterministic)
        if hidden:
            w_last = self.radial.last_weight(tp_weights.dtype)
            if route.recompute:
                return folded.folded_conv_tp(self._key, graph, node_feats, edge_attrs,
                                             tp_weights, w_last, **run)
            tp_weights = self.radial.last_layer(tp_weights, w_last)
        return autograd.conv_tp(self._key, graph, node_feats, edge_attrs, tp_weights, **run)

    def _check(self, node_feats, edge_attrs, tp_weights, edge_index,
               weight_columns: int) -> None:
        s = self.spec
        expected = (("node_feats", node_feats, s.dim_in1), ("edge_attrs", edge_attrs, s.dim_in2),
                    ("tp_weights", tp_weights, weight_columns))
        for name, t, dim in expected:
            if t.dim() != 2 or t.shape[1] != dim:
                raise InputError(f"{name} must have shape [n, {dim}] for {self.describe()}, "
                                 f"got {tuple(t.shape)}")
        n_edges = edge_attrs.shape[0]
        if tp_weights.shape[0] != n_edges or edge_index.shape[-1] != n_edges:
            raise InputError(
                f"edge counts disagree: edge_attrs {edge_attrs.shape[0]}, tp_weights "
                f"{tp_weights.shape[0]}, edge_index {edge_index.shape[-1]}")
        dtypes = {node_feats.dtype, edge_attrs.dtype, tp_weights.dtype}
        if len(dtypes) != 1:
            raise InputError(f"node_feats, edge_attrs and tp_weights must share one dtype, got "
                             f"{sorted(map(str, dtypes))}")
        devices = {node_feats.device, edge_attrs.device, tp_weights.device, edge_index.device}
        if len(devices) != 1:
            raise InputError(f"all inputs must be on one device, got {sorted(map(str, devices))}")

    def __setstate__(self, state) -> None:
        state.setdefault("radial", None)  # saved before the fold existed
        super().__setstate__(state)
