"""``FusedRadialMLP``: the module that replaces an interaction block's ``conv_tp_weights`` (an
e3nn ``FullyConnectedNet`` with SiLU), computing the per-edge TP weights with the constants
folded into the weights (:mod:`mace_accel.ops.radial.mlp`).

The folded weights are cached while the parameters are unchanged and nobody asks for their
gradient (inference), so a call (and a captured CUDA graph) runs only the GEMMs and SiLUs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional, Tuple

import torch

from mace_accel.errors import InputError
from mace_accel.ops.radial import mlp as radial_mlp
from mace_accel.ops.conv_tp import folded
from mace_accel.profiling import RADIAL_MLP, part_range
from mace_accel.options import AccelOptions
from mace_accel.patches.radial import table as radial_table
from mace_accel.patches.adopt import FusedModule, grads_wanted

PART = "radial_mlp"
# Where the tables do not run, every layer is a cuBLAS GEMM (with a SiLU pass after each hidden
# one), float32 and float64: 3xTF32 kernels of our own with the SiLU in their epilogue were not
# 5% faster end to end on any path (docs/performance.md, "The radial MLP without tables").


@dataclasses.dataclass(frozen=True)
class RadialMLPSpec:
    """The layer sizes ``hs`` ``[h0, ..., h_L]`` and the folded weights' scales."""

    hs: Tuple[int, ...]
    scales: Tuple[float, ...]

    def describe(self, folded: bool = False) -> str:
        head = (f"MLP {'->'.join(map(str, self.hs))} (SiLU), constants folded, a GEMM per "
                "layer; ")
        if folded:
            return head + (f"last layer folded into the conv (it takes the hidden [E, "
                           f"{self.hs[-2]}]; the TP weights [E, {self.hs[-1]}] are recomputed "
                           "in the backward when large)")
        return head + f"the TP weights [E, {self.hs[-1]}] are written"


@dataclasses.dataclass(frozen=True)
class RadialRoute:
    """How one call of a block's radial MLP runs: decided once per call by
    :meth:`FusedRadialMLP.route`, followed by the MLP and read by the block's fused conv
    (:meth:`FusedRadialMLP.route_for`), which neither decides again nor guesses from widths.

    Attributes:
        path: ``"table"`` (looked up in the radial tables) or ``"layers"`` (a GEMM and a
            SiLU per layer).
        full_output: the MLP hands over the TP weights ``[E, h_L]``; else (its last layer
            folded into the conv) the hidden activations ``[E, h_{L-1}]``.
        recompute: the TP weights are recomputed in the backward instead of kept (the folded
            conv recomputes them).
        n_edges, dtype, device: the call it was made for.
        tables: ``(found, tables)`` for the ``"table"`` path (what
            :func:`~mace_accel.patches.radial.table.lookup` takes), else None.
    """

    path: str
    full_output: bool
    recompute: bool
    n_edges: int
    dtype: torch.dtype
    device: torch.device
    tables: Optional[tuple] = dataclasses.field(default=None, compare=False, repr=False)

    def fits(self, t: torch.Tensor) -> bool:
        """Whether this route was made for a call on ``t``'s edges, dtype and device."""
        return (int(t.shape[0]) == self.n_edges and t.dtype == self.dtype
                and t.device == self.device)


def _is_silu(f) -> bool:
    return f is torch.nn.functional.silu or isinstance(f, torch.nn.SiLU)


def spec_or_reason(net: torch.nn.Module) -> Tuple[Optional[RadialMLPSpec], Optional[str]]:
    """``(spec, None)`` for an e3nn ``FullyConnectedNet`` with SiLU hidden layers and a linear
    last layer, else ``(None, why not)``."""
    cls = type(net)
    if cls.__name__ != "FullyConnectedNet" or not cls.__module__.startswith("e3nn."):
        return None, (f"conv_tp_weights is {cls.__module__}.{cls.__name__}, not e3nn's "
                      "FullyConnectedNet (mace's LayerNorm RadialMLP runs as it is)")
    layers = [m for _, m in sorted(net._modules.items(), key=lambda kv: int(kv[0][5:]))
              if m is not None] if all(k.startswith("layer") for k in net._modules) else []
    if not layers:
        return None, "FullyConnectedNet without layer0..layerN children"
    cst: List[float] = []
    for i, layer in enumerate(layers):
        act = getattr(layer, "act", None)
        last = i == len(layers) - 1
        if last:
            if act is not None:
                return None, "the last layer has an activation (out_act=True)"
            continue
        if act is None:
            return None, f"hidden layer {i} has no activation"
        f = getattr(act, "f", act)
        if not _is_silu(f):
            return None, f"hidden layer {i} uses {getattr(f, '__name__', f)!r}, not SiLU"
        cst.append(1.0 if getattr(act, "_is_id", False) or not hasattr(act, "cst")
                   else float(act.cst))
    hs = (int(layers[0].h_in), *(int(layer.h_out) for layer in layers))
    scales = radial_mlp.layer_scales([float(m.h_in) for m in layers],
                                     [float(m.var_in) for m in layers],
                                     [float(m.var_out) for m in layers], cst)
    return RadialMLPSpec(hs, tuple(scales)), None


def _column_major(w: torch.Tensor) -> torch.Tensor:
    """``w [k, n]`` stored transposed (a view of a contiguous ``[n, k]``): cuBLAS runs both the
    forward ``h @ w`` and the backward ``g @ w.t()`` faster so
    (``scripts/bench_kernels.py gemm-layouts`` compares the layouts on MACE-MP's shapes)."""
    return w.t().contiguous().t()


class FusedRadialMLP(FusedModule):
    """The block's radial MLP: ``edge_feats [E, h0] -> tp_weights [E, h_L]``, or, with
    ``fold_last``, the last hidden activation ``[E, h_{L-1}]``: the block's fused conv then
    applies the last layer (:meth:`last_weight`) itself (:mod:`mace_accel.ops.conv_tp.folded`).

    Args:
        original: the e3nn ``FullyConnectedNet``.
        spec: its :class:`RadialMLPSpec`.
        options: the acceleration options.
        fold_last: leave the last layer to the convolution.
    """

    part = PART

    def __init__(self, original: torch.nn.Module, spec: RadialMLPSpec,
                 options: AccelOptions, fold_last: bool = False) -> None:
        super().__init__(original, options)
        self.spec = spec
        self.hs = list(spec.hs)
        self.fold_last = fold_last
        self._names = sorted(original._modules, key=lambda k: int(k[5:]))

    def describe(self) -> str:
        head = self.spec.describe(self.fold_last)
        if self.backend != "cuda":
            return head
        table = radial_table.describe(self, "mlp") or radial_table.describe(self, "density")
        return (head + "; every layer on cuBLAS"
                + ("" if table is None else f"; at inference: {table}"))

    def describe_radial(self) -> str:
        """A few words naming this MLP (for warnings)."""
        return f"the radial MLP {'->'.join(map(str, self.hs))}"

    def __setstate__(self, state) -> None:
        state.setdefault("fold_last", False)  # saved before the fold existed
        state.setdefault("embedding", None)  # linked by radial_table.link (older saves: none)
        super().__setstate__(state)

    def raw_weights(self) -> List[torch.Tensor]:
        """The layers' parameters ``[h_i, h_{i+1}]`` as e3nn stores them (unscaled)."""
        return [self._modules[name].weight for name in self._names]

    def _weights(self, dtype: torch.dtype) -> List[torch.Tensor]:
        def fold(dtype: torch.dtype) -> List[torch.Tensor]:
            return [_column_major(w.to(dtype))
                    for w in radial_mlp.effective_weights(raw, self.spec.scales)]

        raw = self.raw_weights()
        return self._derived("weights", raw, dtype, fold)

    def last_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``[h_{L-1}, h_L]`` the last layer's folded weight (column-major)."""
        return self._weights(dtype)[-1]

    def last_layer(self, hidden: torch.Tensor,
                   w: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[E, h_L]`` = ``hidden [E, h_{L-1}] @ W_last`` (differentiable); ``w``: the folded
        ``W_last`` where the caller has it already (else fetched: built again when training).
        On cuBLAS (GEMMs of our own on the tensor cores, 3xTF32 and float64 DMMA, were not 5%
        faster end to end: docs/performance.md, "The radial MLP without tables"). Profiled as
        radial-MLP work wherever it is called from (the fused conv applies it when the last
        layer is folded in)."""
        if w is None:
            w = self.last_weight(hidden.dtype)
        with part_range(RADIAL_MLP):
            return torch.mm(hidden, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[E, h_L]`` per-edge TP weights of the radial features ``x [E, h0]``
        (with ``fold_last``: ``[E, h_{L-1}]`` hidden activations, unless the call's
        :meth:`route` gives the full weights; the conv reads it, :meth:`route_for`). Where the
        model's radial MLPs are linked (:mod:`~mace_accel.patches.radial.overlap`), a later
        block's may have been started already beside the earlier blocks' work."""
        self._check_input(x)
        overlap = getattr(self, "overlap", None)
        return self.compute(x) if overlap is None else overlap(self, x)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 2 or x.shape[1] != self.hs[0]:
            raise InputError(f"edge_feats must have shape [n_edges, {self.hs[0]}] for the "
                             f"radial MLP, got {tuple(x.shape)}")

    def density(self, x: torch.Tensor) -> torch.Tensor:
        """``tanh(forward(x)^2)`` ``[E, h_L]``: a Density block's edge density (its
        ``density_fn`` squashed as mace squashes it), looked up in tables of its own where the
        tables run (no square and tanh over the edges, nor their backward)."""
        self._check_input(x)
        found = None if self.fold_last else radial_table.table_input(self, x)
        if found is not None:
            built = radial_table.tables_of(
                self, "density", self.raw_weights(),
                lambda: radial_table.squashed(radial_table.mlp_function(self)), found.pairs, x)
            if built is not None:
                return radial_table.lookup(self, found, built)
        return torch.tanh(self(x) ** 2)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` on the current stream, ``x`` checked already."""
        route = self.route(x)
        if not torch.compiler.is_compiling():  # dynamo: the conv routes the call itself
            # for the block's conv (route_for); with the kernels, never pickled or copied; not
            # holding the tables, which the next call's build may replace while this is kept
            self._kernels["route"] = dataclasses.replace(route, tables=None)
        if route.path == "table":
            return radial_table.lookup(self, *route.tables)
        weights = self._weights(x.dtype)
        if self.fold_last:
            return radial_mlp.radial_mlp(x, weights[:-1], last_act=True)
        return radial_mlp.radial_mlp(x, weights)

    def start_compiles(self, dtype: torch.dtype, device: torch.device) -> None:
        """The table lookups (what a forces call at inference runs; the MLP's own kernels
        are compiled when a call takes them)."""
        radial_table.start_compiles(self, self.hs[-1], dtype, device)

    def _no_weight_grads(self) -> bool:
        """Whether no gradient of the weights is asked for (inference: the tables run only
        then, :func:`~mace_accel.patches.radial.table.table_input`)."""
        return not grads_wanted(self.raw_weights())

    def route(self, x: torch.Tensor, tables: bool = True) -> RadialRoute:
        """How the call on ``x [E, h0]`` runs (:class:`RadialRoute`): the radial tables
        (``tables``, CUDA inference on the linked embedding's last output, built on first use;
        with ``fold_last`` only where the conv keeps the full TP weights), else the layers one
        by one."""
        n, dtype, device = int(x.shape[0]), x.dtype, x.device
        recompute = folded.recompute_weights(self.options.recompute_tp_weights, n,
                                             self.hs[-1], dtype, device)
        # the folded conv recomputes the TP weights from the hidden activations; where the
        # widths are equal it could not tell full weights from hidden ones
        keeps_full = not self.fold_last or (self.hs[-1] != self.hs[-2] and not recompute)
        route = functools.partial(RadialRoute, recompute=recompute, n_edges=n, dtype=dtype,
                                  device=device)
        found = radial_table.table_input(self, x) if tables and keeps_full else None
        if found is not None:
            built = radial_table.tables_of(self, "mlp", self.raw_weights(),
                                           lambda: radial_table.mlp_function(self),
                                           found.pairs, x)
            if built is not None:
                return route("table", True, tables=(found, built))
        return route("layers", not self.fold_last)

    def route_for(self, tp_weights: torch.Tensor) -> RadialRoute:
        """The route of the call whose output ``tp_weights [E, ...]`` the block's conv was
        handed (scaled by the cutoff, say): the one this module's last call made, or, under
        ``torch.compile`` (which runs no tables), the same decision made again."""
        route = self._kernels.get("route")
        if torch.compiler.is_compiling() or route is None or not route.fits(tp_weights):
            route = self.route(tp_weights, tables=False)
        return route
