"""Runs that fail part-way, as a new user meets them: a full disk, a diverging MD run, an
optimisation that does not converge, MD of one atom, a read-only filesystem. Each says what
happened in one line (exit 2 on the command line) and keeps its files readable. Each case was
reproduced against the code before this behaviour existed. (A seed out of range, which gave a
numpy traceback and a folder that blocked the rerun: tests/test_bad_input.py's RUN_CASES.)"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import ase.io
import pytest
from ase import Atoms
from test_run_outputs import STRUCTURES, run_cli, write_run  # pytest puts tests/ on sys.path

from mace_accel import cli, files
from mace_accel.errors import InputError, SimulationError
from mace_accel.files import RecordWriter
from mace_accel.runs import tasks as runs

def error_line(err: str) -> str:
    """The one ``error:`` line of stderr (progress and notes are other lines)."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def assert_readable(out: Path) -> None:
    """Every file a run writes as it goes ends with a whole record."""
    if (out / "trajectory.extxyz").exists():
        ase.io.read(out / "trajectory.extxyz", ":")
    if (out / "stats.dat").exists():
        rows = [line.split() for line in (out / "stats.dat").read_text().splitlines()[1:]]
        assert all(len(row) == 6 for row in rows)
    for name in ("run.log", "stats.dat", "trajectory.extxyz"):
        if (out / name).exists() and (out / name).stat().st_size:
            assert (out / name).read_bytes().endswith(b"\n")


# -- whole records ------------------------------------------------------------------------------
def test_a_record_that_does_not_fit_is_cut_back(tmp_path, monkeypatch):
    """A full disk writes what fits, then fails: the file keeps only whole records."""
    path = tmp_path / "rows.dat"
    writer = RecordWriter(path)
    writer.write("row 1\n")
    real_write = os.write

    def full(fd, data):  # the disk takes 3 bytes, then is full
        if full.left == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = real_write(fd, bytes(data[:full.left]))
        full.left -= n
        return n

    full.left = 3
    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError) as info:
        writer.write("row 2 is longer\n")
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(path)
    assert path.read_text() == "row 1\n" and writer.records == 1
    writer.write("row 3\n")  # the space freed by the cut is used again, at the end
    writer.close()
    assert path.read_text() == "row 1\nrow 3\n"


class SmallDisk:
    """``os`` for mace_accel.files with a disk of ``size`` bytes behind ``write``."""

    def __init__(self, size: int) -> None:
        self.left = size

    def __getattr__(self, name):
        return getattr(os, name)

    def write(self, fd, data) -> int:
        if self.left <= 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = os.write(fd, bytes(data[:self.left]))
        self.left -= n
        return n


def test_a_full_disk_during_md_keeps_readable_files(model_file, tmp_path, capsys, monkeypatch):
    """Before: exit 1, ``error: No space left on device`` with no path, and a trajectory
    ending in half a frame that ase.io.read refuses."""
    run_file = write_run(tmp_path, model_file, "md", md={"steps": 50, "traj_every": 1})
    monkeypatch.setattr(files, "os", SmallDisk(30_000))
    code, _, err = run_cli(capsys, "run", run_file)
    assert code == 2
    line = error_line(err)
    out = tmp_path / "out"
    for fragment in ("cannot write", "the disk is full", f"kept in {out}", "run.log",
                     "stats.dat", "whole frame(s)", "free space", "--overwrite",
                     "--set frame=-1"):
        assert fragment in line, (fragment, line)
    assert_readable(out)
    frames = ase.io.read(out / "trajectory.extxyz", ":")
    assert 0 < len(frames) < 51 and f"trajectory.extxyz ({len(frames)} whole frame(s)" in line
    assert not (out / "final.extxyz").exists()


def test_a_full_disk_during_singlepoint_keeps_the_whole_frames(model_file, tmp_path, capsys,
                                                                monkeypatch):
    frames = [ase.io.read(STRUCTURES / "cu_ni_fcc32.extxyz")] * 6
    ase.io.write(tmp_path / "frames.extxyz", frames)
    run_file = write_run(tmp_path, model_file, "singlepoint", struct="frames.extxyz")
    monkeypatch.setattr(files, "os", SmallDisk(12_000))
    code, _, err = run_cli(capsys, "run", run_file)
    assert code == 2
    line = error_line(err)
    partial = tmp_path / "out" / "results.extxyz.partial"
    kept = ase.io.read(partial, ":", format="extxyz")
    assert 0 < len(kept) < 6 and f"results.extxyz.partial ({len(kept)} whole frame(s)" in line
    assert not (tmp_path / "out" / "results.extxyz").exists()


@pytest.fixture
def tiny_disk(tmp_path):
    """A 64 KB tmpfs (root only, where mounting is allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_real_full_disk(model_file, tmp_path, capsys, tiny_disk):
    """The issue's reproduction: a 64 KB tmpfs as the outputs folder."""
    run_file = write_run(tmp_path, model_file, "md", md={"steps": 100, "traj_every": 1})
    out = tiny_disk / "out"
    code, _, err = run_cli(capsys, "run", run_file, "--set", f"outputs={out}")
    assert code == 2
    line = error_line(err)
    assert "the disk is full" in line and f"kept in {out}" in line
    assert_readable(out)
    assert len(ase.io.read(out / "trajectory.extxyz", ":")) > 0


# -- simulations that go wrong ------------------------------------------------------------------
def test_a_diverging_md_run_is_reported_as_such(model_file, tmp_path, capsys):
    """Before: blamed on the input structure ("check units and the cell, or lower
    min_distance"), with no step, no hint at the timestep and no word of the files kept."""
    run_file = write_run(tmp_path, model_file, "md", md={
        "steps": 30, "timestep": 100, "temperature": 20000, "traj_every": 1, "stats_every": 1})
    code, _, err = run_cli(capsys, "run", run_file)
    assert code == 2
    line = error_line(err)
    out = tmp_path / "out"
    assert line.startswith("error: md diverged at step ")
    for fragment in ("of 30", "timestep (100 fs) is likely too large", "--set md.timestep=",
                     f"kept in {out}", "stats.dat", "trajectory.extxyz", "--overwrite"):
        assert fragment in line, (fragment, line)
    assert "check units" not in line and "lower min_distance" not in line
    assert_readable(out)
    step = int(line.split("at step ")[1].split()[0])
    assert len(ase.io.read(out / "trajectory.extxyz", ":")) == step  # steps 0 .. step-1
    with pytest.raises(SimulationError, match="md diverged at step"):
        runs.run(run_file, {"outputs": str(tmp_path / "again")})


def test_md_of_one_atom_is_refused_before_anything_is_written(model_file, tmp_path, capsys):
    """Before: NaN momenta from the velocity set-up, then blamed on the structure."""
    ase.io.write(tmp_path / "one.extxyz", Atoms("Cu", cell=[6, 6, 6], pbc=True))
    run_file = write_run(tmp_path, model_file, "md", struct="one.extxyz")
    for extra in ([], ["--dry-run"]):
        code, _, err = run_cli(capsys, "run", run_file, *extra)
        assert code == 2
        assert "md needs at least 2 atoms" in error_line(err)
    assert not (tmp_path / "out").exists()
    with pytest.raises(InputError, match="centre of mass at rest"):
        runs.run(run_file)


def test_an_unconverged_geomopt_warns_and_exits_3(model_file, tmp_path, capsys):
    """Before: exit 0 and nothing on stderr."""
    run_file = write_run(tmp_path, model_file, "geomopt", geomopt={"steps": 2, "fmax": 1e-6},
                         struct="cu_ni_fcc32_rattled.extxyz")
    code, out, err = run_cli(capsys, "run", run_file)
    assert code == cli.EXIT_NOT_CONVERGED == 3
    warning = [line for line in err.splitlines() if line.startswith("warning: geomopt")]
    assert len(warning) == 1 and "did not converge" in warning[0]
    assert "--set geomopt.steps=N" in warning[0] and "final.extxyz" in warning[0]
    assert "converged: False" in out and (tmp_path / "out" / "final.extxyz").is_file()
    assert "warning: geomopt did not converge" in (tmp_path / "out" / "run.log").read_text()
    with pytest.warns(RuntimeWarning, match="geomopt did not converge"):
        result = runs.run(run_file, {"outputs": str(tmp_path / "py")})
    assert not result.ok and result.summary["converged"] is False
    converged = runs.run(run_file, {"outputs": str(tmp_path / "ok"), "geomopt.fmax": 100.0})
    assert converged.ok and converged.warnings == []


# -- filesystems ----------------------------------------------------------------------------------
def test_a_read_only_filesystem_is_not_called_a_permissions_problem(model_file, tmp_path, capsys,
                                                                    monkeypatch):
    run_file = write_run(tmp_path, model_file, "md")
    real = files.read_only_filesystem
    monkeypatch.setattr(files, "read_only_filesystem",
                        lambda p: Path(p) == tmp_path or real(p))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False
                        if Path(p) == tmp_path else real_access(p, mode, *a, **k))
    code, _, err = run_cli(capsys, "run", run_file)
    line = error_line(err)
    assert code == 2 and "read-only filesystem" in line and "permission" not in line
    code, _, err = run_cli(capsys, "convert", model_file, tmp_path / "fast.model",
                           "--device", "cpu", "--backend", "reference")
    line = error_line(err)
    assert code == 2 and "read-only filesystem" in line and "permission" not in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cu_ni_fcc32.extxyz", "run.yaml"]


def test_convert_onto_a_full_disk_is_one_line_and_leaves_no_file(model_file, tmp_path, capsys,
                                                                 monkeypatch):
    """torch.save reports a full disk as a RuntimeError of its zip writer (the OSError as its
    context); before, that was a traceback and exit 1."""
    import torch

    def full(obj, f, *args, **kwargs):
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", full)
    out = tmp_path / "fast.model"
    code, _, err = run_cli(capsys, "convert", model_file, out, "--device", "cpu", "--backend",
                           "reference")
    line = error_line(err)
    assert code == 2 and f"cannot write {str(out)!r}: the disk is full" in line
    assert "free space" in line and list(tmp_path.iterdir()) == []


def test_a_real_read_only_filesystem(model_file, tmp_path, capsys, tiny_disk):
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_disk)], check=True)
    run_file = write_run(tmp_path, model_file, "md")
    code, _, err = run_cli(capsys, "run", run_file, "--set", f"outputs={tiny_disk / 'out'}")
    line = error_line(err)
    assert code == 2 and "read-only filesystem" in line and "permission" not in line


def test_the_backend_fix_is_said_in_run_file_terms(model_file, tmp_path, capsys):
    """Before: "Use backend='reference' ... or fallback='warn'" (Python keywords)."""
    if __import__("torch").cuda.is_available():
        pytest.skip("checks the message shown without a GPU")
    run_file = write_run(tmp_path, model_file, "md", backend="cuda", fallback="error")
    code, _, err = run_cli(capsys, "run", run_file)
    line = error_line(err)
    assert code == 2 and "`backend: reference`" in line and "--set backend=reference" in line
    assert "backend='reference'" not in line and "fallback='warn'" not in line
    code, _, err = run_cli(capsys, "run", run_file, "--set", "backend=auto", "--set", "head=pbe")
    line = error_line(err)
    assert code == 2 and "unknown head 'pbe'" in line and "--set head=NAME" in line
    assert not (tmp_path / "out").exists()
