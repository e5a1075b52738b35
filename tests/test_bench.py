"""CPU tests of ``mace-accel bench``: structures, backends' statuses, timing, bisection,
speedups, report/JSON schema, profile, MD and the command line (through the main CLI: CPU-sized
defaults that it announces, an honest message when interrupted, one error line)."""

from __future__ import annotations

import argparse
import copy
import json

import numpy as np
import pytest
import torch

from mace_accel import cli
from mace_accel.bench import backends as bench_backends
from mace_accel.bench import cli as bench_cli
from mace_accel.bench.backends import (
    REFERENCE_NAME,
    ModelSource,
    preserve_default_dtype,
)
from mace_accel.bench.cli import (
    CPU_DEFAULTS,
    GPU_DEFAULTS,
    add_bench_parser,
    config_from_args,
    run_from_args,
)
from mace_accel.bench.maxsize import CONVERGED, NOTHING_FITS, TIME_LIMIT, UPPER_BOUND, find_max_size
from mace_accel.bench.report import (
    JSON_NAME,
    RECORD_FIELDS,
    SCHEMA,
    SCHEMA_VERSION,
    load_json,
    render_table,
    write_outputs,
    write_plots,
)
from mace_accel.bench.runner import BenchConfig, CaseRecord, compute_speedups, run_bench
from mace_accel.bench.systems import build_system, cells_for_atoms, make_batch
from mace_accel.bench.timing import Deadline, is_out_of_memory, time_calls
from mace_accel.errors import ConfigError, InputError
from mace_accel.models.architectures import OFF_ELEMENTS, small_test_model
from mace_accel.models.batch import ModelInfo


@pytest.fixture(autouse=True)
def _restore_default_dtype():
    saved = torch.get_default_dtype()
    yield
    torch.set_default_dtype(saved)


@pytest.fixture(scope="module")
def tiny_model():
    return small_test_model("RealAgnosticResidualInteractionBlock", elements=(28, 29))


@pytest.fixture()
def tiny_source(tiny_model):
    return ModelSource("tiny", lambda dtype, device: copy.deepcopy(tiny_model).to(
        device=device, dtype=dtype))


def _info(elements, r_max):
    return ModelInfo(tuple(elements), r_max, ("Default",), torch.float64)


def _missing(*names):
    """An importer under which ``names`` raise ImportError (others import normally)."""
    real = bench_backends._import

    def fake(name):
        if name in names:
            raise ImportError(f"No module named '{name}' (test)")
        return real(name)
    return fake


# -- systems -----------------------------------------------------------------------------------
@pytest.mark.parametrize("target,n", [(256, 4), (2048, 8), (6912, 12), (300, 4), (400, 5),
                                      (1, 1), (33, 2)])
def test_cells_for_atoms_picks_nearest_4n3(target, n):
    assert cells_for_atoms(target) == n


def test_cells_for_atoms_rejects_nonpositive():
    with pytest.raises(InputError, match="positive"):
        cells_for_atoms(0)


def test_fcc_system_has_78_neighbours_at_6_angstrom():
    info = _info((28, 29), 6.0)
    system = build_system(info, 32, seed=1)
    batch, edges = make_batch(system, info, torch.float64, "cpu")
    assert system.kind == "fcc" and system.n_cells == 2 and system.n_atoms == 32
    assert set(system.atoms.numbers) == {28, 29}
    assert 74 <= edges / system.n_atoms <= 82  # 12+6+24+12+24 shells within 6 Å
    assert batch["positions"].shape == (32, 3)


def test_molecular_system_liquid_like():
    info = _info(OFF_ELEMENTS, 5.0)
    system = build_system(info, 150, seed=2)
    _, edges = make_batch(system, info, torch.float64, "cpu")
    assert system.kind == "molecular"
    assert 150 <= system.n_atoms < 160
    assert set(system.atoms.numbers) <= {1, 6, 7, 8} and 6 in system.atoms.numbers
    dist = system.atoms.get_all_distances(mic=True)
    np.fill_diagonal(dist, np.inf)
    assert dist.min() > 0.9  # bonds, no overlapping molecules
    density = system.atoms.get_masses().sum() / system.atoms.get_volume() * 1.66054
    assert 0.85 < density < 1.05
    assert 35 <= edges / system.n_atoms <= 80


def test_system_uses_only_the_models_elements():
    fcc = build_system(_info((13, 14), 5.0), 100)
    assert set(fcc.atoms.numbers) == {13, 14} and fcc.substitutions
    mol = build_system(_info((1, 8), 5.0), 40, kind="molecular")
    assert set(mol.atoms.numbers) <= {1, 8} and set(mol.substitutions) == {6, 7}


# -- timing and bisection ----------------------------------------------------------------------
def test_time_calls_skips_warmup_and_takes_percentiles():
    ticks = iter(np.cumsum([0.0] + [v for d in (1, 5, 2, 4, 3) for v in (d * 1e-3, 0.0)]))
    calls = []
    timing = time_calls(lambda: calls.append(1), "cpu", warmup=3, repeats=5,
                        clock=lambda: float(next(ticks)))
    assert len(calls) == 8
    assert timing.clock == "perf_counter" and timing.warmup == 3
    assert timing.samples_ms == pytest.approx((1, 5, 2, 4, 3))
    assert timing.median_ms == pytest.approx(3.0)
    assert timing.p10_ms == pytest.approx(1.4) and timing.p90_ms == pytest.approx(4.6)


def _oom_above(limit, calls):
    def try_size(n):
        calls.append(n)
        if n > limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory at n={n}")
        return {"atoms": 4 * n**3}
    return try_size


@pytest.mark.parametrize("limit", [2, 3, 13, 31, 47])
def test_find_max_size_bisects_to_the_oom_boundary(limit):
    calls = []
    found = find_max_size(_oom_above(limit, calls), start=2, upper=48)
    assert (found.largest_fit, found.smallest_oom, found.stop_reason) == (limit, limit + 1,
                                                                            CONVERGED)
    assert len(calls) <= 12 and all((t.n <= limit) == t.fits for t in found.trials)
    assert found.trials[-1].n in (limit, limit + 1)


def test_find_max_size_upper_bound_nothing_fits_and_errors():
    assert find_max_size(_oom_above(99, []), 3, 10).stop_reason == UPPER_BOUND
    assert find_max_size(_oom_above(99, []), 3, 10).largest_fit == 10
    calls = []
    below = find_max_size(_oom_above(4, calls), 12, 48)  # start too large: shrink, then bisect
    assert (below.largest_fit, below.smallest_oom, below.stop_reason) == (4, 5, CONVERGED)
    assert calls[:3] == [12, 6, 3]
    none = find_max_size(_oom_above(0, []), 5, 10)
    assert (none.largest_fit, none.stop_reason) == (None, NOTHING_FITS)

    def broken(n):
        raise ValueError("not an OOM")
    with pytest.raises(ValueError, match="not an OOM"):
        find_max_size(broken, 1, 4)


def test_find_max_size_counts_a_kernel_size_limit_as_not_fitting():
    """A cell past a kernel's int32 indices does not fit, like one past the memory (else the
    search stops there with an error: at 442k atoms on the SiLU MLP's edge-count check)."""
    from mace_accel.errors import KernelSizeError

    def try_size(n):
        if n > 40:
            raise KernelSizeError(f"{n} rows exceed the kernel's int32 row index")
        if n > 33:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return {"atoms": 4 * n**3}

    found = find_max_size(try_size, 4, 48)
    assert (found.largest_fit, found.smallest_oom, found.stop_reason) == (33, 34, CONVERGED)
    assert any("int32" in str(t.info) for t in found.trials if not t.fits)


def test_find_max_size_stops_at_the_time_limit():
    clock = iter(range(100))
    deadline = Deadline(2.5, clock=lambda: float(next(clock)))  # 2 attempts fit in the budget
    calls = []
    found = find_max_size(_oom_above(20, calls), 1, 48, deadline)
    assert found.stop_reason == TIME_LIMIT and calls == [1, 2] and found.largest_fit == 2


def test_is_out_of_memory_recognises_torch_and_text():
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("x"))
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


# -- backends ----------------------------------------------------------------------------------
def test_model_sources_resolve_names_and_checkpoints(tmp_path, tiny_model):
    from mace_accel.bench.backends import resolve_model_source

    assert resolve_model_source("mp-medium").label == "mp-medium"  # resolved, not built
    path = tmp_path / "tiny.model"
    torch.save(tiny_model, path)
    source = resolve_model_source(str(path))
    model = source.load(torch.float32, torch.device("cpu"))
    assert source.label == "tiny.model"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with pytest.raises(ConfigError, match="neither a known architecture"):
        resolve_model_source(str(tmp_path / "missing.model"))


def test_preserve_default_dtype_restores_third_party_changes():
    before = torch.get_default_dtype()
    other = torch.float64 if before == torch.float32 else torch.float32
    with preserve_default_dtype():
        torch.set_default_dtype(other)
    assert torch.get_default_dtype() == before


# -- speedups and table ------------------------------------------------------------------------
def _rec(backend, median, size=256, status="ok"):
    return CaseRecord("m", "float32", size, backend, status, atoms=size, edges=78 * size,
                      median_ms=median if status == "ok" else None, p10_ms=median,
                      p90_ms=median, clock="cuda-events")


def test_compute_speedups_per_group():
    recs = [_rec("e3nn", 100.0), _rec("cueq", 20.0), _rec("oeq", 50.0),
            _rec("mace-accel", 10.0), _rec("e3nn", 10.0, size=32),
            _rec("mace-accel", 4.0, size=32), _rec("oeq", None, size=32, status="out of memory")]
    compute_speedups(recs)
    e3nn, cueq, oeq, accel, e3nn_s, accel_s, oom = recs
    assert accel.speedup_vs_e3nn == pytest.approx(10.0)
    assert (accel.speedup_vs_best_other, accel.best_other) == (pytest.approx(2.0), "cueq")
    assert (cueq.speedup_vs_best_other, cueq.best_other) == (pytest.approx(2.5), "oeq")
    assert e3nn.speedup_vs_e3nn == 1.0 and e3nn.speedup_vs_best_other == pytest.approx(0.2)
    assert oeq.speedup_vs_e3nn == pytest.approx(2.0)
    assert (accel_s.speedup_vs_e3nn, accel_s.best_other) == (pytest.approx(2.5), "e3nn")
    assert e3nn_s.speedup_vs_best_other is None  # mace-accel never counts as "other"
    assert oom.speedup_vs_e3nn is None and oom.speedup_vs_best_other is None


def test_render_table_shows_numbers_and_statuses():
    recs = [_rec("e3nn", 100.0), _rec("mace-accel", 10.0),
            _rec("cueq", None, status="not installed: ModuleNotFoundError: cuequivariance")]
    recs[1].force_rel_err, recs[1].within_tolerance = 3e-7, True
    compute_speedups(recs)
    table = render_table(recs)
    lines = table.splitlines()
    assert len(lines) == 2 + 3 + 1
    accel = next(line for line in lines if "mace-accel" in line)
    assert "10.00" in accel and "10.00x" in accel and "3.0e-07" in accel
    assert "(e3nn)" in accel
    assert "not installed: ModuleNotFoundError" in table and "cuda-events" in table


def test_write_plots_png(tmp_path):
    pytest.importorskip("matplotlib")
    recs = [_rec("e3nn", 10.0 * s, size=s) for s in (32, 256)] + [_rec("cueq", 1.0, size=32)]
    path, message = write_plots(recs, tmp_path / "t.png")
    assert path.is_file() and path.stat().st_size > 1000 and str(path) in message


# -- the runner on CPU (tiny model, JSON schema) -----------------------------------------------
def test_runner_reports_every_backend_and_writes_schema(tmp_path, monkeypatch, tiny_source):
    monkeypatch.setattr(bench_backends, "_import",
                        _missing("cuequivariance", "openequivariance"))
    config = BenchConfig(models=["tiny"], dtypes=["float32"], sizes=[32],
                         backends=["e3nn", "cueq", "oeq", "mace-accel"], device="cpu",
                         warmup=0, repeats=2)
    writes = []
    result = run_bench(config, [tiny_source], log=lambda line: None,
                       on_update=lambda r: writes.append(len(r.records)),
                       environment={"device": "cpu"})
    by = {r.backend: r for r in result.records}
    assert set(by) == {"e3nn", "cueq", "oeq", "mace-accel"} and writes
    assert by["e3nn"].ok and by["e3nn"].clock == "perf_counter" and by["e3nn"].median_ms > 0
    assert by["e3nn"].edges == 32 * 18 and by["e3nn"].atoms == 32  # fcc shells within 4 Å
    assert by["e3nn"].edges_per_s == pytest.approx(576 / (by["e3nn"].median_ms * 1e-3))
    assert by["cueq"].status.startswith("not installed: ") and "cuequivariance" in by["cueq"].status
    assert by["oeq"].status.startswith("not installed: ") and "openequivariance" in by["oeq"].status
    assert by["mace-accel"].status.startswith("unavailable: ")
    write_outputs(result, tmp_path)
    doc = json.loads((tmp_path / JSON_NAME).read_text())
    assert doc["schema"] == SCHEMA and doc["schema_version"] == SCHEMA_VERSION
    assert all(tuple(r) == RECORD_FIELDS for r in doc["records"])
    assert {"records", "max_size", "md", "environment", "config"} <= set(doc)
    assert load_json(tmp_path / JSON_NAME).records[0].median_ms == by["e3nn"].median_ms
    assert doc["train"] == []  # no --train: no training rows
    table = (tmp_path / "bench_table.txt").read_text()
    assert table.count("tiny") == 4 and "Training" not in table


def test_runner_allow_reference_times_the_reference_backend(tiny_source):
    config = BenchConfig(models=["tiny"], dtypes=["float64"], sizes=[32],
                         backends=["e3nn", "mace-accel"], device="cpu", warmup=0, repeats=2,
                         allow_reference=True, compute_stress=True)
    result = run_bench(config, [tiny_source], log=lambda line: None)
    e3nn, accel = result.records
    assert accel.backend == REFERENCE_NAME and accel.ok, accel.status
    assert "CUDA backend unavailable" in accel.detail
    assert accel.force_rel_err < 1e-10 and accel.energy_rel_err < 1e-10
    assert accel.stress_rel_err < 1e-10 and accel.within_tolerance
    assert accel.speedup_vs_e3nn == pytest.approx(e3nn.median_ms / accel.median_ms)
    assert accel.best_other == "e3nn"


def test_untimed_reference_keeps_its_per_atom_energies(tiny_source, monkeypatch):
    """With e3nn not among the timed backends, its reference outputs still carry the per-atom
    energies, so every backend's energy is measured against their float64 sum."""
    from mace_accel.bench.runner import BenchRunner as Runner

    seen = []
    fill = Runner._fill_errors

    def recording(record, out, ref, dtype):
        seen.append("node_energy" in ref)
        return fill(record, out, ref, dtype)

    monkeypatch.setattr(Runner, "_fill_errors", staticmethod(recording))
    config = BenchConfig(models=["tiny"], dtypes=["float64"], sizes=[32],
                         backends=["mace-accel"], device="cpu", warmup=0, repeats=2,
                         allow_reference=True)
    result = run_bench(config, [tiny_source], log=lambda line: None)
    assert seen == [True] and result.records[0].energy_rel_err < 1e-10


# -- profile and MD ----------------------------------------------------------------------------
def test_profile_splits_a_call_into_parts(tiny_model, monkeypatch):
    from mace_accel.bench import profile as bench_profile
    from mace_accel.bench.profile import PARTS, hooked_modules, profile_call, render_profile

    paths = [p for p, _, _ in hooked_modules(tiny_model)]
    assert "products.0" in paths and "interactions.0.conv_tp" in paths
    assert not any(p.startswith("products.0.") for p in paths)  # nested linears not twice
    info = ModelInfo((28, 29), 4.0, ("Default",), torch.float64)
    batch, _ = make_batch(build_system(info, 32), info, torch.float64, "cpu")
    tiny_model(dict(batch), training=False, compute_force=True)
    result = profile_call(tiny_model, batch, "cpu")
    parts = {p.part: p for p in result.parts}
    assert tuple(parts) == PARTS + ("other",)
    for name in PARTS:  # forward ranges and their backward nodes both counted
        assert parts[name].time_ms > 0 and parts[name].count > 0, name
    assert sum(p.time_ms for p in result.parts) == pytest.approx(result.total_ms, rel=1e-6)
    assert "symmetric contraction" in render_profile(result)
    # without the backward attribution every part loses its backward ops to "other"
    monkeypatch.setattr(bench_profile, "_BACKWARD_PREFIX", "no backward node matches this")
    forward_only = {p.part: p.count for p in profile_call(tiny_model, batch, "cpu").parts}
    assert all(forward_only[name] < parts[name].count for name in PARTS)
    assert forward_only["other"] > parts["other"].count


def test_profile_says_the_gpu_clock_it_ran_at(monkeypatch):
    """The profile records the GPU's SM clock, power and temperature after the call (hosts of
    one GPU model differ there) and prints them; nothing on a CPU or where NVML cannot be
    read."""
    from mace_accel.bench import profile as bench_profile

    assert bench_profile.gpu_state("cpu") == {}
    readings = {"clock_rate": 1755, "power_draw": 612_000, "temperature": 61}
    for name, value in readings.items():
        monkeypatch.setattr(torch.cuda, name, lambda device, value=value: value)
    state = bench_profile.gpu_state("cuda")
    assert state == {"sm_clock_mhz": 1755.0, "power_w": 612.0, "temperature_c": 61.0}
    result = bench_profile.ProfileResult("self CUDA time", "kernels", [], 1.0, 0, gpu=state)
    assert "SM clock 1755 MHz, 612 W, 61 C" in bench_profile.render_profile(result)
    assert result.to_dict()["gpu"] == state

    def no_nvml(device):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "clock_rate", no_nvml)
    assert bench_profile.gpu_state("cuda") == {}
    assert "SM clock" not in bench_profile.render_profile(
        bench_profile.ProfileResult("self CUDA time", "kernels", [], 1.0, 0))


def test_profile_counts_the_folded_last_layer_as_radial_mlp(tiny_model, monkeypatch):
    """With the radial MLP's last layer folded into the fused conv, its GEMM (forward and
    backward) runs from the conv's module but is still the radial MLP's work."""
    import contextlib

    import mace_accel.patches.radial.mlp as radial_patch
    from mace_accel.bench.profile import profile_call
    from mace_accel.options import AccelOptions
    from mace_accel.surgery import accelerate

    model = copy.deepcopy(tiny_model)
    accelerate(model, options=AccelOptions(backend="reference"))
    assert all(block.conv_tp.radial is not None for block in model.interactions)
    info = ModelInfo((28, 29), 4.0, ("Default",), torch.float64)
    batch, _ = make_batch(build_system(info, 32), info, torch.float64, "cpu")
    model(dict(batch), training=False, compute_force=True)

    def counts():
        return {p.part: p.count for p in profile_call(model, batch, "cpu").parts}

    ranged = counts()
    monkeypatch.setattr(radial_patch, "part_range", lambda part: contextlib.nullcontext())
    unranged = counts()
    # per block: the forward mm and its backward's mm move from the conv to the radial MLP
    moved = ranged["radial MLP"] - unranged["radial MLP"]
    assert moved >= 2 * len(model.interactions)
    assert unranged["conv TP"] - ranged["conv TP"] == moved


def test_profile_counts_each_kernel_once_under_the_op_that_launched_it():
    """With CUPTI the call and part ranges also appear as device events spanning their
    kernels; counting them made the total (and so "other") several times the call. And torch
    lists a kernel under every op carrying its launch's linked id: an op of autograd's thread
    that shared the id of a conv op counted the conv's kernel a second time (MH-1: the radial
    table's 0.8 ms in "linears" too). The runtime call's time names the launcher."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from mace_accel.bench import profile as bench_profile
    from mace_accel.profiling import PART_RANGE

    def span(start, end):
        return SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)

    def cpu_event(name, start, end, parent=None, kernels=(), id=7, thread=1):
        return SimpleNamespace(name=name, device_type=DeviceType.CPU, is_async=False, id=id,
                               sequence_nr=-1, thread=thread, is_legacy=False, cpu_children=[],
                               cpu_parent=parent, kernels=list(kernels),
                               time_range=span(start, end))

    kernel = SimpleNamespace(name="sgemm", duration=5.0)
    conv = cpu_event(PART_RANGE + "conv TP", 0.0, 50.0, id=3)
    linears = cpu_event(PART_RANGE + "linears", 60.0, 90.0, id=4, thread=2)
    op = cpu_event("aten::mm", 10.0, 20.0, conv, [kernel])
    twin = cpu_event("aten::add", 70.0, 80.0, linears, [kernel], thread=2)  # the same id, 7
    launch = cpu_event("cuLaunchKernel", 12.0, 13.0, op, id=100)  # CUPTI's id: the kernel's
    device = [SimpleNamespace(name="sgemm", device_type=DeviceType.CUDA, time_range=span(95, 100),
                              id=100),
              SimpleNamespace(name=bench_profile._CALL_RANGE, device_type=DeviceType.CUDA,
                              time_range=span(0.0, 100.0), id=1),
              SimpleNamespace(name=PART_RANGE + "conv TP", device_type=DeviceType.CUDA,
                              time_range=span(95, 100), id=3)]
    parts, total_ms, total_n, kernels = bench_profile.attribute(
        [conv, linears, op, twin, launch, *device], on_cuda=True)
    by = {p.part: p for p in parts}
    assert total_ms == pytest.approx(0.005) and total_n == 1
    assert by["conv TP"].time_ms == pytest.approx(0.005) and by["conv TP"].count == 1
    assert by["linears"].time_ms == 0 and by["other"].time_ms == 0
    assert kernels == {"conv TP": [("sgemm", pytest.approx(0.005), 1)]}


def test_md_throughput_and_missing_calculator_packages(monkeypatch, tiny_model):
    from mace_accel.bench.md import run_md

    atoms = build_system(_info((28, 29), 4.0), 32).atoms
    record = run_md("e3nn", tiny_model, atoms, "cpu", "tiny", steps=2, warmup_steps=1)
    assert record.status == "ok", record.status
    assert record.steps_per_s > 0 and record.ms_per_step == pytest.approx(1e3 / record.steps_per_s)
    monkeypatch.setattr(bench_backends, "_import", _missing("openequivariance"))
    assert run_md("oeq", tiny_model, atoms, "cpu", "tiny").status.startswith("not installed")


def test_md_with_the_mace_accel_calculator(tiny_model):
    pytest.importorskip("mace_accel.calculator")
    from mace_accel.bench.md import run_md

    atoms = build_system(_info((28, 29), 4.0), 32).atoms
    if not torch.cuda.is_available():
        refused = run_md("mace-accel", tiny_model, atoms, "cpu", "tiny", steps=1, warmup_steps=0)
        assert refused.status.startswith("unavailable: "), refused.status
    record = run_md("mace-accel", tiny_model, atoms, "cpu", "tiny", steps=2, warmup_steps=1,
                    allow_reference=True)
    assert record.backend == REFERENCE_NAME and record.status == "ok", record.status
    assert record.steps_per_s > 0
    # the step splits into the calculator and the rest, the calculator into its parts
    assert record.calc_ms + record.rest_ms == pytest.approx(record.ms_per_step)
    parts = record.checks_ms + record.neighbours_ms + record.model_ms
    assert 0 < parts <= record.calc_ms and record.model_ms > record.neighbours_ms


def test_nve_drift_of_accelerated_and_e3nn_models(tiny_model):
    """Both drift backends run the same trajectory (same seed): the accelerated model and
    the reverted (e3nn) one agree to round-off, so their drifts agree too."""
    from mace_accel.bench.md import nve_drift

    atoms = build_system(_info((28, 29), 4.0), 32).atoms
    records = [nve_drift(b, tiny_model, atoms, "cpu", "tiny", steps=20, sample_every=5)
               for b in ("mace-accel", "e3nn-graphs")]
    for r in records:
        assert r.status == "ok", r.status
        assert np.isfinite(r.drift_meV_per_atom_per_ns) and r.max_dev_meV_per_atom >= 0
    assert records[0].max_dev_meV_per_atom == pytest.approx(records[1].max_dev_meV_per_atom,
                                                            rel=1e-6, abs=1e-9)
    with pytest.raises(ConfigError, match="drift backend"):
        nve_drift("cueq", tiny_model, atoms, "cpu", "tiny")


# -- command line ------------------------------------------------------------------------------
def _parse(*argv):
    parser = argparse.ArgumentParser(prog="mace-accel")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_cli_parses_and_validates(capsys, tmp_path):
    args = _parse("--models", "mp-small,off-medium", "--sizes", "32,64", "--dtypes", "float64",
                  "--backends", "e3nn,mace-accel", "--device", "cpu", "--md")
    assert args.func is run_from_args
    config = config_from_args(args)
    assert config.sizes == [32, 64] and config.backends == ["e3nn", "mace-accel"] and config.md
    with pytest.raises(SystemExit):
        _parse("--backends", "e3nn,torchmd")
    assert "unknown torchmd" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="needs --device cuda"):
        config_from_args(_parse("--device", "cpu", "--max-size"))
    with pytest.raises(ConfigError, match="positive"):
        config_from_args(_parse("--device", "cpu", "--sizes", "0"))
    code = cli.main(["bench", "--device", "cpu", "--models", str(tmp_path / "nope.model"),
                     "--out", str(tmp_path / "o")])
    assert code == 2 and "neither a known architecture" in capsys.readouterr().err


def test_cpu_gets_cpu_sized_defaults_and_given_options_are_kept():
    config = config_from_args(_parse("--device", "cpu"))
    assert (list(config.dtypes), list(config.sizes), config.warmup, config.repeats) == (
        CPU_DEFAULTS["dtypes"], CPU_DEFAULTS["sizes"], CPU_DEFAULTS["warmup"],
        CPU_DEFAULTS["repeats"])
    assert max(config.sizes) < 200 and GPU_DEFAULTS["sizes"][-1] == 6912
    config = config_from_args(_parse("--device", "cpu", "--sizes", "500", "--repeats", "7"))
    assert list(config.sizes) == [500] and config.repeats == 7 and config.warmup == 1


def test_cpu_run_says_what_it_will_run(model_file, tmp_path, capsys, monkeypatch):
    seen = {}

    def fake_run_bench(config, sources, log, on_update, environment):
        seen["config"] = config
        raise KeyboardInterrupt  # stop before any measurement

    monkeypatch.setattr("mace_accel.bench.runner.run_bench", fake_run_bench)
    out = tmp_path / "bench_out"
    code = cli.main(["bench", "--device", "cpu", "--models", str(model_file), "--out", str(out)])
    stdout, err = capsys.readouterr()
    assert "note: benchmarking on the CPU" in err and "32, 108 atoms" in err
    assert "CPU-sized defaults" in err and "would take hours" in err
    assert "note" not in stdout  # notes go to stderr
    assert list(seen["config"].sizes) == [32, 108]
    # interrupted before any measurement: no claim that files were kept, and no empty folder
    assert code == 130
    assert err.strip().splitlines()[-1] == ("error: interrupted; nothing was written (no "
                                            "measurement had finished)")
    assert not out.exists()


def test_large_cpu_sizes_come_with_a_time_warning():
    args = _parse("--device", "cpu", "--sizes", "6912")
    note = bench_cli.cpu_plan_note(config_from_args(args), args)
    assert "6912 atoms" in note and "--time-limit" in note and "minutes" in note


def test_interrupted_bench_points_to_the_results_so_far(model_file, tmp_path, capsys,
                                                        monkeypatch):
    from mace_accel.bench.runner import BenchResult

    def one_record_then_ctrl_c(config, sources, log, on_update, environment):
        on_update(BenchResult(config.to_dict(), {}))  # writes bench.json
        raise KeyboardInterrupt

    monkeypatch.setattr("mace_accel.bench.runner.run_bench", one_record_then_ctrl_c)
    out = tmp_path / "bench_out"
    code = cli.main(["bench", "--device", "cpu", "--models", str(model_file), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 130
    assert err.strip().splitlines()[-1] == (f"error: interrupted; the results measured so far "
                                            f"are in {out / JSON_NAME}")
    assert (out / JSON_NAME).is_file()


def test_out_that_is_a_file_is_one_error_line(model_file, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    code = cli.main(["bench", "--device", "cpu", "--models", str(model_file),
                     "--out", str(a_file)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        f"error: --out folder {str(a_file)!r} is a file, not a folder; "
        "choose another folder with --out DIR"]


@pytest.mark.parametrize("value,message", [
    ("0", "error: --train-size must be a positive atom count, got 0"),
    ("-5", "error: --train-size must be a positive atom count, got -5"),
    ("many", "error: argument --train-size: invalid int value: 'many'; see mace-accel bench "
             "--help")])
def test_bad_train_size_is_one_error_line(model_file, tmp_path, capsys, value, message):
    try:
        code = cli.main(["bench", "--device", "cpu", "--models", str(model_file), "--train",
                         "--train-size", value, "--out", str(tmp_path / "o")])
    except SystemExit as exc:  # argparse's own errors exit (one line, through cli._Parser)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [message]
    assert not (tmp_path / "o").exists()


def test_train_options_reach_the_config():
    config = config_from_args(_parse("--device", "cpu", "--train", "--train-size", "500",
                                     "--train-steps", "4", "--train-warmup", "0"))
    assert (config.train, config.train_size, config.train_steps, config.train_warmup) == (
        True, 500, 4, 0)
    config = config_from_args(_parse("--device", "cpu"))
    assert (config.train, config.train_size, config.train_steps, config.train_warmup) == (
        False, 864, 10, 3)


# -- training step -----------------------------------------------------------------------------
def test_train_rows_from_the_command_line(tmp_path, tiny_model):
    """--train with e3nn and mace-accel (its reference backend on the CPU): both rows OK, the
    same first loss to 1e-9 in float64, in bench.json and bench_table.txt."""
    model_file = tmp_path / "tiny.model"
    torch.save(tiny_model, model_file)
    out = tmp_path / "out"
    code = cli.main(["bench", "--device", "cpu", "--models", str(model_file), "--dtypes",
                     "float64", "--sizes", "4", "--warmup", "0", "--repeats", "1",
                     "--backends", "e3nn,mace-accel", "--allow-reference", "--train",
                     "--train-size", "32", "--train-steps", "2", "--train-warmup", "1",
                     "--out", str(out)])
    assert code == 0
    doc = json.loads((out / JSON_NAME).read_text())
    e3nn, accel = doc["train"]
    assert (e3nn["backend"], accel["backend"]) == ("e3nn", REFERENCE_NAME)
    for r in (e3nn, accel):
        assert r["status"] == "ok", r["status"]
        assert (r["atoms"], r["edges"], r["steps"], r["warmup_steps"]) == (32, 576, 2, 1)
        assert r["clock"] == "perf_counter" and r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert r["first_loss"] > 0
    assert accel["first_loss"] == pytest.approx(e3nn["first_loss"], rel=1e-9, abs=0)
    assert accel["speedup_vs_e3nn"] == pytest.approx(e3nn["median_ms"] / accel["median_ms"])
    assert accel["speedup_vs_cueq"] is None and "within" in accel["detail"]
    assert doc["config"]["train"] and doc["config"]["train_size"] == 32
    table = (out / "bench_table.txt").read_text()
    assert "Training step" in table and f"{e3nn['first_loss']:.10g}" in table
    train_rows = table.split("Training step")[1].split("\n\n")[0]
    assert "e3nn" in train_rows and REFERENCE_NAME in train_rows


def _train(backend, median, loss=1.5, status="ok", dtype="float32"):
    from mace_accel.bench.training import TrainRecord

    return TrainRecord("m", dtype, backend, status, atoms=864, edges=67392, steps=10,
                       warmup_steps=3, clock="cuda-events", median_ms=median,
                       p10_ms=median and median * 0.9, p90_ms=median and median * 1.1,
                       peak_mem_mb=1234.0 if median else None, first_loss=loss)


def test_train_loss_mismatch_is_a_status_and_speedups_are_vs_cueq():
    from mace_accel.bench.training import check_loss, compute_train_speedups

    e3nn, cueq, accel = _train("e3nn", 40.0), _train("cueq", 10.0), _train("mace-accel", 5.0)
    far = _train("oeq", 8.0, loss=1.5 * (1 + 2e-4))
    close64 = _train("mace-accel", 5.0, loss=1.5 * (1 + 5e-10), dtype="float64")
    for r in (cueq, accel, far, close64):
        check_loss(r, e3nn.first_loss)
    assert cueq.status == accel.status == close64.status == "ok"
    assert far.status.startswith("loss differs from e3nn's: ") and "> 1e-04" in far.status
    nan = _train("cueq", 9.0, loss=float("nan"))
    check_loss(nan, 1.5)
    assert nan.status.startswith("loss differs")
    unchecked = _train("mace-accel", 5.0)
    check_loss(unchecked, None)
    assert unchecked.status == "ok" and "no e3nn loss" in unchecked.detail
    records = [e3nn, cueq, accel, far]
    compute_train_speedups(records)
    assert accel.speedup_vs_cueq == pytest.approx(2.0) and accel.speedup_vs_e3nn == 8.0
    assert cueq.speedup_vs_cueq == 1.0 and far.speedup_vs_cueq == pytest.approx(1.25)


def test_train_records_survive_the_json_round_trip(tmp_path):
    from mace_accel.bench.runner import BenchResult
    from mace_accel.bench.training import TrainRecord, compute_train_speedups

    records = [_train("e3nn", 40.0), _train("mace-accel", 5.0),
               _train("cueq", None, loss=None, status="out of memory")]
    compute_train_speedups(records)
    result = BenchResult({"train": True}, {"device": "cuda:0"}, train=records)
    write_outputs(result, tmp_path)
    loaded = load_json(tmp_path / JSON_NAME)
    assert all(isinstance(r, TrainRecord) for r in loaded.train)
    assert loaded.train == records
    table = (tmp_path / "bench_table.txt").read_text()
    assert "Training step" in table and "8.00x" in table and "out of memory" in table


# -- on the GPU --------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_on_gpu_side_by_side(tmp_path, tiny_source):
    config = BenchConfig(models=["tiny"], dtypes=["float32", "float64"], sizes=[32, 256],
                         device="cuda", warmup=2, repeats=5, profile=True, max_size=True,
                         max_size_cells=6, max_size_time_limit_s=60, md=True, md_sizes=[32],
                         md_steps=3, md_warmup=1, compute_stress=True)
    result = run_bench(config, [tiny_source], log=print)
    write_outputs(result, tmp_path)
    assert len(result.records) == 2 * 2 * 4  # nothing dropped
    for r in result.records:
        assert r.ok or r.status.startswith(("not installed", "unavailable")), (r.backend,
                                                                                r.status)
        if not r.ok:
            continue
        assert r.clock == "cuda-events" and r.peak_mem_mb > 0 and r.median_ms > 0
        assert r.p10_ms <= r.median_ms <= r.p90_ms
        parts = r.profile["parts"]
        assert r.profile["count_label"] == "kernels" and r.profile["total_count"] > 0
        assert sum(p["time_ms"] for p in parts.values()) == pytest.approx(r.profile["total_ms"],
                                                                           rel=1e-6)
        if r.backend == "e3nn":
            assert parts["conv TP"]["count"] > 0 and parts["radial MLP"]["count"] > 0
        elif r.backend == "mace-accel":
            assert r.within_tolerance, (r.dtype, r.force_rel_err, r.energy_rel_err)
        else:  # third-party backends: a sanity bound that catches a wrong conversion
            assert r.force_rel_err < (1e-3 if r.dtype == "float32" else 1e-8), r.backend
    accel = [r for r in result.records if r.backend == "mace-accel"]
    assert accel and all(r.ok for r in accel), [r.status for r in accel]
    assert all(r.speedup_vs_e3nn is not None for r in accel)
    for m in result.max_size:
        assert m.status == "ok" and m.stop_reason == UPPER_BOUND and m.max_atoms == 4 * 6**3
    for md in result.md:
        assert md.status == "ok" or md.status.startswith("not installed"), md.status


def test_throughput_batched_vs_one_by_one(tiny_model):
    from mace_accel.bench.throughput import make_frames, run_throughput

    frames = make_frames(tiny_model, 6)
    assert all(64 <= len(a) <= 256 for a in frames)
    records = run_throughput(tiny_model, "cpu", "tiny", n_frames=6, one_by_one_frames=3,
                             log=lambda line: None)
    batched, ours, cueq = records
    assert batched.status == "ok" and batched.frames == 6 and batched.model_calls < 6
    assert ours.status == "ok" and ours.model_calls == ours.frames == 3
    assert batched.frames_per_s > 0 and ours.atoms_per_s > 0
    if bench_backends.missing_requirement("cueq") is not None:
        assert cueq.status.startswith("not installed")


def test_throughput_over_gpus_reports_what_it_could_not_run_and_parses_results():
    from mace_accel.bench.multi_gpu import RESULT_PREFIX, launch, parse_result
    from mace_accel.bench.throughput import ThroughputRecord

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    record = launch("mp-small", available + 1, 10, "float32", "mp-small")
    assert record.status == f"not run: {available + 1} GPU(s) asked, {available} visible"
    assert record.frames_per_s is None
    fresh = ThroughputRecord("m", "float32", "batched, 2 GPU(s)", "ok", 100, 0)
    line = RESULT_PREFIX + json.dumps({"gpus": 2, "frames": 100, "atoms": 5000,
                                       "seconds": 2.0, "calls": 3})
    got = parse_result(f"noise\n{line}\n", "", 0, fresh)
    assert (got.frames_per_s, got.atoms_per_s, got.model_calls) == (50.0, 2500.0, 3)
    failed = parse_result("", "Traceback...\nRuntimeError: NCCL error", 1,
                          ThroughputRecord("m", "float32", "batched, 2 GPU(s)", "ok", 100, 0))
    assert failed.status == "failed (exit 1): RuntimeError: NCCL error"


def test_energy_error_is_against_the_exact_sum_of_the_reference_per_atom_energies():
    """The reference's total is the float64 sum of its per-atom energies (its own float32 total
    may have drifted from them), measured at their scale as the verification does; without
    per-atom energies, the reference's total and the total's relative error."""
    from mace_accel.bench.runner import BenchRunner as Runner

    node = torch.tensor([100.0, -99.0], dtype=torch.float64)
    ref = {"energy": torch.tensor([1.0 + 3e-3], dtype=torch.float64), "node_energy": node,
           "forces": torch.ones(2, 3, dtype=torch.float64)}
    out = {"energy": torch.tensor([1.0 + 1e-4], dtype=torch.float64),
           "forces": torch.ones(2, 3, dtype=torch.float64)}
    record = CaseRecord("m", "float32", 2, "mace-accel", "ok")
    Runner._fill_errors(record, out, ref, torch.float32)
    assert record.energy_rel_err == pytest.approx(1e-4 / 199.0)
    assert record.within_tolerance
    ref.pop("node_energy")
    Runner._fill_errors(record, out, ref, torch.float32)
    assert record.energy_rel_err == pytest.approx(2.9e-3 / 1.003) and not record.within_tolerance
