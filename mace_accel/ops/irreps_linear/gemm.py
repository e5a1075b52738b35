"""An equivariant linear map as GEMMs on the tensor cores, for many nodes: the generated
kernel runs its multiply-adds on the FMA units. float64 runs cuBLAS's GEMMs (DMMA, twice the
FMA units' peak on an H100); float32 maps with many weights (MACE-MH-1's 512-channel linears)
run the 3xTF32 kernels of :mod:`mace_accel.ops.tf32x3_gemm` (float32's accuracy on the TF32
tensor cores), or, where a map's blocks go in one launch, its 3xFP16 kernel
(:mod:`~mace_accel.ops.tf32x3_gemm.fp16x3`: the same accuracy on the FP16 tensor cores; on
Hopper its ``wgmma`` form, :mod:`~mace_accel.ops.tf32x3_gemm.fp16x3_wgmma`).

Per output block, the input blocks that feed it (all of one irrep dimension ``d``) are multiplied
by their stacked weights ``[U, V]`` in one GEMM. On the 3xTF32 kernels, where those blocks lie
side by side in ``x`` (as e3nn orders them), the kernel reads them and writes the output block
in e3nn's ``[N, channel, component]`` layout where they stand (:attr:`~mace_accel.ops.
tf32x3_gemm.spec.GemmSpec.irrep_dim`), all such blocks of the map in one launch
(:class:`~mace_accel.ops.tf32x3_gemm.spec.GroupedSpec`). Otherwise (cuBLAS, float64) they are
put side by side along the channels, ``[N, d, U]`` (one copy: e3nn's layout keeps the channel
outside the irrep component), and the ``[N, d, V]`` result is copied into the output block's
``[N, V, d]`` columns. Not for element-indexed weights (the skip connection), which the
generated kernel keeps.
"""

from __future__ import annotations

import weakref
from typing import Dict, FrozenSet, List, NamedTuple, Optional, Tuple

import torch

from mace_accel.ops.irreps_linear.spec import LinearInstruction, LinearSpec, weight_block
from mace_accel.ops.runtime import is_aligned16
from mace_accel.ops.tf32x3_gemm import autograd as tf32x3
from mace_accel.ops.tf32x3_gemm import fp16x3, fp16x3_wgmma
from mace_accel.ops.tf32x3_gemm.spec import (IRREP_DIMS, E3nnBlock, GroupedSpec, e3nn_misfit,
                                             layout_misfit)

Tensor = torch.Tensor
# float64 maps with shared weights run here from this many nodes: the kernel's multiply-adds
# run on the FMA units, cuBLAS's on the DMMA tensor cores, which overtake it on the MP message
# map between 700 and 1,200 nodes (its transpose ties at ~1,200, the 256-wide map crosses
# earlier, the small readout stays on the kernel; scripts/bench_kernels.py irreps-linear). This path
# takes 3-5 launches per output block, so small cells (the 256-atom graph: 280 nodes) keep the
# kernel's one.
MIN_NODES_FLOAT64 = 1024
# float32 maps run on the tensor cores (3xFP16 or 3xTF32 GEMMs) from this many nodes and
# weights: a 512-channel map of MACE-MH-1 (2.6e5 to 1e6 weights, 5-8 MFLOP a node) is bound by
# the FMA units in the kernel. From 2^16 weights (MH-1's linear_up, MACE-MP's 4-path message
# map) rather than 2^18: with the wgmma kernel, MH-1's call 5% faster at 256 atoms, 3% at 864
# (graph replay), 5% at 6,912; MP-0's 8% and 10% faster at 256 and 864 atoms
# (scripts/bench_model.py replay --linear-thresholds). The one-hot element embeddings
# (4.6e4 weights) keep the kernel. Fewer than 256 nodes not measured.
MIN_NODES_FLOAT32 = 256
MIN_WEIGHTS_FLOAT32 = 1 << 16
# blocks that lie side by side are read and written in e3nn's layout by the 3xTF32 kernel (a
# test hook: off, every block goes through the stacked copies, for A/B timings)
_IN_PLACE = True
# ... all of them in one launch (a test hook: off, one launch a block, for A/B timings)
_GROUPED = True
# ... on the FP16 tensor cores (3xFP16) where every block's k is a multiple of 32 (MH-1's maps):
# MH-1's linear_2 at 6,912 nodes in 0.50x the 3xTF32 kernel's time (see fp16x3.TILES), as
# accurate (a test hook: off, the 3xTF32 kernel, for A/B timings)
_FP16X3 = True
# ... and there on Hopper's wgmma (sm_90): MH-1's maps in 0.44-0.60x the mma.sync kernel's time
# at 256 to 6,912 nodes (see fp16x3_wgmma; a test hook: off, the mma.sync kernel)
_WGMMA = True


def runs_on(spec: LinearSpec) -> bool:
    """Whether :func:`apply` takes ``spec`` (shared weights)."""
    return not spec.indexed


def takes(spec: LinearSpec, dtype: torch.dtype, n_nodes: int, min_nodes_float64: int) -> bool:
    """Whether ``n_nodes`` nodes of ``spec`` in ``dtype`` run here rather than in the kernel."""
    if not runs_on(spec):
        return False
    if dtype == torch.float64:
        return n_nodes >= min_nodes_float64
    return dtype == torch.float32 and n_nodes >= MIN_NODES_FLOAT32 \
        and spec.weight_numel >= MIN_WEIGHTS_FLOAT32


# (id(weights), id(spec)) -> (a weak reference to them, (spec, version), their Prepared), kept
# while the weights live: a captured CUDA graph reads the Prepared's split and packed weights,
# so they must not go while the weights (which the graph's module holds) remain. (A cache of
# the last 64 freed them under a graph once several MH-1 models were live: a replay then read
# freed memory.)
_PREPARED: Dict[Tuple[int, int], Tuple] = {}
# per output block: the instructions that feed it, their stacked weights as _layout makes them,
# and the column where the input blocks start if they lie side by side in that order (else None)
Blocks = List[Tuple[List[LinearInstruction], Optional[Tuple[bool, Tensor]], Optional[int]]]


class Prepared(NamedTuple):
    """A map's GEMMs for one weights tensor: ``blocks`` (:data:`Blocks`), and the blocks the
    grouped kernel can take in one launch: its spec and weights (``[n, k]`` matrices one
    after another; each block's own weights are views of them), the output blocks' indices
    (None, empty: no such blocks), those weights split for the 3xFP16 kernel (None: it
    cannot take the spec) and packed for its wgmma form (None: not on this device)."""

    blocks: Blocks
    grouped: Optional[Tuple[GroupedSpec, Tensor]]
    in_group: FrozenSet[int]
    split: Optional[Tuple[Tensor, Tensor, Tensor]] = None
    packed: Optional[Tuple[Tensor, Tensor, Tensor]] = None


def _prepared(spec: LinearSpec, w: Tensor) -> Prepared:
    """The map's GEMMs for the effective weights ``w``: made once per weights tensor and
    version (the module's effective weights, cached while the parameters are unchanged, come
    back as the same tensor)."""
    key = (id(w), id(spec))  # one weights tensor serves a map and its fed prefix
    hit = _PREPARED.get(key)
    if hit is not None and hit[0]() is w and hit[1] == (spec, w._version):
        return hit[2]
    feeds: Dict[int, List[LinearInstruction]] = {}
    for ins in spec.instructions:
        feeds.setdefault(ins.i_out, []).append(ins)
    blocks: Blocks = []
    shared = w.detach()  # views of this share w's memory but do not keep w alive
    with torch.no_grad():
        for i_out in range(len(spec.out_blocks)):
            group = feeds.get(i_out, [])
            if not group:
                blocks.append((group, None, None))
                continue
            weights = [weight_block(spec, ins, shared)[0] for ins in group]
            wcat = torch.cat(weights, dim=0) if len(weights) > 1 else weights[0]  # [U, V]
            blocks.append((group, _layout(wcat), _side_by_side(spec, group)))
        out = _group(spec, blocks)
    if hit is None or hit[0]() is not w:  # the entry goes with the weights
        weakref.finalize(w, _PREPARED.pop, key, None)
    _PREPARED[key] = (weakref.ref(w), (spec, w._version), out)
    return out


def _group(spec: LinearSpec, blocks: Blocks) -> Prepared:
    """``blocks`` with those that the 3xTF32 kernel can read and write in place gathered into
    one :class:`GroupedSpec` (largest irreps first: their tiles are the most); their weights
    become views of the grouped kernel's buffer."""
    chosen, members, offset = [], [], 0
    order = sorted(range(len(blocks)), key=lambda i: -spec.out_blocks[i].d)
    for i in order:
        group, weights, x_col = blocks[i]
        b = spec.out_blocks[i]
        if not group or not weights[0] or x_col is None or b.d not in IRREP_DIMS:
            continue
        wt = weights[1]  # [V, U]
        block = E3nnBlock(b.d, int(wt.shape[1]), int(wt.shape[0]), x_col, b.offset, offset)
        if layout_misfit(b.d, block.x_col, block.k, spec.dim_in, block.out_col, block.n,
                         spec.dim_out) is not None:
            continue  # misaligned for the kernel's copies: one launch of its own
        chosen.append(block)
        members.append(i)
        offset += wt.numel()
    if not chosen:
        return Prepared(blocks, None, frozenset())
    buffer = torch.cat([blocks[i][1][1].reshape(-1) for i in members])
    for i, block in zip(members, chosen):
        group, weights, x_col = blocks[i]
        view = buffer[block.w_offset:block.w_offset + block.n * block.k].view(block.n, block.k)
        blocks[i] = (group, (True, view), x_col)
    grouped = GroupedSpec(tuple(chosen), spec.dim_in, spec.dim_out)
    split = packed = None
    if fp16x3.misfit(grouped) is None:
        split = fp16x3.split_weights(grouped, buffer)
        if fp16x3_wgmma.runs_on(grouped, buffer.device):
            packed = fp16x3_wgmma.pack_weights(fp16x3_wgmma.plan_wgmma(grouped), split)
    return Prepared(blocks, (grouped, buffer), frozenset(members), split, packed)


def _side_by_side(spec: LinearSpec, group: List[LinearInstruction]) -> Optional[int]:
    """The column where ``group``'s input blocks start in ``x`` if each follows the one before
    (so that their stacked channels are one block of e3nn's layout), else None."""
    blocks = [spec.in_blocks[ins.i_in] for ins in group]
    for before, after in zip(blocks, blocks[1:]):
        if after.offset != before.offset + before.size:
            return None
    return blocks[0].offset


def _layout(wcat: Tensor) -> Tuple[bool, Tensor]:
    """``(on the 3xTF32 kernels, weights)``: ``wcat [U, V]`` as :func:`_mm` takes it,
    transposed to a contiguous ``[V, U]`` for the kernels (float32, widths in multiples of
    4), else as it is for cuBLAS."""
    if _tf32x3_takes(wcat):
        return True, wcat.t().contiguous()
    return False, wcat.contiguous()


def _tf32x3_takes(wcat: Tensor) -> bool:
    return tf32x3.runs_on(wcat, int(wcat.shape[0]), int(wcat.shape[1]))


def _in_place(weights: Tuple[bool, Tensor], x_col: Optional[int], d: int, x: Tensor,
              out: Tensor, out_col: int) -> bool:
    """Whether the 3xTF32 kernel reads the block's inputs at ``x_col`` of ``x`` and writes its
    output at ``out_col`` of ``out`` in e3nn's layout (no copies)."""
    if not (_IN_PLACE and weights[0]) or x_col is None or d not in IRREP_DIMS:
        return False
    wt = weights[1]  # [V, U]
    return e3nn_misfit(d, x, x_col, int(wt.shape[1]), out, out_col, int(wt.shape[0])) is None


def _fits_grouped(x: Tensor, out: Tensor) -> bool:
    """Whether ``x`` and ``out`` are what the grouped kernel reads and writes: contiguous,
    16-byte aligned (the columns' alignment is the spec's)."""
    return all(t.is_contiguous() and is_aligned16(t) for t in (x, out))


def _mm(a: Tensor, weights: Tuple[bool, Tensor]) -> Tensor:
    """``a [M, U]`` times a block's weights as :func:`_layout` made them."""
    on_kernels, w = weights
    if on_kernels:
        return tf32x3.mm_nk(a, w)
    return torch.mm(a, w)


def apply(spec: LinearSpec, x: Tensor, w: Tensor) -> Tensor:
    """``[N, dim_out]`` of ``x [N, dim_in]`` and the effective weights ``w [weight_numel]``
    (inside the op's forward: no autograd)."""
    n = int(x.shape[0])
    out = x.new_empty((n, spec.dim_out))
    prepared = _prepared(spec, w)
    done: FrozenSet[int] = frozenset()
    if prepared.grouped is not None and _IN_PLACE and _GROUPED and _fits_grouped(x, out):
        grouped, buffer = prepared.grouped
        if prepared.packed is not None and _FP16X3 and _WGMMA:
            tf32x3.mm_grouped_fp16x3_wgmma(grouped, x, prepared.packed, out)
        elif prepared.split is not None and _FP16X3:
            tf32x3.mm_grouped_fp16x3(grouped, x, prepared.split, out)
        else:
            tf32x3.mm_grouped(grouped, x, buffer, out)
        done = prepared.in_group
    for i, (b, (group, weights, x_col)) in enumerate(zip(spec.out_blocks, prepared.blocks)):
        if i in done:
            continue
        if group and _in_place(weights, x_col, b.d, x, out, b.offset):
            tf32x3.mm_e3nn(x, x_col, weights[1], out, b.offset, b.d)
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
        y = _mm(stacked.view(n * b.d, -1), weights).view(n, b.d, b.mul)
        target.copy_(y.transpose(1, 2))
    return out
