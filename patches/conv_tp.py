"""``FusedConvTP``: the module that replaces an interaction block's e3nn ``conv_tp``.

It takes MACE's fused call ``(node_feats, edge_attrs, tp_weights, edge_index)`` and returns the
message ``[n_nodes, irreps_out.dim]`` (gather by sender, TP, scatter-sum to receiver) in one op.

The original e3nn module is kept inside (``.original``) and its parameters, buffers and
submodules are *adopted* under the same names, so the model's ``state_dict`` keys and values do
not change and ``revert`` hands back the very same object. Compiled kernels are never pickled:
they are rebuilt on first use after unpickling.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from mace_accel import ops, reference
from mace_accel.errors import InputError
from mace_accel.graph import graph_from_edge_index
from mace_accel.spec import TPSpec

BACKENDS = ("cuda", "reference")


class FusedConvTP(torch.nn.Module):
    """Fused gather + tensor product + scatter-sum for one interaction block.

    Args:
        original: the block's e3nn ``o3.TensorProduct``.
        spec: its frozen :class:`~mace_accel.spec.TPSpec`.
        backend: ``"cuda"`` (generated kernels) or ``"reference"`` (plain torch).
        deterministic: CUDA backend only; no float atomics (the default).
        check_indices: validate edge_index ranges before each call (synchronises; debugging).
    """

    def __init__(self, original: torch.nn.Module, spec: TPSpec, backend: str = "cuda",
                 deterministic: bool = True, check_indices: bool = False) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        object.__setattr__(self, "original", original)  # kept, but not as a child module
        for name, p in original._parameters.items():
            self._parameters[name] = p
        for name, b in original._buffers.items():
            self._buffers[name] = b
        self._non_persistent_buffers_set.update(original._non_persistent_buffers_set)
        for name, m in original._modules.items():
            self._modules[name] = m
        self.spec = spec
        self.backend = backend
        self.deterministic = deterministic
        self.check_indices = check_indices
        self.irreps_in1 = getattr(original, "irreps_in1", None)
        self.irreps_in2 = getattr(original, "irreps_in2", None)
        self.irreps_out = getattr(original, "irreps_out", None)
        self.weight_numel = spec.weight_numel
        self._kernels: Dict[Tuple[torch.dtype, torch.device], Any] = {}

    # -- state -------------------------------------------------------------------------------
    def sync_original(self) -> torch.nn.Module:
        """Write adopted tensors (possibly moved/cast since) back into the original module."""
        for name in list(self.original._parameters):
            self.original._parameters[name] = self._parameters[name]
        for name in list(self.original._buffers):
            self.original._buffers[name] = self._buffers[name]
        return self.original

    def __getstate__(self) -> Dict[str, Any]:
        self.sync_original()
        state = self.__dict__.copy()
        state["_kernels"] = {}  # binaries never travel; rebuilt on first call
        # e3nn's generated submodules only pickle through the original's own __getstate__;
        # re-adopt them on load
        state["_modules"] = {k: v for k, v in self._modules.items()
                             if k not in self.original._modules}
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        for name, m in self.original._modules.items():
            self._modules[name] = m

    def extra_repr(self) -> str:
        return f"{self.spec.describe()}, backend={self.backend!r}"

    # -- call ----------------------------------------------------------------------------------
    def forward(self, node_feats: torch.Tensor, edge_attrs: torch.Tensor,
                tp_weights: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        """Message ``[n_nodes, dim_out]``.

        Args:
            node_feats: ``[n_nodes, dim_in1]``; edge_attrs: ``[n_edges, dim_in2]``;
            tp_weights: ``[n_edges, weight_numel]``; edge_index: ``[2, n_edges]`` (sender, receiver).
        """
        self._check(node_feats, edge_attrs, tp_weights, edge_index)
        graph = graph_from_edge_index(edge_index, node_feats.shape[0], self.check_indices)
        if self.backend == "reference":
            return reference.conv_tp(self.spec, node_feats, edge_attrs, tp_weights,
                                     graph.sender, graph.receiver, graph.n_nodes)
        return ops.conv_tp(self._cuda_primitives(node_feats), graph, node_feats, edge_attrs,
                           tp_weights)

    def _cuda_primitives(self, like: torch.Tensor):
        key = (like.dtype, like.device)
        prims = self._kernels.get(key)
        if prims is None:
            from mace_accel.runtime import CudaConvPrimitives

            prims = CudaConvPrimitives(self.spec, like.dtype, like.device,
                                       deterministic=self.deterministic)
            self._kernels[key] = prims
        return prims

    def _check(self, node_feats, edge_attrs, tp_weights, edge_index) -> None:
        s = self.spec
        expected = (("node_feats", node_feats, s.dim_in1), ("edge_attrs", edge_attrs, s.dim_in2),
                    ("tp_weights", tp_weights, s.weight_numel))
        for name, t, dim in expected:
            if t.dim() != 2 or t.shape[1] != dim:
                raise InputError(f"{name} must have shape [n, {dim}] for {s.describe()}, "
                                 f"got {tuple(t.shape)}")
        if edge_attrs.shape[0] != tp_weights.shape[0] or edge_index.shape[-1] != edge_attrs.shape[0]:
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
