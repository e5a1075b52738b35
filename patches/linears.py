"""``FusedLinear`` and ``FusedSkip``: e3nn ``o3.Linear`` and MACE's element-dependent skip tensor
product (``FullyConnectedTensorProduct(node_feats, one-hot Zx0e)``) as one generated kernel
per pass (:mod:`mace_accel.ops.irreps_linear`).

e3nn's linear splits the row per irrep, runs a GEMM per path between copies, and its backward
fills and adds full-size zero gradients per path; the skip tensor product multiplies by the
whole one-hot (a GEMM ``Z`` times larger than needed). Here each is one kernel forward and one
backward. The effective weights (path weights folded in, and their transpose for the backward)
are cached while the parameters are unchanged and need no gradient.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from mace_accel.errors import InputError
from mace_accel.ops.irreps_linear import autograd, gemm
from mace_accel.ops.irreps_linear import spec as linear_spec
from mace_accel.ops.irreps_linear.spec import LinearSpec, transpose_weights
from mace_accel.options import AccelOptions
from mace_accel.patches.adopt import FusedModule
from mace_accel.patches.edge_vectors import element_index
from mace_accel.profiling import part_range


def check_one_hot(y: torch.Tensor, who: str) -> None:
    """Raise :class:`InputError` unless every row of ``y`` is one-hot."""
    ones = (y == 1).sum(dim=-1)
    if not bool(((y == 0) | (y == 1)).all()) or not bool((ones == 1).all()):
        raise InputError(f"node_attrs are not one-hot: the fused {who} gathers one element's "
                         "weights per node; revert the model to run mace's weighted mix of "
                         "elements")


class _FusedLinearBase(FusedModule):
    part = "linears"
    register_spec = staticmethod(autograd.register_spec)

    def __init__(self, original: torch.nn.Module, spec: LinearSpec, scales: List[float],
                 z_inside: bool, options: AccelOptions) -> None:
        super().__init__(original, options)
        self._use_spec(spec)
        self.irreps_in = getattr(original, "irreps_in", getattr(original, "irreps_in1", None))
        self.irreps_out = getattr(original, "irreps_out", None)
        self._scales, self._z_inside = list(scales), z_inside

    def describe(self) -> str:
        if not gemm.runs_on(self.spec):
            return self.spec.describe()
        ways = []
        if self.spec.weight_numel >= gemm.MIN_WEIGHTS_FLOAT64:
            ways.append(f"float64 from {gemm.MIN_NODES_FLOAT64} nodes as cuBLAS GEMMs")
        if self.spec.weight_numel >= gemm.MIN_WEIGHTS_FLOAT32 \
                and gemm.grouped_in_float32(self.spec):
            ways.append(f"float32 as grouped 3xFP16 GEMMs from {gemm.MIN_NODES_FLOAT32} nodes")
        if not ways:
            return self.spec.describe()
        return f"{self.spec.describe()}; on the tensor cores: {', '.join(ways)}"

    def _weights(self, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """The op's effective weights and their transpose (what the backward applies)."""
        def build(dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
            w = linear_spec.effective_weights(self.spec, weight, self._scales,
                                              self._z_inside).to(dtype).contiguous()
            return w, transpose_weights(self.spec, w).contiguous()

        weight = self._parameters["weight"]
        return self._derived("weights", [weight], dtype, build)

    def start_compiles(self, dtype: torch.dtype, device: torch.device) -> None:
        autograd.start_compiles(self._key, dtype, device)

    def _apply_map(self, x: torch.Tensor, elem: torch.Tensor,
                   key: Optional[str] = None) -> torch.Tensor:
        """The map of spec ``key`` (default: this module's) on ``x [N, dim_in]``."""
        if x.dim() != 2 or x.shape[1] != self.spec.dim_in:
            raise InputError(f"node features must have shape [n_nodes, {self.spec.dim_in}] for "
                             f"{self.describe()}, got {tuple(x.shape)}")
        w, wt = self._weights(x.dtype)
        return autograd.irreps_linear(key or self._key, x, w, wt, elem, self.backend)


class FusedLinear(_FusedLinearBase):
    """An e3nn ``o3.Linear``: ``x [N, dim_in] -> [N, dim_out]``."""

    def __init__(self, original: torch.nn.Module, options: AccelOptions) -> None:
        super().__init__(original, linear_spec.linear_spec(original),
                         linear_spec.linear_scales(original), False, options)
        self._fed_key = self._register_fed()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply_map(x, x.new_empty((0,), dtype=torch.int32))

    def fed_columns(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, r]``: the leading ``r`` columns of ``forward(x)``, those its instructions
        feed; the trailing blocks that none feeds (zero) are neither written nor differentiated
        (``r = dim_out`` where every block is fed). For a caller that reads the rest as zero;
        its kernels compile at its first call (most models never make one)."""
        with part_range(self.part):  # called by a fused block, not through forward's hooks
            return self._apply_map(x, x.new_empty((0,), dtype=torch.int32), self._fed_key)

    def _register_fed(self) -> Optional[str]:
        fed = self.spec.fed_prefix()
        return None if fed is None else autograd.register_spec(fed)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self._fed_key = self._register_fed()


class FusedSkip(_FusedLinearBase):
    """MACE's skip tensor product ``(node_feats [N, dim_in], node_attrs [N, Z] one-hot)``."""

    part = "skip"

    def __init__(self, original: torch.nn.Module, options: AccelOptions) -> None:
        super().__init__(original, linear_spec.skip_spec(original),
                         linear_spec.skip_scales(original), True, options)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = self.spec.num_elements
        if y.dim() != 2 or y.shape[0] != x.shape[0] or y.shape[1] != z:
            raise InputError(f"node_attrs must have shape [{x.shape[0]}, {z}], got "
                             f"{tuple(y.shape)}")
        if self.options.check_indices:
            check_one_hot(y, "skip connection")
        return self._apply_map(x, element_index(y))


def linear_reason(module: object) -> Optional[str]:
    """Why ``module`` cannot become a :class:`FusedLinear`, or None."""
    cls = type(module)
    if cls.__name__ != "Linear" or not cls.__module__.startswith("e3nn."):
        return f"{cls.__module__}.{cls.__name__} is not an e3nn o3.Linear"
    return linear_spec.linear_reason(module)
