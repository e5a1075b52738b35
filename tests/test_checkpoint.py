"""Loading (incl. legacy layouts), atomic saving, accelerated checkpoints and foundation helpers."""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import rel_error

from mace_accel import accelerate, is_accelerated
from mace_accel.calculator import MACEAccelCalculator
from mace_accel.errors import CheckpointError, MaceAccelError, OutputError
from mace_accel.models.checkpoint import load_model, save_model, upgrade_legacy_model
from mace_accel.tolerances import MODEL_TOL

# mace-accel's own (reference) ops on the CPU, where backend "auto" runs mace's modules
REFERENCE = {"device": "cpu", "backend": "reference"}

TOL = MODEL_TOL[torch.float64]

# attributes mace 0.3.16 sets that older releases did not write (see checkpoint._MODEL_DEFAULTS)
NEW_MODEL_FLAGS = ("heads", "lammps_mliap", "apply_cutoff", "edge_irreps", "use_reduced_cg",
                   "use_agnostic_product", "use_so3", "use_last_readout_only",
                   "use_edge_irreps_first")
NEW_BLOCK_FLAGS = ("cueq_config", "oeq_config", "apply_cutoff", "use_agnostic_product",
                   "num_heads", "edge_irreps", "out_dim")


def make_legacy(model: torch.nn.Module) -> torch.nn.Module:
    """Rewrite a current model the way early mace-torch releases stored it."""
    r_max, numbers = float(model.r_max), [int(z) for z in model.atomic_numbers]
    for name in ("r_max", "atomic_numbers", "num_interactions"):
        del model._buffers[name]
    model.r_max, model.atomic_numbers = r_max, numbers  # plain float and list
    for name in NEW_MODEL_FLAGS:
        model.__dict__.pop(name, None)
    for module in model.modules():
        if module is not model:
            for name in NEW_BLOCK_FLAGS:
                module.__dict__.pop(name, None)
    return model


def results(calc, atoms):
    atoms = atoms.copy()
    atoms.calc = calc
    return atoms.get_potential_energy(), atoms.get_forces(), atoms.get_stress()


# -- load_model -----------------------------------------------------------------------------------
def test_load_model_casts_without_touching_default_dtype(tiny_model, tmp_path):
    default = torch.get_default_dtype()
    path = save_model(tiny_model(), tmp_path / "m.model")
    model = load_model(path, device="cpu", dtype="float32")
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.atomic_numbers.dtype == torch.int64
    assert torch.get_default_dtype() == default
    same = tiny_model()
    assert load_model(same, dtype=torch.float64) is same  # a module is upgraded in place


def test_current_model_needs_no_upgrade(tiny_model):
    assert upgrade_legacy_model(tiny_model()) == []


def test_legacy_checkpoint(tiny_model, tmp_path, cu_atoms):
    from mace.calculators import MACECalculator
    from mace.tools.scripts_utils import extract_config_mace_model

    intact_path = save_model(tiny_model(), tmp_path / "intact.model")
    legacy_path = save_model(make_legacy(tiny_model()), tmp_path / "legacy.model")

    with pytest.raises(AttributeError, match="cpu"):  # mace reads model.r_max.cpu()
        MACECalculator(model_paths=str(legacy_path), device="cpu", default_dtype="float64")

    legacy = load_model(legacy_path)
    intact = load_model(intact_path)
    assert legacy.r_max.dtype == torch.float64 and "r_max" in legacy._buffers
    assert legacy.atomic_numbers.tolist() == [1, 6, 8, 29]
    assert int(legacy.num_interactions) == 2 and legacy.heads == ["Default"]
    assert legacy.use_reduced_cg is False  # old checkpoints hold the full CG basis
    # mace's own tools, which read these attributes plainly, see the same model
    ours, theirs = extract_config_mace_model(legacy), extract_config_mace_model(intact)
    for key in ("r_max", "num_interactions", "apply_cutoff", "heads", "use_so3",
                "use_agnostic_product", "edge_irreps", "distance_transform"):
        assert ours[key] == theirs[key], key

    new = results(MACEAccelCalculator(legacy_path, **REFERENCE, default_dtype="float64"),
                  cu_atoms)
    ref = results(MACECalculator(model_paths=str(intact_path), device="cpu",
                                 default_dtype="float64"), cu_atoms)
    assert abs(new[0] - ref[0]) <= TOL * abs(ref[0])
    assert rel_error(new[1], ref[1]) <= TOL and rel_error(new[2], ref[2]) <= TOL


def _agnesi_zbl_model() -> torch.nn.Module:
    """A tiny ScaleShiftMACE with the Agnesi transform and ZBL repulsion (like MACE-MP-0b)."""
    from mace_accel._e3nn_compat import import_mace, o3

    import_mace()
    from mace import modules

    torch.manual_seed(0)
    model = modules.ScaleShiftMACE(
        atomic_inter_scale=1.0, atomic_inter_shift=0.0, r_max=4.0, num_bessel=4,
        num_polynomial_cutoff=5, max_ell=1,
        interaction_cls=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
        interaction_cls_first=modules.interaction_classes["RealAgnosticResidualInteractionBlock"],
        num_interactions=2, num_elements=2, hidden_irreps=o3().Irreps("4x0e+4x1o"),
        MLP_irreps=o3().Irreps("4x0e"), atomic_energies=np.array([-1.0, -3.0]),
        avg_num_neighbors=8.0, atomic_numbers=[8, 29], correlation=2,
        gate=torch.nn.functional.silu, radial_MLP=[8], pair_repulsion=True,
        distance_transform="Agnesi")
    return model.to(torch.float64).eval()


def test_legacy_atomic_numbers_list_breaks_mace_forward(tmp_path, cu_atoms):
    from mace_accel.models.batch import atoms_to_batch, model_info

    model = _agnesi_zbl_model()
    intact_path = save_model(model, tmp_path / "intact.model")
    legacy = make_legacy(model)
    info = model_info(legacy)
    with pytest.raises(TypeError):  # Agnesi/ZBL index atomic_numbers with a tensor
        legacy(atoms_to_batch(cu_atoms, info), compute_stress=True)
    legacy_path = save_model(legacy, tmp_path / "legacy.model")
    new = results(MACEAccelCalculator(legacy_path, **REFERENCE, default_dtype="float64"),
                  cu_atoms)
    ref = results(MACEAccelCalculator(intact_path, **REFERENCE, default_dtype="float64"),
                  cu_atoms)
    assert abs(new[0] - ref[0]) <= TOL * abs(ref[0])
    assert rel_error(new[1], ref[1]) <= TOL and rel_error(new[2], ref[2]) <= TOL


# -- save_model -----------------------------------------------------------------------------------
class _Unpicklable(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.fn = lambda x: x  # pickle cannot save a lambda


def test_save_model_is_atomic(tmp_path):
    target = tmp_path / "out.model"
    with pytest.raises(Exception):
        save_model(_Unpicklable(), target)
    assert list(tmp_path.iterdir()) == []  # no output, no temporary file
    target.write_bytes(b"previous")
    with pytest.raises(Exception):
        save_model(_Unpicklable(), target)
    assert target.read_bytes() == b"previous" and len(list(tmp_path.iterdir())) == 1
    save_model(torch.nn.Linear(2, 2), target)
    assert isinstance(torch.load(target, weights_only=False), torch.nn.Linear)
    assert len(list(tmp_path.iterdir())) == 1


def test_save_model_into_missing_directory(tmp_path):
    with pytest.raises(OutputError, match="does not exist"):
        save_model(torch.nn.Linear(2, 2), tmp_path / "nope" / "m.model")


def test_save_model_path_errors_are_output_errors(tmp_path):
    """A folder as the target, an existing file without overwrite: OutputError (a
    MaceAccelError and an OSError), and nothing is written."""
    folder = tmp_path / "a.model"
    folder.mkdir()
    with pytest.raises(OutputError, match="it is a folder"):
        save_model(torch.nn.Linear(2, 2), folder)
    target = tmp_path / "m.model"
    target.write_bytes(b"first")
    with pytest.raises(OutputError, match="exists") as err:
        save_model(torch.nn.Linear(2, 2), target, overwrite=False)
    assert isinstance(err.value, MaceAccelError) and isinstance(err.value, OSError)
    assert target.read_bytes() == b"first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.model", "m.model"]


def test_accelerated_checkpoint_is_not_repatched(tiny_model, tmp_path, cu_atoms):
    model = tiny_model()
    plain = results(MACEAccelCalculator(tiny_model(), **REFERENCE, default_dtype="float64"),
                    cu_atoms)
    accelerate(model, backend="reference")
    for module in model.modules():  # a kernel cache entry must not travel
        if hasattr(module, "_kernels"):
            module._kernels[("x", "y")] = object()
    path = save_model(model, tmp_path / "accelerated.model")
    loaded = load_model(path)
    assert is_accelerated(loaded)
    assert all(m._kernels == {} for m in loaded.modules() if hasattr(m, "_kernels"))
    calc = MACEAccelCalculator(path, **REFERENCE, default_dtype="float64")
    blocks = [r for r in calc.report.records if r.kind == "interaction_block"]
    assert calc.backend == "reference" and len(blocks) == 2
    assert calc.report.verification and max(calc.report.verification.values()) <= TOL
    new = results(calc, cu_atoms)
    assert abs(new[0] - plain[0]) <= TOL * abs(plain[0]) and rel_error(new[1], plain[1]) <= TOL


def test_a_model_accelerated_by_an_earlier_version_loads(tiny_model, tmp_path, cu_atoms):
    """A file written before the radial modules moved names their old paths; it loads."""
    import io

    from mace_accel.models.checkpoint import MOVED_MODULES

    model = tiny_model()
    plain = results(MACEAccelCalculator(tiny_model(), **REFERENCE, default_dtype="float64"),
                    cu_atoms)
    accelerate(model, backend="reference")
    buffer = io.BytesIO()
    torch.save(model, buffer, _use_new_zipfile_serialization=False)  # protocol 2: text names
    raw = buffer.getvalue()
    for old, new in MOVED_MODULES.items():
        raw = raw.replace(b"c" + new.encode() + b"\n", b"c" + old.encode() + b"\n")
    assert b"cmace_accel.patches.radial_mlp\n" in raw  # the old name, as an old file has it
    path = tmp_path / "earlier.model"
    path.write_bytes(raw)
    calc = MACEAccelCalculator(load_model(path), **REFERENCE, default_dtype="float64")
    new = results(calc, cu_atoms)
    assert abs(new[0] - plain[0]) <= TOL * abs(plain[0]) and rel_error(new[1], plain[1]) <= TOL


# -- foundation helpers ---------------------------------------------------------------------------
def test_foundations_accept_a_local_path(tiny_model, tmp_path, cu_atoms):
    from mace_accel.calculator import mace_mp, mace_off

    path = save_model(tiny_model(), tmp_path / "local.model")
    calc_mp = mace_mp(model=str(path), **REFERENCE, default_dtype="float64")
    calc_off = mace_off(model=path, **REFERENCE)
    assert isinstance(calc_mp, MACEAccelCalculator) and calc_off.dtype == torch.float64
    assert results(calc_mp, cu_atoms)[0] == results(calc_off, cu_atoms)[0]


def test_foundations_missing_file(tmp_path):
    """A path that is not there is said to be missing (an unknown name: test_bad_input.py's
    API_CASES)."""
    from mace_accel.calculator import mace_mp

    with pytest.raises(CheckpointError, match="does not exist"):
        mace_mp(model=str(tmp_path / "missing.model"), **REFERENCE)


def test_foundations_download_failure_names_the_url(tmp_path, monkeypatch):
    from mace.calculators import foundations_models as fm

    from mace_accel.calculator import mace_mp, mace_off

    def offline(*args, **kwargs):
        raise urllib.error.URLError("network is unreachable")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # an empty download cache
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    for helper, urls in ((mace_mp, fm.mace_mp_urls), (mace_off, fm.mace_off_urls)):
        with pytest.raises(CheckpointError) as err:
            helper(model="small", device="cpu")
        message = str(err.value)
        assert urls["small"] in message and "local path" in message
    leftovers = [p for p in Path(tmp_path).rglob("*") if p.is_file()]
    assert leftovers == []  # no partial download left behind
    assert os.environ["XDG_CACHE_HOME"] == str(tmp_path)
