"""The radial MLPs as tables in the edge length (:mod:`mace_accel.ops.radial_table`) inside a
patched model.

An interaction block's radial MLP maps the radial embedding of each edge's length to its TP
weights, so where its input is the model's fused radial embedding
(:class:`~mace_accel.patches.edge_features.FusedRadialEmbedding`: a function of the lengths
alone) its output is a function of the length. :func:`link` gives every fused radial MLP the
model's embedding; at a call, :func:`lengths_for` finds the lengths behind the MLP's input (the
embedding's last output, the very tensor); :func:`lookup` builds the table once per weights
and dtype (in float64, from the embedding's spec as torch ops and the MLP's folded weights,
checked between the nodes) and looks the weights up. Where the table cannot be built within its tolerance the MLP
runs, and a warning says why once.
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

import torch

from mace_accel.ops import radial_mlp
from mace_accel.ops.radial_table import autograd as table_ops
from mace_accel.ops.radial_table.table import SPECS, RadialTable, TableError, build_table

Tensor = torch.Tensor
# from this many edges the lookups walk the edges in order of length (one sort a call, shared
# by the blocks): at 539k edges on an H200 sorted lookups took 0.58x (forward) the time of
# unsorted ones, sort included; at 20k, for a table that stays in L2, the sort costs about
# what it saves
SORT_MIN_EDGES = 65536
# a table larger than this does not stay in L2: walked as the edges come, every edge reads its
# cell's coefficient rows from memory (at 20k edges, a 126 MB float64 table of 1,280 weights:
# 233 + 199 us forward + backward against 88 + 97 us sorted), so these sort from
# SORT_MIN_EDGES_LARGE_TABLE edges (an estimate from those figures, not measured between 1k
# and 20k edges). MACE-MP medium: float64 96 and 240 MB, float32 16 and 40 MB (the 256-atom
# graphs: float64 1.317 -> 1.159 ms, float32 0.739 -> 0.733 ms)
LARGE_TABLE_BYTES = 32 * 2 ** 20
SORT_MIN_EDGES_LARGE_TABLE = 4096


def link(model: torch.nn.Module, options) -> Optional[str]:
    """Give each fused radial MLP of ``model`` the model's fused radial embedding (None where
    there is not exactly one); a line for the report when the tables may run."""
    from mace_accel.patches.edge_features import FusedRadialEmbedding
    from mace_accel.patches.radial_mlp import FusedRadialMLP

    embeddings = [m for m in model.modules() if isinstance(m, FusedRadialEmbedding)]
    mlps = [m for m in model.modules() if isinstance(m, FusedRadialMLP)]
    embedding = embeddings[0] if len(embeddings) == 1 else None
    for mlp in mlps:
        mlp.__dict__["embedding"] = embedding  # not a child: no second state-dict entry
    if embedding is None or not mlps or not getattr(options, "radial_table", False) \
            or options.backend != "cuda":
        return None
    return (f"radial tables: the {len(mlps)} interaction blocks look their TP weights up in a "
            "Hermite table of the edge length (CUDA inference; built in float64 from each "
            "block's radial MLP on first use: float32 cubic, within 1e-7 of the largest "
            "weight and 5e-7 of the largest slope between the nodes, float64 quintic, within "
            "1e-13 and 2e-12; AccelOptions(radial_table=False) runs the MLP kernels)")


def lengths_for(mlp, x: Tensor) -> Optional[Tensor]:
    """The edge lengths ``[E]`` behind ``mlp``'s input ``x`` where its table may run: the
    option on, CUDA float32 or float64, no weight gradient (inference), not under
    ``torch.compile``, and ``x`` the linked embedding's last output; else None."""
    embedding = mlp.__dict__.get("embedding")
    if embedding is None or not getattr(mlp.options, "radial_table", False) \
            or mlp.backend != "cuda" or not x.is_cuda or x.dtype not in SPECS \
            or torch.compiler.is_compiling() or not mlp._no_weight_grads():
        return None
    lengths = embedding.lengths_for(x)
    if lengths is None or lengths.dtype != x.dtype or table_of(mlp, x) is None:
        return None
    return lengths


def table_of(mlp, like: Tensor) -> Optional[Tuple[RadialTable, Tensor]]:
    """``(table, its coefficients in like's dtype on like's device)`` of ``mlp`` with its
    linked embedding (:data:`~mace_accel.ops.radial_table.table.SPECS`: cubic in float32,
    quintic in float64), built on first use and again when the weights, the embedding or the
    dtype change; None (and a warning, once) where it cannot be built within the tolerance."""
    embedding = mlp.__dict__["embedding"]
    key = embedding._current_key()
    if ("table_failed", key, like.dtype) in mlp._kernels:
        return None

    def build(dtype: torch.dtype):
        weights = [w.to(like.device, torch.float64)
                   for w in radial_mlp.effective_weights(mlp.raw_weights(), mlp.spec.scales)]
        features = embedding.table_function()
        try:
            table = build_table(lambda r: radial_mlp.reference(features(r), weights),
                                embedding.spec.r_max, weights[0], SPECS[dtype], dtype)
        except TableError as err:
            return err
        return table, table.coeffs.to(dtype).contiguous()

    got = mlp._derived(f"radial_table:{key}", mlp.raw_weights(), like.dtype, build)
    if isinstance(got, TableError):
        mlp._kernels[("table_failed", key, like.dtype)] = str(got)
        warnings.warn(f"mace-accel: the radial MLP {mlp.spec.describe()} runs as an MLP, not a "
                      f"table: {got}", RuntimeWarning, stacklevel=3)
        return None
    return got


def lookup(mlp, lengths: Tensor) -> Tensor:
    """``[E, h_L]``: ``mlp``'s TP weights of the edges of ``lengths`` (from
    :func:`lengths_for`) looked up in its table."""
    table, coeffs = table_of(mlp, lengths)
    order = (mlp.__dict__["embedding"].length_order(lengths)
             if walks_sorted(lengths.shape[0], coeffs) else None)
    return table_ops.lookup(lengths, order, coeffs, table.inv_h)


def walks_sorted(edges: int, coeffs: Tensor) -> bool:
    """Whether the lookups of ``edges`` edges in the table ``coeffs`` walk them in order of
    length (see :data:`SORT_MIN_EDGES`, :data:`LARGE_TABLE_BYTES`)."""
    large = coeffs.numel() * coeffs.element_size() > LARGE_TABLE_BYTES
    return edges >= (SORT_MIN_EDGES_LARGE_TABLE if large else SORT_MIN_EDGES)


def describe(mlp) -> Optional[str]:
    """The report's words on ``mlp``'s table where one was built (else None)."""
    embedding = mlp.__dict__.get("embedding")
    if embedding is None:
        return None
    key = embedding._current_key()
    failed = [v for k, v in mlp._kernels.items()
              if isinstance(k, tuple) and k[:2] == ("table_failed", key)]
    if failed:
        return f"the MLP runs, not its table: {failed[0]}"
    cached = mlp._kernels.get(f"radial_table:{key}")
    if cached is None or isinstance(cached[1], TableError):
        return None
    table, coeffs = cached[1]
    return f"looked up in a {table.describe(coeffs.dtype)}"
