"""Run outputs are transactional: one run per folder (a lock), no mixing with an earlier run's
files, nothing written by a run that fails a check, umask file modes, and every check also in
``--dry-run``. Each case was reproduced against the code before this behaviour existed."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import ase.io
import numpy as np
import pytest
import torch
import yaml

from mace_accel import cli
from mace_accel.errors import ConfigError, InputError, Interrupted, OutputError
from mace_accel.runs import tasks as runs
from mace_accel.runs.outputs import LOCK_NAME, RunFolder

REPO = Path(__file__).resolve().parents[1]
STRUCTURES = REPO / "configs" / "structures"
CPU = {"device": "cpu", "backend": "reference", "dtype": "float64", "progress": False}


def write_run(folder: Path, model: Path, task: str = "md", struct: str = "cu_ni_fcc32.extxyz",
              name: str = "run.yaml", **keys) -> Path:
    """A run file in ``folder`` (structure copied next to it), outputs in folder/out."""
    folder.mkdir(parents=True, exist_ok=True)
    if (STRUCTURES / struct).is_file() and not (folder / struct).exists():
        shutil.copy(STRUCTURES / struct, folder / struct)
    data = {"task": task, "struct": struct, "model": str(model), "outputs": "out", **CPU}
    if task == "md":
        data["md"] = {"steps": 2, "traj_every": 1}
    data.update(keys)
    path = folder / name
    path.write_text(yaml.safe_dump(data))
    return path


def run_cli(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_user_error(code, err, *fragments):
    assert code == 2, err
    lines = [line for line in err.strip().splitlines() if not line.startswith(
        ("mace-accel: device auto", "WARNING", "warning:"))]
    assert lines and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def files_in(folder: Path):
    return sorted(p.name for p in folder.iterdir() if p.name != LOCK_NAME)


def bad_frames(path: Path, kind: str, frame: int = 2, n: int = 4) -> Path:
    """``n`` copies of the fcc32 cell with a defect of ``kind`` in frame ``frame``."""
    atoms = ase.io.read(STRUCTURES / "cu_ni_fcc32.extxyz")
    frames = [atoms.copy() for _ in range(n)]
    bad = frames[frame]
    if kind == "nan":
        bad.positions[5, 1] = np.nan
    elif kind == "overlap":
        bad.positions[7] = bad.positions[3] + [0.1, 0.0, 0.0]
    elif kind == "element":
        bad.numbers[4] = 26  # Fe: not in the model
    ase.io.write(path, frames)
    return path


# -- re-runs into one folder ----------------------------------------------------------------------
def test_rerun_into_a_used_folder_is_refused_and_overwrite_clears_it(model_file, tmp_path, capsys):
    md = write_run(tmp_path, model_file, "md", name="md.yaml")
    assert run_cli(capsys, "run", md)[0] == 0
    out = tmp_path / "out"
    assert files_in(out) == ["config.yaml", "final.extxyz", "run.log", "stats.dat",
                             "trajectory.extxyz"]
    before = {name: (out / name).read_bytes() for name in files_in(out)}

    # a different run into the same folder: refused, the md run's files untouched
    sp = write_run(tmp_path, model_file, "singlepoint", name="sp.yaml")
    code, _, err = run_cli(capsys, "run", sp)
    assert_user_error(code, err, "holds the results of an earlier run", "--overwrite",
                      "final.extxyz")
    assert {name: (out / name).read_bytes() for name in files_in(out)} == before

    # --overwrite: the earlier run's files are gone, only this run's are there
    code, stdout, err = run_cli(capsys, "run", sp, "--overwrite")
    assert code == 0, err
    assert files_in(out) == ["config.yaml", "results.extxyz", "run.log"]
    assert yaml.safe_load((out / "config.yaml").read_text())["task"] == "singlepoint"
    assert "task md" not in (out / "run.log").read_text()


def test_overwrite_never_deletes_files_a_run_does_not_write(model_file, tmp_path, capsys):
    run_file = write_run(tmp_path, model_file, "singlepoint")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "run.log").write_text("an old log")
    code, _, err = run_cli(capsys, "run", run_file)
    assert_user_error(code, err, "is not empty", "notes.txt", "new or empty folder")
    code, _, err = run_cli(capsys, "run", run_file, "--overwrite")
    assert_user_error(code, err, "notes.txt", "does not write")
    assert (out / "notes.txt").read_text() == "mine" and (out / "run.log").read_text() == \
        "an old log"


def test_a_bad_structure_writes_nothing(model_file, tmp_path, capsys):
    """A re-run that fails validation leaves the earlier run's files as they were (it used to
    empty trajectory.extxyz), and a new folder is not even created."""
    md = write_run(tmp_path, model_file, "md")
    assert run_cli(capsys, "run", md)[0] == 0
    out = tmp_path / "out"
    before = {name: (out / name).read_bytes() for name in files_in(out)}
    bad_frames(tmp_path / "bad.extxyz", "nan", frame=0, n=1)
    code, _, err = run_cli(capsys, "run", md, "--overwrite", "--set",
                           f"struct={tmp_path / 'bad.extxyz'}")
    assert_user_error(code, err, "frame 0 of", "bad.extxyz", "NaN")
    assert {name: (out / name).read_bytes() for name in files_in(out)} == before

    fresh = tmp_path / "fresh"
    code, _, err = run_cli(capsys, "run", md, "--set", f"struct={tmp_path / 'bad.extxyz'}",
                           "--set", f"outputs={fresh}")
    assert_user_error(code, err, "NaN")
    assert not fresh.exists()


@pytest.mark.parametrize("kind, fragments", [
    ("nan", ["frame 2 of", "NaN or inf"]),
    ("overlap", ["frame 2 of", "atoms 3 (", "closer than min_distance", "`min_distance:`"]),
    ("element", ["frame 2 of", "Fe (Z=26)"]),
])
def test_every_frame_is_checked_and_named_before_anything_is_written(model_file, tmp_path,
                                                                      kind, fragments):
    bad_frames(tmp_path / "frames.extxyz", kind)
    run_file = write_run(tmp_path, model_file, "singlepoint", struct="frames.extxyz")
    with pytest.raises(InputError) as err:
        runs.run(run_file)
    for fragment in fragments:
        assert fragment in str(err.value)
    assert not (tmp_path / "out").exists()
    with pytest.raises(InputError, match="frame 2 of"):  # the dry run finds the same
        runs.dry_run(run_file)


@pytest.mark.parametrize("task, keys, fragment", [
    ("md", {"md": {"ensemble": "npt", "steps": 2}}, "npt needs a structure with a 3D periodic"),
    ("geomopt", {"geomopt": {"relax_cell": True}}, "relax_cell needs a structure"),
])
def test_what_a_task_needs_of_its_structure_is_checked_first(model_file, tmp_path, capsys,
                                                             task, keys, fragment):
    (tmp_path / "dimer.xyz").write_text("2\n\nCu 0 0 0\nNi 0 0 2.4\n")
    run_file = write_run(tmp_path, model_file, task, struct="dimer.xyz", **keys)
    code, _, err = run_cli(capsys, "run", run_file)
    assert_user_error(code, err, fragment, "frame 0 of")
    assert not (tmp_path / "out").exists()


def test_a_failed_model_check_writes_nothing(model_file, tmp_path, capsys):
    """A model that is itself broken (NaN weight) fails verification: no outputs folder."""
    model = torch.load(model_file, weights_only=False)
    with torch.no_grad():
        next(model.readouts[-1].parameters()).view(-1)[0] = float("nan")
    path = tmp_path / "nan.model"
    torch.save(model, path)
    run_file = write_run(tmp_path, path, "md")
    code, _, err = run_cli(capsys, "run", run_file)
    assert_user_error(code, err, "the model itself (without mace-accel) gives non-finite")
    assert "disagrees" not in err and not (tmp_path / "out").exists()


# -- one run per folder: the lock -----------------------------------------------------------------
HOLD_LOCK = textwrap.dedent("""
    import sys, time
    from mace_accel.runs.outputs import RunFolder
    RunFolder(sys.argv[1]).claim()
    print("locked", flush=True)
    time.sleep(120)
""")


def test_a_second_run_into_a_held_folder_is_refused(model_file, tmp_path, capsys):
    run_file = write_run(tmp_path, model_file, "md")
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        code, _, err = run_cli(capsys, "run", run_file)
        assert_user_error(code, err, "is in use by another mace-accel run",
                          f"pid {holder.pid} on", "wait for that run to finish")
        code, _, err = run_cli(capsys, "run", run_file, "--dry-run")  # the dry run too
        assert_user_error(code, err, f"pid {holder.pid}")
        code, _, err = run_cli(capsys, "run", run_file, "--overwrite")
        assert_user_error(code, err, "is in use")
        assert files_in(out) == []
    finally:
        holder.kill()
        holder.wait()
    # the kernel released the dead holder's lock: no stale lock to clean up
    code, _, err = run_cli(capsys, "run", run_file)
    assert code == 0, err
    assert "stats.dat" in files_in(out)


def test_the_lock_is_checked_again_when_the_folder_is_claimed(tmp_path):
    """Both runs passed the early check; the one that claims second is refused."""
    first = RunFolder(tmp_path / "out")
    second = RunFolder(tmp_path / "out")
    first.check()
    second.check()
    with first:
        with pytest.raises(OutputError, match="in use by another mace-accel run"):
            second.claim()
    with second:  # released: now it may
        assert second.owned


@pytest.mark.slow
def test_two_cli_runs_into_one_folder_at_once(model_file, tmp_path, capsys):
    """The issue's case end to end: a long md run, and a second run into its folder."""
    run_file = write_run(tmp_path, model_file, "md")
    out = tmp_path / "out"
    first = subprocess.Popen([sys.executable, "-m", "mace_accel.cli", "run", str(run_file),
                              "--set", "md.steps=100000"], cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        traj = out / "trajectory.extxyz"
        while not (traj.exists() and traj.stat().st_size > 0):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first run did not start writing"
            time.sleep(0.5)
        code, _, err = run_cli(capsys, "run", run_file, "--overwrite")
        assert_user_error(code, err, "is in use by another mace-accel run", f"pid {first.pid}")
        assert first.poll() is None  # the first run goes on, its files untouched
        log = (out / "run.log").read_text()
        assert f"pid {first.pid}" in log and log.count("mace-accel 0") == 1
    finally:
        first.kill()
        first.wait()
    assert ase.io.read(out / "trajectory.extxyz", ":")  # readable up to the kill


# -- output paths ---------------------------------------------------------------------------------
def test_outputs_that_cannot_be_a_folder(model_file, tmp_path, capsys):
    run_file = write_run(tmp_path, model_file, "singlepoint")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    code, _, err = run_cli(capsys, "run", run_file, "--set", f"outputs={a_file}")
    assert_user_error(code, err, "is a file, not a folder", "--set outputs=DIR")
    code, _, err = run_cli(capsys, "run", run_file, "--set", f"outputs={a_file / 'sub' / 'out'}")
    assert_user_error(code, err, "cannot create the outputs folder", "is a file, not a folder")
    code, _, err = run_cli(capsys, "run", run_file, "--dry-run", "--set", f"outputs={a_file}")
    assert_user_error(code, err, "is a file, not a folder")
    assert a_file.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_outputs_in_a_read_only_folder(model_file, tmp_path, capsys):
    run_file = write_run(tmp_path, model_file, "singlepoint")
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        code, _, err = run_cli(capsys, "run", run_file, "--set", f"outputs={locked / 'out'}")
        assert_user_error(code, err, "no permission to write", str(locked))
    finally:
        locked.chmod(0o755)


def test_outputs_without_write_permission_is_one_error_line(model_file, tmp_path, capsys,
                                                           monkeypatch):
    """The same as above where tests run as root: os.access says no."""
    run_file = write_run(tmp_path, model_file, "singlepoint")
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False
                        if Path(p) == tmp_path else real_access(p, mode, *a, **k))
    code, _, err = run_cli(capsys, "run", run_file)
    assert_user_error(code, err, "no permission to write", "--set outputs=DIR")
    assert "Errno" not in err and not (tmp_path / "out").exists()


def test_os_error_while_writing_is_one_error_line(model_file, tmp_path, capsys, monkeypatch):
    """An OS error the checks could not foresee (here: EACCES creating run.log) is still one
    ``error:`` line naming the file, what was kept and the fix, exit 2."""
    run_file = write_run(tmp_path, model_file, "singlepoint")

    def denied(self, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(runs.RunLog, "__init__", denied)
    code, _, err = run_cli(capsys, "run", run_file)
    assert_user_error(code, err, "cannot write run.log", "permission denied",
                      "kept in", "config.yaml", "fix the folder's permissions")
    assert len(err.strip().splitlines()) <= 3 and "Errno" not in err


# -- file modes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_files_get_the_umask_mode(model_file, tmp_path, umask, mode):
    run_file = write_run(tmp_path, model_file, "md")
    previous = os.umask(umask)
    try:
        runs.run(run_file)
    finally:
        os.umask(previous)
    out = tmp_path / "out"
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert {"config.yaml", "final.extxyz", "run.log", "trajectory.extxyz"} <= set(modes)
    assert modes == {name: mode for name in modes}, modes


# -- multi-frame files ----------------------------------------------------------------------------
def test_md_on_a_multi_frame_file_needs_a_frame(model_file, tmp_path):
    run_file = write_run(tmp_path, model_file, "md", struct="cu_ni_fcc32_frames.extxyz")
    with pytest.raises(ConfigError) as err:
        runs.run(run_file)
    message = str(err.value)
    assert "cu_ni_fcc32_frames.extxyz" in message and "holds 4 frames" in message
    assert "frame: N" in message and not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="holds 4 frames"):
        runs.dry_run(run_file)
    with pytest.raises(ConfigError, match=r"frame: 4 is out of range.*0\.\.3"):
        runs.run(run_file, {"frame": 4})

    frames = ase.io.read(tmp_path / "cu_ni_fcc32_frames.extxyz", ":")
    result = runs.run(run_file, {"frame": 1, "md.steps": 0})
    first = ase.io.read(result.outputs / "trajectory.extxyz", 0)
    np.testing.assert_allclose(first.positions, frames[1].positions, atol=1e-7)
    assert "frame 1 of 4" in (result.outputs / "run.log").read_text()


def test_geomopt_frame_minus_one_is_the_last(model_file, tmp_path):
    run_file = write_run(tmp_path, model_file, "geomopt", struct="cu_ni_fcc32_frames.extxyz",
                         frame=-1, geomopt={"steps": 0, "traj_every": 1})
    result = runs.run(run_file)
    frames = ase.io.read(tmp_path / "cu_ni_fcc32_frames.extxyz", ":")
    got = ase.io.read(result.outputs / "trajectory.extxyz", 0)
    np.testing.assert_allclose(got.positions, frames[-1].positions, atol=1e-7)


# -- YAML keys ------------------------------------------------------------------------------------
def test_deterministic_and_min_distance_reach_the_calculator(model_file, tmp_path, monkeypatch):
    seen = {}
    real = runs.make_calculator

    def spy(cfg, compute_stress):
        calc = real(cfg, compute_stress)
        seen.update(options=calc.options, min_distance=calc.min_distance)
        return calc

    monkeypatch.setattr(runs, "make_calculator", spy)
    run_file = write_run(tmp_path, model_file, "singlepoint", deterministic=False,
                         min_distance=0.2)
    result = runs.run(run_file)
    assert seen["min_distance"] == 0.2 and seen["options"].deterministic is False
    assert "deterministic False" in (result.outputs / "run.log").read_text()


# -- dry run: the same checks ---------------------------------------------------------------------
def test_dry_run_catches_overlaps_and_a_truncated_model(model_file, tmp_path, capsys):
    bad_frames(tmp_path / "overlap.extxyz", "overlap", frame=0, n=1)
    run_file = write_run(tmp_path, model_file, "md", struct="overlap.extxyz")
    code, _, err = run_cli(capsys, "run", run_file, "--dry-run")
    assert_user_error(code, err, "frame 0 of", "overlap.extxyz", "0.1000 Å apart")

    truncated = tmp_path / "truncated.model"
    truncated.write_bytes(model_file.read_bytes()[:3000])
    good = write_run(tmp_path, truncated, "md", name="trunc.yaml")
    code, _, err = run_cli(capsys, "run", good, "--dry-run")
    assert_user_error(code, err, "truncated.model", "corrupt, truncated")

    fine = write_run(tmp_path, model_file, "md", name="fine.yaml")
    code, stdout, err = run_cli(capsys, "run", fine, "--dry-run")
    assert code == 0, err
    assert "# checked: run file, model, structure, outputs folder" in stdout
    assert "elements Ni Cu" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "cu_ni_fcc32.extxyz", "fine.yaml", "overlap.extxyz", "run.yaml", "trunc.yaml",
        "truncated.model"]


def test_dry_run_refuses_a_used_folder_unless_overwrite(model_file, tmp_path, capsys):
    run_file = write_run(tmp_path, model_file, "singlepoint")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "run.log").write_text("old")
    code, _, err = run_cli(capsys, "run", run_file, "--dry-run")
    assert_user_error(code, err, "holds the results of an earlier run", "--overwrite")
    code, _, err = run_cli(capsys, "run", run_file, "--dry-run", "--overwrite")
    assert code == 0, err
    assert (tmp_path / "out" / "run.log").read_text() == "old"  # the dry run deletes nothing


def test_a_folder_as_model_or_struct_says_so(model_file, tmp_path, capsys):
    run_file = write_run(tmp_path, tmp_path, "md")
    code, _, err = run_cli(capsys, "run", run_file, "--dry-run")
    assert_user_error(code, err, "model:", "is a folder, not a file")
    code, _, err = run_cli(capsys, "run", tmp_path, "--dry-run")
    assert_user_error(code, err, "is a folder, not a run file")


# -- Ctrl-C ---------------------------------------------------------------------------------------
def test_ctrl_c_during_start_up_claims_no_files(model_file, tmp_path, capsys, monkeypatch):
    def interrupted(cfg, compute_stress):
        raise KeyboardInterrupt

    monkeypatch.setattr(runs, "make_calculator", interrupted)
    run_file = write_run(tmp_path, model_file, "md")
    code, _, err = run_cli(capsys, "run", run_file)
    assert code == 130
    assert err.strip().splitlines()[-1] == "error: interrupted; nothing was written"
    assert "kept" not in err and not (tmp_path / "out").exists()


def test_ctrl_c_during_the_run_says_where_the_files_are(model_file, tmp_path, capsys,
                                                        monkeypatch):
    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(runs.StatsWriter, "__call__", interrupted)
    run_file = write_run(tmp_path, model_file, "md")
    code, _, err = run_cli(capsys, "run", run_file)
    assert code == 130
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: interrupted; the files written so far are in ")
    assert str(tmp_path / "out") in last
    with pytest.raises(Interrupted):
        runs.run(run_file, {"outputs": str(tmp_path / "again")})
