"""Plain-torch implementation of the fused convolution tensor product.

Same signatures and layouts as the CUDA kernels (see :mod:`mace_accel.spec` for layouts). It is
the CPU backend of :func:`mace_accel.accelerate` and the oracle of every GPU test.

For one ``uvu`` path with per-edge weights ``W[e, u, v]`` and CG coefficients ``C[i, j, k]``::

    msg[e, u, k]  = pw * sum_{v,i,j} C[i,j,k] * W[e,u,v] * x1[sender[e], u, i] * x2[e, v, j]
    out[n, u, k]  = sum_{e : receiver[e] = n} msg[e, u, k]

:func:`conv_tp` is differentiable by autograd (any order). :func:`conv_tp_backward` writes the
first derivatives out explicitly; it is what the CUDA backward kernel computes, and
:mod:`mace_accel.ops` composes it with :func:`conv_tp_forward` into double backward.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from mace_accel.ops.conv_tp.spec import Path, TPSpec

_CG_CACHE: Dict[Tuple[Tuple, torch.dtype, str], torch.Tensor] = {}


def cg_tensor(path: Path, dims: Tuple[int, int, int], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """Dense ``[2l1+1, 2l2+1, 2l3+1]`` CG tensor of ``path`` times its path weight."""
    key = (path.cg + (path.path_weight,) + dims, dtype, str(device))
    out = _CG_CACHE.get(key)
    if out is None:
        dense = torch.zeros(dims, dtype=torch.float64)
        for i, j, k, value in path.cg:
            dense[i, j, k] = value * path.path_weight
        out = dense.to(dtype=dtype, device=device)
        _CG_CACHE[key] = out
    return out


def _segments(spec: TPSpec, path: Path, x1: torch.Tensor, x2: torch.Tensor,
              weights: torch.Tensor):
    """Views ``x1 [E, mul1, d1]``, ``x2 [E, mul2, d2]``, ``w [E, mul1, mul2]`` and the CG."""
    a, b, c = spec.irreps_in1[path.i_in1], spec.irreps_in2[path.i_in2], spec.irreps_out[path.i_out]
    o1, o2 = spec.offsets_in1[path.i_in1], spec.offsets_in2[path.i_in2]
    x1s = x1[:, o1:o1 + a.dim].reshape(-1, a.mul, a.ir_dim)
    x2s = x2[:, o2:o2 + b.dim].reshape(-1, b.mul, b.ir_dim)
    ws = weights[:, path.weight_offset:path.weight_offset + path.weight_numel]
    ws = ws.reshape(-1, a.mul, b.mul)
    cg = cg_tensor(path, (a.ir_dim, b.ir_dim, c.ir_dim), x1.dtype, x1.device)
    return x1s, x2s, ws, cg


def edge_messages(spec: TPSpec, x1: torch.Tensor, x2: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """Per-edge tensor product ``[E, dim_out]`` (differentiable); ``x1`` already gathered."""
    n_edges = x1.shape[0]
    segments: list = [None] * len(spec.irreps_out)
    for path in spec.paths:
        x1s, x2s, ws, cg = _segments(spec, path, x1, x2, weights)
        msg = torch.einsum("euv,ijk,eui,evj->euk", ws, cg, x1s, x2s).reshape(
            n_edges, spec.irreps_out[path.i_out].dim)
        prev = segments[path.i_out]
        segments[path.i_out] = msg if prev is None else prev + msg
    for i, ir in enumerate(spec.irreps_out):  # outputs no path writes are zero, as in e3nn
        if segments[i] is None:
            segments[i] = x1.new_zeros((n_edges, ir.dim))
    return torch.cat(segments, dim=1)


def conv_tp(spec: TPSpec, node_feats: torch.Tensor, edge_attrs: torch.Tensor,
            tp_weights: torch.Tensor, sender: torch.Tensor, receiver: torch.Tensor,
            n_nodes: int) -> torch.Tensor:
    """Fused convolution ``[n_nodes, dim_out]``: gather by sender, TP, scatter-sum to receiver.

    Args:
        node_feats: ``[N, dim_in1]``; edge_attrs: ``[E, dim_in2]``; tp_weights: ``[E, weight_numel]``.
        sender, receiver: ``[E]`` integer node indices.
        n_nodes: number of output rows.
    """
    msg = edge_messages(spec, node_feats[sender], edge_attrs, tp_weights)
    out = node_feats.new_zeros((n_nodes, spec.dim_out))
    return out.index_add(0, receiver, msg)


# Explicit forward/backward primitives (the contract the CUDA kernels implement) ----------------
def conv_tp_forward(spec: TPSpec, node_feats: torch.Tensor, edge_attrs: torch.Tensor,
                    tp_weights: torch.Tensor, sender: torch.Tensor, receiver: torch.Tensor,
                    n_nodes: int) -> torch.Tensor:
    """Same as :func:`conv_tp`, but not recorded by autograd."""
    with torch.no_grad():
        return conv_tp(spec, node_feats, edge_attrs, tp_weights, sender, receiver, n_nodes)


def conv_tp_backward(
    spec: TPSpec, node_feats: torch.Tensor, edge_attrs: torch.Tensor, tp_weights: torch.Tensor,
    grad_out: torch.Tensor, sender: torch.Tensor, receiver: torch.Tensor,
    needs: Tuple[bool, bool, bool] = (True, True, True),
) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Gradients of ``<grad_out, conv_tp(...)>`` w.r.t. node_feats, edge_attrs and tp_weights.

    Returns ``(grad_node_feats [N, dim_in1], grad_edge_attrs [E, dim_in2],
    grad_tp_weights [E, weight_numel])``, each ``None`` where ``needs`` says so.
    """
    with torch.no_grad():
        x1 = node_feats[sender]
        g = grad_out[receiver]
        g_x1 = torch.zeros_like(x1) if needs[0] else None
        g_x2 = torch.zeros_like(edge_attrs) if needs[1] else None
        g_w = torch.zeros_like(tp_weights) if needs[2] else None
        for path in spec.paths:
            x1s, x2s, ws, cg = _segments(spec, path, x1, edge_attrs, tp_weights)
            c = spec.irreps_out[path.i_out]
            o = spec.offsets_out[path.i_out]
            gs = g[:, o:o + c.dim].reshape(-1, c.mul, c.ir_dim)
            if g_x1 is not None:
                o1 = spec.offsets_in1[path.i_in1]
                part = torch.einsum("euv,ijk,evj,euk->eui", ws, cg, x2s, gs)
                g_x1[:, o1:o1 + part.shape[1] * part.shape[2]] += part.flatten(1)
            if g_x2 is not None:
                o2 = spec.offsets_in2[path.i_in2]
                part = torch.einsum("euv,ijk,eui,euk->evj", ws, cg, x1s, gs)
                g_x2[:, o2:o2 + part.shape[1] * part.shape[2]] += part.flatten(1)
            if g_w is not None:
                part = torch.einsum("ijk,eui,evj,euk->euv", cg, x1s, x2s, gs)
                g_w[:, path.weight_offset:path.weight_offset + path.weight_numel] += \
                    part.flatten(1)
        g_node = None
        if g_x1 is not None:
            g_node = torch.zeros_like(node_feats).index_add_(0, sender, g_x1)
        return g_node, g_x2, g_w
