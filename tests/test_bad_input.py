"""Every bad input gets a clear error that says what is wrong (asserted on the message)."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

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
    with pytest.raises(ConfigError, match="backend must be one of auto, cuda, reference, mace; got "
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


# -- a new user's mistakes, through the command line and the YAML runner -------------------------
# Each case: one `error:` line on stderr (no traceback), exit 2, nothing written. The run file
# starts from RUN and takes the case's changes (DROP deletes a key); paths are relative to the
# inputs folder, where the run file is written.
DROP = object()
RUN = {"task": "md", "struct": "cu32.extxyz", "model": "cuni.model", "device": "cpu",
       "dtype": "float64", "progress": False, "md": {"steps": 1}}

RUN_CASES = [
    # id, run-file changes, extra arguments, fragments of the error line
    ("no-task", {"task": DROP}, [], ["task is required: one of singlepoint, geomopt, md"]),
    ("unknown-task", {"task": "relax"}, [], ["task must be one of", "'relax'"]),
    ("no-struct", {"struct": DROP}, [], ["missing required key(s): 'struct'"]),
    ("struct-missing", {"struct": "nope.xyz"}, [], ["struct: no such file", "nope.xyz"]),
    ("struct-not-a-structure", {"struct": "notes.yaml"}, [],
     ["could not read structure file", "give a structure file ASE reads"]),
    ("struct-empty-file", {"struct": "empty.extxyz"}, [], ["could not read structure file",
                                                           "Empty file"]),
    ("struct-no-atoms", {"struct": "zero.extxyz"}, [], ["frame 0 of", "holds no atoms"]),
    ("struct-is-a-folder", {"struct": "."}, [], ["struct:", "is a folder, not a file"]),
    ("typo-top-key", {"temprature": 300}, [], ["unknown key(s) 'temprature' in the run file",
                                               "valid keys: task, struct"]),
    ("typo-md-key", {"md": {"temp": 300}}, [], ["unknown key(s) 'temp' in section 'md'",
                                                "temperature"]),
    ("section-of-another-task", {"geomopt": {"fmax": 0.1}}, [],
     ["section 'geomopt' is given but task is 'md'"]),
    ("negative-steps", {"md": {"steps": -1}}, [], ["md.steps must be >= 0, got -1"]),
    ("steps-1e99", {"md": {"steps": "1e99"}}, [], ["md.steps must be <= 9.22e+18, got 1e+99"]),
    ("timestep-not-a-number", {"md": {"timestep": "fast"}}, [],
     ["md.timestep must be a finite number, got 'fast'"]),
    ("timestep-inf", {"md": {"timestep": ".inf"}}, [], ["md.timestep must be a finite number"]),
    ("negative-temperature", {"md": {"temperature": -5}}, [], ["md.temperature must be >= 0"]),
    ("seed-negative", {"md": {"seed": -1}}, [], ["md.seed must be >= 0, got -1"]),
    ("seed-too-large", {}, ["--set", "md.seed=4294967296"], ["md.seed must be <= 4294967295"]),
    ("seed-not-whole", {"md": {"seed": 1.5}}, [], ["md.seed must be an integer, got 1.5"]),
    ("unknown-ensemble", {"md": {"ensemble": "nph"}}, [], ["md.ensemble must be one of nve, nvt, "
                                                           "npt; got 'nph'"]),
    ("md-section-a-list", {"md": [1, 2]}, [], ["md must be a mapping of keys to values"]),
    ("frame-out-of-range", {"frame": 5}, [], ["frame: 5 is out of range", "holds 1 frame(s)"]),
    ("multi-frame-md-without-frame", {"struct": "frames.extxyz"}, [],
     ["holds 4 frames and md runs from one", "--set frame=-1"]),
    ("device-gpu", {"device": "gpu"}, [], ["device must be auto | cpu | cuda | cuda:N, got 'gpu'"]),
    ("device-cuda-x", {"device": "cuda:x"}, [], ["device must be auto | cpu | cuda | cuda:N"]),
    ("dtype-float16", {"dtype": "float16"}, [], ["dtype must be one of float32, float64"]),
    ("backend-triton", {"backend": "triton"}, [], ["backend must be one of auto, cuda, reference"]),
    ("negative-min-distance", {"min_distance": -1}, [], ["min_distance must be >= 0"]),
    ("negative-skin", {"skin": -1}, [], ["skin must be >= 0"]),
    ("unknown-property", {"task": "singlepoint", "md": DROP,
                          "singlepoint": {"properties": ["dipole"]}}, [],
     ["singlepoint.properties: unknown property 'dipole'"]),
    ("zero-max-edges", {"task": "singlepoint", "md": DROP, "singlepoint": {"max_edges": 0}}, [],
     ["singlepoint.max_edges must be > 0"]),
    ("unknown-optimizer", {"task": "geomopt", "md": DROP, "geomopt": {"optimizer": "adam"}}, [],
     ["geomopt.optimizer must be one of FIRE, BFGS, LBFGS; got 'adam'"]),
    ("model-missing", {"model": "nope.model"}, [], ["model: no such file", "nope.model"]),
    ("model-is-a-folder", {"model": "."}, [], ["model:", "is a folder, not a file"]),
    ("model-is-text", {"model": "notes.model"}, [], ["could not be read as a torch checkpoint",
                                                     "not a torch file"]),
    ("model-is-a-state-dict", {"model": "weights.pt"}, [], ["holds a state dict",
                                                            "not a whole model"]),
    ("unknown-head", {"head": "pbe"}, [], ["unknown head 'pbe'", "--set head=NAME"]),
    ("unknown-element", {"struct": "cufe.extxyz"}, [], ["Fe (Z=26)", "the model's elements are "
                                                        "Ni, Cu"]),
    ("overlapping-atoms", {"struct": "close.extxyz"}, [],
     ["0.2000 Å apart", "lower `min_distance:` in the run file (or --set min_distance=...)"]),
    ("nan-positions", {"struct": "nan.extxyz"}, [], ["positions of atom(s) [1] are NaN or inf"]),
    ("npt-of-a-molecule", {"struct": "dimer.extxyz", "md": {"ensemble": "npt"}}, [],
     ["md.ensemble npt needs a structure with a 3D periodic cell"]),
    ("relax-cell-of-a-molecule", {"task": "geomopt", "md": DROP, "struct": "dimer.extxyz",
                                  "geomopt": {"relax_cell": True}}, [],
     ["geomopt.relax_cell needs a structure with a 3D periodic cell"]),
    ("md-of-one-atom", {"struct": "one.extxyz"}, [], ["md needs at least 2 atoms"]),
    ("outputs-is-a-file", {"outputs": "notes.yaml"}, [], ["is a file, not a folder",
                                                          "--set outputs=DIR"]),
    ("override-without-value", {}, ["--set", "md.steps"], ["expected KEY=VALUE"]),
    ("override-unknown-section", {}, ["--set", "mdd.steps=3"], ["unknown key(s) 'mdd'"]),
    ("override-bad-yaml", {}, ["--set", "md.steps=[1"], ["bad value in override", "line 1"]),
    ("override-into-a-value", {}, ["--set", "device.x=1"], ["'device' is not a section"]),
    ("gpus-zero", {}, ["--gpus", "0"], ["argument --gpus: must be at least 1",
                                        "see mace-accel run --help"]),
    ("gpus-for-md", {}, ["--gpus", "2"], ["task md runs in one process; only singlepoint is "
                                          "shared"]),
    ("gpus-for-geomopt", {"task": "geomopt", "md": DROP}, ["--gpus", "2"],
     ["task geomopt runs in one process; only singlepoint is shared"]),
]
if not torch.cuda.is_available():  # the messages shown on a machine without a GPU
    RUN_CASES += [
        ("device-cuda-without-gpu", {"device": "cuda"}, [],
         ["no CUDA GPU is visible", "set `device: cpu` in the run file (or pass --set "
                                    "device=cpu)"]),
        ("cuda-backend-without-gpu", {"backend": "cuda", "fallback": "error"}, [],
         ["the CUDA backend cannot run", "`backend: reference`", "--set backend=reference"]),
        ("graphs-on-the-cpu", {"graphs": True}, [], ["`graphs: true` needs a CUDA device",
                                                     "--set graphs=null"]),
    ]

COMMAND_CASES = [
    # id, arguments ({in}: the inputs folder), fragments of the error line
    ("no-command", [], ["the following arguments are required: COMMAND",
                        "see mace-accel --help"]),
    ("unknown-command", ["relax"], ["invalid choice: 'relax'"]),
    ("run-file-missing", ["run", "{in}/nope.yaml"], ["run file not found"]),
    ("run-file-is-a-folder", ["run", "{in}"], ["is a folder, not a run file"]),
    ("run-file-not-text", ["run", "{in}/binary.yaml"], ["is not a text file"]),
    ("run-file-not-yaml", ["run", "{in}/broken.yaml"], ["is not valid YAML: line 2, column 9"]),
    ("run-file-a-list", ["run", "{in}/list.yaml"], ["must hold a mapping of keys to values"]),
    ("run-file-empty", ["run", "{in}/empty.yaml"], ["task is required"]),
    ("convert-missing-input", ["convert", "{in}/nope.model", "{in}/o.model"],
     ["input model not found"]),
    ("convert-folder-input", ["convert", "{in}", "{in}/o.model"], ["is a folder, not a model "
                                                                   "file"]),
    ("convert-into-a-folder", ["convert", "{in}/cuni.model", "{in}", "--device", "cpu"],
     ["is a folder; give a file path such as", "cuni-accel.model"]),
    ("convert-over-a-file", ["convert", "{in}/cuni.model", "{in}/notes.yaml"],
     ["exists; choose another path or pass --force"]),
    ("convert-into-a-missing-folder", ["convert", "{in}/cuni.model", "{in}/no/dir/o.model"],
     ["does not exist; create it first (mkdir -p"]),
    ("convert-float16", ["convert", "{in}/cuni.model", "{in}/o.model", "--dtype", "float16"],
     ["argument --dtype: invalid choice: 'float16'"]),
    ("convert-a-text-file", ["convert", "{in}/notes.model", "{in}/o.model", "--device", "cpu",
                             "--backend", "reference"], ["notes.model", "not a torch file"]),
    ("revert-a-plain-model", ["revert", "{in}/cuni.model", "{in}/p.model"],
     ["is not accelerated", "nothing to revert"]),
    ("revert-a-folder", ["revert", "{in}", "{in}/p.model"], ["is a folder, not a model file"]),
    ("info-missing-file", ["info", "{in}/nope.model"], ["nope.model", "not found"]),
    ("info-of-a-state-dict", ["info", "{in}/weights.pt"], ["holds a state dict"]),
    ("info-of-a-folder", ["info", "{in}"], ["is a folder, not a model file"]),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A folder of inputs a new user might give: a Cu/Ni model, structures good and bad, files
    that are not what they are named."""
    from ase.io import write

    from mace_accel.models.architectures import small_test_model

    folder = tmp_path_factory.mktemp("inputs")
    model = small_test_model("RealAgnosticResidualInteractionBlock", elements=(28, 29),
                             hidden_irreps="4x0e+4x1o", seed=5)
    torch.save(model, folder / "cuni.model")
    torch.save(model.state_dict(), folder / "weights.pt")
    structures = Path(__file__).resolve().parents[1] / "configs" / "structures"
    shutil.copy(structures / "cu_ni_fcc32.extxyz", folder / "cu32.extxyz")
    shutil.copy(structures / "cu_ni_fcc32_frames.extxyz", folder / "frames.extxyz")
    (folder / "notes.model").write_text("this is not a model\n")
    (folder / "notes.yaml").write_text("just: notes\n")
    (folder / "binary.yaml").write_bytes(b"\x00\xff\xfe\x00")
    (folder / "broken.yaml").write_text("task: md\n  struct: [\n")
    (folder / "list.yaml").write_text("- 1\n- 2\n")
    (folder / "empty.yaml").write_text("")
    (folder / "empty.extxyz").write_text("")
    write(folder / "zero.extxyz", Atoms())
    write(folder / "one.extxyz", Atoms("Cu", cell=[6, 6, 6], pbc=True))
    write(folder / "dimer.extxyz", Atoms("Cu2", positions=[[0, 0, 0], [2.5, 0, 0]]))
    write(folder / "cufe.extxyz", Atoms("CuFe", positions=[[0, 0, 0], [2.5, 0, 0]]))
    write(folder / "close.extxyz", Atoms("Cu2", positions=[[0, 0, 0], [0.2, 0, 0]]))
    nan = Atoms("Cu2", positions=[[0, 0, 0], [2.5, 0, 0]])
    nan.positions[1, 0] = np.nan
    write(folder / "nan.extxyz", nan)
    return folder


def _cli(argv) -> int:
    """``mace-accel ARGV``'s exit code (argparse's usage errors exit by SystemExit)."""
    from mace_accel import cli

    try:
        return cli.main([str(a) for a in argv])
    except SystemExit as exc:
        return exc.code


def _one_error_line(code: int, err: str, fragments) -> str:
    assert code == 2, err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    others = [line for line in err.splitlines() if not line.startswith(("error:", "mace-accel:"))]
    assert not others, err  # nothing but start-up notes and the error
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    return errors[0]


@pytest.mark.parametrize("changes, argv, fragments", [c[1:] for c in RUN_CASES],
                         ids=[c[0] for c in RUN_CASES])
def test_run_file_mistakes(inputs, tmp_path, capsys, changes, argv, fragments):
    import yaml

    data = {**RUN, "outputs": str(tmp_path / "out"), **changes}
    data = {k: v for k, v in data.items() if v is not DROP}
    run_file = inputs / f"run-{tmp_path.name}.yaml"
    run_file.write_text(yaml.safe_dump(data))
    code = _cli(["run", run_file, *argv])
    _one_error_line(code, capsys.readouterr().err, fragments)
    assert not (tmp_path / "out").exists()  # nothing written, nothing to block a rerun


@pytest.mark.parametrize("argv, fragments", [c[1:] for c in COMMAND_CASES],
                         ids=[c[0] for c in COMMAND_CASES])
def test_command_line_mistakes(inputs, capsys, argv, fragments):
    before = sorted(p.name for p in inputs.iterdir())
    code = _cli([a.replace("{in}", str(inputs)) for a in argv])
    _one_error_line(code, capsys.readouterr().err, fragments)
    assert sorted(p.name for p in inputs.iterdir()) == before


# -- a new user's mistakes in Python --------------------------------------------------------------
def _dimer(symbols: str = "Cu2", distance: float = 2.5, **kwargs) -> Atoms:
    return Atoms(symbols, positions=[[0, 0, 0], [distance, 0, 0]], **kwargs)


API_CASES = [
    # id, call(inputs folder), error class, fragment of the message
    ("calculator-of-a-number", lambda d: MACEAccelCalculator(123, device="cpu"),
     CheckpointError, "holds a builtins.int, not a MACE model"),
    ("calculator-of-a-folder", lambda d: MACEAccelCalculator(d, device="cpu"),
     CheckpointError, "is a folder (directory), not a model file"),
    ("calculator-negative-skin", lambda d: MACEAccelCalculator(d / "cuni.model", device="cpu",
                                                               skin=-1),
     ConfigError, "skin must be a finite number of Å >= 0"),
    ("calculator-graphs-on-the-cpu", lambda d: MACEAccelCalculator(d / "cuni.model", device="cpu",
                                                                   graphs=True),
     ConfigError, "graphs=True needs a CUDA device, the calculator runs on cpu"),
    ("calculator-options-as-a-dict",
     lambda d: MACEAccelCalculator(d / "cuni.model", device="cpu", options={"radial_table": 0}),
     ConfigError, "options must be an AccelOptions, got dict"),
    ("calculator-negative-min-distance", lambda d: _energy(
        MACEAccelCalculator(d / "cuni.model", device="cpu", min_distance=-1), _dimer()),
     InputError, "min_distance must be a distance >= 0 Å"),
    ("calculator-positions-in-nm", lambda d: _energy(
        MACEAccelCalculator(d / "cuni.model", device="cpu"), _dimer(distance=0.25)),
     InputError, "0.2500 Å apart"),
    ("calculator-infinite-cell", lambda d: _energy(
        MACEAccelCalculator(d / "cuni.model", device="cpu"),
        Atoms("Cu", cell=[np.inf, 1, 1], pbc=True)),
     InputError, "the cell contains NaN or inf"),
    ("load-model-bad-dtype", lambda d: load_model(d / "cuni.model", dtype="half"),
     InputError, "dtype must be one of float32, float64"),
    ("accelerate-a-path", lambda d: __import__("mace_accel").accelerate(str(d / "cuni.model")),
     UnsupportedModelError, "expected a MACE torch.nn.Module, got str"),
    ("options-unknown-choice",
     lambda d: __import__("mace_accel").AccelOptions(recompute_tp_weights="sometimes"),
     ConfigError, "recompute_tp_weights must be one of auto, always, never"),
    ("options-unknown-part", lambda d: __import__("mace_accel").AccelOptions(parts=("magic",)),
     ConfigError, "unknown part(s) ['magic'] in parts"),
    ("evaluate-a-string", lambda d: __import__("mace_accel").evaluate(["Cu"], d / "cuni.model",
                                                                      device="cpu"),
     InputError, "frame 0: not an ase.Atoms (str)"),
    ("evaluate-a-bad-frame", lambda d: __import__("mace_accel").evaluate(
        [bulk("Cu", "fcc", a=3.6), Atoms("Fe")], d / "cuni.model", device="cpu"),
     InputError, "frame 1: the structure contains element(s) Fe (Z=26)"),
    ("batch-evaluator-zero-edges", lambda d: __import__("mace_accel").BatchEvaluator(
        d / "cuni.model", device="cpu", max_edges=0),
     ConfigError, "max_edges must be a positive number of edges"),
    ("mace-mp-unknown-name", lambda d: __import__("mace_accel").mace_mp("huge", device="cpu"),
     InputError, "unknown MACE-MP model 'huge'; choose one of ['"),
    ("mace-off-unknown-name", lambda d: __import__("mace_accel").mace_off("xl", device="cpu"),
     InputError, "unknown MACE-OFF model 'xl'; choose one of ['"),
    ("run-a-built-config-with-overrides", lambda d: _run_built_config(d),
     ConfigError, "overrides apply to a run file"),
    ("run-file-override-typo", lambda d: _run_tasks().run(
        Path(__file__).resolve().parents[1] / "configs" / "md_nve.yaml", {"md.stepz": 1}),
     ConfigError, "unknown key(s) 'stepz' in section 'md'"),
]


def _energy(calc, atoms: Atoms) -> float:
    atoms.calc = calc
    return atoms.get_potential_energy()


def _run_tasks():
    from mace_accel.runs import tasks

    return tasks


def _run_built_config(folder: Path):
    tasks = _run_tasks()
    config = Path(__file__).resolve().parents[1] / "configs" / "md_nve.yaml"
    return tasks.run(tasks.load_run_config(config), {"md.steps": 1})


@pytest.mark.parametrize("call, error, fragment", [c[1:] for c in API_CASES],
                         ids=[c[0] for c in API_CASES])
def test_python_api_mistakes(inputs, call, error, fragment):
    from mace_accel.errors import MaceAccelError

    with pytest.raises(error) as info:
        call(inputs)
    assert isinstance(info.value, MaceAccelError)
    message = str(info.value)
    assert fragment in message and "\n" not in message, message
