"""YAML runs end to end: every example config in configs/, run for a few steps on the CPU."""

from __future__ import annotations

import io
import time
from pathlib import Path

import ase.io
import numpy as np
import pytest
import torch
import yaml

from mace_accel import cli
from mace_accel.errors import BackendUnavailableError, ConfigError, Interrupted
from mace_accel.models.batch import atoms_to_batch, model_info
from mace_accel.runs import tasks as runs
from mace_accel.runs.config import load_run_config
from mace_accel.runs.progress import ProgressLines, progress_bar, ticker
from mace_accel.surgery import evaluate
from mace_accel.tolerances import rel_norm_error

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def run_example(name: str, tmp_path: Path, model: Path, **overrides):
    """Run configs/<name>.yaml on the CPU with the tiny model, outputs into tmp_path."""
    base = {"device": "cpu", "backend": "reference", "dtype": "float64", "model": str(model),
            "outputs": str(tmp_path / "out"), "progress": False}
    return runs.run(CONFIGS / f"{name}.yaml", {**base, **overrides})


def read_stats(path: Path):
    header = path.read_text().splitlines()[0]
    assert header.startswith("#")
    return header[1:].split(), np.atleast_2d(np.loadtxt(path))


def no_temp_files(directory: Path) -> bool:
    return not [p for p in directory.iterdir() if p.name.endswith((".tmp", ".partial"))]


def test_singlepoint_matches_the_model(model_file, tmp_path):
    model = torch.load(model_file, weights_only=False)
    result = run_example("singlepoint", tmp_path, model_file)
    out = result.outputs
    assert result.backend == "reference" and result.summary["frames"] == 4
    frames = ase.io.read(out / "results.extxyz", ":")
    inputs = ase.io.read(CONFIGS / "structures" / "cu_ni_fcc32_frames.extxyz", ":")
    assert len(frames) == 4 and no_temp_files(out)
    info = model_info(model)
    for got, atoms in zip(frames, inputs):
        np.testing.assert_allclose(got.positions, atoms.positions, atol=1e-8)
        want = evaluate(model, atoms_to_batch(atoms, info), compute_stress=True)
        assert rel_norm_error(torch.tensor(got.get_potential_energy()), want["energy"][0]) < 1e-10
        # extxyz stores per-atom columns with 8 decimals
        np.testing.assert_allclose(got.get_forces(), want["forces"].numpy(), rtol=0, atol=1e-8)
        assert rel_norm_error(torch.from_numpy(got.get_stress(voigt=False)),
                              want["stress"][0]) < 1e-10
    log = (out / "run.log").read_text()
    assert "active backend: reference" in log and "frame 3:" in log
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["task"] == "singlepoint" and saved["device"] == "cpu"


def test_singlepoint_batches_frames_and_keeps_input_order(model_file, tmp_path):
    """With a small edge budget the 4 frames take several batched calls; the results are the
    same as one call, frame by frame, in input order."""
    one = run_example("singlepoint", tmp_path / "one", model_file)
    many = run_example("singlepoint", tmp_path / "many", model_file,
                       **{"singlepoint.max_edges": 2000})
    assert one.summary["model_calls"] == 1 and many.summary["model_calls"] > 1
    a = ase.io.read(one.outputs / "results.extxyz", ":")
    b = ase.io.read(many.outputs / "results.extxyz", ":")
    for x, y in zip(a, b):
        assert x.get_potential_energy() == pytest.approx(y.get_potential_energy(), abs=1e-10)
        np.testing.assert_allclose(x.get_forces(), y.get_forces(), atol=1e-8)
    assert "batched model call(s); up to 2000 edges per call (given)" in \
        (many.outputs / "run.log").read_text()


def test_singlepoint_without_cell_leaves_stress_out(model_file, tmp_path):
    (tmp_path / "dimer.xyz").write_text("2\n\nCu 0 0 0\nNi 0 0 2.4\n")
    run_file = tmp_path / "sp.yaml"
    run_file.write_text(yaml.safe_dump({"task": "singlepoint", "struct": "dimer.xyz",
                                        "singlepoint": {"properties": ["energy", "stress"]}}))
    result = runs.run(run_file, {"device": "cpu", "backend": "reference",
                                 "model": str(model_file)})
    assert result.outputs == tmp_path / "sp-results"
    frame = ase.io.read(result.outputs / "results.extxyz")
    assert "stress" not in frame.calc.results and "forces" not in frame.calc.results
    assert np.isfinite(frame.get_potential_energy())
    assert result.summary["stress_skipped"] == 1
    assert "stress left out for 1 frame(s)" in (result.outputs / "run.log").read_text()


def test_geomopt_reduces_the_max_force(model_file, tmp_path):
    result = run_example("geomopt", tmp_path, model_file, **{"geomopt.steps": 15})
    out, s = result.outputs, result.summary
    assert s["steps"] == 15 and not s["converged"]  # fmax 0.01 is out of reach in 15 steps
    assert s["final_fmax"] < 0.5 * s["initial_fmax"]
    final = ase.io.read(out / "final.extxyz")
    f = np.linalg.norm(final.get_forces(), axis=1).max()
    assert f == pytest.approx(s["final_fmax"], rel=1e-6)  # extxyz keeps 8 decimals
    assert np.isfinite(final.get_stress()).all()  # relax_cell: true in the example
    traj = ase.io.read(out / "trajectory.extxyz", ":")
    assert len(traj) == s["steps"] + 1  # step 0 and every step after it
    first = np.linalg.norm(traj[0].get_forces(), axis=1).max()
    assert first == pytest.approx(s["initial_fmax"], rel=1e-6)
    assert final.get_potential_energy() < traj[0].get_potential_energy()
    assert not np.allclose(traj[0].cell, final.cell)  # the cell was relaxed too
    assert "FIRE" in (out / "run.log").read_text() and no_temp_files(out)


def test_md_nve_conserves_energy(model_file, tmp_path):
    steps = 20
    result = run_example("md_nve", tmp_path, model_file,
                         **{"md.steps": steps, "md.timestep": 0.25, "md.stats_every": 1,
                            "md.traj_every": 5})
    out = result.outputs
    columns, stats = read_stats(out / "stats.dat")
    assert columns == list(runs.STATS_COLUMNS)
    assert len(stats) == steps + 1
    np.testing.assert_array_equal(stats[:, 0], np.arange(steps + 1))
    np.testing.assert_allclose(stats[:, 1], 0.25 * np.arange(steps + 1))
    np.testing.assert_allclose(stats[:, 4], stats[:, 2] + stats[:, 3], atol=1e-7)
    assert stats[0, 5] > 100  # Maxwell-Boltzmann velocities at 300 K
    etot, ekin = stats[:, 4], stats[:, 3]
    drift = np.abs(etot - etot[0]).max()
    assert np.ptp(ekin) > 1e-3  # energy does flow between kinetic and potential
    # velocity Verlet at 0.25 fs: drift ~1e-8 eV; 5e-8 is the rounding of 8-decimal columns
    assert drift < 1e-3 * np.ptp(ekin) + 5e-8, (drift, np.ptp(ekin))
    assert len(ase.io.read(out / "trajectory.extxyz", ":")) == steps // 5 + 1
    final = ase.io.read(out / "final.extxyz")
    assert final.get_potential_energy() == pytest.approx(stats[-1, 2], abs=1e-7)
    assert result.summary["steps"] == steps and no_temp_files(out)


def test_md_langevin_is_seeded(model_file, tmp_path):
    over = {"md.steps": 6, "md.stats_every": 2, "md.traj_every": 3, "md.timestep": 1.0}
    a = run_example("md_langevin", tmp_path / "a", model_file, **over)
    b = run_example("md_langevin", tmp_path / "b", model_file, **over)
    c = run_example("md_langevin", tmp_path / "c", model_file, **over, **{"md.seed": 7})
    _, sa = read_stats(a.outputs / "stats.dat")
    _, sb = read_stats(b.outputs / "stats.dat")
    _, sc = read_stats(c.outputs / "stats.dat")
    assert len(sa) == 6 // 2 + 1
    np.testing.assert_array_equal(sa, sb)
    assert not np.allclose(sa[1:, 3], sc[1:, 3])
    assert len(ase.io.read(a.outputs / "trajectory.extxyz", ":")) == 3


def test_md_npt_writes_volume_and_pressure(model_file, tmp_path):
    result = run_example("md_npt", tmp_path, model_file,
                         **{"md.steps": 4, "md.stats_every": 1, "md.traj_every": 2})
    columns, stats = read_stats(result.outputs / "stats.dat")
    assert columns == list(runs.STATS_COLUMNS + runs.NPT_STATS_COLUMNS)
    assert stats.shape == (5, len(columns)) and np.isfinite(stats).all()
    start = ase.io.read(CONFIGS / "structures" / "cu_ni_fcc32.extxyz")
    assert stats[0, 6] == pytest.approx(start.get_volume())
    assert stats[-1, 6] != stats[0, 6]  # the barostat moves the cell
    final = ase.io.read(result.outputs / "final.extxyz")
    assert final.get_volume() == pytest.approx(stats[-1, 6])


def test_md_starts_from_stored_momenta(model_file, tmp_path):
    atoms = ase.io.read(CONFIGS / "structures" / "cu_ni_fcc32.extxyz")
    rng = np.random.default_rng(0)
    atoms.set_momenta(rng.normal(0, 0.05, (len(atoms), 3)))
    ase.io.write(tmp_path / "moving.extxyz", atoms)
    run_file = tmp_path / "md.yaml"
    run_file.write_text(yaml.safe_dump({"task": "md", "struct": "moving.extxyz",
                                        "md": {"steps": 1, "temperature": 5000}}))
    result = runs.run(run_file, {"device": "cpu", "backend": "reference", "progress": False,
                                 "model": str(model_file)})
    _, stats = read_stats(result.outputs / "stats.dat")
    assert stats[0, 3] == pytest.approx(atoms.get_kinetic_energy(), abs=1e-8)  # 8 decimals


def test_interrupted_md_keeps_what_it_did(model_file, tmp_path, monkeypatch):
    real_row = runs.StatsWriter.__call__

    def interrupt_after_4_rows(self):
        real_row(self)
        if self.step() >= 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(runs.StatsWriter, "__call__", interrupt_after_4_rows)
    with pytest.raises(KeyboardInterrupt) as info:
        run_example("md_nve", tmp_path, model_file,
                    **{"md.steps": 50, "md.stats_every": 1, "md.traj_every": 1})
    out = tmp_path / "out"
    assert isinstance(info.value, Interrupted) and str(out) in info.value.note
    _, stats = read_stats(out / "stats.dat")
    assert len(stats) == 4  # steps 0..3, flushed as they were written
    # the interrupt came in step 3's stats row, before its trajectory frame: steps 0..2
    assert len(ase.io.read(out / "trajectory.extxyz", ":")) == 3
    assert not (out / "final.extxyz").exists() and no_temp_files(out)
    assert "interrupted" in (out / "run.log").read_text()


def test_cli_run_prints_the_summary(model_file, tmp_path, capsys):
    code = cli.main(["run", str(CONFIGS / "md_nve.yaml"), "--set", "device=cpu",
                     "--set", "backend=reference", "--set", f"model={model_file}",
                     "--set", f"outputs={tmp_path}", "--set", "md.steps=2"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "md finished (backend 'reference')" in out and "steps: 2" in out
    assert (tmp_path / "stats.dat").is_file()


def test_runs_refuse_a_missing_gpu_and_overrides_of_a_built_config(model_file, tmp_path):
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match="device: cpu"):
            runs.run(CONFIGS / "md_nve.yaml", {"device": "cuda", "outputs": str(tmp_path)})
    cfg = load_run_config(CONFIGS / "md_nve.yaml", {"device": "cpu", "outputs": str(tmp_path),
                                                    "model": str(model_file)})
    with pytest.raises(ConfigError, match="overrides apply to a run file"):
        runs.run(cfg, {"md.steps": 1})


def test_dry_run_describes_without_writing(tmp_path):
    text = runs.dry_run(CONFIGS / "md_npt.yaml", {"outputs": str(tmp_path / "o")})
    assert "md on 1 frame(s) (Cu24Ni8) of 32 atoms" in text and "(bundled)" in text
    assert yaml.safe_load(text)["md"]["ensemble"] == "npt"
    assert not (tmp_path / "o").exists()


# -- progress bar (tqdm) -----------------------------------------------------------------------


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_draws_on_a_terminal():
    stream = FakeTerminal()
    with progress_bar(10, desc="md nve", stream=stream) as bar:
        for _ in range(10):
            bar.update()
    text = stream.getvalue()
    assert "md nve" in text and "10/10" in text and text.endswith("\n")


def test_progress_off_a_terminal_is_whole_lines():
    """A batch job's log (stderr not a terminal) gets progress lines, never a bar: one per
    interval and one at the end (before, it got nothing at all)."""
    stream = io.StringIO()  # not a TTY
    with progress_bar(10, desc="md nve", stream=stream, interval=0.0) as bar:
        for _ in range(10):
            bar.update()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and len(lines) == 10  # 9 on the way, 1 at the end
    assert lines[0].startswith("md nve: 1/10 steps (10%)") and "left" in lines[0]
    assert lines[-1].startswith("md nve: 10/10 steps (100%)")


def test_progress_lines_come_every_interval_and_say_where_a_run_stopped():
    now = [0.0]
    stream = io.StringIO()
    with pytest.raises(RuntimeError):
        with ProgressLines(100, "md nvt", stream, interval=10.0, clock=lambda: now[0]) as lines:
            for _ in range(30):
                now[0] += 1.0  # a step a second: a line every 10 steps
                lines.update()
            raise RuntimeError("diverged")
    text = stream.getvalue().splitlines()
    assert [line.split(" steps")[0] for line in text] == ["md nvt: 10/100", "md nvt: 20/100",
                                                          "md nvt: 30/100", "md nvt: 30/100"]
    assert "(1.00step/s)" in text[0] and "01:30 left" in text[0]
    assert text[-1].endswith("; stopped")


def test_progress_is_silent_when_off_or_empty():
    terminal = FakeTerminal()
    with progress_bar(10, stream=terminal, enabled=False) as bar:  # progress: false
        bar.update(10)
    with progress_bar(0, stream=terminal) as bar:  # nothing to do: no bar
        pass
    log = io.StringIO()
    with progress_bar(10, stream=log, enabled=False) as bar:
        bar.update(10)
    with progress_bar(0, stream=log) as bar:
        pass
    assert terminal.getvalue() == "" and log.getvalue() == ""


def test_ticker_reports_a_long_start_up():
    stream = io.StringIO()
    with ticker("loading the model", stream, interval=0.05):
        time.sleep(0.3)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "mace-accel: loading the model ..."
    assert any(line.startswith("mace-accel: still loading the model (") for line in lines[1:-1])
    assert lines[-1].startswith("mace-accel: loading the model: done in ")
    quiet = io.StringIO()
    with ticker("loading the model", quiet, enabled=False, interval=0.01):
        time.sleep(0.05)
    assert quiet.getvalue() == ""


def test_a_run_reports_its_start_up_and_steps_off_a_terminal(model_file, tmp_path):
    log = io.StringIO()
    runs.run(CONFIGS / "md_nve.yaml", {"device": "cpu", "backend": "reference",
                                       "model": str(model_file), "md.steps": 3,
                                       "outputs": str(tmp_path / "a")}, progress_stream=log)
    lines = log.getvalue().splitlines()
    assert lines[0].startswith("mace-accel: loading, accelerating and verifying the model")
    assert lines[1].startswith("mace-accel: loading, accelerating and verifying the model")
    assert "done in" in lines[1]
    assert lines[-1].startswith("md nve: 3/3 steps (100%)")


def test_progress_false_in_a_run_draws_nothing_on_a_terminal(model_file, tmp_path):
    terminal = FakeTerminal()
    runs.run(CONFIGS / "md_nve.yaml", {"device": "cpu", "backend": "reference",
                                       "model": str(model_file), "md.steps": 2,
                                       "outputs": str(tmp_path / "a"), "progress": False},
             progress_stream=terminal)
    assert terminal.getvalue() == ""
    runs.run(CONFIGS / "md_nve.yaml", {"device": "cpu", "backend": "reference",
                                       "model": str(model_file), "md.steps": 2,
                                       "outputs": str(tmp_path / "b")},
             progress_stream=terminal)
    assert "md nve" in terminal.getvalue() and "2/2" in terminal.getvalue()


def test_device_auto_resolves_and_says_so(capsys):
    cfg = load_run_config(CONFIGS / "md_langevin.yaml")
    assert cfg.device == "auto"
    resolved = runs.resolve_auto_device(cfg)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolved.device == expected
    if expected == "cpu":
        assert "device auto -> cpu" in capsys.readouterr().err
