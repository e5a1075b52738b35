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
# float64 maps with shared weights run here from this many nodes. Measured on an H100 at
# 6,912 nodes (scripts/bench_irreps_linear.py): the MP message map 301 vs 387 us with the
# generated kernel, its transpose 310 vs 405 us, the 256-wide map 186 vs 310 us, the small maps
# within a few us either way; the MP-medium float64 call 27.31 -> 26.88 ms. This path takes 3-5
# launches per output block, so small cells (the 256-atom graph: 280 nodes) keep the kernel's
# one; 2,048 itself is a guess between the two, not a measured crossover.
MIN_NODES_FLOAT64 = 2048


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
