"""Frozen dataclasses for YAML-driven runs, and the loader that validates them.

A run file names a task and its structure; per-task options live in a section named after the
task (keys in the spirit of janus-core and mace's own scripts)::

    task: md                       # singlepoint | geomopt | md
    struct: structures/cu32.extxyz # relative to this file
    frame: -1                      # md/geomopt: which frame of a multi-frame file (else error)
    model: my.model                # default: the model bundled with mace-accel
    device: auto                   # auto | cpu | cuda | cuda:N
    dtype: float32                 # float32 | float64
    backend: auto                  # auto (cuda on a GPU, mace on a CPU) | cuda | reference | mace
    md:
      ensemble: nvt                # nve | nvt (Langevin) | npt (Melchionna)
      steps: 1000
      timestep: 1.0                # fs
      temperature: 300             # K

Every key is checked when the file is loaded: an unknown key is an error listing the valid keys
of its section, a wrong type or out-of-range value is an error naming the key (``md.timestep``).
Numbers may be written as YAML 1.1 reads them or not (``1e3`` is a string to PyYAML: it is read
as the number it is). The same checks run when the dataclasses are built in Python.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any, ClassVar, Dict, Literal, Mapping, Optional, Tuple

from mace_accel.errors import ConfigError
from mace_accel.options import DEVICE_CHOICES_HELP, check_device_name

TASKS = ("singlepoint", "geomopt", "md")
SINGLEPOINT_PROPERTIES = ("energy", "free_energy", "forces", "stress", "energies")
PATH_KEYS = ("struct", "model", "outputs")  # resolved against the run file's directory
SEED_MAX = 2**32 - 1  # numpy's seeds are non-negative; 32 bits is what every seed API takes
STEPS_MAX = 2**63 - 1  # step counters are int64 (ASE, numpy); 1e99 steps is a typo


def _opt(default: Any, doc: str, **checks: Any) -> Any:
    """A dataclass field with a default, a one-line doc and range checks (gt, ge, le)."""
    return dataclasses.field(default=default, metadata={"doc": doc, **checks})


def _required(doc: str) -> Any:
    """A dataclass field without a default (a key the run file must give)."""
    return dataclasses.field(metadata={"doc": doc, "required": True})


class _Section:
    """Shared validation of the config dataclasses (type coercion, ranges, key listing)."""

    SECTION: ClassVar[str] = ""

    @classmethod
    def keys(cls) -> Tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def _where(cls, name: str) -> str:
        return f"{cls.SECTION}.{name}" if cls.SECTION else name

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            where = self._where(f.name)
            value = _coerce(where, hints[f.name], getattr(self, f.name))
            for check, bound in f.metadata.items():
                if check in ("doc", "required") or value is None:  # None: an optional key unset
                    continue
                if check == "gt" and not value > bound:
                    raise ConfigError(f"{where} must be > {bound}, got {value}")
                if check == "ge" and not value >= bound:
                    raise ConfigError(f"{where} must be >= {bound}, got {value}")
                if check == "le" and not value <= bound:
                    raise ConfigError(f"{where} must be <= {_show(bound)}, got {_show(value)}")
            object.__setattr__(self, f.name, value)
        self._check()

    def _check(self) -> None:
        """Checks that involve more than one key (overridden per section)."""

    @classmethod
    def from_dict(cls, raw: Any, **fixed: Any):
        """Build from a YAML mapping; unknown keys are an error that lists the valid ones."""
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            where = cls.SECTION or "the run file"
            raise ConfigError(f"{where} must be a mapping of keys to values, got "
                              f"{type(raw).__name__} ({raw!r})")
        unknown = sorted(str(k) for k in raw if k not in cls.keys())
        if unknown:
            where = f"section {cls.SECTION!r}" if cls.SECTION else "the run file"
            raise ConfigError(f"unknown key(s) {', '.join(map(repr, unknown))} in {where}; "
                              f"valid keys: {', '.join(cls.keys())}")
        values = {**dict(raw), **fixed}
        missing = [f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                   if f.metadata.get("required") and f.name not in values]
        if missing:
            raise ConfigError("missing required key(s): " + "; ".join(
                f"{cls._where(n)!r} ({cls._doc(n)})" for n in missing))
        return cls(**values)

    @classmethod
    def _doc(cls, name: str) -> str:
        return next(f.metadata.get("doc", "") for f in dataclasses.fields(cls)  # type: ignore
                    if f.name == name)

    def to_dict(self) -> Dict[str, Any]:
        """Plain YAML-able values (paths as strings, tuples as lists)."""
        out: Dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if isinstance(v, _Section):
                v = v.to_dict()
            elif isinstance(v, Path):
                v = str(v)
            elif isinstance(v, tuple):
                v = list(v)
            out[f.name] = v
        return out


def _show(number: Any) -> str:
    """A number for a message: huge integers (a typed ``1e99``) in exponent form."""
    if isinstance(number, int) and abs(number) >= 10**15:
        return f"{float(number):.3g}"
    return str(number)


def _coerce(where: str, hint: Any, value: Any) -> Any:
    """Check ``value`` against the annotation ``hint``; return it in canonical form."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(where, inner, value)
    if origin is Literal:
        if isinstance(value, str):
            for choice in args:
                if value.lower() == str(choice).lower():
                    return choice
        raise ConfigError(f"{where} must be one of {', '.join(map(str, args))}; got {value!r}")
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {type(value).__name__} ({value!r})")
        return tuple(_coerce(f"{where}[{i}]", args[0], v) for i, v in enumerate(value))
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if hint is int:
        number = _number(value)
        if isinstance(number, float) and number.is_integer():
            number = int(number)  # 1e3, 1000.0
        if not isinstance(number, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return number
    if hint is float:
        number = _number(value)
        if number is None or not math.isfinite(number):
            raise ConfigError(f"{where} must be a finite number, got {value!r}")
        return float(number)
    if hint is str:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where} must be a non-empty string, got {value!r}")
        return value
    if hint is Path:
        if not isinstance(value, (str, Path)) or not str(value):
            raise ConfigError(f"{where} must be a file path, got {value!r}")
        return Path(value)
    if isinstance(hint, type) and issubclass(hint, _Section):
        if isinstance(value, hint):
            return value
        return hint.from_dict(value)
    raise TypeError(f"config field {where} has an unsupported annotation {hint!r}")


def _number(value: Any) -> Any:
    """``value`` as an int or float if it is one or a string spelling one (YAML 1.1 reads
    ``1e3`` and ``1_000.5`` as strings), else None; booleans are not numbers."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        text = value.strip()
        for parse in (int, float):
            try:
                return parse(text)
            except ValueError:
                continue
    return None


@dataclasses.dataclass(frozen=True)
class SinglePointOptions(_Section):
    """``singlepoint:`` section: evaluate every frame of ``struct``."""

    SECTION: ClassVar[str] = "singlepoint"
    properties: Tuple[str, ...] = _opt(("energy", "forces", "stress"),
                                       f"subset of {', '.join(SINGLEPOINT_PROPERTIES)}")
    max_edges: Optional[int] = _opt(None, "edges per batched model call (null: measured on a "
                                    "GPU to fill free memory; 100000 on the CPU)", gt=0)

    def _check(self) -> None:
        if not self.properties:
            raise ConfigError("singlepoint.properties must name at least one property")
        for p in self.properties:
            if p not in SINGLEPOINT_PROPERTIES:
                raise ConfigError(f"singlepoint.properties: unknown property {p!r}; valid: "
                                  f"{', '.join(SINGLEPOINT_PROPERTIES)}")
        if len(set(self.properties)) != len(self.properties):
            raise ConfigError(f"singlepoint.properties lists a property twice: {self.properties}")


@dataclasses.dataclass(frozen=True)
class GeomOptOptions(_Section):
    """``geomopt:`` section: relax positions (and optionally the cell) of one frame."""

    SECTION: ClassVar[str] = "geomopt"
    fmax: float = _opt(0.05, "force convergence threshold, eV/Å", gt=0)
    steps: int = _opt(1000, "maximum optimizer steps", ge=0, le=STEPS_MAX)
    optimizer: Literal["FIRE", "BFGS", "LBFGS"] = _opt("FIRE", "ASE optimizer")
    relax_cell: bool = _opt(False, "also relax the cell (FrechetCellFilter)")
    traj_every: int = _opt(1, "write a trajectory frame every N steps (0: none)", ge=0)


@dataclasses.dataclass(frozen=True)
class MDOptions(_Section):
    """``md:`` section: molecular dynamics of one frame."""

    SECTION: ClassVar[str] = "md"
    ensemble: Literal["nve", "nvt", "npt"] = _opt("nve", "nve | nvt (Langevin) | npt (Melchionna)")
    steps: int = _opt(1000, "number of MD steps", ge=0, le=STEPS_MAX)
    timestep: float = _opt(1.0, "fs", gt=0)
    temperature: float = _opt(300.0, "K: target (nvt/npt) and initial velocities", ge=0)
    friction: float = _opt(0.01, "Langevin friction, 1/fs", ge=0)
    pressure: float = _opt(1.01325, "npt external pressure, bar")
    taut: float = _opt(50.0, "npt thermostat time, fs", gt=0)
    taup: float = _opt(75.0, "npt barostat time, fs", gt=0)
    bulk_modulus: float = _opt(100.0, "npt: bulk modulus estimate, GPa (barostat mass)", gt=0)
    traj_every: int = _opt(10, "write a trajectory frame every N steps (0: none)", ge=0)
    stats_every: int = _opt(1, "write a stats row every N steps", gt=0)
    seed: int = _opt(0, f"seed of the initial velocities and the Langevin noise, 0..{SEED_MAX}",
                     ge=0, le=SEED_MAX)

    def _check(self) -> None:
        if self.ensemble == "nvt" and not self.friction > 0:
            raise ConfigError(f"md.friction must be > 0 for the nvt (Langevin) ensemble, got "
                              f"{self.friction}")
        if self.ensemble == "npt" and not self.temperature > 0:
            raise ConfigError(f"md.temperature must be > 0 for the npt ensemble, got "
                              f"{self.temperature}")


@dataclasses.dataclass(frozen=True)
class RunConfig(_Section):
    """A whole run: structure, model, calculator options, and the task's section.

    Only the section of ``task`` is used; giving another task's section is an error.
    Paths are resolved (relative ones against the run file's directory by :func:`load_run_config`).
    """

    task: Literal["singlepoint", "geomopt", "md"] = _required("singlepoint | geomopt | md")
    struct: Path = _required("structure file (ase.io.read); singlepoint evaluates every frame, "
                             "geomopt and md need a one-frame file or `frame`")
    frame: Optional[int] = _opt(None, "which frame of `struct` to use (0 = first, -1 = last; "
                                "default: all for singlepoint, the only one otherwise)")
    model: Optional[Path] = _opt(None, "MACE model file (default: the bundled model)")
    device: str = _opt("auto", f"{DEVICE_CHOICES_HELP} (auto: cuda if a GPU is visible)")
    dtype: Literal["float32", "float64"] = _opt("float32", "model dtype")
    head: Optional[str] = _opt(None, "head of a multi-head model (default: the only one, or "
                               "the one called 'default')")
    backend: Literal["auto", "cuda", "reference", "mace"] = _opt(
        "auto", "mace-accel backend (auto: cuda on a GPU, mace's own modules on a CPU)")
    fallback: Literal["warn", "error"] = _opt("warn", "if the CUDA backend cannot run")
    verify: bool = _opt(True, "check the accelerated model against the unpatched one")
    deterministic: bool = _opt(True, "cuda backend: no float atomics (bit-identical repeats); "
                               "false allows the faster atomic backward")
    min_distance: float = _opt(0.5, "smallest interatomic distance accepted, Å (0: no check)",
                               ge=0)
    graphs: Optional[bool] = _opt(None, "whole-call CUDA graphs (default: on for a GPU, off on "
                                  "the CPU)")
    skin: float = _opt(0.3, "Verlet skin of the neighbour list, Å (0: rebuild every step)", ge=0)
    outputs: Optional[Path] = _opt(None, "output directory (default: <run file stem>-results)")
    progress: bool = _opt(True, "progress bar on stderr (only when it is a terminal)")
    singlepoint: SinglePointOptions = dataclasses.field(default_factory=SinglePointOptions)
    geomopt: GeomOptOptions = dataclasses.field(default_factory=GeomOptOptions)
    md: MDOptions = dataclasses.field(default_factory=MDOptions)

    def _check(self) -> None:
        check_device_name(self.device)
        if self.outputs is None:
            object.__setattr__(self, "outputs", Path(f"{self.task}-results"))

    def to_dict(self) -> Dict[str, Any]:
        """The run as YAML-able values, with only the chosen task's section."""
        out = super().to_dict()
        for other in TASKS:
            if other != self.task:
                del out[other]
        return out

    @property
    def model_path(self) -> Path:
        """``model``, or the bundled default model."""
        if self.model is not None:
            return self.model
        from mace_accel.models.checkpoint import default_model_path

        return default_model_path()


def apply_overrides(raw: Dict[str, Any], overrides: Mapping[str, Any]) -> Dict[str, Any]:
    """A copy of ``raw`` with dotted keys set (``{"md.steps": 5, "device": "cpu"}``)."""
    out = _deep_copy(raw)
    for key, value in overrides.items():
        parts = str(key).split(".")
        if not all(parts):
            raise ConfigError(f"bad override key {key!r}; use KEY or SECTION.KEY")
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"cannot set {key!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(raw: Mapping[str, Any]) -> Dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in raw.items()}


def parse_override(text: str) -> Tuple[str, Any]:
    """``"md.steps=5"`` -> ``("md.steps", 5)``; the value is parsed as YAML."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"bad override {text!r}; expected KEY=VALUE, e.g. md.steps=100")
    try:
        parsed = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(f"bad value in override {text!r}: {yaml_problem(exc)}; quote a text "
                          "value (--set 'key=\"...\"')") from None
    return key.strip(), parsed


def yaml_problem(exc: Exception) -> str:
    """A YAML parser's error on one line: where (line, column) and what."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + " ".join(str(problem).split())


def config_from_dict(raw: Mapping[str, Any], base_dir: Path | str = ".",
                     stem: Optional[str] = None) -> RunConfig:
    """Validate a run mapping and resolve its paths against ``base_dir``.

    Args:
        raw: the parsed YAML mapping (after overrides).
        base_dir: directory relative ``struct``, ``model`` and ``outputs`` are resolved against.
        stem: name the default output directory ``<stem>-results`` is derived from.
    """
    task = raw.get("task")
    if task is None:
        raise ConfigError(f"task is required: one of {', '.join(TASKS)}")
    task = _coerce("task", typing.get_type_hints(RunConfig)["task"], task)
    for other in TASKS:
        if other != task and raw.get(other) is not None:
            raise ConfigError(f"section {other!r} is given but task is {task!r}; remove it or "
                              f"set task: {other}")
    base = Path(base_dir).resolve()
    fixed: Dict[str, Any] = {"task": task, **_resolve_paths(raw, base)}
    if raw.get("outputs") is None:
        fixed["outputs"] = base / f"{stem or task}-results"
    config = RunConfig.from_dict(raw, **fixed)
    _check_input_file("struct", config.struct, "a structure file ase.io.read can read")
    if config.model is not None:
        _check_input_file("model", config.model, "the MACE .model file")
    return config


def _resolve_paths(raw: Mapping[str, Any], base: Path) -> Dict[str, Path]:
    """The path keys (struct, model, outputs) that ``raw`` gives, as absolute paths: a relative
    one is taken from ``base``, ``~`` is expanded."""
    paths: Dict[str, Path] = {}
    for key in PATH_KEYS:
        value = raw.get(key)
        if isinstance(value, (str, Path)) and str(value):
            paths[key] = (base / Path(value).expanduser()).resolve()
    return paths


def _check_input_file(key: str, path: Path, what: str) -> None:
    if path.is_dir():
        raise ConfigError(f"{key}: {str(path)!r} is a folder, not a file; give the path of {what}")
    if not path.is_file():
        raise ConfigError(f"{key}: no such file {str(path)!r}")


def load_run_config(path: Path | str, overrides: Optional[Mapping[str, Any]] = None,
                    overrides_base: Optional[Path | str] = None) -> RunConfig:
    """Read, override and validate a YAML run file.

    Args:
        path: the YAML file; relative paths inside it are taken from its directory.
        overrides: dotted keys to set before validation (``{"md.steps": 10, "device": "cpu"}``),
            as the CLI's ``--set KEY=VALUE`` does.
        overrides_base: directory relative paths in ``overrides`` (struct, model, outputs) are
            taken from (the CLI passes the working directory); default: the run file's.

    Raises:
        ConfigError: the file is missing, is not valid YAML, or holds an invalid run.
    """
    import yaml

    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{str(path)!r} is a folder, not a run file; give the path of a YAML "
                          "run file (see configs/)")
    if not path.is_file():
        raise ConfigError(f"run file not found: {str(path)!r}")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {yaml_problem(exc)}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text file; give a YAML run file") from None
    except OSError as exc:
        raise ConfigError(f"cannot read run file {str(path)!r}: {exc.strerror or exc}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of keys to values, got "
                          f"{type(raw).__name__}")
    overrides = dict(overrides or {})
    if overrides_base is not None:
        overrides.update(_resolve_paths(overrides, Path(overrides_base)))
    raw = apply_overrides(raw, overrides)
    try:
        return config_from_dict(raw, base_dir=path.parent, stem=path.stem)
    except ConfigError as exc:
        raise ConfigError(f"{path.name}: {exc}") from None
