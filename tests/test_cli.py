"""The ``mace-accel`` command line, in process through ``mace_accel.cli.main``.

Two subprocess tests: the installed console script, and loading a converted file in a fresh
interpreter.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import shutil
import stat
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
from mace_accel.patches import find_blocks
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


def test_convert_prints_the_report(plain_model, tmp_path, capsys):
    out = tmp_path / "fast.model"
    code, stdout, _ = run_cli(capsys, "convert", plain_model[0], out, *CPU, "--no-verify")
    assert code == 0
    assert "block groups patched" in stdout and f"saved the accelerated model to {out}" in stdout
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
    fused = load(fast_model)
    n_patched = sum(patch.is_applied(m) for _, m, patch in find_blocks(fused))
    assert code == 0 and f"restored {n_patched} block(s)" in stdout and n_patched >= 2
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
    assert plan["accelerated"] is False
    for block, spec in zip(interactions, _expected_blocks(model)):
        assert block["tensor_product"] == spec.describe() and block["skipped"] is None
        # a plain model: nothing is patched or fused now (before, "patched": true); would_*
        # says what accelerate does
        assert block["patched"] is False and block["would_patch"] is True
        conv = next(p for p in block["parts"] if p["part"] == "conv")
        assert conv == {"part": "conv", "fused": False, "would_fuse": True,
                        "detail": spec.describe() + "; the radial MLP's last layer folded in"}
    assert not any(b["patched"] or any(p["fused"] for p in b["parts"]) for b in plan["blocks"])


def test_info_accelerated_and_skipped_blocks(fast_model, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "info", fast_model)
    assert code == 0 and "accelerated: yes" in out
    assert out.count("conv                   fused: TPSpec(") == 2
    plan = json.loads(run_cli(capsys, "info", fast_model, "--json")[1])
    interactions = [b for b in plan["blocks"] if b["kind"] == "interaction_block"]
    assert plan["accelerated"] is True and len(interactions) == 2
    assert all(b["patched"] and b["would_patch"] for b in interactions)

    # a block already fused by another backend is reported with the reason it would be left
    model = small_test_model(BLOCK, elements=(28, 29), seed=3)
    model.interactions[0].conv_fusion = True
    odd = tmp_path / "odd.model"
    torch.save(model, odd)
    plan = json.loads(run_cli(capsys, "info", odd, "--json")[1])
    convs = [next(p for p in b["parts"] if p["part"] == "conv") for b in plan["blocks"]
             if b["kind"] == "interaction_block"]
    assert [c["would_fuse"] for c in convs] == [False, True]
    assert [c["fused"] for c in convs] == [False, False]  # the model is not accelerated
    assert "already fused by another backend" in convs[0]["detail"]


def _run_file(tmp_path: Path, **md) -> Path:
    (tmp_path / "s.xyz").write_text("2\n\nCu 0 0 0\nCu 2.5 0 0\n")
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
    assert "1 frame(s) (Cu2)" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nve.yaml", "s.xyz"]


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


# -- convert: output paths checked before the model is loaded ------------------------------------
@pytest.fixture
def no_loading(monkeypatch):
    """Make loading a model fail loudly: the checks under test must come first."""
    from mace_accel.models import checkpoint

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the output path was checked")

    monkeypatch.setattr(checkpoint, "load_model", refuse)


def test_convert_output_path_problems_are_found_before_loading(plain_model, tmp_path, capsys,
                                                               no_loading):
    src = plain_model[0]
    folder = tmp_path / "folder"
    folder.mkdir()
    code, _, err = run_cli(capsys, "convert", src, folder, *CPU)
    assert_user_error(code, err, "is a folder", str(folder / "tiny-accel.model"))
    # into the input's own folder: the path offered is not the input file's (before, it was)
    code, _, err = run_cli(capsys, "convert", src, src.parent, *CPU)
    assert_user_error(code, err, "is a folder", str(src.parent / "tiny-accel.model"))
    assert repr(str(src)) not in err
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    code, _, err = run_cli(capsys, "convert", src, a_file / "fast.model", *CPU)
    assert_user_error(code, err, "is a file, not a folder")
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "missing" / "fast.model", *CPU)
    assert_user_error(code, err, "does not exist", "mkdir -p")
    for line in err.splitlines():
        assert "Errno" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "folder"]


def test_convert_into_a_folder_without_write_permission(plain_model, tmp_path, capsys,
                                                        monkeypatch, no_loading):
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False
                        if Path(p) == tmp_path else real_access(p, mode, *a, **k))
    code, _, err = run_cli(capsys, "convert", plain_model[0], tmp_path / "o.model", *CPU)
    assert_user_error(code, err, "no permission to write in folder", str(tmp_path))


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_convert_into_a_read_only_folder(plain_model, tmp_path, capsys):
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        code, _, err = run_cli(capsys, "convert", plain_model[0], locked / "o.model", *CPU)
        assert_user_error(code, err, "no permission")
    finally:
        locked.chmod(0o755)


def test_convert_nondeterministic_flag(plain_model, tmp_path, capsys):
    code, stdout, err = run_cli(capsys, "convert", plain_model[0], tmp_path / "f.model", *CPU,
                                "--nondeterministic", "--no-verify")
    assert code == 0, err
    assert "deterministic=False" in stdout
    code, stdout, _ = run_cli(capsys, "convert", plain_model[0], tmp_path / "g.model", *CPU,
                              "--no-verify")
    assert code == 0 and "deterministic=True" in stdout


# -- convert: never replaces a file it did not mean to -------------------------------------------
def test_convert_loses_a_race_for_a_new_path_with_a_clear_error(plain_model, tmp_path, capsys,
                                                                monkeypatch):
    """Another process creates OUT while this one converts: this one must not replace it (and
    must not say 'saved')."""
    from mace_accel import surgery

    out = tmp_path / "fast.model"
    real = surgery.accelerate

    def racing(model, *args, **kwargs):
        report = real(model, *args, **kwargs)
        out.write_bytes(b"the other process's model")
        return report

    monkeypatch.setattr(surgery, "accelerate", racing)
    code, stdout, err = run_cli(capsys, "convert", plain_model[0], out, *CPU, "--no-verify")
    assert_user_error(code, err, "created by another process", "--force")
    assert "saved" not in stdout
    assert out.read_bytes() == b"the other process's model"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fast.model"]  # no temp file


@pytest.mark.slow
def test_two_converts_to_one_new_path_at_once(plain_model, tmp_path):
    """Two real processes: exactly one saves, the other fails with exit 2; the file loads."""
    out = tmp_path / "fast.model"
    argv = [sys.executable, "-m", "mace_accel.cli", "convert", str(plain_model[0]), str(out),
            *CPU, "--no-verify"]
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, _, err in results if code == 2)
    assert loser.strip().splitlines()[-1].startswith("error: output ")
    assert ("exists" in loser or "created by another process" in loser) and "--force" in loser
    assert sum("saved the accelerated model" in out_ for _, out_, _ in results) == 1
    assert is_accelerated(load(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fast.model"]


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664)])
def test_converted_model_gets_the_umask_mode(plain_model, tmp_path, capsys, umask, mode):
    previous = os.umask(umask)
    try:
        code, _, err = run_cli(capsys, "convert", plain_model[0], tmp_path / "f.model", *CPU,
                               "--no-verify")
    finally:
        os.umask(previous)
    assert code == 0, err
    assert stat.S_IMODE((tmp_path / "f.model").stat().st_mode) == mode


# -- a model that itself gives NaN ----------------------------------------------------------------
def test_convert_of_a_model_that_itself_gives_nan(tmp_path, capsys):
    model = small_test_model(BLOCK, elements=(28, 29), seed=3)
    with torch.no_grad():
        next(model.readouts[-1].parameters()).view(-1)[0] = float("nan")
    src = tmp_path / "nan.model"
    torch.save(model, src)
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "o.model", *CPU)
    assert_user_error(code, err, "the model itself (without mace-accel) gives non-finite",
                      "left it unpatched")
    assert "disagrees" not in err and not (tmp_path / "o.model").exists()


# -- clean streams ------------------------------------------------------------------------------
def test_commands_print_no_library_notices(plain_model, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mace_accel.cli", "convert",
                           str(plain_model[0]), str(tmp_path / "f.model"), *CPU],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "cuequivariance" not in proc.stdout + proc.stderr
    assert "Warning" not in proc.stderr and "deprecated" not in proc.stderr, proc.stderr
    assert proc.stdout.rstrip().endswith(f"saved the accelerated model to {tmp_path / 'f.model'}")


# -- one error contract ---------------------------------------------------------------------------
def test_os_errors_on_a_path_are_one_error_line(capsys, monkeypatch, tmp_path):
    def denied(args):
        raise PermissionError(13, "Permission denied", str(tmp_path / "x"))

    monkeypatch.setattr(cli, "cmd_info", denied)
    code, _, err = run_cli(capsys, "info", tmp_path / "x")
    assert_user_error(code, err, str(tmp_path / "x"), "permission denied")
    assert len(err.strip().splitlines()) == 1

    def failing(errno_, text):
        def command(args):
            raise OSError(errno_, text, str(tmp_path / "x"))
        return command

    # a full disk is the user's to fix (free space): exit 2, said as such
    monkeypatch.setattr(cli, "cmd_info", failing(28, "No space left on device"))
    code, _, err = run_cli(capsys, "info", tmp_path / "x")
    assert_user_error(code, err, "the disk is full", "free space")
    assert len(err.strip().splitlines()) == 1
    # a read-only filesystem is named as such, not as a permissions problem
    monkeypatch.setattr(cli, "cmd_info", failing(30, "Read-only file system"))
    code, _, err = run_cli(capsys, "info", tmp_path / "x")
    assert_user_error(code, err, "the filesystem is read-only", "writable filesystem")
    assert "permission" not in err
    # a failing disk is not the user's mistake: exit 1, still one line
    monkeypatch.setattr(cli, "cmd_info", failing(5, "Input/output error"))
    code, _, err = run_cli(capsys, "info", tmp_path / "x")
    assert code == 1 and err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert "input/output error" in err


def test_ctrl_c_is_one_line_and_exit_130(plain_model, capsys, monkeypatch, tmp_path):
    from mace_accel.models import checkpoint

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "load_model", interrupted)
    code, _, err = run_cli(capsys, "convert", plain_model[0], tmp_path / "o.model", *CPU)
    assert code == 130
    assert err.strip() == f"error: interrupted; {tmp_path / 'o.model'} was not written"
    assert list(tmp_path.iterdir()) == []

    monkeypatch.setattr(cli, "build_parser", interrupted)  # while starting up
    code, _, err = run_cli(capsys, "info", plain_model[0])
    assert code == 130 and err.strip() == "error: interrupted; nothing was written"
