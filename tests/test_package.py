"""Packaging: the installed layout, import hygiene, the console script and the bundled model."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


def library_modules() -> list:
    """Every module of the package as an importable name (mace_accel.*, patches, kernels)."""
    names = []
    for folder, package in ((REPO / "mace_accel", "mace_accel"),
                            (REPO / "patches", "mace_accel.patches"),
                            (REPO / "kernels", "mace_accel.kernels")):
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if parts and parts[-1] == "__main__":
                continue
            names.append(".".join([package] + parts))
    return names


def run_python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter in ``cwd`` (so the repo is not on sys.path)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_subpackages_import_from_outside_the_repo(tmp_path):
    proc = run_python("""
        import json, sys, mace_accel, mace_accel.patches, mace_accel.kernels
        from mace_accel.patches import find_blocks
        from mace_accel.patches.interaction_blocks import PATCHES
        print(json.dumps({"sys_path0": sys.path[0], "patches": mace_accel.patches.__file__,
                          "kernels": mace_accel.kernels.__file__, "n": len(PATCHES)}))
    """, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert str(REPO) not in out["sys_path0"]
    assert Path(out["patches"]).name == "__init__.py" and out["n"] >= 1
    # templates ship with the kernels package, one folder per op family
    kernels_dir = Path(out["kernels"]).parent
    assert any(kernels_dir.glob("*/*.j2"))


def test_import_has_no_global_side_effects(tmp_path):
    """Importing mace-accel's modules sets no env var, keeps the default dtype, skips cupy."""
    modules = library_modules()
    assert "mace_accel.surgery" in modules and "mace_accel.patches.conv_tp" in modules
    proc = run_python(f"""
        import importlib, json, os, sys
        import torch
        env, dtype = dict(os.environ), torch.get_default_dtype()
        for name in {modules!r}:
            importlib.import_module(name)
            assert torch.get_default_dtype() == dtype, name
            assert "cupy" not in sys.modules, name
        changed = sorted(k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k))
        print(json.dumps({{"env_changed": changed, "dtype": str(torch.get_default_dtype()),
                          "dtype_before": str(dtype), "cupy": "cupy" in sys.modules,
                          "mace": "mace" in sys.modules, "e3nn": "e3nn" in sys.modules}}))
    """, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["env_changed"] == [], f"importing mace-accel changed os.environ: {out}"
    assert out["dtype"] == out["dtype_before"] == "torch.float32"
    assert not out["cupy"], "cupy must only be imported when the CUDA backend is used"
    # mace sets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD when imported: only import it on demand
    assert not out["mace"] and not out["e3nn"], out


def test_lazy_public_api_is_complete():
    import mace_accel

    assert callable(mace_accel.accelerate) and callable(mace_accel.revert)
    for name in mace_accel.__all__:
        if name == "__version__":
            continue
        module = mace_accel._API.get(name)
        if module is not None and not (REPO / (module.replace(".", "/") + ".py")).is_file():
            pytest.fail(f"mace_accel.{name} is advertised but {module} does not exist")
        assert getattr(mace_accel, name) is not None
    with pytest.raises(AttributeError):
        mace_accel.no_such_thing  # noqa: B018


def test_accelerate_is_not_shadowed_by_its_module(tmp_path):
    """The surgery lives in ``mace_accel.surgery``, so no submodule import can rebind
    ``mace_accel.accelerate`` to a module (the package is lazy and torch-free)."""
    proc = run_python("""
        import mace_accel.surgery, mace_accel
        from mace_accel import accelerate
        print(callable(accelerate), callable(mace_accel.accelerate))
    """, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "True"]


def test_console_script_is_declared():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["mace-accel"] == "mace_accel.cli:main"
    installed = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert installed.get("mace-accel") == "mace_accel.cli:main", (
        "the installed metadata lacks the console script: reinstall with pip install -e .")


def setup_arguments(monkeypatch) -> dict:
    """What setup.py passes to setuptools' ``setup`` (the packages it finds, the folders)."""
    import runpy

    import setuptools

    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: seen.update(kwargs))
    runpy.run_path(str(REPO / "setup.py"))
    return seen


def test_bundled_model_is_declared_as_package_data(monkeypatch):
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "mace_accel.data" in setup_arguments(monkeypatch)["packages"]
    patterns = project["tool"]["setuptools"]["package-data"]["mace_accel.data"]
    assert "*.model" in patterns and "*.json" in patterns


def test_bundled_model_matches_its_metadata():
    """The shipped model is a MACE module that loads with torch.load and matches its JSON."""
    import torch

    from mace_accel import _e3nn_compat
    from mace_accel.models.batch import model_info
    from mace_accel.models.checkpoint import default_model_path

    path = default_model_path()
    assert path.is_file(), "run scripts/train_default_model.py to build the bundled model"
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest(), (
        "the model file and its metadata are out of sync; rerun scripts/train_default_model.py")
    assert path.stat().st_size < 5 * 2**20
    _e3nn_compat.import_mace()
    model = torch.load(path, map_location="cpu", weights_only=False)
    info = model_info(model)
    assert type(model).__name__ == meta["hyperparameters"]["model"] == "ScaleShiftMACE"
    assert info.symbols == ["Ni", "Cu"] and info.r_max == meta["hyperparameters"]["r_max"]
    assert str(info.dtype) == "torch." + meta["dtype"]
    assert [type(b).__name__ for b in model.interactions] == [
        meta["hyperparameters"]["interaction_first"], meta["hyperparameters"]["interaction"]]

    # it is a usable potential: close to EMT on a fresh rattled alloy cell it never saw
    from ase.build import bulk
    from ase.calculators.emt import EMT

    from mace_accel.models.batch import atoms_to_batch
    from mace_accel.surgery import evaluate

    rng = np.random.default_rng(123)
    atoms = bulk("Cu", "fcc", a=3.57, cubic=True).repeat(2)
    atoms.numbers = rng.choice([28, 29], size=len(atoms))
    atoms.positions += rng.normal(0.0, 0.05, atoms.positions.shape)
    out = evaluate(model.eval(), atoms_to_batch(atoms, info), compute_stress=False)
    atoms.calc = EMT()
    energy_err = abs(float(out["energy"][0]) - atoms.get_potential_energy()) / len(atoms)
    force_rmse = float(np.sqrt(np.mean((out["forces"].numpy() - atoms.get_forces()) ** 2)))
    assert energy_err < 0.03, f"energy off EMT by {1e3 * energy_err:.1f} meV/atom"
    assert force_rmse < 0.15, f"force RMSE vs EMT {1e3 * force_rmse:.0f} meV/Å"


CPU_TORCH = "python -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def _readme_commands() -> list:
    """The README's one-line shell commands (lines of its bash blocks)."""
    text = (REPO / "README.md").read_text()
    blocks = text.split("```bash\n")[1:]
    return [line for block in blocks for line in block.split("```")[0].splitlines()]


def test_ci_runs_the_readme_test_command():
    """.ci/run installs the CPU-only torch first and then runs exactly the README's test
    command; the README says why (PyPI's torch is the CUDA build)."""
    readme = (REPO / "README.md").read_text()
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert "set -euo pipefail" in ci
    command = ci[-1]
    assert command.startswith(CPU_TORCH + " && ")
    assert "pip install -e '.[test]'" in command
    assert "pytest" in command and '-m "not gpu"' in command
    assert command in _readme_commands(), "README's test command and .ci/run differ"
    # the README says what plain `pip install torch` does on a machine without a GPU, and how
    # long the CPU suite takes (as measured on 2 cores)
    assert "3 GB" in readme and "10 minutes" in readme


def test_readme_first_command_installs_the_cpu_torch_first_and_runs(capsys, tmp_path):
    """Command 1 on a fresh machine without torch: the stated CPU torch first (a plain
    `pip install -e .` resolved another torch with ~3 GB of CUDA wheels), then the package,
    then a run of an example config that exists and passes every check (--dry-run here)."""
    from mace_accel import cli

    first = [line for line in _readme_commands() if line.startswith(CPU_TORCH + " && ")
             and "mace-accel run" in line]
    assert len(first) == 1
    steps = first[0].split(" && ")
    assert steps[:2] == [CPU_TORCH, "python -m pip install -e ."]
    run = steps[2].split()
    assert run[:3] == ["mace-accel", "run", "configs/md_langevin.yaml"]
    code = cli.main(["run", str(REPO / run[2]), *run[3:], "--dry-run",
                     "--set", f"outputs={tmp_path / 'out'}"])
    assert code == 0, capsys.readouterr().err


def test_readme_is_a_user_document():
    """Short enough to read (the measurement logs live in docs/performance.md), and its links
    into the repository resolve."""
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 350
    for target in re.findall(r"\]\(((?:docs|CHANGELOG)[^)#]*)", readme):
        assert (REPO / target).exists(), target
    assert "--overwrite" in readme and "--set model=" in readme and "--set struct=" in readme


def test_docs_speak_of_the_product():
    """README, changelog and docs say what the product does and measures; how it was made
    (dated log folders, work sessions, device calls) is git's history."""
    texts = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]
    for path in texts:
        text = path.read_text()
        for pattern in (r"(?i)\bsessions?\b", r"(?i)\bcall \d+\b", r"docs/h[12]00",
                        r"\b20\d\d-\d\d-\d\d\b"):
            assert not re.search(pattern, text), (path.name, pattern)
    dated = [p.name for p in (REPO / "docs").iterdir() if re.match(r"h[12]00", p.name)]
    assert not dated, dated


ENTRY_POINTS = {
    "calculator": """
        from ase.build import bulk
        from mace_accel import MACEAccelCalculator
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
        atoms.calc = MACEAccelCalculator(device="cpu")
        atoms.get_potential_energy()
    """,
    "evaluate": """
        from ase.build import bulk
        import mace_accel
        mace_accel.evaluate([bulk("Cu", "fcc", a=3.6)], mace_accel.default_model_path(),
                            device="cpu")
    """,
    "torchsim": """
        from mace_accel.torchsim import AcceleratedMaceModel
        AcceleratedMaceModel(device="cpu")
    """,
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_python_entry_points_keep_stdout_clean(tmp_path, entry):
    """A Python user's first call into mace-accel (each in a fresh interpreter, where mace is
    imported for the first time) prints nothing on stdout: mace's cuequivariance notice is
    swallowed wherever mace-accel imports mace."""
    if entry == "torchsim":
        pytest.importorskip("torch_sim")
    proc = run_python(ENTRY_POINTS[entry], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and "cuequivariance" not in proc.stderr


def test_import_mace_passes_other_output_on_to_stderr(tmp_path):
    proc = run_python("""
        import builtins, importlib, sys
        real = importlib.import_module
        def noisy(name, *a, **k):
            if name == "mace.tools.cg":
                print("an unexpected message from mace")
            return real(name, *a, **k)
        importlib.import_module = noisy
        from mace_accel._e3nn_compat import import_mace
        import_mace()
    """, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and "an unexpected message from mace" in proc.stderr


def test_pytest_config_filters_the_known_library_warnings(tmp_path):
    """torch.jit deprecations and e3nn's TorchScript warnings are filtered in pytest's config
    (the issue counted ~2,500 of them in a run of the suite)."""
    (tmp_path / "test_noise.py").write_text(textwrap.dedent("""
        import io
        import torch
        from mace_accel._e3nn_compat import import_mace, o3

        def test_noise():
            import_mace()
            o3().Linear("2x0e", "2x0e")
            scripted = torch.jit.script(torch.nn.Linear(2, 2))
            buffer = io.BytesIO()
            torch.jit.save(scripted, buffer)
            buffer.seek(0)
            torch.jit.load(buffer)
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path),
                           str(tmp_path / "test_noise.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout and "warning" not in proc.stdout.lower(), proc.stdout


def test_cli_help_imports_no_torch(tmp_path):
    """``import mace_accel.cli`` and ``mace-accel --help`` stay torch-free (fast start-up)."""
    proc = run_python("""
        import sys, time
        t0 = time.perf_counter()
        import mace_accel.cli
        try:
            mace_accel.cli.main(["--help"])
        except SystemExit:
            pass
        print("TORCH", "torch" in sys.modules, time.perf_counter() - t0)
    """, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    line = [t for t in proc.stdout.splitlines() if t.startswith("TORCH")][-1].split()
    assert line[1] == "False", "mace-accel --help imported torch"
    assert float(line[2]) < 2.0  # measured 0.2 s for the whole process on 2 CPU cores


def test_every_subpackage_is_declared_for_a_wheel(monkeypatch):
    """setup.py finds every package folder, kernels/ and patches/ under mace_accel's name (an
    editable install finds them anyway; a wheel would silently lack a missing one)."""
    arguments = setup_arguments(monkeypatch)
    found = {".".join(p.parent.relative_to(REPO).parts)
             for p in (REPO / "mace_accel").rglob("__init__.py")}
    found |= {"mace_accel.kernels", "mace_accel.patches"}
    assert found <= set(arguments["packages"]), sorted(found - set(arguments["packages"]))
    assert arguments["package_dir"] == {"mace_accel.kernels": "kernels",
                                        "mace_accel.patches": "patches"}
