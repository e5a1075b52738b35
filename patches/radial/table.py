"""The radial MLPs as tables in the edge length (:mod:`mace_accel.ops.radial.table`) inside a
patched model.

An interaction block's radial MLP maps the radial embedding of each edge's length to its TP
weights, so where its input is the model's fused radial embedding
(:class:`~mace_accel.patches.edge_features.FusedRadialEmbedding`) its output is a function of
the length, and of the edge's two elements where the embedding has a distance transform (their
covalent radii scale it: MACE-MPA-0 and later) or the block embeds the elements (the
non-linear blocks of MACE-MH-1): then one table per pair of elements
(:class:`~mace_accel.ops.species.PairSet`), laid end to end, each edge reading its pair's.

:func:`link` gives every fused radial MLP the model's embedding and tells the embedding which
pairs to tell apart; at a call, :func:`table_input` finds the lengths (and the edges' table
slots) behind the MLP's input (the embedding's last output, the very tensor); :func:`tables_of`
builds the tables once per weights, pairs and dtype (in float64, from the embedding's spec as
torch ops and the MLP's weights, checked between the nodes) and :func:`lookup` looks the
weights up. Where the tables cannot be built within their tolerance, or would take more than
:data:`TABLE_MEMORY_FRACTION` of the GPU's memory, the MLP runs, and a warning says why once.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, List, Optional, Tuple

import torch

from mace_accel.ops.radial import mlp as radial_mlp
from mace_accel.ops.radial.table import autograd as table_ops
from mace_accel.ops.radial.table.table import SPECS, RadialTable, TableError, build_tables
from mace_accel.ops.species import ORDERED, UNORDERED, PairSet
from mace_accel.patches.adopt import set_link

Tensor = torch.Tensor
# a table larger than this does not stay in L2: walked as the edges come, every edge reads its
# cell's coefficient rows from memory, so the lookups of large tables walk the edges in order of
# table and length (one sort a call, shared by the blocks) from SORT_MIN_EDGES edges (at 20k
# edges, a 126 MB float64 table of 1,280 weights: 233 + 199 us forward + backward unsorted
# against 88 + 97 us sorted). A table that stays in L2 is walked as the edges come: sorting it
# gained nothing end to end (MACE-MP-0, float32: 4% slower at 160k edges, 0.5% faster at 539k),
# while MPA-0's pair tables gained 9-13% (float32) and 31-33% (float64) at 539k edges, lost 3-4%
# at 160k (scripts/bench_model.py table-walks), and in CUDA graphs were even at 20k
# edges and 10% faster at 60k (docs/performance.md)
LARGE_TABLE_BYTES = 32 * 2 ** 20
SORT_MIN_EDGES = 4096
# the most of the GPU's memory one block's tables may take (all pairs of elements together);
# beyond it (many elements in one structure) the block runs its MLP
TABLE_MEMORY_FRACTION = 1 / 16

# pairs (None: one table) -> f(r [N], which [N]): row i at r[i] of table which[i]
PairFunction = Callable[[Optional[List[Tuple[int, int]]]], Callable[[Tensor, Tensor], Tensor]]


def pair_kind(model: torch.nn.Module, embedding) -> Optional[str]:
    """Which pairs of elements a model's radial weights tell apart: ``"ordered"`` where an
    interaction block embeds the sender's and the receiver's elements (the non-linear blocks'
    ``source_embedding`` / ``target_embedding``), ``"unordered"`` where only the embedding's
    distance transform depends on them (symmetric in the two), else None."""
    if any(hasattr(block, "source_embedding") for block in getattr(model, "interactions", ())):
        return ORDERED
    return UNORDERED if embedding.spec.transform is not None else None


def link(model: torch.nn.Module, options) -> Optional[str]:
    """Give each fused radial MLP of ``model`` the model's fused radial embedding (None where
    there is not exactly one) and the embedding the pairs to tell apart where tables may run;
    a line for the report when they may."""
    from mace_accel.patches.edge_features import FusedRadialEmbedding
    from mace_accel.patches.radial.mlp import FusedRadialMLP

    embeddings = [m for m in model.modules() if isinstance(m, FusedRadialEmbedding)]
    mlps = [m for m in model.modules() if isinstance(m, FusedRadialMLP)]
    users = [m for m in model.modules() if getattr(m, "uses_radial_tables", False)]
    embedding = embeddings[0] if len(embeddings) == 1 else None
    for mlp in mlps + users:
        set_link(mlp, "embedding", embedding)
    on = (embedding is not None and bool(mlps or users)
          and getattr(options, "radial_table", False) and options.backend == "cuda")
    if embedding is not None:
        embedding.pair_kind = pair_kind(model, embedding) if on else None
    if not on:
        return None
    f32, f64 = SPECS[torch.float32], SPECS[torch.float64]
    pairs = ("" if embedding.pair_kind is None else
             f", one per {embedding.pair_kind} pair of the elements present")
    return (f"radial tables: the interaction blocks look their radial weights up in Hermite "
            f"tables of the edge length{pairs} (CUDA inference; built in float64 from each "
            "block's radial MLP on first use: float32 cubic, within "
            f"{f32.tolerance:.0e} of the largest weight and {f32.slope_tolerance:.0e} of the "
            f"largest slope between the nodes, float64 quintic, within {f64.tolerance:.0e} "
            f"and {f64.slope_tolerance:.0e}; AccelOptions(radial_table=False) runs the MLP "
            "kernels)")


def _tables_allowed(user, dtype: torch.dtype) -> bool:
    """Whether ``user``'s options and backend let its tables run in ``dtype``: the option on,
    the CUDA backend, float32 or float64 (a call asks more: :func:`table_input`)."""
    return bool(getattr(user.options, "radial_table", False)) and user.backend == "cuda" \
        and dtype in SPECS


def table_input(user, x: Tensor):
    """The :class:`~mace_accel.patches.edge_features.TableInput` behind ``user``'s input ``x``
    where its tables may run: the option on, CUDA float32 or float64, no weight gradient
    (inference), not under ``torch.compile``, and ``x`` the linked embedding's last output;
    else None."""
    embedding = getattr(user, "embedding", None)
    if embedding is None or not _tables_allowed(user, x.dtype) or not x.is_cuda \
            or torch.compiler.is_compiling() or not user._no_weight_grads():
        return None
    found = embedding.table_input(x)
    if found is None or found.lengths.dtype != x.dtype:
        return None
    return found


def start_compiles(user, width: int, dtype: torch.dtype, device: torch.device) -> None:
    """Start compiling the lookups of ``user``'s tables of ``width`` weights a row where
    tables may run (:func:`_tables_allowed`)."""
    if _tables_allowed(user, dtype):
        table_ops.start_compiles(width, dtype, SPECS[dtype].degree, device)


def mlp_function(mlp) -> PairFunction:
    """``pairs -> f(r, which)``: an e3nn ``FullyConnectedNet`` radial MLP
    (:class:`~mace_accel.patches.radial.mlp.FusedRadialMLP`) of the linked embedding's
    features, in float64 (pass ``lambda: mlp_function(mlp)`` to :func:`tables_of`)."""
    embedding = mlp.embedding
    weights = [w.detach().to(torch.float64)
               for w in radial_mlp.effective_weights(mlp.raw_weights(), mlp.spec.scales)]

    def of_pairs(pairs):
        features = embedding.table_function(pairs)
        return lambda r, which: radial_mlp.reference(features(r, which), weights)

    return of_pairs


def squashed(of_pairs: PairFunction) -> PairFunction:
    """``of_pairs`` followed by ``tanh(f^2)`` (a Density block's edge density, tabulated with
    its MLP: no square and tanh over the edges a call)."""
    def wrap(pairs):
        f = of_pairs(pairs)
        return lambda r, which: torch.tanh(f(r, which) ** 2)

    return wrap


def tables_of(user, name: str, params: List[Tensor], make_function: Callable[[], PairFunction],
              pairs: Optional[PairSet], like: Tensor) -> Optional[Tuple[RadialTable, Tensor]]:
    """``(tables, their coefficients in like's dtype on like's device)`` of the function
    ``make_function()`` gives (``pair -> f(r)``; one table per pair of ``pairs``, or one),
    built on first use and again when ``params``, the embedding, the pairs or the dtype change
    (``user._derived``; ``make_function`` is called only then); None (and a warning, once)
    where they cannot be built within the tolerance or the memory allowed."""
    embedding = user.embedding
    key = f"radial_table:{name}:{embedding._current_key()}:{pairs}"
    if (key, like.dtype) in user._kernels:  # could not be built for these weights: the MLP
        return None
    if key not in user._kernels:  # another set of elements: its tables replace the old ones
        for old in [k for k in user._kernels if isinstance(k, str)
                    and k.startswith(f"radial_table:{name}:") and k != key]:
            del user._kernels[old]

    def build(dtype: torch.dtype):
        spec = SPECS[dtype]
        count = 1 if pairs is None else pairs.count
        function = make_function()(None if pairs is None else pairs.pairs())
        width = int(function(torch.ones(1, dtype=torch.float64, device=like.device),
                             torch.zeros(1, dtype=torch.long, device=like.device)).shape[-1])
        bytes_each = (spec.degree + 1) * width * torch.finfo(dtype).bits // 8
        budget = _memory_budget(like.device)
        # the most cells the budget allows (the tables of a finer grid are not built at all)
        most = budget // max(1, count * bytes_each)
        if most < spec.first_cells:
            return TableError(f"{count} tables of {width} weights would take more than "
                              f"{budget / 2 ** 30:.1f} GB ({TABLE_MEMORY_FRACTION:.3g} of the "
                              "GPU's memory)")
        limited = dataclasses.replace(spec, max_cells=min(spec.max_cells, int(most)))
        try:
            table = build_tables(function, count, embedding.spec.r_max,
                                 torch.zeros(1, dtype=torch.float64, device=like.device),
                                 limited, dtype)
        except TableError as err:
            # a new error, not ``err``: the cache keeps what is returned, and err's traceback
            # would keep the build's float64 tensors (gigabytes) alive with the model
            if limited.max_cells < spec.max_cells:
                return TableError(f"{err} ({count} tables of a finer grid would take more than "
                                  f"{budget / 2 ** 30:.1f} GB, {TABLE_MEMORY_FRACTION:.3g} of "
                                  "the GPU's memory)")
            return TableError(str(err))
        # only the coefficients in the model's dtype are kept (not the float64 build as well)
        table = dataclasses.replace(table, coeffs=table.coeffs.to(dtype).contiguous())
        return table, table.coeffs

    got = user._derived(key, params, like.dtype, build)
    if isinstance(got, TableError):
        user._kernels[(key, like.dtype)] = str(got)
        warnings.warn(f"mace-accel: {user.describe_radial()} runs as an MLP, not as tables: "
                      f"{got}", RuntimeWarning, stacklevel=3)
        return None
    return got


def _memory_budget(device: torch.device) -> int:
    if device.type != "cuda":
        return 1 << 62
    return int(torch.cuda.get_device_properties(device).total_memory * TABLE_MEMORY_FRACTION)


def lookup(user, found, tables: Tuple[RadialTable, Tensor]) -> Tensor:
    """``[E, n]``: the weights of the edges of ``found`` (:func:`table_input`) looked up in
    ``tables`` (:func:`tables_of`)."""
    table, coeffs = tables
    embedding = user.embedding
    count = None if found.slots is None else table.tables
    order = (embedding.length_order(found.lengths, found.slots, count)
             if walks_sorted(found.lengths.shape[0], coeffs, table.tables) else None)
    return table_ops.lookup(found.lengths, order, coeffs, table.inv_h, found.slots,
                            table.tables)


def walks_sorted(edges: int, coeffs: Tensor, tables: int = 1) -> bool:
    """Whether the lookups of ``edges`` edges in the tables ``coeffs`` walk them in order of
    table and length: tables larger than :data:`LARGE_TABLE_BYTES`, from
    :data:`SORT_MIN_EDGES` edges."""
    large = coeffs.numel() * coeffs.element_size() > LARGE_TABLE_BYTES
    return large and edges >= SORT_MIN_EDGES


def describe(user, name: str) -> Optional[str]:
    """The report's words on ``user``'s tables ``name`` where they were built (else None)."""
    embedding = getattr(user, "embedding", None)
    if embedding is None:
        return None
    prefix = f"radial_table:{name}:{embedding._current_key()}:"
    failed = [v for k, v in user._kernels.items()
              if isinstance(k, tuple) and isinstance(k[0], str) and k[0].startswith(prefix)]
    if failed:
        return f"runs as an MLP, not as tables: {failed[0]}"
    built = [v for k, v in user._kernels.items() if isinstance(k, str) and k.startswith(prefix)]
    if not built or isinstance(built[-1][1], TableError):
        return None
    table, coeffs = built[-1][1]
    return f"looked up in {table.describe(coeffs.dtype)}"
