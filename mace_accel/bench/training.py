"""Training-step time: one optimizer step of energy + forces training with each backend.

Inference benchmarks say nothing about training, where the weights require grad and the forces
are differentiated again (``create_graph=True``) for the force loss. This times what a mace
training loop does per batch, on the same batch and the same fixed targets for every backend:

* the backend's model (:func:`mace_accel.bench.backends.prepare_backend`, prepared afresh for
  this measurement), in train mode, every floating parameter requiring grad (the prepared
  model is an inference one);
* ``out = model(batch, training=True, compute_force=True)``: the model's own forward for every
  backend, mace-accel included (its model is mace's model patched in place; with weights that
  require grad the patched blocks take their exact, twice-differentiable path);
* ``loss = mean(((E - E0) / N)^2) + mean((F - F0)^2)`` with random targets ``E0`` [1] and
  ``F0`` [N, 3] drawn from the bench's ``--seed``;
* ``optimizer.zero_grad(set_to_none=True); loss.backward(); optimizer.step()`` with
  ``torch.optim.Adam(lr=1e-4)``, one optimizer per backend;
* on a CUDA device, each backend again with the whole step captured as CUDA graphs
  (:class:`mace_accel.training.TrainingStep`, Adam with ``capturable=True``; the backend's
  name followed by ``+graphs``): an eager step is bound by the host issuing ~1,500 launches,
  a captured one by its kernels. Speedups compare steps run the same way.

The first step's loss is computed before any weight update, so it is a function of the
starting weights, the batch and the targets only: every backend must give e3nn's. A backend
whose first loss differs by more than :data:`LOSS_TOLERANCE` (relative) keeps its timing but
gets the status ``"loss differs from e3nn's: ..."``. Failures (exceptions, out of memory) are
statuses, never raised, as everywhere in the bench.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Dict, List, Optional, Sequence

import torch

from mace_accel.bench.backends import OK, PreparedBackend, failure_status, join_details
from mace_accel.bench.timing import free_memory, time_calls, track_peak_memory

# relative difference of a backend's first loss from e3nn's that is reported (the loss is an
# average of squares, so its relative rounding error is about that of the forces)
LOSS_TOLERANCE = {"float32": 1e-4, "float64": 1e-9}
LEARNING_RATE = 1e-4
LOSS_DIFFERS = "loss differs from e3nn's"
# the backend name of a step captured as CUDA graphs (mace_accel.training.TrainingStep)
GRAPHS = "+graphs"


@dataclasses.dataclass
class TrainRecord:
    """Training-step time of one backend on one batch (schema: see :mod:`.report`).

    Attributes:
        model, dtype, backend, status: as the other records; status ``"loss differs from
            e3nn's: ..."`` when the first loss disagrees (the timing is still kept).
        atoms, edges: the batch actually trained on.
        steps, warmup_steps: timed and untimed optimizer steps.
        clock: ``"cuda-events"`` or ``"perf_counter"``.
        median_ms, p10_ms, p90_ms: per optimizer step (forward, forces, loss, backward, Adam).
        peak_mem_mb: ``torch.cuda.max_memory_allocated`` over the steps (null on the CPU).
        first_loss: the loss of the first step (before any update).
        speedup_vs_e3nn, speedup_vs_cueq: e3nn's / cueq's median over this median (same model
            and dtype; null where that backend did not run).
        detail: extra facts (patch summary, the loss comparison).
    """

    model: str
    dtype: str
    backend: str
    status: str
    atoms: Optional[int] = None
    edges: Optional[int] = None
    steps: int = 0
    warmup_steps: int = 0
    clock: str = ""
    median_ms: Optional[float] = None
    p10_ms: Optional[float] = None
    p90_ms: Optional[float] = None
    peak_mem_mb: Optional[float] = None
    first_loss: Optional[float] = None
    speedup_vs_e3nn: Optional[float] = None
    speedup_vs_cueq: Optional[float] = None
    detail: str = ""


def make_targets(n_atoms: int, dtype: torch.dtype, device: torch.device | str,
                 seed: int = 0) -> Dict[str, torch.Tensor]:
    """Fixed random targets, the same for every backend and dtype of a run.

    Drawn in float64 on the CPU from ``seed`` (then cast), so the targets do not depend on the
    device's random generator or the dtype.

    Returns:
        ``{"energy": E0 [1], "forces": F0 [n_atoms, 3]}``; ``E0 / n_atoms`` and the components
        of ``F0`` are standard normal (a per-atom energy and forces of order one).
    """
    generator = torch.Generator().manual_seed(seed)
    energy = torch.randn(1, generator=generator, dtype=torch.float64) * n_atoms
    forces = torch.randn(n_atoms, 3, generator=generator, dtype=torch.float64)
    return {"energy": energy.to(device=device, dtype=dtype),
            "forces": forces.to(device=device, dtype=dtype)}


def training_loss(model: torch.nn.Module, batch: Dict[str, torch.Tensor],
                  targets: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss of one training step, graph attached (scalar).

    Args:
        model: a MACE model in train mode.
        batch: one structure of ``N`` atoms (``positions`` [N, 3], ...); not modified.
        targets: :func:`make_targets` (``energy`` [1], ``forces`` [N, 3]).

    Returns:
        ``mean(((E - E0) / N)^2) + mean((F - F0)^2)``, ``E`` [1] and ``F`` [N, 3] the model's.
    """
    step_batch = dict(batch)
    # a fresh leaf each step: mace differentiates the energy with respect to it, and a reused
    # leaf would accumulate .grad across steps
    step_batch["positions"] = batch["positions"].detach().clone().requires_grad_(True)
    out = model(step_batch, training=True, compute_force=True)
    n_atoms = batch["positions"].shape[0]
    energy_term = (((out["energy"] - targets["energy"]) / n_atoms) ** 2).mean()
    return energy_term + ((out["forces"] - targets["forces"]) ** 2).mean()


def make_trainable(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` itself in train mode with every floating parameter requiring grad (the
    benchmarked models are prepared for inference, with no weight grads)."""
    model.train()
    for p in model.parameters():
        if p.is_floating_point():
            p.requires_grad_(True)
    return model


def reference_loss(model: torch.nn.Module, batch: Dict[str, torch.Tensor],
                   targets: Dict[str, torch.Tensor]) -> float:
    """The first-step loss of ``model`` (e3nn) without timing it: what the other backends are
    compared with when e3nn itself is not among the timed backends."""
    trainable = make_trainable(copy.deepcopy(model))  # the source stays untouched
    try:
        return float(training_loss(trainable, batch, targets).detach())
    finally:
        del trainable


def run_training_step(prepared: PreparedBackend, batch: Dict[str, torch.Tensor],
                      targets: Dict[str, torch.Tensor], device: torch.device | str,
                      label: str, dtype_name: str, steps: int = 10, warmup_steps: int = 3,
                      edges: Optional[int] = None, graphs: bool = False) -> TrainRecord:
    """Time ``steps`` optimizer steps of ``prepared``'s model after ``warmup_steps`` untimed
    ones (module docstring).

    Args:
        prepared: the backend's inference model, prepared for this measurement only (it is
            made trainable and trained in place), or why there is none.
        batch: one structure of ``N`` atoms on ``device`` (``positions`` [N, 3], ...).
        targets: :func:`make_targets` for ``N`` atoms (``energy`` [1], ``forces`` [N, 3]).
        label, dtype_name: the model's name and dtype for the record.
        edges: the batch's edge count ``E`` (``edge_index`` [2, E]), for the record.
        graphs: run the step as :class:`mace_accel.training.TrainingStep` captures it (the
            first warm-up step eager, the second captured; at least two warm-up steps).

    Returns:
        a :class:`TrainRecord` with the timing and the first step's loss (compare it with
        :func:`check_loss`); failures are in its ``status``, never raised.
    """
    if graphs:
        warmup_steps = max(warmup_steps, 2)
    record = TrainRecord(label, dtype_name, prepared.name + (GRAPHS if graphs else ""),
                         prepared.status,
                         atoms=int(batch["positions"].shape[0]), edges=edges, steps=steps,
                         warmup_steps=warmup_steps, detail=prepared.detail)
    if not prepared.ok:
        return record
    model = optimizer = train = labelled = None
    first: List[torch.Tensor] = []

    def step() -> None:
        loss = training_loss(model, batch, targets)
        if not first:
            # kept as a tensor: reading it here (.item()) would synchronise inside a timed step
            first.append(loss.detach())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def graphed_step() -> None:
        loss = train(labelled)
        if not first:
            first.append(loss)

    try:
        # the prepared model is this step's own (prepared afresh per backend): trained in
        # place, not copied (a copy of a converted model is one more thing that can fail)
        model = make_trainable(prepared.model)
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad],
                                     lr=LEARNING_RATE, capturable=graphs)
        if graphs:
            from mace_accel.training import TrainingStep

            train = TrainingStep(model, optimizer, graphs=True)
            labelled = dict(batch, energy=targets["energy"], forces=targets["forces"])
        with track_peak_memory(device) as memory:
            timing = time_calls(graphed_step if graphs else step, device,
                                warmup=warmup_steps, repeats=steps)
        record.first_loss = float(first[0])
    except Exception as exc:  # reported in the record; the other backends still run
        record.status = failure_status(exc)
        return record
    finally:  # drop the copy, its gradients and Adam's state before the next backend
        model = optimizer = train = labelled = None
        first.clear()
        free_memory(device)
    record.clock = timing.clock
    record.median_ms, record.p10_ms, record.p90_ms = (timing.median_ms, timing.p10_ms,
                                                      timing.p90_ms)
    record.peak_mem_mb = memory.peak_mb
    return record


def check_loss(record: TrainRecord, reference: Optional[float]) -> None:
    """Compare ``record``'s first loss with e3nn's ``reference`` (in place).

    A relative difference above :data:`LOSS_TOLERANCE` of the record's dtype becomes its status
    (``"loss differs from e3nn's: ..."``); within it, the difference goes to ``detail``.
    """
    if record.status != OK or record.first_loss is None or record.backend == "e3nn":
        return
    if reference is None:
        record.detail = join_details(record.detail, "no e3nn loss to compare")
        return
    rel = abs(record.first_loss - reference) / max(abs(reference), torch.finfo(
        torch.float64).tiny)
    tolerance = LOSS_TOLERANCE[record.dtype]
    if not rel <= tolerance:  # NaN counts as a difference
        record.status = (f"{LOSS_DIFFERS}: {record.first_loss:.10g} vs {reference:.10g} "
                         f"(relative {rel:.1e} > {tolerance:.0e})")
    else:
        record.detail = join_details(record.detail, f"first loss within {rel:.1e} of e3nn's")


def compute_train_speedups(records: Sequence[TrainRecord]) -> None:
    """Fill ``speedup_vs_e3nn`` and ``speedup_vs_cueq`` in place, within each (model, dtype,
    eager or captured): that backend's median over this one's, both run the same way. Records
    with a timing count, a loss mismatch included (its status says so); a baseline must have
    run OK."""
    groups: Dict[tuple, List[TrainRecord]] = {}
    for r in records:
        suffix = GRAPHS if r.backend.endswith(GRAPHS) else ""
        groups.setdefault((r.model, r.dtype, suffix), []).append(r)
    for (_, _, suffix), group in groups.items():
        timed = [r for r in group if r.median_ms]
        base = {name: next((r for r in timed if r.backend == name + suffix
                            and r.status == OK), None) for name in ("e3nn", "cueq")}
        for r in timed:
            r.speedup_vs_e3nn = base["e3nn"].median_ms / r.median_ms if base["e3nn"] else None
            r.speedup_vs_cueq = base["cueq"].median_ms / r.median_ms if base["cueq"] else None
