"""The convolution with the radial MLP's last layer folded in, never storing the TP weights.

MACE computes per-edge TP weights ``w = h @ W_last`` (``h [E, hidden]``: the radial MLP's last
hidden activation, ``W_last [hidden, weight_numel]``) and convolves ``conv(x, y, w)``. ``w`` is
the largest tensor of a call (``[E, 1280]`` for MACE-MP, 2.8 GB at 539k edges in fp32), and
autograd keeps it for the backward, with its gradient as large again in the backward. Here::

    folded_conv_tp(x, y, h, W_last) = conv(x, y, h @ W_last)

runs over chunks of receivers: each chunk's weights are computed (one GEMM, rows in receiver
order), convolved by the ``w_sorted`` kernels and dropped; the backward recomputes them chunk by
chunk and turns each chunk's ``d w`` into ``d h = d w @ W_last^T`` (and ``d W_last``) at once. The
memory per edge falls from ``2 * weight_numel`` values to ``hidden``; the price is the GEMM run
again in the backward. :class:`~mace_accel.patches.conv_tp.FusedConvTP` picks this path only when
the weights would not fit comfortably (:func:`recompute_weights`).

Two ``torch.library`` custom ops with fake implementations: ``torch.compile`` and CUDA graphs
see one op each way. Double backward (training on forces, ``create_graph``) takes the composed
path instead: ``w`` rebuilt in full and the differentiable ``conv_tp_backward`` op.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from mace_accel.ops import registry
from mace_accel.ops.custom_op import custom_op, placeholder
from mace_accel.ops.conv_tp import autograd as conv_autograd
from mace_accel.ops.conv_tp import reference
from mace_accel.ops.conv_tp.cuda import BackwardBuffers
from mace_accel.ops.graph import ConvGraph, KernelGraph, ReceiverRows, receiver_chunks
from mace_accel.profiling import RADIAL_MLP, part_range

Tensor = torch.Tensor

# per-chunk weights (and their gradient) stay below this share of the device's memory
CHUNK_MEMORY_FRACTION = 1 / 32
# auto: the weights of one block are recomputed when they would take more than this share
KEEP_MEMORY_FRACTION = 1 / 8
CPU_CHUNK_BYTES = 256 << 20


def _device_bytes(device: torch.device) -> Optional[int]:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def chunk_edges(weight_numel: int, dtype: torch.dtype, device: torch.device) -> int:
    """Edges per chunk: the chunk's weights stay under :data:`CHUNK_MEMORY_FRACTION` of the
    device's memory (:data:`CPU_CHUNK_BYTES` on the CPU)."""
    total = _device_bytes(device)
    budget = CPU_CHUNK_BYTES if total is None else int(total * CHUNK_MEMORY_FRACTION)
    return max(1, budget // (weight_numel * torch.finfo(dtype).bits // 8))


def recompute_weights(mode: str, n_edges: int, weight_numel: int, dtype: torch.dtype,
                      device: torch.device) -> bool:
    """Whether a block's TP weights are recomputed in the backward (``mode``: ``"always"``,
    ``"never"`` or ``"auto"``: when ``[E, weight_numel]`` would exceed
    :data:`KEEP_MEMORY_FRACTION` of the GPU's memory; never on the CPU)."""
    if mode != "auto":
        return mode == "always"
    total = _device_bytes(device)
    size = n_edges * weight_numel * torch.finfo(dtype).bits // 8
    return total is not None and size > total * KEEP_MEMORY_FRACTION


class _Rows:
    """One backend's convolution over ranges of receivers (weights in receiver order)."""

    def __init__(self, key: str, backend: str, graph: List[Tensor], n_nodes: int, like: Tensor,
                 deterministic: bool) -> None:
        self.spec = registry.lookup(key)
        self.n_nodes = n_nodes
        if backend == "reference":
            self.sender, self.receiver = graph
            self.recv_ptr, self.perm = ConvGraph(self.sender, self.receiver, n_nodes).csr(
                "receiver", torch.int64)
            self.cuda = None
        else:
            self.kgraph = KernelGraph(*graph)
            self.recv_ptr = self.kgraph.recv_ptr
            self.perm = self.kgraph.recv_perm.long()
            self.cuda = conv_autograd._cuda(key, like, deterministic)
        self.n_edges = int(self.perm.shape[0])

    def chunks(self, max_edges: int) -> List[ReceiverRows]:
        if self.cuda is not None and torch.cuda.is_current_stream_capturing():
            # a CUDA graph cannot read the CSR on the host: one chunk (graphs are for small
            # systems, whose weights fit)
            max_edges = max(max_edges, self.n_edges)
        return receiver_chunks(self.recv_ptr, self.n_nodes, self.n_edges, max_edges)

    def edges(self, rows: ReceiverRows) -> Tensor:
        """``[e1 - e0]`` the edge ids of ``rows`` in receiver order."""
        return self.perm[rows.e0:rows.e1]

    def new_output(self, like: Tensor) -> Tensor:
        if self.cuda is not None:
            return self.cuda.new_output(self.n_nodes)
        return like.new_zeros((self.n_nodes, self.spec.dim_out))

    def forward(self, rows: ReceiverRows, ids: Tensor, x: Tensor, y: Tensor, w_rows: Tensor,
                out: Tensor) -> None:
        if self.cuda is not None:
            self.cuda.forward_rows(rows, self.kgraph, x, y, w_rows, out)
            return
        out[rows.n0:rows.n1] = reference.conv_tp_forward(
            self.spec, x, y[ids], w_rows, self.sender[ids], self.receiver[ids] - rows.n0,
            rows.n1 - rows.n0)

    def backward_buffers(self, x: Tensor, y: Tensor, needs: Tuple[bool, bool, bool]):
        if self.cuda is not None:
            return self.cuda.backward_buffers(self.n_nodes, self.kgraph, needs)
        return BackwardBuffers(needs, torch.zeros_like(x) if needs[0] else None, None,
                               torch.empty_like(y) if needs[1] else None)

    def backward(self, rows: ReceiverRows, ids: Tensor, x: Tensor, y: Tensor, w_rows: Tensor,
                 g: Tensor, acc) -> Optional[Tensor]:
        """Add the rows' d(node_feats), write their d(edge_attrs); return their d(w)."""
        if self.cuda is not None:
            return self.cuda.backward_rows(rows, self.kgraph, x, y, w_rows, g, acc)
        gx_c, gy_c, gw_c = reference.conv_tp_backward(
            self.spec, x, y[ids], w_rows, g[rows.n0:rows.n1], self.sender[ids],
            self.receiver[ids] - rows.n0, acc.needs)
        if acc.gx is not None:
            acc.gx.add_(gx_c)
        if acc.gy is not None:
            acc.gy[ids] = gy_c
        return gw_c

    def finish_backward(self, acc) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        if self.cuda is not None:
            return self.cuda.finish_backward(self.n_nodes, self.kgraph, acc)
        return acc.gx, acc.gy


class LastLayer:
    """``h @ W_last`` and ``g @ W_last^T`` on cuBLAS: separate GEMM launches of the radial
    MLP's layer, profiled as radial-MLP work."""

    def __init__(self, w: Tensor) -> None:
        self.w = w

    def mm(self, a: Tensor) -> Tensor:
        with part_range(RADIAL_MLP):
            return torch.mm(a, self.w)

    def mm_t(self, g: Tensor) -> Tensor:
        with part_range(RADIAL_MLP):
            return torch.mm(g, self.w.t())

    def weight_grad(self, h: Tensor, gw: Tensor) -> Tensor:
        """``h^T gw`` (training)."""
        with part_range(RADIAL_MLP):
            return torch.mm(h.t(), gw)


@custom_op("mace_accel::folded_conv_tp")
def folded_conv_tp_op(x: Tensor, y: Tensor, h: Tensor, w_last: Tensor, graph: List[Tensor],
                      n_nodes: int, key: str, backend: str, deterministic: bool,
                      max_edges: int) -> Tensor:
    """``[n_nodes, dim_out]`` = ``conv(x, y, h @ w_last)``, the weights never kept: made
    ``max_edges`` edges at a time."""
    rows_of = _Rows(key, backend, graph, n_nodes, x, deterministic)
    last = LastLayer(w_last)
    out = rows_of.new_output(x)
    for rows in rows_of.chunks(max_edges):
        ids = rows_of.edges(rows)
        w_rows = last.mm(h.index_select(0, ids))
        rows_of.forward(rows, ids, x, y, w_rows, out)
    return out


@folded_conv_tp_op.register_fake
def _(x, y, h, w_last, graph, n_nodes, key, backend, deterministic, max_edges):
    return x.new_empty((n_nodes, registry.lookup(key).dim_out))


@custom_op("mace_accel::folded_conv_tp_backward")
def folded_conv_tp_backward_op(x: Tensor, y: Tensor, h: Tensor, w_last: Tensor, g: Tensor,
                               graph: List[Tensor], n_nodes: int, key: str, backend: str,
                               deterministic: bool, max_edges: int,
                               need_x: bool, need_y: bool,
                               need_h: bool, need_w: bool
                               ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(gx [N, dim_in1], gy [E, dim_in2], gh [E, hidden], gw_last [hidden, weight_numel])``
    of ``<g, folded_conv_tp(...)>``, the weights recomputed chunk by chunk; a gradient not
    asked for comes back empty."""
    rows_of = _Rows(key, backend, graph, n_nodes, x, deterministic)
    acc = rows_of.backward_buffers(x, y, (need_x, need_y, need_h or need_w))
    gh = torch.empty_like(h) if need_h else None
    gw_last = torch.zeros_like(w_last) if need_w else None
    last = LastLayer(w_last)
    for rows in rows_of.chunks(max_edges):
        ids = rows_of.edges(rows)
        h_rows = h.index_select(0, ids)
        gw_rows = rows_of.backward(rows, ids, x, y, last.mm(h_rows), g, acc)
        if gh is not None:
            gh.index_copy_(0, ids, last.mm_t(gw_rows))
        if gw_last is not None:
            gw_last += last.weight_grad(h_rows, gw_rows)
    gx, gy = rows_of.finish_backward(acc)
    return tuple(t if t is not None else placeholder(x) for t in (gx, gy, gh, gw_last))


@folded_conv_tp_backward_op.register_fake
def _(x, y, h, w_last, g, graph, n_nodes, key, backend, deterministic, max_edges,
      need_x, need_y, need_h, need_w):
    spec = registry.lookup(key)
    return (x.new_empty((n_nodes, spec.dim_in1)) if need_x else placeholder(x),
            x.new_empty((y.shape[0], spec.dim_in2)) if need_y else placeholder(x),
            torch.empty_like(h) if need_h else placeholder(x),
            torch.empty_like(w_last) if need_w else placeholder(x))


def _setup(ctx, inputs, output) -> None:
    x, y, h, w_last, graph, n_nodes, key, backend, deterministic, max_edges = inputs
    ctx.save_for_backward(x, y, h, w_last)
    ctx.static = (graph, n_nodes, key, backend, deterministic)
    ctx.max_edges = max_edges


def composed_backward(x: Tensor, y: Tensor, h: Tensor, w_last: Tensor, g: Tensor,
                      static: tuple, needs) -> Tuple[Tensor, ...]:
    """``(gx, gy, gh, gw_last)`` of ``<g, conv(x, y, h @ w_last)>`` from differentiable ops,
    ``w`` made in full (the create_graph backward: training on forces); ``static``: the conv
    op's ``(graph, n_nodes, key, backend, deterministic)``, ``needs``: which of x, y, h,
    w_last."""
    need_x, need_y, need_h, need_w = needs
    with part_range(RADIAL_MLP):
        w = torch.mm(h, w_last)
    gx, gy, gw = conv_autograd.conv_tp_backward_op(x, y, w, g, *static, need_x, need_y,
                                                   need_h or need_w)
    with part_range(RADIAL_MLP):
        gh = torch.mm(gw, w_last.t()) if need_h else None
        gw_last = torch.mm(h.t(), gw) if need_w else None
    return gx, gy, gh, gw_last


def _backward(ctx, g):
    x, y, h, w_last = ctx.saved_tensors
    need_x, need_y, need_h, need_w = ctx.needs_input_grad[:4]
    none = ([None] * len(ctx.static[0]),) + (None,) * 5  # graph, the static args
    if g is None or not (need_x or need_y or need_h or need_w):
        return (None,) * 4 + none
    g = g.contiguous()
    if torch.is_grad_enabled():  # create_graph: compose differentiable ops (w made in full)
        gx, gy, gh, gw_last = composed_backward(x, y, h, w_last, g, ctx.static,
                                                ctx.needs_input_grad[:4])
    else:
        gx, gy, gh, gw_last = folded_conv_tp_backward_op(x, y, h, w_last, g, *ctx.static,
                                                         ctx.max_edges, need_x, need_y,
                                                         need_h, need_w)
    grads = [t if need else None for t, need in
             zip((gx, gy, gh, gw_last), (need_x, need_y, need_h, need_w))]
    return (*grads, *none)


folded_conv_tp_op.register_autograd(_backward, setup_context=_setup)


def folded_conv_tp(key: str, graph: ConvGraph, node_feats: Tensor, edge_attrs: Tensor,
                   hidden: Tensor, w_last: Tensor, backend: str = "cuda",
                   deterministic: bool = True, max_edges: Optional[int] = None) -> Tensor:
    """Differentiable ``conv(node_feats, edge_attrs, hidden @ w_last)`` ``[n_nodes, dim_out]``
    without storing the per-edge weights.

    Args:
        key: the convolution's spec (:func:`~mace_accel.ops.conv_tp.autograd.register_spec`).
        graph: the edges. node_feats ``[N, dim_in1]``, edge_attrs ``[E, dim_in2]``,
            hidden ``[E, h]``, w_last ``[h, weight_numel]``: one dtype and device.
        max_edges: edges per chunk (default :func:`chunk_edges`); the create_graph backward
            composes torch ops.
    """
    if max_edges is None:
        max_edges = chunk_edges(w_last.shape[1], w_last.dtype, w_last.device)
    return folded_conv_tp_op(node_feats.contiguous(), edge_attrs.contiguous(),
                             hidden.contiguous(), w_last, graph.tensors(backend),
                             graph.n_nodes, key, backend, deterministic, int(max_edges))
