"""An equivariant linear map as cuBLAS GEMMs through torch, for float64 on many nodes: the
generated kernel runs its multiply-adds on the FMA units, cuBLAS runs float64 GEMMs on the
tensor cores (DMMA, twice the FMA units' peak on an H100).

Per output block, the input blocks that feed it (all of one irrep dimension ``d``) are put side
by side along the channels, ``[N, d, U]`` (one copy: e3nn's layout keeps the channel outside the
irrep component), multiplied by their stacked weights ``[U, V]`` in one GEMM, and the
``[N, d, V]`` result is written into the output block's ``[N, V, d]`` columns. Not for
element-indexed weights (the skip connection), which the generated kernel keeps.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from mace_accel.ops.irreps_linear.spec import LinearInstruction, LinearSpec, weight_block

Tensor = torch.Tensor
# float64 maps with shared weights run here from this many nodes. Measured on an H100
# (scripts/bench_irreps_linear.py, docs/h100-2026-11-25-s11 call 6): the MP message map with the
# generated kernel / cuBLAS 41.3 / 55.6 us at 700 nodes, 83.2 / 72.4 us at 1,200, 125.7 / 102.4
# us at 2,048; its transpose ties at 1,200 (74.7 / 74.9 us); the 256-wide map is faster on
# cuBLAS from 700 nodes (27.5 vs 29.3 us), the readout (a few us) stays faster on the kernel.
# At 6,912 nodes: the message map 301 vs 387 us, MP-medium float64 27.31 -> 26.88 ms. This path
# takes 3-5 launches per output block, so small cells (the 256-atom graph: 280 nodes) keep the
# kernel's one.
MIN_NODES_FLOAT64 = 1024


def runs_on(spec: LinearSpec) -> bool:
    """Whether :func:`apply` takes ``spec`` (shared weights)."""
    return not spec.indexed


def apply(spec: LinearSpec, x: Tensor, w: Tensor) -> Tensor:
    """``[N, dim_out]`` of ``x [N, dim_in]`` and the effective weights ``w [weight_numel]``
    (differentiable torch ops)."""
    n = int(x.shape[0])
    out = x.new_empty((n, spec.dim_out))
    feeds: Dict[int, List[LinearInstruction]] = {}
    for ins in spec.instructions:
        feeds.setdefault(ins.i_out, []).append(ins)
    for i_out, b in enumerate(spec.out_blocks):
        target = out[:, b.offset:b.offset + b.size].view(n, b.mul, b.d)
        group = feeds.get(i_out)
        if not group:
            target.zero_()
            continue
        xs = []
        for ins in group:
            a = spec.in_blocks[ins.i_in]
            xs.append(x[:, a.offset:a.offset + a.size].view(n, a.mul, a.d).transpose(1, 2))
        stacked = torch.cat(xs, dim=2) if len(xs) > 1 else xs[0].contiguous()  # [N, d, U]
        weights = [weight_block(spec, ins, w)[0] for ins in group]
        wcat = torch.cat(weights, dim=0) if len(weights) > 1 else weights[0]  # [U, V]
        y = torch.mm(stacked.view(n * b.d, -1), wcat).view(n, b.d, b.mul)
        target.copy_(y.transpose(1, 2))
    return out
