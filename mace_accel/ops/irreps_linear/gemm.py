"""An equivariant linear map as GEMMs on the tensor cores, for many nodes: the generated
kernel runs its multiply-adds on the FMA units. float64 maps with many weights run cuBLAS's
GEMMs (DMMA, twice the FMA units' peak on an H100). float32 maps with many weights
(MACE-MH-1's 512-channel linears) whose blocks all go in one launch run the grouped 3xFP16
kernel (:mod:`.fp16x3`: float32's accuracy on the FP16 tensor cores; on Hopper its ``wgmma``
form, :mod:`.fp16x3_wgmma`), which reads each block's inputs and writes its output in e3nn's
``[N, channel, component]`` layout where they stand (:class:`~.grouped.GroupedSpec`); other
float32 maps keep the generated kernel.

Per output block, the input blocks that feed it (all of one irrep dimension ``d``) are multiplied
by their stacked weights ``[U, V]``. On cuBLAS (float64, and blocks outside the grouped
launch) they are put side by side along the channels, ``[N, d, U]`` (one copy: e3nn's
layout keeps the channel outside the irrep component), and the ``[N, d, V]`` result is copied
into the output block's ``[N, V, d]`` columns. Not for element-indexed weights (the skip
connection), which the generated kernel keeps.
"""

from __future__ import annotations

import weakref
from typing import Dict, FrozenSet, List, NamedTuple, Optional, Tuple

import torch

from mace_accel.ops.irreps_linear import fp16x3, fp16x3_wgmma
from mace_accel.ops.irreps_linear.grouped import (IRREP_DIMS, E3nnBlock, GroupedSpec,
                                                  layout_misfit, unsupported_reason)
from mace_accel.ops.irreps_linear.spec import LinearInstruction, LinearSpec, weight_block
from mace_accel.ops.runtime import aligned16, is_aligned16

Tensor = torch.Tensor
# float64 maps with shared weights run here from this many nodes and weights: the kernel's
# multiply-adds run on the FMA units, cuBLAS's on the DMMA tensor cores (twice their float64
# rate), which overtake it on the MP message map between 700 and 1,200 nodes alone
# (scripts/bench_kernels.py irreps-linear). This path takes 3-5 launches and copies per output
# block, so small cells (the 256-atom graph: 280 nodes) keep the kernel's one, and so do maps
# under 2^18 weights: with MP-0's and MPA-0's (1.6e5 at most) on cuBLAS, eager energy+forces
# evaluations were 1.5x slower at 2,048 atoms and 4.4% faster at 6,912 (docs/performance.md,
# "Why each kernel variant stays"). From 2^18: MACE-MH-1's 512-channel linears (2.6e5 to 1e6
# weights, 5-8 MFLOP a node) and OFF-large's message map (8.5e5).
MIN_NODES_FLOAT64 = 1024
MIN_WEIGHTS_FLOAT64 = 1 << 18
# float32 maps run on the grouped 3xFP16 kernel from this many nodes and weights: a
# 512-channel map of MACE-MH-1 (2.6e5 to 1e6 weights, 5-8 MFLOP a node) is bound by the FMA
# units in the generated kernel. From 2^16 weights (MH-1's linear_up, MACE-MP's 4-path message
# map) rather than 2^18: with the wgmma kernel, an MH-1 energy+forces evaluation 5% faster at
# 256 atoms, 3% at 864 (graph replay), 5% at 6,912; MP-0's 8% and 10% faster at 256 and 864 atoms
# (scripts/bench_model.py replay --linear-thresholds). The one-hot element embeddings
# (4.6e4 weights) keep the kernel. Fewer than 256 nodes not measured.
MIN_NODES_FLOAT32 = 256
MIN_WEIGHTS_FLOAT32 = 1 << 16
# the grouped 3xFP16 kernel on Hopper's wgmma (sm_90): MH-1's maps in 0.44-0.60x the mma.sync
# kernel's time at 256 to 6,912 nodes (see fp16x3_wgmma; a test hook: off, the mma.sync kernel)
_WGMMA = True


def runs_on(spec: LinearSpec) -> bool:
    """Whether :func:`apply` takes ``spec`` (shared weights)."""
    return not spec.indexed


def takes(spec: LinearSpec, dtype: torch.dtype, n_nodes: int, min_nodes_float64: int,
          grouped_float32: bool) -> bool:
    """Whether ``n_nodes`` nodes of ``spec`` in ``dtype`` run here rather than in the kernel;
    ``grouped_float32``: :func:`grouped_in_float32` of ``spec``."""
    if not runs_on(spec):
        return False
    if dtype == torch.float64:
        return n_nodes >= min_nodes_float64 and spec.weight_numel >= MIN_WEIGHTS_FLOAT64
    return dtype == torch.float32 and grouped_float32 and n_nodes >= MIN_NODES_FLOAT32 \
        and spec.weight_numel >= MIN_WEIGHTS_FLOAT32


def grouped_in_float32(spec: LinearSpec) -> bool:
    """Whether every output block of ``spec`` that an input feeds goes in the one launch of the
    grouped 3xFP16 kernel (:func:`grouping`; the unfed ones are zero-filled)."""
    grouped, members = grouping(spec)
    fed = {ins.i_out for ins in spec.instructions}
    return runs_on(spec) and grouped is not None and fed == set(members) \
        and fp16x3.misfit(grouped) is None


# per output block: the instructions that feed it and their stacked weights ``[U, V]`` for
# cuBLAS (None: no instruction feeds it, or the grouped launch takes the block)
Blocks = List[Tuple[List[LinearInstruction], Optional[Tensor]]]


class Prepared(NamedTuple):
    """A map's GEMMs for one weights tensor: ``blocks`` (:data:`Blocks`), and the blocks the
    grouped 3xFP16 kernel takes in one launch (float32 on CUDA): its spec (None: no such
    blocks), the output blocks' indices, its weights split (:func:`~.fp16x3.split_weights`)
    and packed for its wgmma form (None: not on this device)."""

    blocks: Blocks
    grouped: Optional[GroupedSpec] = None
    in_group: FrozenSet[int] = frozenset()
    split: Optional[Tuple[Tensor, Tensor, Tensor]] = None
    packed: Optional[Tuple[Tensor, Tensor, Tensor]] = None


def _feeds(spec: LinearSpec) -> Dict[int, List[LinearInstruction]]:
    """Output block -> the instructions that feed it, in weight order."""
    feeds: Dict[int, List[LinearInstruction]] = {}
    for ins in spec.instructions:
        feeds.setdefault(ins.i_out, []).append(ins)
    return feeds


def grouping(spec: LinearSpec) -> Tuple[Optional[GroupedSpec], List[int]]:
    """The output blocks the grouped kernel can read and write in e3nn's layout where they
    stand (inputs side by side, widths in multiples of 4, aligned for its copies), as one
    :class:`GroupedSpec` (largest irreps first: their tiles are the most; weights ``[n, k]``
    one after another), and their indices; ``(None, [])`` where none can."""
    feeds = _feeds(spec)
    chosen, members, offset = [], [], 0
    for i in sorted(range(len(spec.out_blocks)), key=lambda i: -spec.out_blocks[i].d):
        group, b = feeds.get(i, []), spec.out_blocks[i]
        x_col = _side_by_side(spec, group) if group else None
        k = sum(spec.in_blocks[ins.i_in].mul for ins in group)
        if x_col is None or b.d not in IRREP_DIMS or unsupported_reason(k, b.mul) is not None \
                or layout_misfit(b.d, x_col, k, spec.dim_in, b.offset, b.mul,
                                 spec.dim_out) is not None:
            continue  # cuBLAS on stacked copies
        chosen.append(E3nnBlock(b.d, k, b.mul, x_col, b.offset, offset))
        members.append(i)
        offset += k * b.mul
    if not chosen:
        return None, []
    return GroupedSpec(tuple(chosen), spec.dim_in, spec.dim_out), members


# (id(weights), id(spec)) -> (a weak reference to them, (spec, version), their Prepared), kept
# while the weights live: a captured CUDA graph reads the Prepared's split and packed weights,
# so they must not go while the weights (which the graph's module holds) remain: a bounded
# cache would free them under a graph once enough maps were live, and a replay read freed memory
_PREPARED: Dict[Tuple[int, int], Tuple] = {}


def _prepared(spec: LinearSpec, w: Tensor) -> Prepared:
    """The map's GEMMs for the effective weights ``w``: made once per weights tensor and
    version (the module's effective weights, cached while the parameters are unchanged, come
    back as the same tensor)."""
    key = (id(w), id(spec))  # one weights tensor serves a map and its fed prefix
    hit = _PREPARED.get(key)
    if hit is not None and hit[0]() is w and hit[1] == (spec, w._version):
        return hit[2]
    shared = w.detach()  # views of this share w's memory but do not keep w alive
    with torch.no_grad():
        blocks: Blocks = []
        for i_out, group in sorted(_feeds(spec).items()):
            while len(blocks) < i_out:
                blocks.append(([], None))
            weights = [weight_block(spec, ins, shared)[0] for ins in group]
            wcat = torch.cat(weights, dim=0) if len(weights) > 1 else weights[0]  # [U, V]
            blocks.append((group, wcat.contiguous()))
        while len(blocks) < len(spec.out_blocks):
            blocks.append(([], None))
        out = _group(spec, blocks, shared)
    if hit is None or hit[0]() is not w:  # the entry goes with the weights
        weakref.finalize(w, _PREPARED.pop, key, None)
    _PREPARED[key] = (weakref.ref(w), (spec, w._version), out)
    return out


def _group(spec: LinearSpec, blocks: Blocks, w: Tensor) -> Prepared:
    """``blocks`` with the grouped kernel's (:func:`grouping`, float32 on CUDA, where its
    3xFP16 form takes them) weights moved into its ``[n, k]`` buffer, split and packed: those
    blocks keep no weights of their own (:func:`apply` always launches the grouped kernel for
    them)."""
    grouped, members = grouping(spec) if w.is_cuda and w.dtype == torch.float32 \
        else (None, [])
    if grouped is None or fp16x3.misfit(grouped) is not None:
        return Prepared(blocks)
    buffer = torch.cat([blocks[i][1].t().reshape(-1) for i in members])
    for i in members:
        blocks[i] = (blocks[i][0], None)
    split = fp16x3.split_weights(grouped, buffer)
    packed = None
    if fp16x3_wgmma.runs_on(grouped, buffer.device):
        packed = fp16x3_wgmma.pack_weights(fp16x3_wgmma.plan_wgmma(grouped), split)
    return Prepared(blocks, grouped, frozenset(members), split, packed)


def _side_by_side(spec: LinearSpec, group: List[LinearInstruction]) -> Optional[int]:
    """The column where ``group``'s input blocks start in ``x`` if each follows the one before
    (so that their stacked channels are one block of e3nn's layout), else None."""
    blocks = [spec.in_blocks[ins.i_in] for ins in group]
    for before, after in zip(blocks, blocks[1:]):
        if after.offset != before.offset + before.size:
            return None
    return blocks[0].offset


def _fits_grouped(x: Tensor, out: Tensor) -> bool:
    """Whether ``x`` and ``out`` are what the grouped kernel reads and writes: contiguous,
    16-byte aligned (the columns' alignment is the spec's)."""
    return all(t.is_contiguous() and is_aligned16(t) for t in (x, out))


def apply(spec: LinearSpec, x: Tensor, w: Tensor) -> Tensor:
    """``[N, dim_out]`` of ``x [N, dim_in]`` and the effective weights ``w [weight_numel]``
    (inside the op's forward: no autograd)."""
    n = int(x.shape[0])
    out = x.new_empty((n, spec.dim_out))
    prepared = _prepared(spec, w)
    done: FrozenSet[int] = frozenset()
    if prepared.grouped is not None:
        if not _fits_grouped(x, out):
            # a view off the 16-byte boundary or strided (out is fresh): one copy of x costs
            # far less than the grouped blocks on cuBLAS through stacked copies, in FP32
            x = aligned16(x.contiguous())
        if prepared.packed is not None and _WGMMA:
            fp16x3_wgmma.mm_grouped_fp16x3_wgmma(prepared.grouped, x, prepared.packed, out)
        else:
            fp16x3.mm_grouped_fp16x3(prepared.grouped, x, prepared.split, out)
        done = prepared.in_group
    for i, (b, (group, weights)) in enumerate(zip(spec.out_blocks, prepared.blocks)):
        if i in done:
            continue
        target = out[:, b.offset:b.offset + b.size].view(n, b.mul, b.d)
        if not group:
            target.zero_()
            continue
        xs = []
        for ins in group:
            a = spec.in_blocks[ins.i_in]
            xs.append(x[:, a.offset:a.offset + a.size].view(n, a.mul, a.d).transpose(1, 2))
        stacked = torch.cat(xs, dim=2) if len(xs) > 1 else xs[0].contiguous()  # [N, d, U]
        y = torch.mm(stacked.view(n * b.d, -1), weights).view(n, b.d, b.mul)
        target.copy_(y.transpose(1, 2))
    return out
