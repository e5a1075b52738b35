"""The benchmark loop: every (model, dtype, size, backend) side by side on the same batch.

For each model and dtype the structures are built once; the e3nn model runs first and its
energy/forces/stress at each size are the reference for every other backend's errors. One
backend's model is resident at a time (plus the source it is derived from): it is prepared,
timed at every size, optionally searched for its largest system, and freed before the next.
Every outcome (not installed, unavailable, failed, out of memory, skipped at the time limit)
becomes a record; nothing is dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from mace_accel.bench import choices
from mace_accel.bench.backends import (
    BACKENDS,
    OK,
    OUT_OF_MEMORY,
    ModelSource,
    PreparedBackend,
    expected_name,
    failure_status,
    join_details,
    prepare_backend,
)
from mace_accel.bench.maxsize import MaxSizeResult, find_max_size
from mace_accel.bench.md import DRIFT_BACKENDS, DriftRecord, MDRecord, nve_drift, run_md
from mace_accel.bench.systems import (
    SYSTEM_KINDS,
    BenchSystem,
    build_system,
    cells_for_atoms,
    make_batch,
)
from mace_accel.bench.throughput import ThroughputRecord, progress_line, run_throughput
from mace_accel.bench.timing import Deadline, as_device, free_memory, time_calls, track_peak_memory
from mace_accel.bench.training import (
    TrainRecord,
    check_loss,
    compute_train_speedups,
    make_targets,
    reference_loss,
    run_training_step,
)
from mace_accel.errors import ConfigError
from mace_accel.models.batch import ModelInfo, model_info
from mace_accel.models.outputs import evaluate as evaluate_accelerated
from mace_accel.surgery import evaluate
from mace_accel.tolerances import energy_error, model_tolerance, rel_linf_error, rel_norm_error

DTYPES = {name: getattr(torch, name) for name in choices.DTYPES}  # name -> torch.dtype
SKIPPED_TIME = "skipped: time limit reached"


@dataclasses.dataclass
class BenchConfig:
    """What to benchmark (the CLI's options; see ``mace-accel bench --help``)."""

    models: Sequence[str] = (choices.DEFAULT_MODEL,)
    dtypes: Sequence[str] = ("float32", "float64")
    sizes: Sequence[int] = (256, 2048, 6912)
    backends: Sequence[str] = BACKENDS
    device: str = "cuda"
    warmup: int = 5
    repeats: int = 20
    compute_stress: bool = False
    allow_reference: bool = False
    system: str = "auto"
    seed: int = 0
    time_limit_s: Optional[float] = None
    max_size: bool = False
    max_size_cells: int = 48
    max_size_time_limit_s: float = 120.0
    md: bool = False
    md_sizes: Sequence[int] = (256,)
    md_steps: int = 20
    md_warmup: int = 5
    md_compile: bool = False
    md_drift_steps: int = 0
    throughput_frames: int = 0
    throughput_gpus: Sequence[int] = ()
    profile: bool = False
    train: bool = False
    train_size: int = 864
    train_steps: int = 10
    train_warmup: int = 3

    def __post_init__(self) -> None:
        def listed(what: str, values: Sequence, allowed: Sequence) -> None:
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                raise ConfigError(f"{what}: {', '.join(map(str, bad)) or 'nothing given'} "
                                  f"is not valid; choose from {', '.join(allowed)}")

        listed("--dtypes", self.dtypes, tuple(DTYPES))
        listed("--backends", self.backends, BACKENDS)
        listed("--system", [self.system], SYSTEM_KINDS)
        for what, values in (("--sizes", self.sizes), ("--md-sizes", self.md_sizes)):
            if not values or any(int(v) < 1 for v in values):
                raise ConfigError(f"{what} must be positive atom counts, got {list(values)}")
        if int(self.train_size) < 1:
            raise ConfigError(f"--train-size must be a positive atom count, got "
                              f"{self.train_size}")
        if not self.models:
            raise ConfigError("--models: give at least one architecture name or model file")
        for what, value, low in (("--warmup", self.warmup, 0), ("--repeats", self.repeats, 1),
                                 ("--md-steps", self.md_steps, 1),
                                 ("--md-warmup", self.md_warmup, 0),
                                 ("--md-drift-steps", self.md_drift_steps, 0),
                                 ("--train-steps", self.train_steps, 1),
                                 ("--train-warmup", self.train_warmup, 0),
                                 ("--throughput", self.throughput_frames, 0),
                                 ("--max-size-cells", self.max_size_cells, 1)):
            if int(value) < low:
                raise ConfigError(f"{what} must be >= {low}, got {value}")
        for what, value in (("--time-limit", self.time_limit_s),
                            ("--max-size-time-limit", self.max_size_time_limit_s)):
            if value is not None and value <= 0:
                raise ConfigError(f"{what} must be a positive number of seconds, got {value}")
        try:
            device = torch.device(self.device)
        except RuntimeError as exc:
            raise ConfigError(f"--device {self.device!r} is not a device ({exc}); use cpu, "
                              "cuda or cuda:N") from None
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA GPU is visible to torch; use --device cpu "
                              "(timings then use time.perf_counter)")
        if device.type == "cuda" and device.index is not None \
                and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {self.device}: only {torch.cuda.device_count()} CUDA "
                              "device(s) visible")
        if self.max_size and device.type != "cuda":
            raise ConfigError("--max-size searches for the largest system that fits in GPU "
                              "memory; it needs --device cuda")

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v)
                for k, v in dataclasses.asdict(self).items()}


@dataclasses.dataclass
class CaseRecord:
    """One (model, dtype, size, backend) measurement. Field meanings: :mod:`.report`."""

    model: str
    dtype: str
    size: int
    backend: str
    status: str
    atoms: Optional[int] = None
    edges: Optional[int] = None
    system: str = ""
    device: str = ""
    clock: str = ""
    warmup: int = 0
    repeats: int = 0
    median_ms: Optional[float] = None
    p10_ms: Optional[float] = None
    p90_ms: Optional[float] = None
    peak_mem_mb: Optional[float] = None
    force_rel_err: Optional[float] = None
    force_max_err: Optional[float] = None
    energy_rel_err: Optional[float] = None
    stress_rel_err: Optional[float] = None
    within_tolerance: Optional[bool] = None
    edges_per_s: Optional[float] = None
    speedup_vs_e3nn: Optional[float] = None
    speedup_vs_best_other: Optional[float] = None
    best_other: Optional[str] = None
    detail: str = ""
    profile: Optional[dict] = None

    @property
    def ok(self) -> bool:
        return self.status == OK


@dataclasses.dataclass
class MaxSizeRecord:
    """Largest system that fitted for one (model, dtype, backend). Fields: :mod:`.report`."""

    model: str
    dtype: str
    backend: str
    status: str
    max_cells: Optional[int] = None
    max_atoms: Optional[int] = None
    max_edges: Optional[int] = None
    first_oom_cells: Optional[int] = None
    stop_reason: str = ""
    trials: List[dict] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class BenchResult:
    """Everything one ``mace-accel bench`` run produced."""

    config: dict
    environment: dict
    records: List[CaseRecord] = dataclasses.field(default_factory=list)
    max_size: List[MaxSizeRecord] = dataclasses.field(default_factory=list)
    md: List[MDRecord] = dataclasses.field(default_factory=list)
    drift: List[DriftRecord] = dataclasses.field(default_factory=list)
    throughput: List[ThroughputRecord] = dataclasses.field(default_factory=list)
    train: List[TrainRecord] = dataclasses.field(default_factory=list)


def compute_speedups(records: Sequence[CaseRecord]) -> None:
    """Fill ``speedup_vs_e3nn``, ``speedup_vs_best_other`` and ``best_other`` in place.

    Within each (model, dtype, size) group: vs e3nn = e3nn median / this median; vs best other =
    the fastest successful backend other than this one and other than mace-accel's own
    variants, over this median.
    """
    groups: Dict[tuple, List[CaseRecord]] = {}
    for r in records:
        groups.setdefault((r.model, r.dtype, r.size), []).append(r)
    for group in groups.values():
        timed = [r for r in group if r.ok and r.median_ms]
        e3nn = next((r for r in timed if r.backend == "e3nn"), None)
        for r in timed:
            r.speedup_vs_e3nn = e3nn.median_ms / r.median_ms if e3nn else None
            others = [o for o in timed if o is not r and not o.backend.startswith("mace-accel")]
            best = min(others, key=lambda o: o.median_ms, default=None)
            r.speedup_vs_best_other = best.median_ms / r.median_ms if best else None
            r.best_other = best.backend if best else None


@dataclasses.dataclass
class _Case:
    size: int
    system: BenchSystem
    batch: Optional[Dict[str, torch.Tensor]] = None
    edges: Optional[int] = None
    error: str = ""
    reference: Optional[Dict[str, torch.Tensor]] = None
    host: Optional[Dict[str, float]] = None


OUTPUT_KEYS = {False: ("energy", "forces"), True: ("energy", "forces", "stress")}
NODE_ENERGY = "node_energy"  # kept too where a backend returns it: the energy error's scale


def backend_call(backend: str, model: torch.nn.Module, batch: Dict[str, torch.Tensor],
                 compute_stress: bool) -> Dict[str, Any]:
    """One timed call: mace-accel as its calculator, graphs and runs call a model
    (:func:`mace_accel.models.outputs.evaluate`: the lean energy head, the stress from the
    edges), every other backend as mace's calculator does (the model's own forward)."""
    if backend == "mace-accel":
        return evaluate_accelerated(model, dict(batch), compute_stress)
    return model(dict(batch), training=False, compute_force=True, compute_stress=compute_stress)


def _energy_error(out: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> float:
    """The total energy's error against the reference's. Where the reference returned its
    per-atom energies (one structure), its total is their float64 sum and the error is measured
    at their scale (:func:`~mace_accel.tolerances.energy_error`, as the verification does):
    mace's float32 total is summed in float32 (``scatter_sum``) and drifts from its own per-atom
    energies as atoms are added (CPU, 864 atoms: 1.25e-6 of the total, where the float64 sum of
    the same float32 per-atom energies is 1.4e-8 off the float64 model's); else the total's
    relative error."""
    node = ref.get(NODE_ENERGY)
    if node is None or ref["energy"].numel() != 1:
        return rel_norm_error(out["energy"], ref["energy"])
    want = node.double().sum().reshape(ref["energy"].shape)
    return energy_error(out["energy"], want, node)


def _cpu64(out: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", torch.float64) for k, v in out.items()}


class BenchRunner:
    """Runs a :class:`BenchConfig` over model sources; see :func:`run_bench`.

    Args:
        config: what to run.
        log: where progress lines and tables go (``print``).
        on_update: called with the result after every new record (incremental JSON).
    """

    def __init__(self, config: BenchConfig, log: Callable[[str], None] = print,
                 on_update: Optional[Callable[[BenchResult], None]] = None,
                 environment: Optional[dict] = None):
        self.config = config
        self.device = as_device(config.device)
        self.log = log
        self.on_update = on_update or (lambda result: None)
        self.deadline = Deadline(config.time_limit_s)
        self.result = BenchResult(config.to_dict(), environment or {})

    # -- bookkeeping -------------------------------------------------------------------------
    def _add(self, record) -> None:
        """Keep a record (speedups kept current, so a run killed midway saves them too)."""
        if isinstance(record, CaseRecord):
            self.result.records.append(record)
            compute_speedups(self.result.records)
        elif isinstance(record, MaxSizeRecord):
            self.result.max_size.append(record)
        elif isinstance(record, DriftRecord):
            self.result.drift.append(record)
        elif isinstance(record, ThroughputRecord):
            self.result.throughput.append(record)
        elif isinstance(record, TrainRecord):
            self.result.train.append(record)
            compute_train_speedups(self.result.train)
        else:  # MDRecord
            self.result.md.append(record)
        self.on_update(self.result)

    def _case_record(self, label: str, dtype: str, case: _Case, backend: str,
                     status: str, detail: str = "") -> CaseRecord:
        return CaseRecord(model=label, dtype=dtype, size=case.size, backend=backend,
                          status=status, atoms=case.system.n_atoms, edges=case.edges,
                          system=case.system.description, device=self._device_text(),
                          warmup=self.config.warmup, repeats=self.config.repeats, detail=detail)

    def _device_text(self) -> str:
        if self.device.type == "cuda":
            return f"{self.device} ({torch.cuda.get_device_name(self.device)})"
        return "cpu"

    # -- the loop ----------------------------------------------------------------------------
    def run(self, sources: Sequence[ModelSource]) -> BenchResult:
        for source in sources:
            systems: Dict[int, BenchSystem] = {}
            for dtype_name in self.config.dtypes:
                self._run_model_dtype(source, dtype_name, systems)
        return self.result

    def _run_model_dtype(self, source: ModelSource, dtype_name: str,
                         systems: Dict[int, BenchSystem]) -> None:
        cfg, dtype = self.config, DTYPES[dtype_name]
        self.log(f"== {source.label} {dtype_name} on {self._device_text()}")
        try:
            model = source.load(dtype, self.device)
            info = model_info(model)
        except Exception as exc:
            status = failure_status(exc)
            self.log(f"   could not load the model: {status}")
            for size in cfg.sizes:
                for backend in cfg.backends:
                    self._add(CaseRecord(source.label, dtype_name, size, backend,
                                         f"{status} (loading the model)"))
            return
        cases = [self._make_case(info, size, dtype, systems) for size in cfg.sizes]
        order = ["e3nn"] + [b for b in cfg.backends if b != "e3nn"]
        for backend in order:
            self._run_backend(backend, model, info, source.label, dtype_name, cases)
        if cfg.train:
            self._run_training(model, info, source.label, dtype_name, systems)
        if cfg.md:
            self._run_md(model, info, source.label, dtype_name, systems)
        if cfg.throughput_frames and not self.deadline.expired():
            self._run_throughput(model, source, dtype_name)
        del model, cases
        free_memory(self.device)

    def _make_case(self, info: ModelInfo, size: int, dtype: torch.dtype,
                   systems: Dict[int, BenchSystem]) -> _Case:
        if size not in systems:
            systems[size] = build_system(info, size, kind=self.config.system,
                                         seed=self.config.seed)
        case = _Case(size, systems[size])
        try:
            case.batch, case.edges = make_batch(case.system, info, dtype, self.device)
        except Exception as exc:
            case.error = failure_status(exc) + " (building the batch)"
        return case

    def _run_backend(self, backend: str, model: torch.nn.Module, info: ModelInfo, label: str,
                     dtype_name: str, cases: List[_Case]) -> None:
        cfg = self.config
        timed = backend in cfg.backends
        name = expected_name(backend, cfg.allow_reference, self.device)
        if self.deadline.expired():
            for case in cases if timed else []:
                self._add(self._case_record(label, dtype_name, case, name, SKIPPED_TIME))
            return
        if timed:
            prepared = prepare_backend(backend, model, self.device, cfg.allow_reference)
        else:  # e3nn not requested: the source model still gives the reference outputs
            prepared = PreparedBackend("e3nn", OK, model)
        if prepared.detail:
            self.log(f"   {prepared.name}: {prepared.detail}")
        for case in cases:
            if not timed:
                self._reference_only(prepared.model, case)
                continue
            record = self._measure(prepared, case, label, dtype_name)
            self.log(f"   {record.backend:<22} {case.system.n_atoms:>7} atoms: "
                     + (f"{record.median_ms:.2f} ms" if record.ok else record.status))
            self._add(record)
        if timed and cfg.max_size and prepared.ok:
            self._add(self._max_size(prepared, info, label, dtype_name))
        prepared.model = None  # drop this backend's copy before the next one is built
        free_memory(self.device)

    def _reference_only(self, model: torch.nn.Module, case: _Case) -> None:
        if case.batch is None:
            return
        try:
            # the per-atom energies too: the energy errors are measured against their float64
            # sum (the reference's own float32 total drifts from it: 1.85e-5 at 6,912 atoms)
            case.reference = _cpu64(evaluate(model, case.batch, self.config.compute_stress,
                                             node_energy=True))
        except Exception as exc:  # the others are then reported without errors
            self.log(f"   e3nn reference at {case.system.n_atoms} atoms: {failure_status(exc)}")
            free_memory(self.device)

    def _measure(self, prepared: PreparedBackend, case: _Case, label: str,
                 dtype_name: str) -> CaseRecord:
        cfg = self.config
        record = self._case_record(label, dtype_name, case, prepared.name, prepared.status,
                                   prepared.detail)
        if not prepared.ok:
            return record
        if case.batch is None:
            record.status = case.error
            return record
        if self.deadline.expired():
            record.status = SKIPPED_TIME
            return record
        model, batch, stress = prepared.model, case.batch, cfg.compute_stress
        try:
            with track_peak_memory(self.device) as memory:
                out = backend_call(prepared.name, model, batch, stress)
                outputs = _cpu64({k: out[k] for k in (*OUTPUT_KEYS[stress], NODE_ENERGY)
                                  if k in out})
                timing = time_calls(lambda: backend_call(prepared.name, model, batch, stress),
                                    self.device, warmup=cfg.warmup, repeats=cfg.repeats)
        except Exception as exc:
            record.status = failure_status(exc)
            free_memory(self.device)
            return record
        if cfg.profile:
            try:
                record.profile = self._profile(prepared.name, model, case)
            except Exception as exc:  # the timing stands; say why there is no breakdown
                record.profile = {"error": failure_status(exc)}
                self.log(f"   profile failed: {record.profile['error']}")
        record.clock = timing.clock
        record.median_ms, record.p10_ms, record.p90_ms = (timing.median_ms, timing.p10_ms,
                                                          timing.p90_ms)
        record.peak_mem_mb = memory.peak_mb
        record.edges_per_s = case.edges / (timing.median_ms * 1e-3) if timing.median_ms else None
        if prepared.name == "e3nn":
            case.reference = outputs
            record.detail = join_details(record.detail, "reference for the errors")
        elif case.reference is not None:
            self._fill_errors(record, outputs, case.reference, DTYPES[dtype_name])
        else:
            record.detail = join_details(record.detail, "no e3nn reference at this size")
        return record

    @staticmethod
    def _fill_errors(record: CaseRecord, out: Dict[str, torch.Tensor],
                     ref: Dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        record.energy_rel_err = _energy_error(out, ref)
        record.force_rel_err = rel_norm_error(out["forces"], ref["forces"])
        record.force_max_err = rel_linf_error(out["forces"], ref["forces"])
        if "stress" in out and "stress" in ref:
            record.stress_rel_err = rel_norm_error(out["stress"], ref["stress"])
        errors = [e for e in (record.energy_rel_err, record.force_rel_err,
                              record.stress_rel_err) if e is not None]
        record.within_tolerance = all(e <= model_tolerance(dtype) for e in errors)

    def _profile(self, backend: str, model: torch.nn.Module, case: _Case) -> dict:
        from mace_accel.bench.profile import profile_call, render_profile, time_host_graph

        info = model_info(model)
        if case.host is None:
            case.host = time_host_graph(case.system.atoms, info, info.dtype, self.device)
        stress = self.config.compute_stress
        result = profile_call(model, case.batch, self.device, stress,
                              call=lambda: backend_call(backend, model, case.batch, stress))
        result.host = dict(case.host)
        self.log(render_profile(result, f"   profile of one call ({case.system.n_atoms} atoms, "
                                        f"{case.edges} edges):"))
        return result.to_dict()

    def _max_size(self, prepared: PreparedBackend, info: ModelInfo, label: str,
                  dtype_name: str) -> MaxSizeRecord:
        cfg, dtype = self.config, DTYPES[dtype_name]

        def try_size(n: int) -> dict:
            system = build_system(info, 4 * n**3, kind=cfg.system, seed=cfg.seed)
            batch = None
            try:
                with track_peak_memory(self.device) as memory:
                    batch, edges = make_batch(system, info, dtype, self.device)
                    backend_call(prepared.name, prepared.model, batch, cfg.compute_stress)
            finally:
                del batch
                free_memory(self.device)
            return {"atoms": system.n_atoms, "edges": edges, "peak_mem_mb": memory.peak_mb}

        start = min(cells_for_atoms(max(cfg.sizes)), cfg.max_size_cells)
        self.log(f"   {prepared.name}: searching the largest system (n <= {cfg.max_size_cells}, "
                 f"{cfg.max_size_time_limit_s:.0f} s)")
        record = MaxSizeRecord(label, dtype_name, prepared.name, OK)
        try:
            found: MaxSizeResult = find_max_size(try_size, start, cfg.max_size_cells,
                                                 Deadline(cfg.max_size_time_limit_s))
        except Exception as exc:
            record.status = failure_status(exc)
            return record
        record.trials = [{"cells": t.n, "fits": t.fits,
                          **(t.info if isinstance(t.info, dict) else {"error": t.info})}
                         for t in found.trials]
        record.stop_reason = found.stop_reason
        record.first_oom_cells = found.smallest_oom
        record.max_cells = found.largest_fit
        best = next((t for t in record.trials if t["cells"] == found.largest_fit and t["fits"]),
                    None)
        if best is not None:
            record.max_atoms, record.max_edges = best["atoms"], best["edges"]
        else:
            record.status = OUT_OF_MEMORY
        self.log(f"   {prepared.name}: largest fit {record.max_atoms} atoms ({found.stop_reason})")
        return record

    def _run_training(self, model: torch.nn.Module, info: ModelInfo, label: str,
                      dtype_name: str, systems: Dict[int, BenchSystem]) -> None:
        """One training-step record per backend of ``--backends`` on one batch of
        ``--train-size`` atoms (:mod:`.training`); e3nn first, its first loss the reference."""
        cfg, dtype = self.config, DTYPES[dtype_name]
        batch = targets = edges = None
        error = ""
        try:
            if cfg.train_size not in systems:  # shared with the MD rows of the same size
                systems[cfg.train_size] = build_system(info, cfg.train_size, kind=cfg.system,
                                                       seed=cfg.seed)
            system = systems[cfg.train_size]
            batch, edges = make_batch(system, info, dtype, self.device)
            targets = make_targets(system.n_atoms, dtype, self.device, cfg.seed)
        except Exception as exc:  # every backend's record says so
            error = failure_status(exc) + " (building the training batch)"
        atoms = int(batch["positions"].shape[0]) if batch is not None else None
        self.log(f"   training step: {atoms or cfg.train_size} atoms, {cfg.train_warmup} "
                 f"warm-up + {cfg.train_steps} timed steps per backend")
        reference: Optional[float] = None  # e3nn's first loss
        for backend in ["e3nn"] + [b for b in cfg.backends if b != "e3nn"]:
            if backend not in cfg.backends:
                # e3nn not requested: the source model still gives the loss to compare with
                if batch is not None and not self.deadline.expired():
                    try:
                        reference = reference_loss(model, batch, targets)
                    except Exception as exc:  # the others are then reported uncompared
                        self.log(f"   e3nn reference loss: {failure_status(exc)}")
                    free_memory(self.device)
                continue
            name = expected_name(backend, cfg.allow_reference, self.device)
            if self.deadline.expired() or batch is None:
                records = [TrainRecord(label, dtype_name, name, error or SKIPPED_TIME, atoms,
                                       edges, cfg.train_steps, cfg.train_warmup)]
            else:
                records = self._train_backend(backend, model, batch, targets, label,
                                              dtype_name, edges, reference)
                if records[0].backend == "e3nn":
                    reference = records[0].first_loss
            for record in records:
                self.log(f"   train {record.backend:<22} {record.atoms or '-':>7} atoms: "
                         + (f"{record.median_ms:.2f} ms/step, first loss "
                            f"{record.first_loss:.10g}" if record.median_ms is not None else "")
                         + ("" if record.status == OK else
                            ("; " if record.median_ms is not None else "") + record.status))
                self._add(record)

    def _train_backend(self, backend: str, model: torch.nn.Module, batch, targets,
                       label: str, dtype_name: str, edges: Optional[int],
                       reference: Optional[float]) -> list:
        """The training records of ``backend``: eager, and on a CUDA device also its step
        captured as CUDA graphs (e3nn's eager first loss is the reference of the others)."""
        cfg = self.config
        records = []
        for graphs in (False, True) if self.device.type == "cuda" else (False,):
            prepared = prepare_backend(backend, model, self.device, cfg.allow_reference)
            record = run_training_step(prepared, batch, targets, self.device, label,
                                       dtype_name, steps=cfg.train_steps,
                                       warmup_steps=cfg.train_warmup, edges=edges,
                                       graphs=graphs)
            del prepared  # its inference model, before the next one is built
            free_memory(self.device)
            if record.backend == "e3nn":
                reference = record.first_loss
                if record.first_loss is not None:
                    record.detail = join_details(record.detail, "reference for the losses")
            check_loss(record, reference)
            records.append(record)
        return records

    def _run_md(self, model: torch.nn.Module, info: ModelInfo, label: str, dtype_name: str,
                systems: Dict[int, BenchSystem]) -> None:
        cfg = self.config
        backends = list(cfg.backends)
        if cfg.md_compile and "cueq" in backends:
            backends.append("cueq-compile")
        for size in cfg.md_sizes:
            if size not in systems:
                systems[size] = build_system(info, size, kind=cfg.system, seed=cfg.seed)
            for backend in backends:
                if self.deadline.expired():
                    record = MDRecord(label, dtype_name,
                                      expected_name(backend, cfg.allow_reference, self.device),
                                      SKIPPED_TIME, systems[size].n_atoms, cfg.md_steps,
                                      cfg.md_warmup, 1.0)
                else:
                    record = run_md(backend, model, systems[size].atoms, self.device, label,
                                    steps=cfg.md_steps, warmup_steps=cfg.md_warmup,
                                    allow_reference=cfg.allow_reference, seed=cfg.seed)
                self.log(f"   MD {record.backend:<22} {record.atoms:>7} atoms: "
                         + (f"{record.steps_per_s:.2f} steps/s" if record.status == OK
                            else record.status))
                self._add(record)
        if not cfg.md_drift_steps:
            return
        system = systems[cfg.md_sizes[0]]
        for backend in DRIFT_BACKENDS:
            if self.deadline.expired():
                break
            self.log(f"   NVE {backend} {system.n_atoms} atoms, {cfg.md_drift_steps} steps ...")
            record = nve_drift(backend, model, system.atoms, self.device, label,
                               steps=cfg.md_drift_steps, seed=cfg.seed)
            self.log(f"   NVE {backend:<22} drift "
                     + (f"{record.drift_meV_per_atom_per_ns:.3g} meV/atom/ns"
                        if record.status == OK else record.status))
            self._add(record)

    def _run_throughput(self, model: torch.nn.Module, source: ModelSource,
                        dtype_name: str) -> None:
        label = source.label
        n = self.config.throughput_frames
        self.log(f"   throughput: {n} frames of 64-256 atoms, batched vs one call per frame "
                 f"(first {min(n, 200)})")
        for record in run_throughput(model, self.device, label, n_frames=n,
                                     one_by_one_frames=min(n, 200), seed=self.config.seed,
                                     log=self.log):
            self._add(record)
        if not self.config.throughput_gpus:
            return
        if not source.spec:
            self.log(f"   throughput over GPUs: {label} cannot be reloaded in other "
                     "processes; skipped")
            return
        from mace_accel.bench.multi_gpu import launch

        for n_gpus in self.config.throughput_gpus:
            record = launch(source.spec, n_gpus, n, dtype_name, label)
            self.log(progress_line(record))
            self._add(record)


def run_bench(config: BenchConfig, sources: Sequence[ModelSource],
              log: Callable[[str], None] = print,
              on_update: Optional[Callable[[BenchResult], None]] = None,
              environment: Optional[dict] = None) -> BenchResult:
    """Run the benchmark of ``config`` over ``sources`` and return all records."""
    return BenchRunner(config, log, on_update, environment).run(sources)
