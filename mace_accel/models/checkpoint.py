"""Load, upgrade and save MACE checkpoints (``.model`` files: whole pickled modules).

``load_model`` is the one way mace-accel reads a model file: it says precisely what is wrong with
a file that is missing, corrupt, a state dict, a TorchScript archive or not a MACE model; it fills
in the attributes that checkpoints written by older mace-torch releases lack
(:func:`upgrade_legacy_model`); casts to the requested dtype (never touching torch's default
dtype); and moves the model to its device. ``save_model`` writes atomically.
"""

from __future__ import annotations

import logging
import os
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any, List, Optional, Union

import torch

from mace_accel.errors import CheckpointError, InputError, OutputError, UnsupportedModelError
from mace_accel.models.batch import model_dtype
from mace_accel.options import resolve_device, resolve_dtype

log = logging.getLogger(__name__)


def default_model_path() -> Path:
    """Path of the Cu/Ni model bundled with the package (see scripts/train_default_model.py)."""
    return Path(__file__).resolve().parent.parent / "data" / "cu_ni_emt.model"


# -- loading --------------------------------------------------------------------------------------
# modules that moved: a model accelerated and saved by an earlier version names the old paths
MOVED_MODULES = {
    "mace_accel.ops.radial_mlp": "mace_accel.ops.radial.mlp",
    "mace_accel.ops.radial_table": "mace_accel.ops.radial.table",
    "mace_accel.patches.radial_mlp": "mace_accel.patches.radial.mlp",
    "mace_accel.patches.radial_table": "mace_accel.patches.radial.table",
    "mace_accel.patches.radial_overlap": "mace_accel.patches.radial.overlap",
}


def _current_module(name: str) -> str:
    """Where the module ``name`` (or its submodule) lives now."""
    for old, new in MOVED_MODULES.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return name


class _Unpickler(pickle.Unpickler):
    """Reads a pickle whose classes may sit in modules that have moved since it was written."""

    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(_current_module(module), name)


class _MovedModulesPickle:
    """The ``pickle_module`` ``torch.load`` reads model files with."""

    Unpickler = _Unpickler
    UnpicklingError = pickle.UnpicklingError

    @staticmethod
    def load(file, **kwargs) -> Any:
        return _Unpickler(file, **kwargs).load()


def load_model(model: Union[str, Path, torch.nn.Module], device: Union[str, torch.device] = "cpu",
               dtype: Union[torch.dtype, str, None] = None) -> torch.nn.Module:
    """A MACE model from a ``.model`` file (or an already loaded module), ready to evaluate.

    The model is upgraded for old checkpoint layouts (:func:`upgrade_legacy_model`), cast to
    ``dtype`` (parameters and floating buffers; torch's default dtype is not touched), put in
    ``eval()`` mode and moved to ``device``. A module passed in is modified in place and returned.

    Args:
        model: path to a MACE checkpoint (a whole pickled module, as mace writes ``.model``
            files), or a loaded MACE ``torch.nn.Module``.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        dtype: ``"float32"``/``"float64"`` (or the torch dtypes); None keeps the stored dtype.

    Raises:
        CheckpointError: missing, corrupt, state-dict-only or TorchScript file.
        UnsupportedModelError: the object is a module but not a MACE model.
        BackendUnavailableError: ``device="cuda"`` without a visible GPU.
    """
    dtype = resolve_dtype(dtype)
    dev = resolve_device(device)  # fail before reading a large file
    if isinstance(model, (str, Path)):
        path = Path(model)
        obj = _read_checkpoint(path)
        source = str(path)
    else:
        obj, source = model, "the object passed in"
    module = check_mace_module(obj, source)
    upgrade_legacy_model(module)
    if dtype is not None:
        module.to(dtype=dtype)
    module.eval()
    return module.to(dev)


def _read_checkpoint(path: Path):
    if not path.exists():
        raise CheckpointError(f"model file {str(path)!r} does not exist; check the path (a MACE "
                              "checkpoint is the .model file written at the end of training)")
    if path.is_dir():
        raise CheckpointError(f"{str(path)!r} is a folder (directory), not a model file; pass "
                              "the path of the .model file")
    if not os.access(path, os.R_OK):
        raise CheckpointError(f"no permission to read the model file {str(path)!r}; fix its "
                              "permissions (chmod u+r) or copy it somewhere readable")
    if _is_torchscript(path):
        raise CheckpointError(
            f"{str(path)!r} is a TorchScript archive (compiled with torch.jit, e.g. a "
            "'*-lammps.pt' or '*_compiled.model' file); mace-accel patches the Python model. Pass "
            "the original .model file that was compiled into it")
    from mace_accel._e3nn_compat import import_mace

    import_mace()  # unpickling a MACE module imports mace, which imports e3nn
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's FutureWarning about weights_only=False
            return torch.load(path, map_location="cpu", weights_only=False,
                              pickle_module=_MovedModulesPickle)
    except (ModuleNotFoundError, AttributeError) as exc:
        # pickle names a class the installed packages do not have
        raise CheckpointError(
            f"{str(path)!r} refers to code that is not installed ({type(exc).__name__}: {exc}). "
            "It was probably written by a newer mace-torch (or with another package's classes); "
            "upgrade mace-torch (pip install -U mace-torch) and try again") from exc
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError, OSError,
            zipfile.BadZipFile, KeyError, IndexError, TypeError) as exc:
        size = path.stat().st_size
        raise CheckpointError(
            f"{str(path)!r} ({size} bytes) could not be read as a torch checkpoint: it is "
            f"corrupt, truncated or not a torch file ({type(exc).__name__}: {exc}). If it was "
            "downloaded, download it again (an interrupted download leaves a truncated file)"
        ) from exc


def _is_torchscript(path: Path) -> bool:
    """A ``torch.jit.save`` archive: a zip file holding ``constants.pkl`` and ``code/``."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
    except (zipfile.BadZipFile, OSError):
        return False
    return any(n.endswith("/constants.pkl") for n in names) and any("/code/" in n for n in names)


def check_mace_module(obj, source: str = "the object") -> torch.nn.Module:
    """Return ``obj`` if it is a (possibly legacy) MACE model, else raise a clear error."""
    if isinstance(obj, torch.jit.ScriptModule):
        raise CheckpointError(
            f"{source} holds a TorchScript (compiled) model; mace-accel patches the Python model. "
            "Pass the original .model file that was compiled into it")
    if isinstance(obj, dict):
        keys = list(obj)[:5]
        what = ("a training checkpoint (model/optimizer state dicts)"
                if "model" in obj or "optimizer" in obj else "a state dict")
        raise CheckpointError(
            f"{source} holds {what} (a dict with keys {keys}{'...' if len(obj) > 5 else ''}), "
            "not a whole model. MACE .model files are whole pickled modules (torch.save(model)); "
            "use the .model file written at the end of training, or rebuild the model, load this "
            "state dict into it with model.load_state_dict(...) and save it with torch.save(model, "
            "path)")
    if not isinstance(obj, torch.nn.Module):
        raise CheckpointError(f"{source} holds a {type(obj).__module__}.{type(obj).__name__}, "
                              "not a MACE model (torch.nn.Module)")
    missing = [a for a in ("interactions", "atomic_numbers", "r_max") if not hasattr(obj, a)]
    if missing:
        raise UnsupportedModelError(
            f"{source} holds a {type(obj).__name__}, which is not a MACE model (it has no "
            f"{', '.join(missing)}); pass a model saved by mace-torch (MACE, ScaleShiftMACE, ...)")
    return obj


# -- legacy layouts -------------------------------------------------------------------------------
# Attributes that mace 0.3.16 sets in __init__ but checkpoints from older releases lack, with the
# value that reproduces how those releases behaved (the defaults mace's own
# extract_config_mace_model assumes when they are missing). A traced 0.3.16 forward of every
# interaction class reads these only through hasattr; its plain reads are of attributes old
# checkpoints have, except that the Agnesi/Soft transforms and ZBL index ``atomic_numbers`` with a
# tensor (a list fails). The calculator (``model.r_max.cpu()``), extract_config_mace_model
# (``r_max.item()``, ``num_interactions.item()``), LAMMPS export and the cuEquivariance /
# OpenEquivariance converters read them plainly. Never filled in: attributes whose mere presence
# switches a code path on (distance_transform, pair_repulsion, conv_fusion, joint_embedding).
_MODEL_DEFAULTS = {
    "lammps_mliap": False, "apply_cutoff": True, "edge_irreps": None, "use_reduced_cg": False,
    "use_agnostic_product": False, "use_so3": False, "use_last_readout_only": False,
    "use_edge_irreps_first": False,
}
_BLOCK_DEFAULTS = {
    "RadialEmbeddingBlock": {"apply_cutoff": True},
    "EquivariantProductBasisBlock": {"use_agnostic_product": False, "cueq_config": None},
    "reshape_irreps": {"cueq_config": None},
    "NonLinearReadoutBlock": {"num_heads": 1},
    "NonLinearBiasReadoutBlock": {"num_heads": 1},
}
_INTERACTION_DEFAULTS = {"cueq_config": None, "oeq_config": None}


def upgrade_legacy_model(model: torch.nn.Module) -> List[str]:
    """Bring a model saved by any mace-torch release since 2022 to the 0.3.16 layout, in place.

    * ``r_max`` stored as a plain float and ``atomic_numbers`` as a list (early releases) become
      the buffers later code expects (``r_max`` in the model's float dtype, ``atomic_numbers``
      int64); a missing ``num_interactions`` buffer is added.
    * ``heads`` missing (single-head models before multi-head support) becomes ``["Default"]``.
    * flags added after 0.3.0 (see ``_MODEL_DEFAULTS``/``_BLOCK_DEFAULTS``) get the value that
      reproduces the old behaviour: cutoff applied to the radial basis, no agnostic product,
      full (non-reduced) CG basis, no cuEquivariance/OpenEquivariance config, one readout head.

    Returns:
        ``"path.attribute"`` for each thing added or converted (empty for a current model).
    """
    changed: List[str] = []
    float_dtype = model_dtype(model)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))

    def as_buffer(name: str, value: torch.Tensor) -> None:
        if name in model.__dict__:  # a plain attribute must go before a buffer of that name
            delattr(model, name)
        model.register_buffer(name, value)
        changed.append(name)

    r_max = model.r_max
    if _is_plain(model, "r_max"):
        value = float(r_max.item() if torch.is_tensor(r_max) else r_max)
        as_buffer("r_max", torch.tensor(value, dtype=float_dtype, device=device))
    z = model.atomic_numbers
    if _is_plain(model, "atomic_numbers") or (torch.is_tensor(z) and z.dtype != torch.int64):
        values = [int(v) for v in (z.tolist() if torch.is_tensor(z) else z)]
        as_buffer("atomic_numbers", torch.tensor(values, dtype=torch.int64, device=device))
    if not hasattr(model, "num_interactions"):
        as_buffer("num_interactions",
                  torch.tensor(len(model.interactions), dtype=torch.int64, device=device))
    if getattr(model, "heads", None) is None:
        energies = getattr(getattr(model, "atomic_energies_fn", None), "atomic_energies", None)
        n_heads = torch.atleast_2d(energies).shape[0] if torch.is_tensor(energies) else 1
        model.heads = ["Default"] if n_heads == 1 else [f"head_{i}" for i in range(n_heads)]
        if n_heads > 1:
            log.warning("mace-accel: model has %d heads but no head names; calling them %s",
                        n_heads, model.heads)
        changed.append("heads")
    changed += _fill(model, "", _MODEL_DEFAULTS)

    for path, module in model.named_modules():
        cls = type(module).__name__
        if module is model:
            continue
        defaults = dict(_BLOCK_DEFAULTS.get(cls, {}))
        if cls.endswith("InteractionBlock") and hasattr(module, "conv_tp"):
            defaults.update(_INTERACTION_DEFAULTS)
            if "node_feats_irreps" in module.__dict__:
                defaults["edge_irreps"] = module.node_feats_irreps  # 0.3.16: None -> node irreps
        if cls == "RadialEmbeddingBlock" and hasattr(module, "bessel_fn"):
            n_basis = _num_basis(module.bessel_fn)
            if n_basis is not None:
                defaults["out_dim"] = n_basis
        changed += _fill(module, path, defaults)
    if changed:
        log.info("mace-accel: upgraded a legacy checkpoint layout: %s", ", ".join(changed))
    return changed


def _is_plain(module: torch.nn.Module, name: str) -> bool:
    """True if ``name`` is stored as a plain attribute, not as a registered buffer."""
    return name in module.__dict__ and name not in module._buffers


def _fill(module: torch.nn.Module, path: str, defaults: dict) -> List[str]:
    added = []
    for name, value in defaults.items():
        if not hasattr(module, name):
            setattr(module, name, value)
            added.append(f"{path}.{name}" if path else name)
    return added


def _num_basis(bessel_fn: torch.nn.Module) -> Optional[int]:
    for attr in ("bessel_weights", "gaussian_weights"):
        w = getattr(bessel_fn, attr, None)
        if torch.is_tensor(w):
            return int(w.numel())
    n = getattr(bessel_fn, "num_basis", None)
    return int(n) if n is not None else None


# -- saving ---------------------------------------------------------------------------------------
def save_model(model: torch.nn.Module, path: Union[str, Path], *, overwrite: bool = True) -> Path:
    """Write ``model`` to ``path`` atomically (``torch.save`` of the whole module).

    Written through :func:`mace_accel.files.atomic_write`: a failure leaves ``path`` as it was,
    and with ``overwrite=False`` an existing ``path`` (also one another process created
    meanwhile) is never replaced. Accelerated models are saved with their fused modules but
    never with compiled kernels (they are rebuilt on first use after loading).

    Raises:
        InputError: ``model`` is not a module.
        OutputError: ``path`` is a folder, its folder does not exist or is not writable, or
            ``overwrite=False`` and ``path`` exists (also when another process created it
            while this one was writing).
    """
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"save_model expects a torch.nn.Module, got {type(model).__name__}")
    return save_object(model, path, overwrite=overwrite)


def save_object(obj: Any, path: Union[str, Path], *, overwrite: bool = True) -> Path:
    """``torch.save(obj)`` to ``path`` atomically, as :func:`save_model` (which it serves; also
    the LAMMPS model file).

    Raises:
        OutputError: as :func:`save_model`.
    """
    from mace_accel.files import atomic_write

    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise OutputError(f"cannot save to {str(path)!r}: it is a folder; give a file path such "
                          "as folder/name.model")
    if not directory.is_dir():
        raise OutputError(f"cannot save to {str(path)!r}: folder {str(directory)!r} does not "
                          "exist; create it first")
    try:
        with atomic_write(path, "wb", overwrite=overwrite) as f:
            torch.save(obj, f)
    except FileExistsError:
        raise OutputError(f"cannot save to {str(path)!r}: the file exists (perhaps another "
                          "process just wrote it) and was left as it is; choose another path "
                          "or allow overwriting") from None
    except (PermissionError, IsADirectoryError, NotADirectoryError) as exc:
        raise OutputError(f"cannot save to {str(path)!r}: {exc.strerror or exc}; choose "
                          "another path or fix the folder's permissions") from None
    return path
