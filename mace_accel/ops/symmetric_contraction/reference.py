"""The symmetric contraction in plain torch, from an :class:`~.spec.SCSpec` (CPU backend, oracle).

Evaluates the polynomial of :mod:`.spec` with gathered monomials: for each output and degree
``nu``, ``X[n, c, t] = prod_p x[n, c, t_p]`` over the part's sorted index tuples ``t``, then
``out[n, c, m] += sum_t X[n, c, t] * sum_K C[t, K, m] * W[z_n, K, c]``. The backward, weight
gradients and double backward are written out below (the custom ops of :mod:`.autograd` run
below torch's autograd); the forward is also differentiable by autograd, which the tests use to
check them. The CUDA kernels compute the same functions and are tested against these.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from mace_accel.ops.symmetric_contraction.spec import Polynomial, SCSpec

_DENSE: Dict[Tuple[int, torch.dtype, str], Tuple[torch.Tensor, torch.Tensor]] = {}


def dense_part(part: Polynomial, m_dim: int, dtype: torch.dtype,
               device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(index [T, nu] int64, coefficients [T, K, M])`` of one polynomial part (cached)."""
    key = (id(part), dtype, str(device))
    hit = _DENSE.get(key)
    if hit is not None and hit[2] is part:
        return hit[0], hit[1]
    tuples = part.tuples()
    row = {t: i for i, t in enumerate(tuples)}
    coef = torch.zeros(len(tuples), part.num_params, m_dim, dtype=torch.float64)
    for m, t, k, value in part.terms:
        coef[row[t], k, m] += value
    index = torch.tensor(tuples, dtype=torch.int64).reshape(len(tuples), part.nu)
    out = (index.to(device), coef.to(device=device, dtype=dtype))
    _DENSE[key] = (*out, part)
    return out


def symmetric_contraction(spec: SCSpec, x: torch.Tensor, elem: torch.Tensor,
                          weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[N, dim_out]``: mace's product basis of ``x [N, C, D]`` (mul_ir output layout).

    Args:
        x: node features ``[N, C, D]`` (mace's layout after ``reshape_irreps``).
        elem: ``[N]`` element index of each node (the argmax of the one-hot node_attrs).
        weights: ``[Z, K, C]`` per output and part, in :attr:`SCSpec.weight_shapes` order.
    """
    n = x.shape[0]
    outs: List[torch.Tensor] = []
    weights = list(weights)
    for output in spec.outputs:
        acc = x.new_zeros((n, spec.num_features, output.dim))
        for part in output.parts:
            w = weights.pop(0)
            if not part.terms:
                continue
            index, coef = dense_part(part, output.dim, x.dtype, x.device)
            monomials = x[:, :, index].prod(dim=-1)                # [N, C, T]
            per_node = w[elem]                                      # [N, K, C]
            acc = acc + torch.einsum("nct,tkm,nkc->ncm", monomials, coef, per_node)
        outs.append(acc.reshape(n, spec.num_features * output.dim))
    return torch.cat(outs, dim=1) if outs else x.new_zeros((n, 0))


# -- derivatives, written out (the custom ops run below autograd, so no torch.autograd here) ------
def _parts(spec: SCSpec, x: torch.Tensor, weights: Sequence[torch.Tensor]):
    """``(output offset, M, index [T, nu], coef [T, K, M], weight [Z, K, C])`` per nonzero part."""
    weights = list(weights)
    offset = 0
    for output in spec.outputs:
        for part in output.parts:
            w = weights.pop(0)
            if part.terms:
                index, coef = dense_part(part, output.dim, x.dtype, x.device)
                yield offset, output.dim, index, coef, w
        offset += spec.num_features * output.dim


def _others(xs: torch.Tensor, skip: Sequence[int]) -> torch.Tensor:
    """``prod_{q not in skip} xs[..., q]`` (ones when nothing is left) of ``xs [N, C, T, nu]``."""
    keep = [q for q in range(xs.shape[-1]) if q not in skip]
    if not keep:
        return xs.new_ones(xs.shape[:-1])
    return xs[..., keep].prod(dim=-1)


def _g_part(g: torch.Tensor, offset: int, m_dim: int, channels: int) -> torch.Tensor:
    """The slice ``[N, C, M]`` of ``g [N, dim_out]`` that belongs to one output."""
    return g[:, offset:offset + channels * m_dim].reshape(g.shape[0], channels, m_dim)


def _scatter_components(acc: torch.Tensor, index_col: torch.Tensor,
                        values: torch.Tensor) -> None:
    """``acc[n, c, index_col[t]] += values[n, c, t]`` (acc ``[N, C, D]``)."""
    acc.scatter_add_(2, index_col.expand(*values.shape[:2], -1), values)


def _directional(xs: torch.Tensor, vs: torch.Tensor) -> torch.Tensor:
    """``d mono_t [v] = sum_p v_{t_p} prod_{q != p} x_{t_q}``, ``[N, C, T]``."""
    return sum(vs[..., p] * _others(xs, (p,)) for p in range(xs.shape[-1]))


def backward_x(spec: SCSpec, x: torch.Tensor, elem: torch.Tensor,
               weights: Sequence[torch.Tensor], g: torch.Tensor) -> torch.Tensor:
    """``d x [N, C, D]`` of ``<g, out>``."""
    gx = torch.zeros_like(x)
    for offset, m_dim, index, coef, w in _parts(spec, x, weights):
        xs = x[:, :, index]                                                   # [N, C, T, nu]
        a = torch.einsum("ncm,tkm,nkc->nct", _g_part(g, offset, m_dim, spec.num_features),
                         coef, w[elem])
        for p in range(index.shape[1]):
            _scatter_components(gx, index[:, p], a * _others(xs, (p,)))
    return gx


def weight_grads(spec: SCSpec, x: torch.Tensor, elem: torch.Tensor,
                 weights: Sequence[torch.Tensor], g: torch.Tensor,
                 v: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """``d W_j [Z, K_j, C]`` of ``<g, out>``, or with ``v`` of ``<g, J_x(out) v>``."""
    grads = [torch.zeros_like(w) for w in weights]
    onehot = torch.nn.functional.one_hot(elem, spec.num_elements).to(x.dtype)
    nonzero = [j for j, (_, part) in enumerate(
        (o, p) for o in spec.outputs for p in o.parts) if part.terms]
    for j, (offset, m_dim, index, coef, _) in zip(nonzero, _parts(spec, x, weights)):
        xs = x[:, :, index]
        mono = _directional(xs, v[:, :, index]) if v is not None else xs.prod(dim=-1)
        per_node = torch.einsum("nct,tkm,ncm->nkc", mono, coef,
                                _g_part(g, offset, m_dim, spec.num_features))
        grads[j] = torch.einsum("nz,nkc->zkc", onehot, per_node)
    return grads


def double_backward(spec: SCSpec, x: torch.Tensor, v: torch.Tensor, elem: torch.Tensor,
                    weights: Sequence[torch.Tensor], g: torch.Tensor, need_x: bool,
                    need_g: bool) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """For an upstream ``v`` of :func:`backward_x`: ``(H_x(<g, out>) v, J_x(out) v)``."""
    dx = torch.zeros_like(x) if need_x else None
    dg = torch.zeros_like(g) if need_g else None
    for offset, m_dim, index, coef, w in _parts(spec, x, weights):
        xs, vs = x[:, :, index], v[:, :, index]
        e = torch.einsum("tkm,nkc->nctm", coef, w[elem])                     # [N, C, T, M]
        if need_g:
            part = torch.einsum("nctm,nct->ncm", e, _directional(xs, vs))
            dg[:, offset:offset + spec.num_features * m_dim] += part.reshape(x.shape[0], -1)
        if need_x:
            a = torch.einsum("nctm,ncm->nct", e, _g_part(g, offset, m_dim, spec.num_features))
            nu = index.shape[1]
            for p in range(nu):
                for q in range(nu):
                    if q != p:
                        _scatter_components(dx, index[:, q], a * vs[..., p] * _others(xs, (p, q)))
    return dx, dg
