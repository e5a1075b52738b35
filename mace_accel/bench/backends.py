"""Each backend's model from one source model, side by side in one process.

* ``e3nn``: the plain MACE model (a deep copy of the source).
* ``cueq``: ``mace.cli.convert_e3nn_cueq.run(model, device=..., return_model=True)``
  (cuEquivariance, conv fusion on CUDA).
* ``oeq``: ``mace.cli.convert_e3nn_oeq.run(model, device=..., return_model=True)``
  (OpenEquivariance, atomic conv fusion).
* ``mace-accel``: a deep copy patched by ``mace_accel.accelerate(m, backend="cuda")``; where the
  CUDA backend cannot run it is reported ``unavailable`` unless the reference backend was
  allowed, which is then timed under the name ``mace-accel(reference)``.

Nothing is dropped silently: every requested backend comes back as a :class:`PreparedBackend`
whose ``status`` is ``"ok"``, ``"not installed: ..."``, ``"unavailable: ..."``,
``"failed: ..."`` or ``"out of memory"``. mace's converters fall back to plain e3nn modules when
their package is missing, so the package is imported here first, and the converted model is
checked to really contain that package's modules.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
from pathlib import Path
from typing import Callable, Dict, Iterator, Optional, Tuple, TypeVar

import torch

from mace_accel.bench.choices import BACKENDS
from mace_accel.bench.timing import is_out_of_memory
from mace_accel.errors import BackendUnavailableError, ConfigError

REFERENCE_NAME = "mace-accel(reference)"
# importable modules each backend needs, and the module prefix its converted layers come from
REQUIREMENTS: Dict[str, Tuple[str, ...]] = {
    "cueq": ("cuequivariance", "cuequivariance_torch"),
    "oeq": ("openequivariance",),
}
CONVERTED_MODULE_PREFIX = {"cueq": "cuequivariance", "oeq": "openequivariance"}
PACKAGE_HINT = {
    "cueq": "pip install cuequivariance-torch cuequivariance-ops-torch-cu12 (or -cu13)",
    "oeq": "pip install openequivariance",
}

OK = "ok"
OUT_OF_MEMORY = "out of memory"


def _import(name: str):
    """Indirection so tests can make a package look missing."""
    return importlib.import_module(name)


@dataclasses.dataclass
class PreparedBackend:
    """One backend's model, or why there is none.

    Attributes:
        name: ``e3nn``, ``cueq``, ``oeq``, ``mace-accel`` or ``mace-accel(reference)``.
        status: ``"ok"`` or the reason it cannot be timed (see module docstring).
        model: the model to call (``None`` unless ``status == "ok"``).
        detail: extra facts for the report (patch summary, fallback reason).
    """

    name: str
    status: str
    model: Optional[torch.nn.Module] = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK


def failure_status(exc: BaseException) -> str:
    """``"out of memory"`` or ``"failed: <Type>: <message>"`` for an exception."""
    if is_out_of_memory(exc):
        return OUT_OF_MEMORY
    text = " ".join(str(exc).split())
    return f"failed: {type(exc).__name__}: {text}"


def join_details(*parts: str) -> str:
    """A record's ``detail`` from its non-empty ``parts``, joined by ``"; "``."""
    return "; ".join(filter(None, parts))


def missing_requirement(backend: str) -> Optional[str]:
    """The import error text of the first package ``backend`` needs and lacks, or None."""
    for module in REQUIREMENTS.get(backend, ()):
        try:
            _import(module)
        except Exception as exc:  # ImportError, or a CUDA library mismatch at import
            return f"{type(exc).__name__}: {exc} ({PACKAGE_HINT[backend]})"
    return None


@contextlib.contextmanager
def preserve_default_dtype() -> Iterator[None]:
    """Restore torch's default dtype after third-party code that sets it.

    mace's converters call ``torch.set_default_dtype`` themselves; we never set it, but we do
    not let their change leak into the caller's process.
    """
    saved = torch.get_default_dtype()
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


@contextlib.contextmanager
def mace_device(device: torch.device | str) -> Iterator[str]:
    """The device string to hand to mace's converters and calculator.

    mace enables conv fusion only for the exact string ``"cuda"``, so an indexed CUDA device is
    made current for the block and ``"cuda"`` is yielded.
    """
    device = torch.device(device)
    if device.type != "cuda":
        yield str(device)
        return
    with torch.cuda.device(device):
        yield "cuda"


def _modules_from(model: torch.nn.Module, prefix: str) -> int:
    return sum(type(m).__module__.startswith(prefix) for m in model.modules())


def _convert_with_mace(backend: str, source: torch.nn.Module,
                       device: torch.device | str) -> torch.nn.Module:
    """Run mace's e3nn -> cueq/oeq converter and check that it really converted."""
    from mace_accel._e3nn_compat import import_mace

    import_mace()
    converter = importlib.import_module(f"mace.cli.convert_e3nn_{backend}")
    with preserve_default_dtype(), mace_device(device) as mace_dev:
        model = converter.run(source, device=mace_dev, return_model=True)
    model = model.to(device).eval()
    prefix = CONVERTED_MODULE_PREFIX[backend]
    if _modules_from(model, prefix) == 0:
        raise RuntimeError(f"mace's converter returned a model with no {prefix} modules "
                           "(it fell back to e3nn); check that the package imports in this "
                           "Python environment")
    return model


T = TypeVar("T")


def cuda_or_reference(build: Callable[[str], T], allow_reference: bool
                      ) -> Tuple[str, Optional[T], str, str]:
    """Build a mace-accel object with ``backend="cuda"``, or the reference if allowed.

    Args:
        build: ``build(backend) -> object``; raises :class:`BackendUnavailableError` when the
            CUDA backend cannot run.
        allow_reference: time the plain-torch reference under ``mace-accel(reference)``
            instead of reporting the CUDA backend ``unavailable``.

    Returns:
        ``(name, object or None, status, detail)``.
    """
    try:
        return "mace-accel", build("cuda"), OK, ""
    except BackendUnavailableError as exc:
        if not allow_reference:
            return "mace-accel", None, f"unavailable: {exc}", ""
        detail = f"CUDA backend unavailable, timing the reference: {exc}"
        return REFERENCE_NAME, build("reference"), OK, detail


def _prepare_mace_accel(source: torch.nn.Module, allow_reference: bool) -> PreparedBackend:
    from mace_accel.surgery import accelerate

    def build(backend: str):
        model = copy.deepcopy(source)
        return model, accelerate(model, backend=backend)

    name, built, status, detail = cuda_or_reference(build, allow_reference)
    if built is None:
        return PreparedBackend(name, status)
    model, report = built
    if not report.patched:
        reasons = "; ".join(f"{r.path}: {r.skipped}" for r in report.skipped)
        return PreparedBackend(name, f"failed: no interaction block was patched ({reasons})")
    summary = f"{len(report.patched)} of {len(report.records)} blocks patched ({report.backend})"
    return PreparedBackend(name, OK, model.eval(), join_details(summary, detail))


def expected_name(backend: str, allow_reference: bool, device: torch.device | str) -> str:
    """The name a backend's records will carry (``mace-accel`` may become the reference)."""
    if backend == "mace-accel" and allow_reference and torch.device(device).type != "cuda":
        return REFERENCE_NAME
    return backend


def prepare_backend(backend: str, source: torch.nn.Module, device: torch.device | str,
                    allow_reference: bool = False) -> PreparedBackend:
    """Build ``backend``'s model from ``source`` (which stays untouched) on ``device``.

    Never raises for a backend problem: a missing package, an unavailable backend, a failed
    conversion or an out-of-memory error all come back as the status of the result.
    """
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    missing = missing_requirement(backend)
    if missing is not None:
        return PreparedBackend(backend, f"not installed: {missing}")
    name = expected_name(backend, allow_reference, device)
    try:
        if backend == "e3nn":
            prepared = PreparedBackend("e3nn", OK, copy.deepcopy(source).eval())
        elif backend == "mace-accel":
            prepared = _prepare_mace_accel(source, allow_reference)
        else:
            prepared = PreparedBackend(backend, OK, _convert_with_mace(backend, source, device))
    except Exception as exc:  # reported per backend; the other backends still run
        return PreparedBackend(name, failure_status(exc))
    if prepared.model is not None:  # inference, as every calculator runs it: no weight grads
        for p in prepared.model.parameters():
            p.requires_grad_(False)
    return prepared


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a benchmarked model comes from.

    Attributes:
        label: the name used in reports (an architecture name or a file name).
        load: ``load(dtype, device) -> model``.
        spec: what :func:`resolve_model_source` resolves to it again (for child processes).
    """

    label: str
    load: Callable[[torch.dtype, torch.device], torch.nn.Module]
    spec: str = ""


def resolve_model_source(spec: str) -> ModelSource:
    """An architecture name of :data:`mace_accel.models.ARCHITECTURES` or a checkpoint path.

    Architectures get random (seeded) weights; a path is loaded with
    :func:`mace_accel.checkpoint.load_model`. Checked here so a typo fails before any work.
    """
    from mace_accel.models.architectures import ARCHITECTURES, build_architecture

    if spec in ARCHITECTURES:
        cache: Dict[str, torch.nn.Module] = {}

        def load_architecture(dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
            # built once (float64, CPU), then cast: every dtype gets the same random weights
            if "base" not in cache:
                cache["base"] = build_architecture(spec, dtype=torch.float64, device="cpu")
            return copy.deepcopy(cache["base"]).to(device=device, dtype=dtype).eval()

        return ModelSource(spec, load_architecture, spec)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise ConfigError(f"--models: {spec!r} is neither a known architecture "
                          f"({', '.join(sorted(ARCHITECTURES))}) nor an existing model file")

    def load_checkpoint(dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        from mace_accel.models.checkpoint import load_model

        return load_model(str(path), device, dtype).eval()

    return ModelSource(path.name, load_checkpoint, str(path.resolve()))
