"""Energy, forces and stress of a MACE model with one backward pass, the stress from the edges.

mace computes the stress by differentiating through a displacement of positions and cell; the
backward of its per-edge gather of the cell (``cell[batch[sender]]``) accumulates every edge
onto the one or two rows of the cell tensor, which costs more than the whole energy and forces
call at a few hundred atoms.

A standard MACE model sees positions only through its edge vectors ``v``, so the strain
derivative is a sum over edges: with ``g = dE/dv`` of each edge, ``dE/d(strain) = sum_e v (x) g``
per structure, and mace's stress is its symmetric part over the volume. Here the edge vectors
are taken from the input of the model's spherical harmonics (a forward pre-hook), energy is
differentiated once with respect to positions and vectors together (and the lengths, where the
fused edge-vector op made them beside the vectors rather than from them), and the per-structure
sums are segment sums (float64 prefix sums: deterministic, no host synchronisation) over edges
that come grouped by structure, as every batch mace-accel builds does. Models this does not
hold for (other classes) take mace's own path.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch

from mace_accel.models import energy_head
from mace_accel.ops.edge_vectors.autograd import edge_gradient

Tensor = torch.Tensor

# model classes whose energy depends on positions only through the edge vectors
EDGE_ONLY_MODELS = frozenset({"MACE", "ScaleShiftMACE"})


def stress_from_edges_supported(model: torch.nn.Module) -> bool:
    """True if :func:`evaluate` may compute ``model``'s stress from its edges."""
    return (type(model).__name__ in EDGE_ONLY_MODELS
            and isinstance(getattr(model, "spherical_harmonics", None), torch.nn.Module))


def evaluate(model: torch.nn.Module, batch: Dict[str, Tensor], compute_stress: bool,
             edge_gradients: bool = False) -> Dict[str, Tensor]:
    """``{"energy" [S], "node_energy" [N], "forces" [N, 3], "stress" [S, 3, 3] (if asked),
    "edge_gradients" [E, 3] (if asked: dE/dv of each edge vector v, for models that
    :func:`stress_from_edges_supported`)}`` of a batch whose edges are grouped by structure
    (structure 0's edges first, then 1, ...).

    Equal to ``model(batch, training=False, compute_force=True, compute_stress=...)`` (mace's
    stress convention and its zeroing of the stress of a structure without a volume); the
    stress costs a sum over edges instead of mace's displacement backward. A model mace-accel
    accelerated runs its blocks through :func:`energy_head.forward` where that applies (fewer
    glue kernels, per-structure energies summed deterministically); others run mace's forward.
    """
    plan = energy_head.lean_plan(model)
    if plan is not None:
        head = energy_head.forward(model, plan, batch)
        grads = _gradients(head.differentiable.sum(), batch, head.vectors, head.lengths,
                           compute_stress, edge_gradients)
        head.wait()  # the energies ran on a side stream beside the backward
        return {"energy": head.energy, "node_energy": head.node_energy, **grads}
    if edge_gradients and not stress_from_edges_supported(model):
        raise ValueError(f"{type(model).__name__}: no per-edge gradients (its energy may "
                         "depend on more than the edge vectors)")
    if not (compute_stress or edge_gradients) or not stress_from_edges_supported(model):
        return model(batch, training=False, compute_force=True, compute_stress=compute_stress)
    captured: List[Tensor] = []
    lengths_seen: List[Tensor] = []
    hooks = [model.spherical_harmonics.register_forward_pre_hook(
                 lambda module, args: captured.append(args[0])),
             model.radial_embedding.register_forward_pre_hook(
                 lambda module, args: lengths_seen.append(args[0]))]
    try:
        out = model(batch, training=False, compute_force=False, compute_stress=False)
    finally:
        for hook in hooks:
            hook.remove()
    if len(captured) != 1:
        raise RuntimeError(f"expected one call of the spherical harmonics, saw {len(captured)}")
    lengths = lengths_seen[0] if len(lengths_seen) == 1 else None
    return {**out, **_gradients(out["energy"].sum(), batch, captured[0], lengths,
                                compute_stress, edge_gradients)}


def _gradients(energy: Tensor, batch: Dict[str, Tensor], vectors: Tensor,
               lengths: Optional[Tensor], compute_stress: bool,
               edge_gradients: bool = False) -> Dict[str, Tensor]:
    """``{"forces" [N, 3], "stress" [S, 3, 3] (if asked), "edge_gradients" [E, 3] (if
    asked)}`` from one backward of the scalar ``energy`` (the sum over structures) to the
    positions (and the edge ``vectors [E, 3]``, ``lengths [E, 1]`` the model computed from
    them)."""
    positions = batch["positions"]
    if not (compute_stress or edge_gradients):  # seeded with -1: the forces, no negation
        grad = torch.autograd.grad([energy], [positions], [torch.full_like(energy, -1.0)],
                                   allow_unused=True)[0]
        return {"forces": grad if grad is not None else torch.zeros_like(positions)}
    # the fused edge-vector op makes the lengths beside the vectors, not from them: then dE/dv
    # takes the lengths' part explicitly (else autograd's dE/dv holds it already)
    siblings = (lengths is not None and lengths.grad_fn is not None
                and lengths.grad_fn is vectors.grad_fn)
    grads = torch.autograd.grad([energy], [positions, vectors] + ([lengths] if siblings else []),
                                allow_unused=True)
    grad_positions, grad_vectors = grads[:2]
    if siblings and grads[2] is not None:
        grad_vectors = edge_gradient(
            torch.zeros_like(vectors) if grad_vectors is None else grad_vectors,
            grads[2], vectors.detach(), lengths.detach())
    forces = -grad_positions if grad_positions is not None else torch.zeros_like(positions)
    out = {"forces": forces}
    if edge_gradients:
        out["edge_gradients"] = (grad_vectors if grad_vectors is not None
                                 else torch.zeros_like(vectors))
    if not compute_stress:
        return out
    n_graphs = int(batch["ptr"].numel()) - 1
    strain = _strain_derivative(vectors.detach(), grad_vectors, batch, n_graphs)
    cell = batch["cell"].view(-1, 3, 3)
    volume = torch.linalg.det(cell).abs().view(-1, 1, 1)
    stress = 0.5 * (strain + strain.transpose(1, 2)) / volume
    out["stress"] = torch.where(stress.abs() < 1e10, stress, torch.zeros_like(stress))  # mace
    return out


def _strain_derivative(vectors: Tensor, grad: Tensor, batch: Dict[str, Tensor],
                       n_graphs: int) -> Tensor:
    """``[S, 3, 3]``: ``sum_e v_e (x) g_e`` over each structure's edges (grouped by structure)."""
    if grad is None or vectors.shape[0] == 0:
        return vectors.new_zeros((n_graphs, 3, 3))
    outer = (vectors[:, :, None] * grad[:, None, :]).reshape(-1, 9)
    graph_of_edge = batch["batch"][batch["edge_index"][0]]
    lengths = torch.zeros(n_graphs, dtype=torch.int64, device=outer.device).scatter_add_(
        0, graph_of_edge, torch.ones_like(graph_of_edge))
    bounds = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
    # float64 prefix sums per structure, as the energies (deterministic, CUDA-graph safe)
    return energy_head.segment_sums(outer, bounds).to(vectors.dtype).reshape(n_graphs, 3, 3)
