"""An equivariant linear map as GEMMs on the tensor cores, for many nodes: the generated
kernel runs its multiply-adds on the FMA units. float64 runs cuBLAS's GEMMs (DMMA, twice the
FMA units' peak on an H100); float32 maps with many weights (MACE-MH-1's 512-channel linears)
run the 3xTF32 kernels of :mod:`mace_accel.ops.tf32x3_gemm` (float32's accuracy on the TF32
tensor cores).

Per output block, the input blocks that feed it (all of one irrep dimension ``d``) are multiplied
by their stacked weights ``[U, V]`` in one GEMM. On the 3xTF32 kernels, where those blocks lie
side by side in ``x`` (as e3nn orders them), the kernel reads them and writes the output block
in e3nn's ``[N, channel, component]`` layout where they stand (:attr:`~mace_accel.ops.
tf32x3_gemm.spec.GemmSpec.irrep_dim`): one launch a block. Otherwise (cuBLAS, float64) they are
put side by side along the channels, ``[N, d, U]`` (one copy: e3nn's layout keeps the channel
outside the irrep component), and the ``[N, d, V]`` result is copied into the output block's
``[N, V, d]`` columns. Not for element-indexed weights (the skip connection), which the
generated kernel keeps.
"""

from __future__ import annotations

import collections
import weakref
from typing import Dict, List, Optional, Tuple

import torch

from mace_accel.ops.irreps_linear.spec import LinearInstruction, LinearSpec, weight_block
from mace_accel.ops.tf32x3_gemm.spec import IRREP_DIMS, e3nn_misfit

Tensor = torch.Tensor
# float64 maps with shared weights run here from this many nodes: the kernel's multiply-adds
# run on the FMA units, cuBLAS's on the DMMA tensor cores, which overtake it on the MP message
# map between 700 and 1,200 nodes (its transpose ties at ~1,200, the 256-wide map crosses
# earlier, the small readout stays on the kernel; scripts/bench_kernels.py irreps-linear). This path
# takes 3-5 launches per output block, so small cells (the 256-atom graph: 280 nodes) keep the
# kernel's one.
MIN_NODES_FLOAT64 = 1024
# float32 maps run as 3xTF32 GEMMs from this many nodes and weights: a 512-channel map of
# MACE-MH-1 (2.6e5 to 1e6 weights, 5-8 MFLOP a node) is bound by the FMA units in the kernel;
# MACE-MP's 128-channel maps (at most 6.6e4 weights) keep it. MH-1's whole call replayed in a
# CUDA graph: 9% faster on the GEMMs at 864 atoms, 14% slower at 256 (scripts/bench_model.py
# graphs --model mh1 times the default)
MIN_NODES_FLOAT32 = 512
MIN_WEIGHTS_FLOAT32 = 1 << 18
# blocks that lie side by side are read and written in e3nn's layout by the 3xTF32 kernel (a
# test hook: off, every block goes through the stacked copies, for A/B timings)
_IN_PLACE = True


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


# id(weights) -> (a weak reference to them, (spec, version), per output block); the last few
_PREPARED: "collections.OrderedDict[int, Tuple]" = collections.OrderedDict()
_PREPARED_KEPT = 64
# per output block: the instructions that feed it, their stacked weights as _layout makes them,
# and the column where the input blocks start if they lie side by side in that order (else None)
Prepared = List[Tuple[List[LinearInstruction], Optional[Tuple[bool, Tensor]], Optional[int]]]


def _prepared(spec: LinearSpec, w: Tensor) -> Prepared:
    """Per output block: the instructions that feed it and their stacked weights as
    :func:`_layout` makes them; made once per weights tensor and version (the module's
    effective weights, cached while the parameters are unchanged, come back as the same
    tensor)."""
    hit = _PREPARED.get(id(w))
    if hit is not None and hit[0]() is w and hit[1] == (spec, w._version):
        _PREPARED.move_to_end(id(w))
        return hit[2]
    feeds: Dict[int, List[LinearInstruction]] = {}
    for ins in spec.instructions:
        feeds.setdefault(ins.i_out, []).append(ins)
    out = []
    with torch.no_grad():
        for i_out in range(len(spec.out_blocks)):
            group = feeds.get(i_out, [])
            if not group:
                out.append((group, None, None))
                continue
            weights = [weight_block(spec, ins, w)[0] for ins in group]
            wcat = torch.cat(weights, dim=0) if len(weights) > 1 else weights[0]  # [U, V]
            out.append((group, _layout(wcat), _side_by_side(spec, group)))
    _PREPARED[id(w)] = (weakref.ref(w), (spec, w._version), out)
    while len(_PREPARED) > _PREPARED_KEPT:
        _PREPARED.popitem(last=False)
    return out


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
    from mace_accel.ops.tf32x3_gemm import autograd as tf32x3

    return tf32x3.runs_on(wcat, int(wcat.shape[0]), int(wcat.shape[1]))


def _in_place(weights: Tuple[bool, Tensor], x_col: Optional[int], d: int, x: Tensor,
              out: Tensor, out_col: int) -> bool:
    """Whether the 3xTF32 kernel reads the block's inputs at ``x_col`` of ``x`` and writes its
    output at ``out_col`` of ``out`` in e3nn's layout (no copies)."""
    if not (_IN_PLACE and weights[0]) or x_col is None or d not in IRREP_DIMS:
        return False
    wt = weights[1]  # [V, U]
    return e3nn_misfit(d, x, x_col, int(wt.shape[1]), out, out_col, int(wt.shape[0])) is None


def _mm(a: Tensor, weights: Tuple[bool, Tensor]) -> Tensor:
    """``a [M, U]`` times a block's weights as :func:`_layout` made them."""
    on_kernels, w = weights
    if on_kernels:
        from mace_accel.ops.tf32x3_gemm import autograd as tf32x3

        return tf32x3.mm_nk(a, w)
    return torch.mm(a, w)


def apply(spec: LinearSpec, x: Tensor, w: Tensor) -> Tensor:
    """``[N, dim_out]`` of ``x [N, dim_in]`` and the effective weights ``w [weight_numel]``
    (inside the op's forward: no autograd)."""
    n = int(x.shape[0])
    out = x.new_empty((n, spec.dim_out))
    for b, (group, weights, x_col) in zip(spec.out_blocks, _prepared(spec, w)):
        if group and _in_place(weights, x_col, b.d, x, out, b.offset):
            from mace_accel.ops.tf32x3_gemm import autograd as tf32x3

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
