"""Random convolution problems for the GPU tests (never zeros; MACE-like edge order), the
tolerance table's error measure of a dtype, and the comparison of two calls' results bit for
bit."""

from __future__ import annotations

import torch

from mace_accel.ops.graph import ConvGraph
from mace_accel.tolerances import rel_linf_error, rel_norm_error


def random_problem(spec, n_nodes: int, n_edges: int, dtype: torch.dtype, device, seed: int = 0,
                   sorted_by_sender: bool = True):
    """``(graph, x, y, w)`` with random features and a random graph.

    MACE's neighbour lists come sorted by sender; ``sorted_by_sender=False`` shuffles them.
    """
    gen = torch.Generator().manual_seed(seed)
    sender = torch.randint(0, n_nodes, (n_edges,), generator=gen)
    receiver = torch.randint(0, n_nodes, (n_edges,), generator=gen)
    if sorted_by_sender:
        order = torch.argsort(sender, stable=True)
        sender, receiver = sender[order], receiver[order]
    x = torch.randn(n_nodes, spec.dim_in1, generator=gen, dtype=torch.float64)
    y = torch.randn(n_edges, spec.dim_in2, generator=gen, dtype=torch.float64)
    w = torch.randn(n_edges, spec.weight_numel, generator=gen, dtype=torch.float64)
    graph = ConvGraph(sender=sender.to(device), receiver=receiver.to(device), n_nodes=n_nodes)
    cast = dict(dtype=dtype, device=device)
    return graph, x.to(**cast), y.to(**cast), w.to(**cast)


def pass_error(dtype: torch.dtype):
    """The measure the tolerance table's per-pass tolerances of ``dtype`` are in: the relative
    norm error (float64), the relative L-infinity error (float32, as OpenEquivariance)."""
    return rel_norm_error if dtype == torch.float64 else rel_linf_error


def assert_same_results(got: dict, want: dict, keys, n_atoms: int) -> None:
    """``got`` equals ``want`` bit for bit for every key but ``energy``: mace sums the total
    energy with ``scatter_add_`` (float atomics on a GPU, outside mace-accel's kernels), whose
    order may change between calls; it may differ by rounding, ``n_atoms`` ulps at most."""
    for key in keys:
        if key == "energy":
            eps = torch.finfo(want[key].dtype).eps
            bound = n_atoms * eps * want[key].abs().max().item()
            assert (got[key] - want[key]).abs().max().item() <= bound, key
        else:
            assert torch.equal(got[key], want[key]), key
