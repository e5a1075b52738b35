"""Benchmark output: terminal tables, a versioned JSON file, and PNG plots.

JSON schema ``mace-accel-bench``, version 1 (``bench.json``)::

    {
      "schema": "mace-accel-bench", "schema_version": 1,
      "environment": {"timestamp", "python", "platform", "device", "gpu_name", "cuda",
                      "versions": {"torch", "mace-torch", "e3nn", "ase", "numpy",
                                   "mace-accel", "cuequivariance", "cuequivariance-torch",
                                   "cuequivariance-ops-torch-cu12", "cuequivariance-ops-torch-cu13",
                                   "openequivariance", "cupy-cuda12x", "cupy-cuda13x",
                                   "matplotlib"}},   # null = not installed
      "config": {the options of the run},
      "records": [ one per (model, dtype, size, backend):
        model           architecture name or model file name
        dtype           "float32" | "float64"
        size            requested atom count
        backend         "e3nn" | "cueq" | "oeq" | "mace-accel" | "mace-accel(reference)"
        status          "ok" | "not installed: <import error>" | "unavailable: <reason>" |
                        "failed: <error>" | "out of memory" | "skipped: time limit reached"
        atoms, edges    the structure actually run (edges = edge_index columns)
        system          one-line description of the structure
        device          "cuda:0 (<GPU name>)" or "cpu"
        clock           "cuda-events" | "perf_counter"
        warmup, repeats untimed calls after the first (checked) call; timed calls
        median_ms, p10_ms, p90_ms   per energy+forces(+stress) call
        peak_mem_mb     torch.cuda.max_memory_allocated over the calls (null on CPU); includes
                        resident weights and the batch
        force_rel_err   |F - F_e3nn| / |F_e3nn| (same dtype; null for e3nn itself)
        force_max_err   max|F - F_e3nn| / max|F_e3nn|
        energy_rel_err  |E - sum e_i| / max(|sum e_i|, sum |e_i|), e_i e3nn's per-atom energies
                        summed in float64 (else |E - E_e3nn| / |E_e3nn|)
        stress_rel_err  as above, when --stress
        within_tolerance all errors within the model-level tolerance (fp64 1e-10, fp32 1e-5)
        edges_per_s     edges / median time
        speedup_vs_e3nn         e3nn median / this median
        speedup_vs_best_other   fastest other backend (never mace-accel's own variants) / this
        best_other      the backend that speedup_vs_best_other compares with
        detail          extra facts (patch summary, fallback reason)
        profile         with --profile: {"clock", "count_label", "parts": {part: {"time_ms",
                        "count"}}, "total_ms", "total_count", "host": {"neighbour_list_ms",
                        "batch_build_ms"}, "gpu": {"sm_clock_mhz", "power_w",
                        "temperature_c"} (empty where not read)}
      ],
      "max_size": [ with --max-size, one per (model, dtype, backend): model, dtype, backend,
                    status, max_cells, max_atoms, max_edges, first_oom_cells, stop_reason,
                    trials: [{cells, fits, atoms, edges, peak_mem_mb} or {cells, fits, error}] ],
      "md": [ with --md: model, dtype, backend, status, atoms, steps, warmup_steps, timestep_fs,
              ms_per_step, steps_per_s, ns_per_day, calc_ms, rest_ms, checks_ms, neighbours_ms,
              model_ms, detail ],
      "throughput": [ with --throughput: model, dtype, mode, status, frames, atoms, seconds,
                      frames_per_s, atoms_per_s, model_calls, detail ],
      "drift": [ with --md-drift-steps: model, dtype, backend, status, atoms, steps,
                 timestep_fs, temperature_K, drift_meV_per_atom_per_ns, max_dev_meV_per_atom,
                 steps_per_s, detail ],
      "train": [ with --train, one per (model, dtype, backend): one optimizer step (forward,
                 forces, energy + forces loss, backward, Adam) on one batch (see .training):
        model, dtype, backend, status   as in "records"; status also "loss differs from
                        e3nn's: <loss> vs <e3nn's> (relative <d> > <tolerance>)" (timing kept)
        atoms, edges    the batch trained on (--train-size)
        steps, warmup_steps             timed and untimed steps
        clock, median_ms, p10_ms, p90_ms   per step
        peak_mem_mb     as in "records" (null on CPU)
        first_loss      the first step's loss, before any update (equal across backends)
        speedup_vs_e3nn, speedup_vs_cueq   that backend's median / this median
        detail ]
    }

Floats that are not finite are written as the strings "nan"/"inf" (valid JSON, and visible).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import platform
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from mace_accel.bench.md import DriftRecord, MDRecord
from mace_accel.bench.runner import BenchResult, CaseRecord, MaxSizeRecord
from mace_accel.bench.throughput import ThroughputRecord
from mace_accel.bench.training import TrainRecord
from mace_accel.errors import InputError

SCHEMA = "mace-accel-bench"
SCHEMA_VERSION = 1
RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(CaseRecord))
VERSIONED_PACKAGES = (
    "torch", "mace-torch", "e3nn", "ase", "numpy", "mace-accel", "cuequivariance",
    "cuequivariance-torch", "cuequivariance-ops-torch-cu12", "cuequivariance-ops-torch-cu13",
    "openequivariance", "cupy-cuda12x", "cupy-cuda13x", "matplotlib",
)
JSON_NAME, TABLE_NAME, PLOT_NAME = "bench.json", "bench_table.txt", "bench_times.png"
# the text columns of the tables, left-aligned; every other column holds numbers, right-aligned
TEXT_COLUMNS = ("model", "dtype", "backend", "mode", "stopped", "vs best other", "status")


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: torch.device | str) -> dict:
    """Versions and hardware of this run (package versions from metadata, no imports)."""
    device = torch.device(device)
    on_cuda = device.type == "cuda"
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(device),
        "gpu_name": torch.cuda.get_device_name(device) if on_cuda else None,
        "cuda": torch.version.cuda,
        "versions": {p: _version(p) for p in VERSIONED_PACKAGES},
    }


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def result_to_dict(result: BenchResult) -> dict:
    """The JSON document of the module docstring."""
    return _clean({
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "environment": result.environment,
        "config": result.config,
        "records": [dataclasses.asdict(r) for r in result.records],
        "max_size": [dataclasses.asdict(r) for r in result.max_size],
        "md": [dataclasses.asdict(r) for r in result.md],
        "drift": [dataclasses.asdict(r) for r in result.drift],
        "throughput": [dataclasses.asdict(r) for r in result.throughput],
        "train": [dataclasses.asdict(r) for r in result.train],
    })


def write_json(result: BenchResult, path: Path) -> Path:
    """Write atomically (a killed run leaves the previous complete file)."""
    from mace_accel.files import atomic_write_text

    return atomic_write_text(path, json.dumps(result_to_dict(result), indent=1,
                                              allow_nan=False))


def load_json(path: Path) -> BenchResult:
    """Read a ``bench.json`` back (for ``--summarize``); checks the schema and its version."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read benchmark results {path}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise InputError(f"{path} is not a mace-accel bench file (no \"schema\": \"{SCHEMA}\")")
    if doc.get("schema_version") != SCHEMA_VERSION:
        raise InputError(f"{path} has schema version {doc.get('schema_version')}; this "
                         f"mace-accel reads version {SCHEMA_VERSION}")
    return BenchResult(config=doc["config"], environment=doc["environment"],
                       records=[CaseRecord(**r) for r in doc["records"]],
                       max_size=[MaxSizeRecord(**r) for r in doc["max_size"]],
                       md=[MDRecord(**r) for r in doc["md"]],
                       drift=[DriftRecord(**r) for r in doc.get("drift", [])],
                       throughput=[ThroughputRecord(**r) for r in doc.get("throughput", [])],
                       train=[TrainRecord(**r) for r in doc.get("train", [])])


def _fmt(value: Optional[float], spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _short(text: str, width: int = 70) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _speedup(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _table(header: Sequence[str], rows: List[Sequence[str]]) -> str:
    """Columns padded to their widest cell: :data:`TEXT_COLUMNS` left-aligned, numbers right."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    right = [h not in TEXT_COLUMNS for h in header]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if r else c.ljust(w)
                         for c, w, r in zip(cells, widths, right)).rstrip()

    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def render_table(records: Sequence[CaseRecord]) -> str:
    """One line per record: time, spread, memory, force error, speedups (or the status)."""
    header = ("model", "dtype", "atoms", "edges", "backend", "median ms", "p10-p90 ms",
              "peak MB", "F rel err", "vs e3nn", "vs best other", "status")
    rows = []
    for r in records:
        case = (r.model, r.dtype, _fmt(r.atoms, "d"), _fmt(r.edges, ","), r.backend)
        if not r.ok:
            rows.append(case + ("",) * 6 + (_short(r.status),))
            continue
        err = "ref" if r.backend == "e3nn" else _fmt(r.force_rel_err, ".1e")
        if r.within_tolerance is False:
            err += " (!)"
        best = (f"{r.speedup_vs_best_other:.2f}x ({r.best_other})"
                if r.speedup_vs_best_other is not None else "-")
        rows.append(case + (f"{r.median_ms:.2f}", f"{r.p10_ms:.2f}-{r.p90_ms:.2f}",
                            _fmt(r.peak_mem_mb, ".0f"), err, _speedup(r.speedup_vs_e3nn), best,
                            "ok"))
    clocks = sorted({r.clock for r in records if r.clock})
    note = f"\n(timed with {', '.join(clocks)}; F rel err vs e3nn at the same dtype, " \
           "(!) = beyond the model-level tolerance)" if clocks else ""
    return _table(header, rows) + note


def render_max_size_table(records) -> str:
    header = ("model", "dtype", "backend", "largest fit atoms", "edges", "first OOM cells",
              "stopped", "status")
    rows = [(r.model, r.dtype, r.backend, _fmt(r.max_atoms, "d"), _fmt(r.max_edges, ","),
             _fmt(r.first_oom_cells, "d"), r.stop_reason, _short(r.status, 50)) for r in records]
    return _table(header, rows)


def render_training_table(records) -> str:
    """One line per record: ms per step, spread, memory, first loss, speedups, status (the
    timing is shown for a loss mismatch too: its status says what is wrong)."""
    header = ("model", "dtype", "atoms", "edges", "backend", "ms/step", "p10-p90 ms", "peak MB",
              "first loss", "vs e3nn", "vs cueq", "status")
    rows = []
    for r in records:
        timed = r.median_ms is not None
        rows.append((r.model, r.dtype, _fmt(r.atoms, "d"), _fmt(r.edges, ","), r.backend,
                     _fmt(r.median_ms, ".2f"),
                     f"{r.p10_ms:.2f}-{r.p90_ms:.2f}" if timed else "",
                     _fmt(r.peak_mem_mb, ".0f"), _fmt(r.first_loss, ".10g"),
                     _speedup(r.speedup_vs_e3nn), _speedup(r.speedup_vs_cueq), _short(r.status)))
    clocks = sorted({r.clock for r in records if r.clock})
    note = (f"\n(timed with {', '.join(clocks)}; one step = forward, forces, loss, backward, "
            "Adam; every first loss must agree with e3nn's)") if clocks else ""
    return _table(header, rows) + note


def render_md_table(records) -> str:
    header = ("model", "dtype", "atoms", "backend", "ms/step", "steps/s", "ns/day", "calc ms",
              "rest ms", "nlist ms", "model ms", "status")
    rows = [(r.model, r.dtype, str(r.atoms), r.backend, _fmt(r.ms_per_step, ".2f"),
             _fmt(r.steps_per_s, ".2f"), _fmt(r.ns_per_day, ".3f"),
             _fmt(r.calc_ms, ".2f"), _fmt(r.rest_ms, ".2f"), _fmt(r.neighbours_ms, ".2f"),
             _fmt(r.model_ms, ".2f"), _short(r.status, 50))
            for r in records]
    return _table(header, rows)


def render_throughput_table(records) -> str:
    header = ("model", "dtype", "mode", "frames", "atoms", "frames/s", "atoms/s", "calls",
              "status")
    rows = [(r.model, r.dtype, r.mode, str(r.frames), str(r.atoms), _fmt(r.frames_per_s, ".1f"),
             _fmt(r.atoms_per_s, ".0f"), _fmt(r.model_calls, "d"), _short(r.status, 50))
            for r in records]
    return _table(header, rows)


def render_drift_table(records) -> str:
    header = ("model", "dtype", "atoms", "backend", "steps", "drift meV/atom/ns",
              "max dev meV/atom", "steps/s", "status")
    rows = [(r.model, r.dtype, str(r.atoms), r.backend, str(r.steps),
             _fmt(r.drift_meV_per_atom_per_ns, ".3g"), _fmt(r.max_dev_meV_per_atom, ".3g"),
             _fmt(r.steps_per_s, ".1f"), _short(r.status, 50)) for r in records]
    return _table(header, rows)


def render_summary(result: BenchResult) -> str:
    """All tables of a run, the energy+forces table last (it is what a reader looks for)."""
    parts = []
    if result.md:
        parts += ["MD throughput (ASE calculators, velocity Verlet, 1 fs; ms per step split "
                  "into the calculator and the rest, and mace-accel's calculator into neighbour "
                  "list and model):", render_md_table(result.md), ""]
    if result.throughput:
        parts += ["Throughput of many small structures (64-256 atoms):",
                  render_throughput_table(result.throughput), ""]
    if result.drift:
        parts += ["NVE energy drift (velocity Verlet, 1 fs):", render_drift_table(result.drift),
                  ""]
    if result.train:
        parts += ["Training step (energy + forces loss, backward, Adam; same batch and targets "
                  "for every backend):", render_training_table(result.train), ""]
    if result.max_size:
        parts += ["Largest system that fits in GPU memory:",
                  render_max_size_table(result.max_size), ""]
    env = result.environment
    devices = sorted({r.device for r in result.records if r.device})
    where = env.get("gpu_name") or ", ".join(devices) or env.get("device") or "no device"
    parts += [f"Energy + forces per call ({where}):", render_table(result.records)]
    return "\n".join(parts)


def write_plots(records: Sequence[CaseRecord], path: Path) -> Tuple[Optional[Path], str]:
    """Median time vs atoms per backend, log-log, one panel per (model, dtype).

    Returns:
        (the PNG path or None, a message saying what was written or why not).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        return None, f"no plots: matplotlib is not importable ({exc}); pip install matplotlib"
    panels: Dict[Tuple[str, str], List[CaseRecord]] = {}
    for r in records:
        panels.setdefault((r.model, r.dtype), []).append(r)
    panels = {k: v for k, v in panels.items() if any(r.ok for r in v)}
    if not panels:
        return None, "no plots: no backend produced a timing"
    ncols = min(len(panels), 2)
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(6 * ncols, 4.5 * nrows))
    FigureCanvasAgg(fig)
    for i, ((model, dtype), recs) in enumerate(sorted(panels.items())):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        for backend in sorted({r.backend for r in recs}):
            pts = sorted((r.atoms, r.median_ms) for r in recs if r.backend == backend and r.ok)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=backend)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("atoms")
        ax.set_ylabel("energy + forces, median ms")
        ax.set_title(f"{model} {dtype}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path, f"plot: {path}"


def write_outputs(result: BenchResult, out_dir: Path) -> List[str]:
    """Write JSON, the text table and the plot under ``out_dir``; returns messages."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = write_json(result, out_dir / JSON_NAME)
    table_path = out_dir / TABLE_NAME
    table_path.write_text(render_summary(result) + "\n")
    _, plot_message = write_plots(result.records, out_dir / PLOT_NAME)
    return [f"json: {json_path}", f"table: {table_path}", plot_message]
