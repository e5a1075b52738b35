"""Runs shared over several processes (``mace-accel run --gpus N``, torchrun, torch.distributed):
on the CPU, N gloo processes stand in for N GPUs. The results equal a one-process run, in
input order; a failure on one rank stops every rank with that rank's error and writes nothing."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
from pathlib import Path

import ase.io
import numpy as np
import pytest
import yaml
from ase.build import bulk

from mace_accel.errors import InputError
from mace_accel.runs.distributed import RankFailed, World, _Group, share_frames
from mace_accel.runs.tasks import run

CPU = {"device": "cpu", "backend": "reference", "dtype": "float64", "progress": False,
       "verify": False}


def _frames(n: int = 7):
    """Cu/Ni fcc cells of 4 to 36 atoms (uneven sizes), rattled."""
    rng = np.random.default_rng(1)
    frames = []
    for k in range(n):
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((1 + k % 3, 1 + (k * 2) % 3, 1))
        atoms.numbers[rng.random(len(atoms)) < 0.4] = 28
        atoms.rattle(0.03, seed=k)
        frames.append(atoms)
    return frames


def _run_file(folder: Path, model: Path, frames, **keys) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    ase.io.write(folder / "frames.extxyz", frames)
    data = {"task": "singlepoint", "struct": "frames.extxyz", "model": str(model),
            "outputs": "out", **CPU, **keys}
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _cli(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mace_accel.cli", *map(str, argv)],
                          capture_output=True, text=True, timeout=300)


def test_share_frames_balances_atoms_and_keeps_every_frame_once():
    sizes = [36, 4, 8, 24, 12, 16, 4, 36, 8]
    shares = share_frames(sizes, 3)
    assert sorted(i for share in shares for i in share) == list(range(len(sizes)))
    assert all(share == sorted(share) for share in shares)
    loads = [sum(sizes[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes)  # greedy: within one frame of balanced
    assert share_frames(sizes, 3) == shares  # deterministic
    assert share_frames(sizes, 20)[15] == []  # more ranks than frames: some get none
    assert share_frames([], 2) == [[], []]


def test_two_processes_give_the_one_process_results_in_order(model_file, tmp_path):
    frames = _frames()
    one = _run_file(tmp_path / "one", model_file, frames)
    two = _run_file(tmp_path / "two", model_file, frames)
    run(one)  # the one-process reference, in this process (no second start-up to wait for)
    done = _cli("run", two, "--gpus", 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "singlepoint finished" in done.stdout and done.stdout.count("finished") == 1
    a = ase.io.read(tmp_path / "one" / "out" / "results.extxyz", ":")
    b = ase.io.read(tmp_path / "two" / "out" / "results.extxyz", ":")
    assert len(a) == len(b) == len(frames)
    for x, y, atoms in zip(a, b, frames):
        np.testing.assert_allclose(y.positions, atoms.positions, atol=1e-8)  # input order
        assert y.get_potential_energy() == pytest.approx(x.get_potential_energy(), abs=1e-10)
        np.testing.assert_allclose(y.get_forces(), x.get_forces(), atol=1e-8)
    log = (tmp_path / "two" / "out" / "run.log").read_text()
    assert "over 2 processes (torch.distributed" in log


def test_a_failure_on_one_rank_stops_all_and_writes_nothing(model_file, tmp_path):
    frames = _frames()
    on_rank_1 = share_frames([len(a) for a in frames], 2)[1][0]
    bad = frames[on_rank_1]
    bad.positions[1] = bad.positions[0] + [0.1, 0.0, 0.0]  # overlapping atoms
    path = _run_file(tmp_path, model_file, frames)
    done = _cli("run", path, "--gpus", 2)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr  # said once, by the launcher; no torchrun report
    assert errors[0].startswith("error: rank 1 of 2 failed while checking the frames"), errors
    assert f"frame {on_rank_1} of" in errors[0] and "apart" in errors[0], errors
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr
    assert not (tmp_path / "out").exists()  # no results, no .partial, not even the folder


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without GPUs")
def test_gpus_needs_that_many_gpus_unless_cpu(model_file, tmp_path):
    path = _run_file(tmp_path, model_file, _frames(2), device="auto")
    done = _cli("run", path, "--gpus", 2)
    assert done.returncode == 2, done.stderr
    assert "--gpus 2 needs 2 GPUs on this node" in done.stderr and "sees 0" in done.stderr
    assert "`device: cpu`" in done.stderr
    assert "torchrun" not in done.stderr.replace("start at most", "")  # nothing was started
    assert not (tmp_path / "out").exists()


@pytest.fixture
def one_rank_group(monkeypatch):
    """A gloo group of this process alone, as torchrun would set it up."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    group = _Group(World(rank=0, size=1, local_rank=0, local_size=1))
    yield group
    group.close()


def test_agree_names_the_rank_and_keeps_the_kind_of_failure(one_rank_group):
    assert one_rank_group.agree("adding", lambda: 1 + 1) == 2

    def bad_frame():
        raise InputError("frame 3 of 'x.extxyz': atoms 0 and 1 are 0.1 A apart")

    def disk_full():
        raise OSError(errno.ENOSPC, "No space left on device", "/out/results.extxyz")

    with pytest.raises(RankFailed, match=r"^rank 0 of 1 failed while checking: frame 3 of") as e:
        one_rank_group.agree("checking", bad_frame)
    assert e.value.exit_code == 2  # a user mistake
    with pytest.raises(RankFailed, match="results.extxyz': No space left on device") as e:
        one_rank_group.agree("writing", disk_full)
    assert e.value.exit_code == 1  # not one
