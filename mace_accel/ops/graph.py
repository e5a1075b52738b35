"""The graph of one convolution call: edge_index plus the orderings the kernels walk.

The deterministic kernels avoid float atomics by giving each output row to one thread block:
the forward walks the edges of each *receiver* (CSR over receivers), the backward the edges of
each *sender*. Both orderings come from a stable sort, built once per ``edge_index`` tensor and
shared by all interaction layers of a model call (MACE passes the same tensor to each layer).
All of it stays on the device and is asynchronous, so it works under CUDA-graph capture.
"""

from __future__ import annotations

import bisect
import dataclasses
import weakref
from typing import List, NamedTuple, Optional, Tuple

import torch

from mace_accel.errors import InputError


@dataclasses.dataclass
class ConvGraph:
    """Edges of one convolution.

    Attributes:
        sender, receiver: ``[E]`` int64 node indices (MACE's ``edge_index[0]``, ``edge_index[1]``).
        n_nodes: number of nodes (rows of node_feats and of the output).
    """

    sender: torch.Tensor
    receiver: torch.Tensor
    n_nodes: int
    ranges_checked: bool = False  # every index was found in [0, n_nodes)
    _derived: dict = dataclasses.field(default_factory=dict, repr=False)  # int32 copies, CSRs

    @property
    def n_edges(self) -> int:
        return int(self.sender.shape[0])

    def index32(self, which: str) -> torch.Tensor:
        """``sender`` or ``receiver`` as int32 (what the kernels index with), cached."""
        key = ("index32", which)
        if key not in self._derived:
            self._derived[key] = getattr(self, which).to(torch.int32)
        return self._derived[key]

    def csr(self, by: str,
            index_dtype: torch.dtype = torch.int32) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(row_ptr [n_nodes+1], perm [E])`` grouping edges by ``"receiver"`` or ``"sender"``.

        ``perm[row_ptr[n]:row_ptr[n+1]]`` are the edges of node ``n`` in their original order.
        """
        key = (by, index_dtype)
        if key not in self._derived:
            self._derived[key] = self._build(key)
        return self._derived[key]

    def _build(self, key: tuple):
        """The derived tensor(s) of ``key``: ``("index32", which)`` or ``(by, index_dtype)``."""
        if key[0] == "index32":
            return getattr(self, key[1]).to(torch.int32)
        by, index_dtype = key
        idx = self.receiver if by == "receiver" else self.sender
        # node indices as 32-bit sort keys: half the radix passes of int64 keys
        keys = idx.to(torch.int32) if self.n_nodes <= torch.iinfo(torch.int32).max else idx
        perm = torch.sort(keys, stable=True).indices
        counts = torch.zeros(self.n_nodes + 1, dtype=torch.int64, device=idx.device)
        counts.index_add_(0, idx + 1, torch.ones_like(idx))
        row_ptr = torch.cumsum(counts, 0)
        return (row_ptr.to(index_dtype), perm.to(index_dtype))

    def refresh(self, edge_index: torch.Tensor, keys=None) -> None:
        """Rebuild, in place, the endpoints and the derived tensors of ``keys`` (default: all
        built so far) from ``edge_index [2, E]`` of the same shape. A captured CUDA graph reads
        them at fixed addresses: this is how it sees new edges."""
        if tuple(edge_index.shape) != (2, self.n_edges):
            raise InputError(f"refresh needs edge_index of shape [2, {self.n_edges}], got "
                             f"{tuple(edge_index.shape)}")
        with torch.no_grad():
            for mine, row in ((self.sender, edge_index[0]), (self.receiver, edge_index[1])):
                if mine.data_ptr() != row.data_ptr():  # a view of edge_index needs no copy
                    mine.copy_(row)
            for key in list(self._derived if keys is None else keys):
                old, new = self._derived[key], self._build(key)
                for o, n in zip(old if isinstance(old, tuple) else (old,),
                                new if isinstance(new, tuple) else (new,)):
                    o.copy_(n)


    def tensors(self, backend: str) -> List[torch.Tensor]:
        """The graph as the custom ops take it: what ``backend``'s kernels index with.

        ``reference``: ``[sender, receiver]`` (int64); ``cuda``: :class:`KernelGraph`'s fields
        (int32 sender and the receiver and sender CSRs).
        """
        if backend == "reference":
            return [self.sender, self.receiver]
        recv_ptr, recv_perm = self.csr("receiver")
        send_ptr, send_perm = self.csr("sender")
        return [self.index32("sender"), recv_ptr, recv_perm, send_ptr, send_perm]


class KernelGraph(NamedTuple):
    """The int32 edge orderings the CUDA kernels walk (see :meth:`ConvGraph.tensors`).

    Attributes:
        sender: ``[E]`` sender of each edge. recv_ptr ``[N+1]`` / recv_perm ``[E]``: edges
        grouped by receiver; send_ptr / send_perm: grouped by sender (edge order kept).
    """

    sender: torch.Tensor
    recv_ptr: torch.Tensor
    recv_perm: torch.Tensor
    send_ptr: torch.Tensor
    send_perm: torch.Tensor

    @property
    def n_edges(self) -> int:
        return int(self.sender.shape[0])


_HOST_PTR: Optional[Tuple[weakref.ref, int, List[int]]] = None


def _host_list(t: torch.Tensor) -> List[int]:
    """``t.tolist()``, remembered for the last tensor while it is unmodified."""
    global _HOST_PTR
    if _HOST_PTR is not None:
        ref, version, values = _HOST_PTR
        if ref() is t and version == t._version:
            return values
    values = t.tolist()
    _HOST_PTR = (weakref.ref(t), t._version, values)
    return values


class ReceiverRows(NamedTuple):
    """A range of receivers ``[n0, n1)`` and of their edges in receiver order ``[e0, e1)``."""

    n0: int
    n1: int
    e0: int
    e1: int


def receiver_chunks(recv_ptr: torch.Tensor, n_nodes: int, n_edges: int,
                    max_edges: int) -> List[ReceiverRows]:
    """Split the receivers into consecutive ranges of at most ``max_edges`` edges each (a range
    is one node when that node alone has more).

    One range needs nothing from the device; more read ``recv_ptr [N+1]`` (the receiver CSR)
    on the host, which synchronises, so it is only done when the edges do not fit in one, and
    once per CSR: the blocks of one call and their backward reuse the host copy.
    """
    if n_edges <= max_edges:
        return [ReceiverRows(0, n_nodes, 0, n_edges)]
    ptr = _host_list(recv_ptr)
    out = []
    n0 = 0
    while n0 < n_nodes:
        n1 = bisect.bisect_right(ptr, ptr[n0] + max_edges, lo=n0 + 1) - 1
        n1 = min(max(n1, n0 + 1), n_nodes)
        out.append(ReceiverRows(n0, n1, int(ptr[n0]), int(ptr[n1])))
        n0 = n1
    return out


_LAST: Optional[Tuple[weakref.ref, int, int, ConvGraph]] = None


def cached_graph(edge_index: torch.Tensor, n_nodes: int) -> Optional[ConvGraph]:
    """The graph :func:`graph_from_edge_index` would reuse for this unmodified ``edge_index``
    and node count, or None."""
    if _LAST is None:
        return None
    ref, version, nodes, graph = _LAST
    if ref() is edge_index and version == edge_index._version and nodes == n_nodes:
        return graph
    return None


def forget_cached_graph() -> None:
    """Drop the reused graph, so the next call builds its orderings afresh.

    CUDA-graph capture calls this first: a graph built before the capture (in the warm-up)
    would be baked into the captured graph as constants, stale on the next replay."""
    global _LAST
    _LAST = None


def graph_from_edge_index(edge_index: torch.Tensor, n_nodes: int,
                          check_ranges: bool = False) -> ConvGraph:
    """Build (or reuse) the :class:`ConvGraph` of ``edge_index [2, E]``.

    The last graph is reused while the same, unmodified ``edge_index`` tensor comes back with the
    same node count, which is the case for every layer of one model call; a caller that asks for
    the check gets it on a graph another op built without.

    Args:
        check_ranges: verify every index is in ``[0, n_nodes)`` (synchronises with the device).

    Raises:
        InputError: wrong shape or dtype, or (with ``check_ranges``) an index out of range.
    """
    global _LAST
    if edge_index.dim() != 2 or edge_index.shape[0] != 2:
        raise InputError(f"edge_index must have shape [2, n_edges], got {tuple(edge_index.shape)}")
    if edge_index.dtype not in (torch.int32, torch.int64):
        raise InputError(f"edge_index must be int32 or int64, got {edge_index.dtype}")
    compiling = torch.compiler.is_compiling()  # dynamo cannot guard on _version: no reuse
    reused = cached_graph(edge_index, n_nodes) if not compiling else None
    if reused is not None and (reused.ranges_checked or not check_ranges):
        return reused
    if check_ranges and edge_index.numel() > 0:
        lo, hi = int(edge_index.min()), int(edge_index.max())
        if lo < 0 or hi >= n_nodes:
            raise InputError(
                f"edge_index holds node indices in [{lo}, {hi}] but there are only {n_nodes} nodes"
            )
    if reused is not None:  # built by an op that did not check: checked now, kept
        reused.ranges_checked = True
        return reused
    ei = edge_index.to(torch.int64)
    graph = ConvGraph(sender=ei[0].contiguous(), receiver=ei[1].contiguous(),
                      n_nodes=int(n_nodes), ranges_checked=check_ranges)
    if not compiling:
        _LAST = (weakref.ref(edge_index), edge_index._version, int(n_nodes), graph)
    return graph
