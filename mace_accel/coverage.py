"""Every module of a model, accounted for: fused, inside a fused module, evaluated by the lean
energy head, or run as mace built it (and why).

A :class:`~mace_accel.surgery.PatchReport` says what surgery fused; this module says what it did
not, so "N of N patched" can never hide a module that still runs as mace wrote it. Each module
of ``model.named_modules()`` gets one :class:`ModuleStatus`:

* ``fused``: a :class:`~mace_accel.patches.adopt.FusedModule` (or a block whose ``forward``
  mace-accel replaced);
* ``inside fused``: a descendant of a fused module (its weights are used, its forward is not);
* ``lean head``: the energy head's modules where :mod:`mace_accel.models.energy_head` computes
  their result itself (atomic energies, scale-shift);
* ``container``: a module whose own forward only calls its children (a ``ModuleList``,
  ``Sequential``);
* ``mace``: everything else: its forward runs as mace (or e3nn) built it.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

import torch

FUSED, INSIDE, LEAN, CONTAINER, MACE = "fused", "inside fused", "lean head", "container", "mace"
# modules whose forward only dispatches to their children
_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)
# why a module of these classes runs as mace built it (the report's words)
WHY = {
    "AtomicEnergiesBlock": "one matmul of the one-hot elements by the reference energies",
    "ScaleShiftBlock": "the energies' scale and shift",
    "GatedEquivariantBlock": "mace's gated non-linearity (elementwise torch ops per node)",
    "Activation": "e3nn's activation of the readout's hidden scalars (elementwise)",
    "Gate": "e3nn's gated non-linearity (elementwise)",
    "GenericJointEmbedding": "the per-structure charge and spin embedding (per node, small)",
}
_DENSITY_WHY = ("its forward runs as mace built it: between the fused parts, the edge "
                "density's tanh and cutoff, its scatter sum per receiver (float atomics) and "
                "the division of the message by it (torch ops)")
# where mace-accel's forward runs instead, what of it is still plain torch (listed as fused)
_EMBEDDING_WHY = ("an e3nn linear of the one-hot elements, run per node (the radial tables "
                  "hold its values where they run)")


@dataclasses.dataclass(frozen=True)
class ModuleStatus:
    """One module: its path in the model, class, status (see the module docstring), and for
    ``mace`` the reason in words."""

    path: str
    block: str
    status: str
    why: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _replaced_forward(module: torch.nn.Module) -> bool:
    """Whether mace-accel installed its own forward on this instance (a non-linear block, a
    multi-head readout)."""
    forward = module.__dict__.get("forward")
    return forward is not None and type(forward).__module__.startswith("mace_accel.")


def account(model: torch.nn.Module) -> List[ModuleStatus]:
    """One :class:`ModuleStatus` for every module of ``model`` (``model.named_modules()``)."""
    from mace_accel.models.energy_head import lean_plan
    from mace_accel.patches.adopt import FusedModule

    lean = lean_plan(model) is not None
    out: List[ModuleStatus] = []
    inside: Dict[int, bool] = {}
    for path, module in model.named_modules():
        name = type(module).__name__
        parent = path.rsplit(".", 1)[0] if "." in path else ("" if path else None)
        under_fused = parent is not None and inside.get(id(_get(model, parent)), False)
        if isinstance(module, FusedModule) or _replaced_forward(module):
            status, why = FUSED, ""
        elif under_fused:
            status, why = INSIDE, ""
        elif lean and path in ("atomic_energies_fn", "scale_shift"):
            status, why = LEAN, ""
        elif isinstance(module, _CONTAINERS):
            status, why = CONTAINER, ""
        elif module is model:
            status = LEAN if lean else MACE
            why = "" if lean else "mace's forward (the energy head, the sums of the energies)"
        elif name.endswith("InteractionBlock"):
            density = "Density" in name  # its own ops between the parts; others only call them
            status, why = (MACE, _DENSITY_WHY) if density else (CONTAINER, "")
        elif path.endswith(("source_embedding", "target_embedding")):
            status, why = MACE, _EMBEDDING_WHY
        elif not any(True for _ in module.children()) or name in WHY:
            status, why = MACE, WHY.get(name, f"{type(module).__module__}.{name}")
        else:
            status, why = CONTAINER, ""
        inside[id(module)] = under_fused or (status == FUSED and isinstance(module, FusedModule))
        out.append(ModuleStatus(path, name, status, why))
    return out


def _get(model: torch.nn.Module, path: str) -> torch.nn.Module:
    return model.get_submodule(path) if path else model


def mace_built(model: torch.nn.Module) -> List[ModuleStatus]:
    """The modules of ``model`` that run as mace built them (status ``mace``), in model order,
    without the children of a module listed already (they run inside it)."""
    listed: List[ModuleStatus] = []
    for status in account(model):
        if status.status == MACE and not any(status.path.startswith(other.path + ".")
                                             for other in listed if other.path):
            listed.append(status)
    return listed
