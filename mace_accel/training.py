"""Training steps of a MACE model on energies and forces, captured as CUDA graphs.

One training step (the forward, the forces by a backward with ``create_graph``, the loss, its
backward through the forces, the optimizer's update) is ~1,300-1,800 small kernel launches. On
a batch of a few hundred atoms the Python and the launches take several times longer than the
kernels, for every backend (``mace-accel bench --train`` times the step eagerly and captured).
:class:`TrainingStep` runs the whole step, optimizer included, as one CUDA graph per batch
shape, so a step costs what its kernels cost:

* a batch of ``S`` structures, ``N`` atoms and ``E`` edges is padded to a bucket
  ``(N_pad, E_pad)`` of :mod:`mace_accel.capture` (the padding atoms are one more, dummy
  structure with no neighbours within the cutoff) and keyed by ``(N_pad, E_pad, S)``;
* the first batch of a bucket runs eagerly (it compiles the kernels and creates the optimizer's
  state); the second is captured and replayed; later ones replay. Each call is one optimizer
  step on its batch, whichever way it runs;
* the loss is mace's ``WeightedEnergyForcesLoss`` (:func:`energy_forces_loss`); the dummy
  structure has weight zero and the padding atoms' forces are exactly zero, so padding changes
  neither the loss nor any gradient (tested against the unpadded step).

A graph replays what it captured: the parameters', gradients' and optimizer state's storage and
the optimizer's hyper-parameters of that moment. New values written *into* those tensors
(``load_state_dict`` on the model, ``copy_``) are read by the next replay; anything else is
checked before each replay at a few microseconds, and the graphs are captured afresh when it
changed: surgery (``accelerate`` / ``revert``), a parameter's or buffer's storage (``.to``), the
optimizer's parameter groups, hyper-parameters (a learning-rate schedule: give ``lr`` as a
tensor to change it without a new capture) or state tensors (``optimizer.load_state_dict``).

Without CUDA (or with ``graphs=False``) the same step runs eagerly on the unpadded batch.

Float64 training: torch's ``capturable`` Adam keeps its step count in torch's default dtype,
so under a float32 default its bias correction is rounded to float32, ~1e-8 relative per step
away from the eager Adam's. Set the default dtype to float64 for float64 training, as mace's
trainer does, to match it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Dict, Optional, Tuple

import torch

from mace_accel.capture import (_Captured, capture_pool, fill_static,
                                graphs_unavailable_reason, keep_edge_orderings, n_structures,
                                padded_shape, static_inputs)
from mace_accel.errors import InputError
from mace_accel.models.batch import model_info
from mace_accel.ops.graph import forget_cached_graph
from mace_accel.ops.runtime import side_stream
from mace_accel.state import epoch, radial_embeddings

log = logging.getLogger(__name__)

Tensor = torch.Tensor
REQUIRED = ("positions", "node_attrs", "edge_index", "shifts", "batch", "ptr", "energy",
            "forces")


def energy_forces_loss(energy: Tensor, forces: Tensor, labels: Dict[str, Tensor],
                       n_structures: int, inv_components: Tensor | float,
                       energy_weight: float = 1.0, forces_weight: float = 1.0) -> Tensor:
    """mace's ``WeightedEnergyForcesLoss`` of one batch (scalar), padding-aware.

    ``energy_weight * mean_s(w_s we_s ((E0_s - E_s) / n_s)^2)
    + forces_weight * mean_{i, xyz}(w_s(i) wf_s(i) (F0_i - F_i)^2)``

    Args:
        energy: ``[S']`` the model's energies (``S' >= S``: a dummy structure may follow).
        forces: ``[N', 3]`` the model's forces.
        labels: ``energy [S']``, ``forces [N', 3]``, ``weight``, ``energy_weight``,
            ``forces_weight [S']`` (zero for a dummy structure), ``n_atoms [S']`` (>= 1),
            ``batch [N']`` each atom's structure.
        n_structures: ``S``, the real structures the energy term averages over.
        inv_components: ``1 / (3 N)`` for the ``N`` real atoms (a tensor in a captured step:
            ``N`` changes within a bucket).
    """
    w = labels["weight"]
    e_term = (w * labels["energy_weight"]
              * torch.square((labels["energy"] - energy) / labels["n_atoms"])).sum()
    per_atom = (w * labels["forces_weight"])[labels["batch"]].unsqueeze(-1)
    f_term = (per_atom * torch.square(labels["forces"] - forces)).sum() * inv_components
    return energy_weight * (e_term / n_structures) + forces_weight * f_term


def _labels(batch: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """The loss labels of an unpadded batch (weights default to one, as in mace's data)."""
    s = n_structures(batch)
    ptr = batch["ptr"]
    like = batch["energy"]
    ones = torch.ones(s, dtype=like.dtype, device=like.device)
    return {"energy": like, "forces": batch["forces"], "batch": batch["batch"],
            "n_atoms": (ptr[1:] - ptr[:-1]).to(like.dtype),
            **{k: batch.get(k, ones).to(like.dtype) for k in
               ("weight", "energy_weight", "forces_weight")}}


@dataclasses.dataclass
class _Bucket:
    """One shape bucket: its static buffers and, once captured, its graph and loss."""

    entry: _Captured
    labels: Dict[str, Tensor]
    inv_components: Tensor
    loss: Optional[Tensor] = None
    seen: int = 0


class TrainingStep:
    """One optimizer step per call on a batch's energies and forces, as CUDA graphs.

    Args:
        model: a MACE model (accelerated or not) in train mode, its trained parameters
            requiring grad.
        optimizer: over ``model``'s parameters. Captured steps need an optimizer that can be
            captured: ``torch.optim.Adam(..., capturable=True)`` (or AdamW, SGD).
        energy_weight, forces_weight: the loss's weights (mace's defaults).
        graphs: capture steps as CUDA graphs; ``None``: when the model is on a CUDA device.
        max_graphs: buckets kept captured (least recently used dropped first).

    Call it with a mace batch dict (``batch.to_dict()`` of mace's data loader, on the model's
    device) holding ``energy [S]`` and ``forces [N, 3]`` labels (optional ``weight``,
    ``energy_weight``, ``forces_weight [S]``); it returns the step's loss (a scalar tensor,
    computed before the update).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 energy_weight: float = 1.0, forces_weight: float = 1.0,
                 graphs: Optional[bool] = None, max_graphs: int = 8) -> None:
        device = next(model.parameters()).device
        reason = graphs_unavailable_reason(device)
        if graphs is None:
            graphs = reason is None
        elif graphs and reason is not None:
            raise InputError(f"TrainingStep(graphs=True): {reason}; pass graphs=False")
        if graphs and not all(g.get("capturable", True) for g in optimizer.param_groups):
            raise InputError(f"TrainingStep: {type(optimizer).__name__} was made without "
                             "capturable=True, which a step captured as a CUDA graph needs; "
                             "create it with capturable=True or pass graphs=False")
        self.model, self.optimizer = model, optimizer
        self.energy_weight, self.forces_weight = float(energy_weight), float(forces_weight)
        self.graphs = bool(graphs)
        self.max_graphs = int(max_graphs)
        self.pad_length = 2.0 * float(model_info(model).r_max) + 1.0
        self._embeddings = radial_embeddings(model)
        self._buckets: "collections.OrderedDict[Tuple, _Bucket]" = collections.OrderedDict()
        self._pool = None
        self._fingerprint: Optional[Tuple] = None
        self.n_captures = 0

    # -- public ---------------------------------------------------------------------------------
    def __call__(self, batch: Dict[str, Tensor]) -> Tensor:
        missing = [k for k in REQUIRED if k not in batch]
        if missing:
            raise InputError(f"TrainingStep: the batch has no {', '.join(missing)}; pass mace's "
                             "batch dict (batch.to_dict()) with energy and forces labels")
        if not self.graphs:
            return self._eager(batch)
        return self._graphed(batch)

    def drop(self, why: str = "") -> None:
        """Forget every captured step (the next batch of each bucket runs eagerly again)."""
        if any(b.entry.graph is not None for b in self._buckets.values()):
            log.info("mace-accel: dropped the captured training steps%s",
                     f": {why}" if why else "")
        self._buckets.clear()
        self._fingerprint = None

    @property
    def buckets(self) -> Tuple[Tuple[int, int, int], ...]:
        """``(atoms, edges, structures)`` of every bucket kept, oldest first."""
        return tuple(k[:3] for k in self._buckets)

    # -- eager ----------------------------------------------------------------------------------
    def _loss(self, inputs: Dict[str, Tensor], labels: Dict[str, Tensor], structures: int,
              inv_components: Tensor | float) -> Tensor:
        step_inputs = dict(inputs)
        # a fresh leaf each step: mace differentiates the energy with respect to it
        step_inputs["positions"] = inputs["positions"].detach().clone().requires_grad_(True)
        out = self.model(step_inputs, training=True, compute_force=True)
        return energy_forces_loss(out["energy"], out["forces"], labels, structures,
                                  inv_components, self.energy_weight, self.forces_weight)

    def _update(self, loss: Tensor) -> None:
        # gradients zeroed in place, not set to None: every captured step accumulates into the
        # same tensors, which therefore stay the model's .grad after a replay
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        self.optimizer.step()

    def _eager(self, batch: Dict[str, Tensor]) -> Tensor:
        n = int(batch["positions"].shape[0])
        loss = self._loss(batch, _labels(batch), n_structures(batch), 1.0 / (3 * n))
        self._update(loss)
        return loss.detach()

    # -- graphs ---------------------------------------------------------------------------------
    def _graphed(self, batch: Dict[str, Tensor]) -> Tensor:
        n, e = int(batch["positions"].shape[0]), int(batch["edge_index"].shape[1])
        structures = n_structures(batch)
        key = (*padded_shape(n, e), structures, batch["positions"].dtype,
               batch["positions"].device)
        bucket = self._buckets.get(key)
        if bucket is None:
            while len(self._buckets) >= self.max_graphs:
                self._buckets.popitem(last=False)
            bucket = self._buckets[key] = self._new_bucket(key, batch)
        self._buckets.move_to_end(key)
        self._fill(bucket, batch)
        if self._fingerprint is not None and self._fingerprint != self._current_fingerprint():
            self.drop("the model, its elements' pairs or the optimizer changed since the steps "
                      "were captured")
            bucket = self._buckets[key] = self._new_bucket(key, batch)
            self._fill(bucket, batch)
        bucket.seen += 1
        if bucket.entry.graph is None and bucket.seen >= 2:
            self._capture(bucket)
        if bucket.entry.graph is None:  # the bucket's first batch: eager, on a side stream
            side = side_stream("warm-up", batch["positions"].device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self._padded_step(bucket)
            torch.cuda.current_stream().wait_stream(side)
            return loss.detach()
        bucket.entry.graph.replay()
        return bucket.loss.clone()

    def _new_bucket(self, key: Tuple, batch: Dict[str, Tensor]) -> _Bucket:
        n_pad, e_pad, structures = key[:3]
        like = batch["energy"]
        zeros = {"energy": (structures + 1,), "weight": (structures + 1,),
                 "energy_weight": (structures + 1,), "forces_weight": (structures + 1,),
                 "n_atoms": (structures + 1,), "forces": (n_pad, 3)}
        labels = {k: torch.zeros(shape, dtype=like.dtype, device=like.device)
                  for k, shape in zeros.items()}
        entry = _Captured(None, static_inputs(batch, n_pad, e_pad), {}, 0, 0)
        labels["batch"] = entry.inputs["batch"]
        return _Bucket(entry, labels, torch.zeros((), dtype=like.dtype, device=like.device))

    def _fill(self, bucket: _Bucket, batch: Dict[str, Tensor]) -> None:
        """Write ``batch``'s inputs and labels into the bucket's static buffers (the dummy
        structure: weight zero, one atom at least; padding atoms: zero forces)."""
        if "node_attrs" in fill_static(bucket.entry, batch, self.pad_length):
            for embedding in self._embeddings:  # other elements: other pairs (a new capture)
                embedding.cover(bucket.entry.inputs["node_attrs"])
        n = int(batch["positions"].shape[0])
        structures = n_structures(batch)
        with torch.no_grad():
            for name, value in _labels(batch).items():
                if name == "batch":
                    continue
                buf = bucket.labels[name]
                if name == "forces":
                    buf[:n].copy_(value)
                    buf[n:].zero_()
                else:
                    buf[:structures].copy_(value)
                    buf[structures:].fill_(1.0 if name == "n_atoms" else 0.0)
            bucket.inv_components.fill_(1.0 / (3 * n))

    def _padded_step(self, bucket: _Bucket) -> Tensor:
        structures = bucket.labels["energy"].shape[0] - 1
        loss = self._loss(bucket.entry.inputs, bucket.labels, structures, bucket.inv_components)
        self._update(loss)
        return loss

    def _capture(self, bucket: _Bucket) -> None:
        entry = bucket.entry
        self._pool = capture_pool(self._pool, graphs_alive=any(
            b.entry.graph is not None for b in self._buckets.values()))
        entry.graph = torch.cuda.CUDAGraph()
        keep_edge_orderings(entry)
        try:
            with torch.cuda.graph(entry.graph, pool=self._pool):
                bucket.loss = self._padded_step(bucket)
        except Exception as exc:
            entry.graph = None
            forget_cached_graph()
            first = (str(exc).strip().splitlines() or [""])[0]
            raise RuntimeError(f"mace-accel: the training step could not be captured as a "
                               f"CUDA graph ({type(exc).__name__}: {first}); pass graphs=False"
                               ) from exc
        forget_cached_graph()
        self.n_captures += 1
        self._fingerprint = self._current_fingerprint()
        log.debug("mace-accel: captured a training step for bucket %s", entry.inputs[
            "positions"].shape[0])

    def _current_fingerprint(self) -> Tuple:
        """What the captured steps baked in, read on the host: the surgery epoch, the radial
        embeddings' pairs of elements, the storage of every parameter and buffer, the
        buffers' versions, and the optimizer's groups, hyper-parameters and state tensors (by
        identity). Not the parameters' versions: new weights in the same storage are what a
        replay reads. The buffers are the architecture's constants (r_max, the Bessel
        frequencies, the distance transform's and ZBL's parameters, scale and shift), which
        the fused kernels read on the host when they are made; nothing in a step writes them,
        so new values there (``load_state_dict`` of another model) mean a new capture."""
        tensors = tuple(t.data_ptr() for t in self.model.parameters()) + tuple(
            (t.data_ptr(), t._version) for t in self.model.buffers())
        groups = tuple(tuple((k, id(v) if torch.is_tensor(v) else v)
                             for k, v in sorted(g.items(), key=lambda kv: kv[0])
                             if k != "params")
                       + tuple(id(p) for p in g["params"]) for g in self.optimizer.param_groups)
        state = tuple(id(v) for s in self.optimizer.state.values() for v in s.values()
                      if torch.is_tensor(v))
        return (epoch(self.model), tuple(e.generation for e in self._embeddings), tensors,
                groups, state)
