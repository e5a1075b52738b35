"""What a model's derived state was made from, checked cheaply before it is used again.

An accelerated model keeps state derived from its weights: folded and packed weights, radial
tables (:class:`~mace_accel.patches.adopt.FusedModule` caches them keyed by the parameters'
storage and version, so an eager call rebuilds what changed), and, in the calculator, whole
calls captured as CUDA graphs. A graph replays raw device pointers: the weights and every
derived tensor as they were at capture. :class:`StateWatch` records what a capture depended on
and tells, for a few microseconds a call, whether any of it changed since:

* every parameter and buffer's version (bumped by in-place updates: optimizer steps,
  ``load_state_dict``, ``copy_`` under ``no_grad``) and the storage of the first and the last
  (``.to(dtype)``, ``.to(device)`` give every tensor new storage);
* the surgery epoch (:func:`bump_epoch`: ``accelerate`` and ``revert``);
* the radial embeddings' pair generations (a structure of other elements gets radial tables
  of its own, and the old ones are freed).

Replacing modules or parameter objects (``model.readouts[1] = ...``), or one tensor's storage
(``param.data = ...``), is not watched: call the calculator's ``reset()`` (or make a new
:class:`StateWatch`) after it. The check reads one integer per tensor (88 for MACE-MP-0 medium,
159 for MH-1): a small share of a small call's host time (``scripts/profile_gpu.py md`` splits the
calculator's time into its checks, the neighbour list and the model).
"""

from __future__ import annotations

import itertools
from typing import List, Tuple

import torch

EPOCH_ATTR = "_mace_accel_epoch"


def bump_epoch(model: torch.nn.Module) -> None:
    """Record that surgery changed ``model`` (accelerated or reverted)."""
    model.__dict__[EPOCH_ATTR] = model.__dict__.get(EPOCH_ATTR, 0) + 1


def epoch(model: torch.nn.Module) -> int:
    return model.__dict__.get(EPOCH_ATTR, 0)


def radial_embeddings(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The model's fused radial embeddings (their pairs of elements change with the inputs)."""
    from mace_accel.patches.edge_features import FusedRadialEmbedding

    return [m for m in model.modules() if isinstance(m, FusedRadialEmbedding)]


class StateWatch:
    """The weights, surgery and radial pairs of ``model`` as they are now, to compare later.

    Args:
        model: the model a CUDA graph (or any cache) was made from.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.tensors = list(itertools.chain(model.parameters(), model.buffers()))
        self.embeddings = radial_embeddings(model)
        self.key = self.current()

    def current(self) -> Tuple:
        """What the watched state is now (host-side reads only: no device work)."""
        tensors = self.tensors
        ends = (tensors[0].data_ptr(), tensors[-1].data_ptr()) if tensors else ()
        return (epoch(self.model), [e.generation for e in self.embeddings],
                [t._version for t in tensors], ends)

    def changed(self) -> bool:
        """Whether anything watched differs from when this watch was made."""
        return self.current() != self.key

    def cover(self, node_attrs: torch.Tensor) -> None:
        """Give the radial embeddings the elements of ``node_attrs`` (a CUDA graph's inputs
        refilled with another structure): another set of elements changes their pairs' generation
        (:meth:`changed` then says so)."""
        for embedding in self.embeddings:
            embedding.cover(node_attrs)
