"""Every bad input gets a clear error that says what is wrong (asserted on the message)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk

from mace_accel.calculator import MACEAccelCalculator
from mace_accel.errors import (
    BackendUnavailableError,
    CheckpointError,
    ConfigError,
    InputError,
    UnsupportedModelError,
)
from mace_accel.models.batch import ModelInfo
from mace_accel.models.checkpoint import load_model, save_model
from mace_accel.models.validation import validate_atoms, validate_head

INFO = ModelInfo(atomic_numbers=(1, 6, 8, 29), r_max=4.0, heads=("Default",),
                 dtype=torch.float64)


@pytest.fixture(scope="module")
def model_file(tiny_model, tmp_path_factory):
    return save_model(tiny_model(), tmp_path_factory.mktemp("bad") / "tiny.model")


@pytest.fixture(scope="module")
def calc(model_file):
    return MACEAccelCalculator(model_file, device="cpu", default_dtype="float64")


# -- structures -----------------------------------------------------------------------------------
def test_empty_structure(calc):
    atoms = Atoms()
    atoms.calc = calc
    with pytest.raises(InputError, match="empty"):
        atoms.get_potential_energy()


def test_unknown_element(calc):
    atoms = Atoms("CuNiFe", positions=[[0, 0, 0], [2, 0, 0], [0, 2, 0]])
    atoms.calc = calc  # validated on every calculate
    with pytest.raises(InputError) as err:
        atoms.get_potential_energy()
    message = str(err.value)
    assert "Ni (Z=28)" in message and "Fe (Z=26)" in message and "[1, 2]" in message
    assert "H, C, O, Cu" in message


def test_nan_positions():
    atoms = Atoms("CuCuCu", positions=[[0, 0, 0], [2, 0, 0], [0, 2, 0]])
    atoms.positions[1, 2] = np.nan
    atoms.positions[2, 0] = np.inf
    with pytest.raises(InputError, match=r"atom\(s\) \[1, 2\] are NaN or inf"):
        validate_atoms(atoms, INFO)


def test_atoms_too_close():
    atoms = Atoms("CuOH", positions=[[0, 0, 0], [3, 0, 0], [3.3, 0, 0]])
    with pytest.raises(InputError) as err:
        validate_atoms(atoms, INFO)
    message = str(err.value)
    assert "atoms 1 (O) and 2 (H)" in message and "0.3000 Å" in message
    assert "min_distance=0.5" in message and "same cell" in message
    validate_atoms(atoms, INFO, min_distance=0.2)  # the threshold is the user's


def test_atoms_too_close_across_the_boundary():
    atoms = Atoms("Cu2", positions=[[0.1, 1, 1], [3.9, 1, 1]], cell=[4, 4, 4], pbc=True)
    with pytest.raises(InputError, match=r"0\.2000 Å apart \(across a periodic boundary\)"):
        validate_atoms(atoms, INFO)
    atoms.pbc = False  # 3.8 Å apart without the periodic image
    validate_atoms(atoms, INFO)


def test_atom_too_close_to_its_own_image():
    atoms = Atoms("Cu", cell=[[0.3, 0, 0], [0, 4, 0], [0, 0, 4]], pbc=True)
    with pytest.raises(InputError, match=r"0\.3000 Å apart \(an atom and its own periodic image"):
        validate_atoms(atoms, INFO)


def test_overlap_check_is_fast_for_10k_atoms():
    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((14, 14, 13))  # 10192 atoms
    atoms.rattle(0.05, seed=0)
    start = time.perf_counter()
    validate_atoms(atoms, INFO)
    assert time.perf_counter() - start < 5.0
    atoms.positions[7000] = atoms.positions[12] + 0.1
    with pytest.raises(InputError, match="atoms 12 .* and 7000"):
        validate_atoms(atoms, INFO)


def test_periodic_direction_without_a_cell_vector():
    atoms = Atoms("Cu", cell=[[3, 0, 0], [0, 3, 0], [0, 0, 0]], pbc=True)
    with pytest.raises(InputError, match="pbc is True along c but cell vector.* zero length"):
        validate_atoms(atoms, INFO)
    atoms.pbc = [True, True, False]  # a slab: fine
    validate_atoms(atoms, INFO)


def test_degenerate_periodic_cell():
    atoms = Atoms("Cu", cell=[[3, 0, 0], [0, 3, 0], [3, 3, 0]], pbc=True)
    with pytest.raises(InputError, match="linearly dependent .*zero volume"):
        validate_atoms(atoms, INFO)


def test_unknown_head(model_file):
    with pytest.raises(InputError,
                       match=r"unknown head 'pbe'; the model's heads are \['Default'\]"):
        MACEAccelCalculator(model_file, device="cpu", head="pbe")
    two = ModelInfo((29,), 4.0, ("mp", "omat"), torch.float64)
    with pytest.raises(InputError, match=r"several heads \['mp', 'omat'\]"):
        validate_head(None, two)


# -- checkpoints and options ----------------------------------------------------------------------
def test_missing_checkpoint(tmp_path):
    path = tmp_path / "nope.model"
    with pytest.raises(CheckpointError, match=f"{path}.* does not exist"):
        MACEAccelCalculator(path, device="cpu")


def test_corrupt_checkpoint(model_file, tmp_path):
    truncated = tmp_path / "truncated.model"
    truncated.write_bytes(model_file.read_bytes()[:2000])
    with pytest.raises(CheckpointError, match="corrupt, truncated or not a torch file.*again"):
        load_model(truncated)
    text = tmp_path / "notes.model"
    text.write_text("this is not a model\n")
    with pytest.raises(CheckpointError, match="not a torch file"):
        load_model(text)


def test_state_dict_checkpoint(tiny_model, tmp_path):
    path = tmp_path / "weights.pt"
    torch.save(tiny_model().state_dict(), path)
    with pytest.raises(CheckpointError, match="state dict.*whole pickled modules"):
        load_model(path)
    torch.save({"model": tiny_model().state_dict(), "optimizer": {}}, path)
    with pytest.raises(CheckpointError, match="training checkpoint"):
        load_model(path)


def test_torchscript_checkpoint(tmp_path):
    path = tmp_path / "compiled.model"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)
    with pytest.raises(CheckpointError, match="TorchScript.*original .model"):
        load_model(path)


def test_non_mace_module(tmp_path):
    path = tmp_path / "linear.model"
    torch.save(torch.nn.Linear(3, 1), path)
    with pytest.raises(UnsupportedModelError, match="Linear, which is not a MACE model"):
        load_model(path)
    with pytest.raises(UnsupportedModelError, match="interactions"):
        MACEAccelCalculator(torch.nn.Sequential(torch.nn.Linear(3, 1)), device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_cuda_requested_without_gpu(model_file):
    expected = ("device 'cuda' requested but no CUDA GPU is visible; pass device='cpu' (or "
                "'auto') to run the reference path")
    with pytest.raises(BackendUnavailableError) as err:
        MACEAccelCalculator(model_file, device="cuda")
    assert str(err.value) == expected
    with pytest.raises(BackendUnavailableError, match="no CUDA GPU"):
        load_model(model_file, device="cuda")


def test_bad_options(model_file):
    with pytest.raises(InputError, match="dtype must be one of"):
        MACEAccelCalculator(model_file, device="cpu", default_dtype="float16")
    with pytest.raises(ConfigError, match="backend must be one of"):
        MACEAccelCalculator(model_file, device="cpu", backend="triton")
    with pytest.raises(ConfigError, match="fallback must be one of"):
        MACEAccelCalculator(model_file, device="cpu", fallback="ignore")
    with pytest.raises(InputError, match="invalid device"):
        MACEAccelCalculator(model_file, device="gpu please")


def test_cuda_backend_on_cpu_warns_or_raises(model_file):
    with pytest.warns(RuntimeWarning, match="CUDA backend unavailable"):
        calc = MACEAccelCalculator(model_file, device="cpu", backend="cuda")
    assert calc.backend == "reference" and calc.report.requested_backend == "cuda"
    with pytest.raises(BackendUnavailableError, match="backend='reference'"):
        MACEAccelCalculator(model_file, device="cpu", backend="cuda", fallback="error")


def test_accelerate_with_an_unknown_backend_is_a_config_error(tiny_model):
    from mace_accel import accelerate, is_accelerated
    from mace_accel.errors import MaceAccelError

    model = tiny_model()
    with pytest.raises(ConfigError, match="backend must be one of auto, cuda, reference; got "
                                          "'bogus'") as err:
        accelerate(model, backend="bogus")
    assert isinstance(err.value, MaceAccelError) and not is_accelerated(model)
    with pytest.raises(ConfigError, match="fallback"):
        accelerate(model, backend="reference", fallback="maybe")


def test_calculator_device_auto_is_the_default(model_file):
    """``device="auto"`` (also the default, as in YAML runs) runs on the CPU without a GPU."""
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    for calc in (MACEAccelCalculator(model_file, default_dtype="float64"),
                 MACEAccelCalculator(model_file, device="auto", default_dtype="float64")):
        assert calc.device.type == expected
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
        atoms.calc = calc
        assert np.isfinite(atoms.get_potential_energy())


def test_calculator_on_a_model_that_itself_gives_nan(tiny_model):
    """The message blames the model, not the acceleration."""
    from mace_accel.errors import VerificationError

    model = tiny_model()
    with torch.no_grad():
        next(model.readouts[-1].parameters()).view(-1)[0] = float("nan")
    with pytest.raises(VerificationError) as err:
        MACEAccelCalculator(model, device="cpu", default_dtype="float64")
    message = str(err.value)
    assert "the model itself (without mace-accel) gives non-finite" in message
    assert "disagrees" not in message
