"""From ase.Atoms to the batch dict a MACE model takes, through mace's own data path.

mace builds floating tensors in torch's *default* dtype. We never change that global, so the
floating fields (positions, cell, shifts) are rebuilt here from the float64 numpy arrays and cast
once to the model's dtype: a float64 model gets float64-exact geometry whatever the default is.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from mace_accel.errors import InputError


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What the data path needs to know about a model (robust to old checkpoint layouts)."""

    atomic_numbers: tuple
    r_max: float
    heads: tuple
    dtype: torch.dtype

    @property
    def symbols(self) -> List[str]:
        from ase.data import chemical_symbols

        return [chemical_symbols[z] for z in self.atomic_numbers]


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of ``model``'s floating parameters (torch's default dtype if it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()),
                torch.get_default_dtype())


def model_info(model: torch.nn.Module) -> ModelInfo:
    """Read atomic numbers, cutoff, heads and dtype off a loaded MACE model.

    Accepts the layouts of every mace-torch release: ``atomic_numbers`` as a buffer, tensor or
    list; ``r_max`` as a tensor or plain float; ``heads`` missing (single-head models before
    0.3.7) means one head called ``"Default"``.
    """
    z = getattr(model, "atomic_numbers", None)
    r_max = getattr(model, "r_max", None)
    if z is None or r_max is None:
        raise InputError(
            f"{type(model).__name__} has no atomic_numbers/r_max: not a MACE model"
        )
    zs = tuple(int(v) for v in (z.tolist() if torch.is_tensor(z) else z))
    r = float(r_max.item() if torch.is_tensor(r_max) else r_max)
    heads = tuple(getattr(model, "heads", None) or ("Default",))
    return ModelInfo(zs, r, heads, model_dtype(model))


def atoms_to_batch(atoms, info: ModelInfo, head: Optional[str] = None,
                   dtype: Optional[torch.dtype] = None,
                   device: torch.device | str = "cpu") -> Dict[str, torch.Tensor]:
    """One-structure batch for ``model(batch, ...)``.

    Args:
        atoms: an ``ase.Atoms`` whose elements are all in ``info.atomic_numbers``.
        head: head name (default: the model's last head, as mace does).
        dtype: floating dtype of the batch (default: the model's).

    Returns:
        mace's batch dict (``positions [N,3]``, ``edge_index [2,E]``, ``shifts [E,3]``,
        ``node_attrs [N, n_elements]``, ``cell [3,3]``, ``batch [N]``, ``ptr [2]``,
        ``head [1]``, ...) on ``device``.
    """
    from mace_accel._e3nn_compat import import_mace

    import_mace()  # the one place mace is first imported (its notices stay off stdout)
    from mace import data as mace_data
    from mace.tools import torch_geometric, utils

    dtype = dtype or info.dtype
    heads = list(info.heads)
    head = head or heads[-1]
    keyspec = mace_data.KeySpecification(info_keys={}, arrays_keys={})
    config = mace_data.config_from_atoms(atoms, key_specification=keyspec, head_name=head)
    graph = mace_data.AtomicData.from_config(
        config, z_table=utils.AtomicNumberTable(list(info.atomic_numbers)), cutoff=info.r_max,
        heads=heads,
    )
    batch = torch_geometric.Batch.from_data_list([graph])
    out = batch.to_dict() if hasattr(batch, "to_dict") else {k: batch[k] for k in batch.keys}
    _exact_geometry(out, config, dtype)
    return {k: (v.to(device=device, dtype=dtype) if torch.is_tensor(v) and v.is_floating_point()
                else (v.to(device) if torch.is_tensor(v) else v))
            for k, v in out.items()}


def _exact_geometry(batch: Dict[str, torch.Tensor], config, dtype: torch.dtype) -> None:
    """Replace positions/cell/shifts, built in torch's default dtype, by float64-exact values."""
    positions = np.asarray(config.positions, dtype=np.float64)
    batch["positions"] = torch.from_numpy(positions.copy()).to(dtype)
    cell = np.zeros((3, 3)) if config.cell is None else np.asarray(config.cell, dtype=np.float64)
    batch["cell"] = torch.from_numpy(cell.copy()).to(dtype).reshape(batch["cell"].shape)
    if "unit_shifts" in batch:
        unit = batch["unit_shifts"].to(torch.float64).numpy()
        batch["shifts"] = torch.from_numpy(unit @ cell).to(dtype)


def random_structure(atomic_numbers: Sequence[int], n_atoms: int = 8, r_max: float = 5.0,
                     seed: int = 0, periodic: bool = True):
    """A small random ase.Atoms of the model's elements with sane interatomic distances.

    Used by ``accelerate(verify=True)``: about ten neighbours per atom within ``r_max``, no two
    atoms closer than 1.0 Å.
    """
    import ase

    rng = np.random.default_rng(seed)
    density = 10.0 / (4.0 / 3.0 * np.pi * r_max**3)
    side = max((n_atoms / density) ** (1.0 / 3.0), 2.2)
    positions: List[np.ndarray] = []
    while len(positions) < n_atoms:
        p = rng.uniform(0.0, side, 3)
        if all(np.linalg.norm(p - q) > 1.0 for q in positions):
            positions.append(p)
    numbers = rng.choice(np.asarray(list(atomic_numbers)), size=n_atoms)
    cell = np.eye(3) * side if periodic else None
    return ase.Atoms(numbers=numbers, positions=np.array(positions), cell=cell, pbc=periodic)
