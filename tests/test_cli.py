"""The ``mace-accel`` command line, in process through ``mace_accel.cli.main``.

Two subprocess tests: the installed console script, and loading a converted file in a fresh
interpreter.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

from mace_accel import cli
from mace_accel.models.architectures import small_test_model
from mace_accel.models.batch import atoms_to_batch, model_info, random_structure
from mace_accel.ops.conv_tp.spec import spec_from_e3nn
from mace_accel.patches.conv_tp import FusedConvTP
from mace_accel.surgery import evaluate, is_accelerated
from mace_accel.tolerances import rel_norm_error

BLOCK = "RealAgnosticResidualInteractionBlock"
CPU = ["--device", "cpu", "--backend", "reference"]


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    """A tiny fp64 MACE model saved with torch.save, and the in-memory original."""
    model = small_test_model(BLOCK, elements=(28, 29), seed=3)
    path = tmp_path_factory.mktemp("models") / "tiny.model"
    torch.save(model, path)
    return path, model


@pytest.fixture(scope="module")
def batch(plain_model):
    info = model_info(plain_model[1])
    atoms = random_structure(info.atomic_numbers, n_atoms=8, r_max=info.r_max, seed=5)
    return atoms_to_batch(atoms, info)


@pytest.fixture(scope="module")
def fast_model(plain_model, tmp_path_factory):
    """``plain_model`` converted once by the CLI (reference backend); returns its path."""
    out = tmp_path_factory.mktemp("converted") / "fast.model"
    code = cli.main(["convert", str(plain_model[0]), str(out), *CPU])
    assert code == 0
    return out


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code, err, *fragments):
    assert code == 2
    lines = err.strip().splitlines()
    assert lines and lines[0].startswith("error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err


def load(path: Path) -> torch.nn.Module:
    return torch.load(path, weights_only=False)


def test_console_script_help():
    exe = shutil.which("mace-accel")
    assert exe is not None, "the mace-accel console script is not installed (pip install -e .)"
    proc = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for command in ("convert", "revert", "info", "run"):
        assert command in proc.stdout


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([])
    assert exc.value.code == 2


def test_convert_prints_the_report(plain_model, tmp_path, capsys):
    out = tmp_path / "fast.model"
    code, stdout, _ = run_cli(capsys, "convert", plain_model[0], out, *CPU, "--no-verify")
    assert code == 0
    assert "modules patched" in stdout and f"saved the accelerated model to {out}" in stdout
    assert stdout.count("conv                   fused: TPSpec(") == 2
    assert "verified" not in stdout  # --no-verify
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fast.model"]  # no temp files left


def test_convert_reload_gives_the_same_results(plain_model, fast_model, batch):
    original = plain_model[1]
    assert sorted(p.name for p in fast_model.parent.iterdir()) == ["fast.model"]
    fast = load(fast_model)
    convs = [block.conv_tp for block in fast.interactions]
    assert all(isinstance(c, FusedConvTP) and c.backend == "reference" for c in convs)
    assert all(c._kernels == {} for c in convs)
    assert set(fast.state_dict()) == set(original.state_dict())
    got = evaluate(fast, batch, compute_stress=True)
    want = evaluate(original, batch, compute_stress=True)
    for key in ("energy", "forces", "stress"):
        assert rel_norm_error(got[key], want[key]) < 1e-12, key


def test_converted_file_loads_in_a_fresh_interpreter(plain_model, fast_model, batch, tmp_path):
    """Only ``import mace_accel`` and ``torch.load``: nothing else may be needed to unpickle."""
    atoms_file = tmp_path / "batch.pt"
    torch.save(batch, atoms_file)
    script = (
        "import sys, torch, mace_accel\n"
        "model = torch.load(sys.argv[1], weights_only=False)\n"
        "batch = torch.load(sys.argv[2], weights_only=False)\n"
        "out = model(batch, training=False, compute_force=True)\n"
        "print(repr(out['energy'].item()))\n")
    proc = subprocess.run([sys.executable, "-c", script, str(fast_model), str(atoms_file)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    energy = float(proc.stdout.strip().splitlines()[-1])
    want = evaluate(plain_model[1], batch, compute_stress=False)["energy"].item()
    assert abs(energy - want) <= 1e-12 * abs(want)


def test_convert_casts_dtype(plain_model, batch, tmp_path, capsys):
    out = tmp_path / "fast32.model"
    code, stdout, _ = run_cli(capsys, "convert", plain_model[0], out, *CPU, "--dtype", "float32")
    assert code == 0 and "tolerance 1e-05" in stdout
    fast = load(out)
    assert model_info(fast).dtype == torch.float32
    energy = evaluate(fast, {k: v.float() if v.is_floating_point() else v
                             for k, v in batch.items()}, compute_stress=False)["energy"]
    want = evaluate(plain_model[1], batch, compute_stress=False)["energy"]
    assert rel_norm_error(energy, want) < 1e-5


def test_convert_refuses_to_overwrite(plain_model, tmp_path, capsys):
    src = tmp_path / "in.model"
    shutil.copy(plain_model[0], src)
    before = src.read_bytes()
    code, _, err = run_cli(capsys, "convert", src, src, *CPU)
    assert_user_error(code, err, "is the input file", "--force")
    assert src.read_bytes() == before

    existing = tmp_path / "existing.model"
    existing.write_bytes(b"keep me")
    code, _, err = run_cli(capsys, "convert", src, existing, *CPU)
    assert_user_error(code, err, "exists", "--force")
    assert existing.read_bytes() == b"keep me"

    code, _, _ = run_cli(capsys, "convert", src, src, *CPU, "--force")
    assert code == 0 and is_accelerated(load(src))


def test_convert_user_errors(tmp_path, capsys):
    code, _, err = run_cli(capsys, "convert", tmp_path / "missing.model", tmp_path / "o.model",
                           *CPU)
    assert_user_error(code, err, "not found")
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a torch file at all")
    code, _, err = run_cli(capsys, "convert", garbage, tmp_path / "o.model", *CPU)
    assert_user_error(code, err, "garbage.model")
    assert not (tmp_path / "o.model").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_convert_cuda_without_gpu_says_how_to_fix(plain_model, tmp_path, capsys):
    code, _, err = run_cli(capsys, "convert", plain_model[0], tmp_path / "o.model")
    assert_user_error(code, err, "--device cpu --backend reference")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("failure, exit_code", [(KeyboardInterrupt, 130), (OSError, 1)])
def test_failed_write_leaves_no_file(plain_model, tmp_path, capsys, monkeypatch, failure,
                                     exit_code):
    """torch.save dies half-way: no OUT and no temp file may be left behind."""
    real_save = torch.save

    def dying_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        f.flush()
        raise failure("simulated failure during the write")

    monkeypatch.setattr(torch, "save", dying_save)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, _, err = run_cli(capsys, "convert", plain_model[0], out_dir / "fast.model", *CPU)
    monkeypatch.setattr(torch, "save", real_save)
    assert code == exit_code and err.startswith("error: ")
    assert list(out_dir.iterdir()) == []


def test_revert_round_trip(plain_model, fast_model, batch, tmp_path, capsys):
    original = plain_model[1]
    plain = tmp_path / "plain.model"
    code, stdout, _ = run_cli(capsys, "revert", fast_model, plain)
    assert code == 0 and "restored 2 block(s)" in stdout
    restored = load(plain)
    assert not is_accelerated(restored)
    assert all(type(b.conv_tp).__name__ == "TensorProduct" for b in restored.interactions)
    assert not any(hasattr(b, "conv_fusion") for b in restored.interactions)
    ref = original.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in restored.state_dict().items())
    got = evaluate(restored, batch, compute_stress=True)
    want = evaluate(original, batch, compute_stress=True)
    for key in ("energy", "forces", "stress"):
        assert rel_norm_error(got[key], want[key]) < 1e-12, key

    code, _, err = run_cli(capsys, "revert", plain, tmp_path / "again.model")
    assert_user_error(code, err, "not accelerated")
    assert not (tmp_path / "again.model").exists()


def _expected_blocks(model):
    return [spec_from_e3nn(b.conv_tp) for b in model.interactions]


def test_info_text(plain_model, capsys):
    path, model = plain_model
    code, out, _ = run_cli(capsys, "info", path)
    assert code == 0
    n_params = sum(p.numel() for p in model.parameters())
    for fragment in ("ScaleShiftMACE", "Ni Cu (2)", "r_max:       4 Å", "heads:       Default",
                     "float64", f"{n_params:,}", "accelerated: no", f"interactions.1: {BLOCK}"):
        assert fragment in out, fragment
    for spec in _expected_blocks(model):
        assert f"conv_tp: {spec.describe()}" in out
        assert f"conv                   would be fused: {spec.describe()}" in out


def test_info_json_and_does_not_modify(plain_model, tmp_path, capsys):
    path, model = plain_model
    before = path.read_bytes()
    code, out, _ = run_cli(capsys, "info", path, "--json")
    assert code == 0 and path.read_bytes() == before
    plan = json.loads(out)
    assert plan["model"] == "ScaleShiftMACE" and plan["elements"] == ["Ni", "Cu"]
    assert plan["r_max"] == 4.0 and plan["heads"] == ["Default"] and plan["dtype"] == "float64"
    assert plan["parameters"] == sum(p.numel() for p in model.parameters())
    interactions = [b for b in plan["blocks"] if b["kind"] == "interaction_block"]
    assert len(interactions) == 2
    for block, spec in zip(interactions, _expected_blocks(model)):
        assert block["tensor_product"] == spec.describe() and block["skipped"] is None
        conv = next(p for p in block["parts"] if p["part"] == "conv")
        assert conv == {"part": "conv", "fused": True, "detail": spec.describe()}


def test_info_accelerated_and_skipped_blocks(fast_model, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "info", fast_model)
    assert code == 0 and "accelerated: yes" in out
    assert out.count("conv                   fused: TPSpec(") == 2

    # a block already fused by another backend is reported with the reason it would be left
    model = small_test_model(BLOCK, elements=(28, 29), seed=3)
    model.interactions[0].conv_fusion = True
    odd = tmp_path / "odd.model"
    torch.save(model, odd)
    plan = json.loads(run_cli(capsys, "info", odd, "--json")[1])
    convs = [next(p for p in b["parts"] if p["part"] == "conv") for b in plan["blocks"]
             if b["kind"] == "interaction_block"]
    assert [c["fused"] for c in convs] == [False, True]
    assert "already fused by another backend" in convs[0]["detail"]


def test_info_missing_file(tmp_path, capsys):
    code, _, err = run_cli(capsys, "info", tmp_path / "nope.model")
    assert_user_error(code, err, "not found")


def _run_file(tmp_path: Path, **md) -> Path:
    (tmp_path / "s.xyz").write_text("1\n\nCu 0 0 0\n")
    path = tmp_path / "nve.yaml"
    path.write_text(yaml.safe_dump({"task": "md", "struct": "s.xyz", "md": md}))
    return path


def test_run_dry_run_writes_nothing(tmp_path, capsys):
    path = _run_file(tmp_path, steps=10)
    code, out, _ = run_cli(capsys, "run", path, "--dry-run", "--set", "md.steps=3",
                           "--set", "device=cpu")
    assert code == 0
    shown = yaml.safe_load(out)
    assert shown["md"]["steps"] == 3 and shown["device"] == "cpu"
    assert "1 frame(s) (Cu)" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nve.yaml", "s.xyz"]


@pytest.mark.parametrize("extra, fragments", [
    (["--set", "md.temp=300"], ["'temp'", "valid keys: ensemble, steps, timestep"]),
    (["--set", "md.timestep=0"], ["md.timestep must be > 0"]),
    (["--set", "steps"], ["expected KEY=VALUE"]),
])
def test_run_config_errors(tmp_path, capsys, extra, fragments):
    code, _, err = run_cli(capsys, "run", _run_file(tmp_path), "--dry-run", *extra)
    assert_user_error(code, err, *fragments)


def test_run_missing_file(tmp_path, capsys):
    code, _, err = run_cli(capsys, "run", tmp_path / "none.yaml")
    assert_user_error(code, err, "run file not found")


def test_bench_is_registered_only_when_present(monkeypatch):
    def names(parser):
        sub = next(a for a in parser._actions if a.dest == "command")
        return set(sub.choices)

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None
                        if name.startswith("mace_accel.bench") else real_find_spec(name, *a))
    assert "bench" not in names(cli.build_parser())
    monkeypatch.setattr(importlib.util, "find_spec", real_find_spec)

    fake = types.ModuleType("mace_accel.bench.cli")
    fake.__spec__ = importlib.machinery.ModuleSpec("mace_accel.bench.cli", loader=None)
    fake.add_bench_parser = lambda sub: sub.add_parser("bench", help="fake")
    pkg = types.ModuleType("mace_accel.bench")
    pkg.__spec__ = importlib.machinery.ModuleSpec("mace_accel.bench", loader=None,
                                                  is_package=True)
    pkg.__path__ = []
    monkeypatch.setitem(sys.modules, "mace_accel.bench", pkg)
    monkeypatch.setitem(sys.modules, "mace_accel.bench.cli", fake)
    assert "bench" in names(cli.build_parser())

    def broken(sub):
        raise ImportError("a bug inside the bench package")

    fake.add_bench_parser = broken
    with pytest.raises(ImportError, match="bug inside"):
        cli.build_parser()
