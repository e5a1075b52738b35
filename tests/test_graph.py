"""The edge orderings of a convolution call (mace_accel.ops.graph): the CSRs group each node's
edges in their original order; a graph rebuilt in place from new edges equals a fresh one at
the same addresses (what a captured CUDA graph relies on); the reuse of the last graph."""

from __future__ import annotations

import pytest
import torch

from mace_accel.errors import InputError
from mace_accel.ops.graph import ConvGraph, cached_graph, forget_cached_graph, graph_from_edge_index


def _edges(n_nodes: int, n_edges: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, n_nodes, (2, n_edges), generator=gen)
    order = torch.argsort(edge_index[0], stable=True)  # mace's lists come sorted by sender
    return edge_index[:, order].contiguous()


def _derived(graph: ConvGraph) -> list:
    return [t for value in graph._derived.values()
            for t in (value if isinstance(value, tuple) else (value,))]


@pytest.mark.parametrize("by", ["receiver", "sender"])
def test_csr_groups_each_nodes_edges_in_their_order(by):
    edge_index = _edges(37, 500, seed=0)
    graph = ConvGraph(edge_index[0], edge_index[1], 37)
    row_ptr, perm = graph.csr(by)
    assert row_ptr.dtype == perm.dtype == torch.int32
    idx = edge_index[1] if by == "receiver" else edge_index[0]
    for node in range(37):
        mine = perm[row_ptr[node]:row_ptr[node + 1]].long()
        assert torch.equal(mine, torch.nonzero(idx == node).flatten()), node


def test_refresh_rebuilds_in_place():
    n = 50
    static = _edges(n, 800, seed=1)
    graph = ConvGraph(static[0].contiguous(), static[1].contiguous(), n)
    graph.tensors("cuda")  # every ordering the kernels walk (plain torch: works on the CPU)
    pointers = [t.data_ptr() for t in _derived(graph)]
    static.copy_(_edges(n, 800, seed=2))  # a new neighbour list into the same buffer
    graph.refresh(static)
    fresh = ConvGraph(static[0].clone(), static[1].clone(), n)
    fresh.tensors("cuda")
    assert [t.data_ptr() for t in _derived(graph)] == pointers
    for mine, want in zip(_derived(graph), _derived(fresh)):
        assert torch.equal(mine, want)
    assert torch.equal(graph.receiver, static[1])


def test_refresh_only_the_keys_asked_for_and_checks_the_shape():
    static = _edges(20, 100, seed=3)
    graph = ConvGraph(static[0].clone(), static[1].clone(), 20)
    before = graph.csr("receiver")[1].clone()
    static.copy_(_edges(20, 100, seed=4))
    graph.refresh(static, keys=())  # endpoints only
    assert torch.equal(graph.csr("receiver")[1], before)
    with pytest.raises(InputError, match="shape"):
        graph.refresh(static[:, :50])


def test_last_graph_is_reused_until_the_edges_change():
    forget_cached_graph()
    edge_index = _edges(10, 40, seed=5)
    graph = graph_from_edge_index(edge_index, 10)
    assert cached_graph(edge_index, 10) is graph
    assert cached_graph(edge_index, 11) is None
    edge_index[0, 0] = 3  # modified in place: its version moves on
    assert cached_graph(edge_index, 10) is None
    forget_cached_graph()
    assert cached_graph(edge_index, 10) is None


def test_range_check_runs_on_a_graph_built_without_it():
    """An op that builds the call's graph unchecked does not let a later caller that asks for
    the check skip it; once checked, the reused graph is not checked again."""
    forget_cached_graph()
    edge_index = _edges(10, 40, seed=6)
    graph = graph_from_edge_index(edge_index, 10)
    assert not graph.ranges_checked
    assert graph_from_edge_index(edge_index, 10, check_ranges=True) is graph
    assert graph.ranges_checked
    bad = edge_index.clone()
    bad[1, 3] = 10
    unchecked = graph_from_edge_index(bad, 10)
    with pytest.raises(InputError, match="only 10 nodes"):
        graph_from_edge_index(bad, 10, check_ranges=True)
    assert not unchecked.ranges_checked
    forget_cached_graph()
