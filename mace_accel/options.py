"""One place for the choices a user makes: dtypes, backends, fallbacks, devices, fused parts.

Torch-free at import (the CLI builds its parser from these names); the ``resolve_*`` functions
import torch when called. :class:`AccelOptions` is the frozen set of options that surgery, the
calculator, YAML runs and ``convert`` all pass down, and that every :class:`PatchReport` records.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Optional, Tuple, Union

from mace_accel.errors import BackendUnavailableError, ConfigError, InputError

if TYPE_CHECKING:
    import torch

DTYPE_NAMES: Tuple[str, ...] = ("float32", "float64")
BACKENDS: Tuple[str, ...] = ("cuda", "reference")  # the fused ones (what convert writes)
# the model as mace built it, unpatched: what "auto" runs on a CPU, where mace's own modules are
# faster than the reference backend's plain-torch ops (which exist to be the GPU's oracle)
MACE_BACKEND = "mace"
BACKEND_CHOICES: Tuple[str, ...] = ("auto",) + BACKENDS + (MACE_BACKEND,)
FALLBACKS: Tuple[str, ...] = ("error", "warn")
RECOMPUTE_CHOICES: Tuple[str, ...] = ("auto", "always", "never")
DEVICE_CHOICES_HELP = "auto | cpu | cuda | cuda:N"
_DEVICE_RE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")

# the parts of a MACE model that surgery can replace by fused ops (PatchRecord.parts keys)
PARTS: Tuple[str, ...] = ("conv", "radial_mlp", "symmetric_contraction", "linears",
                          "skip", "edge_features", "pair_repulsion")


def check_choice(name: str, value: Any, choices: Tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else a :class:`ConfigError` naming the option."""
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def resolve_dtype(dtype: Union["torch.dtype", str, None]) -> Optional["torch.dtype"]:
    """``"float32" | "float64" | torch.float32 | torch.float64 | None`` -> torch dtype or None."""
    import torch

    table = {"float32": torch.float32, "float64": torch.float64}
    if dtype is None or dtype in table.values():
        return dtype
    if isinstance(dtype, str) and dtype in table:
        return table[dtype]
    raise InputError(f"dtype must be one of {', '.join(DTYPE_NAMES)} (or torch.float32/"
                     f"torch.float64), got {dtype!r}")


def dtype_name(dtype: "torch.dtype") -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).replace("torch.", "")


def check_device_name(device: str) -> str:
    """``device`` if it is ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (no torch needed)."""
    if not isinstance(device, str) or not _DEVICE_RE.match(device):
        raise ConfigError(f"device must be {DEVICE_CHOICES_HELP}, got {device!r}")
    return device


def resolve_device(device: Union[str, "torch.device", None] = "auto") -> "torch.device":
    """Parse ``device`` and check it exists here; ``"auto"`` (or None) picks a GPU if visible.

    Raises:
        InputError: not a device string torch understands, or neither CPU nor CUDA.
        BackendUnavailableError: a CUDA device was asked for and none (or not that one) is visible.
    """
    import torch

    if device is None or device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InputError(f"invalid device {device!r} ({exc}); use {DEVICE_CHOICES_HELP}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                f"device {str(device)!r} requested but no CUDA GPU is visible; pass device='cpu' "
                "(or 'auto') to run the reference path")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise BackendUnavailableError(
                f"device {str(device)!r} requested but only {count} CUDA GPU(s) are visible "
                f"(cuda:0..cuda:{count - 1})")
        if dev.index is None:  # "cuda": the current device, named (tensors report cuda:N)
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise InputError(f"device {str(device)!r} is not supported; use {DEVICE_CHOICES_HELP}")
    return dev


@dataclasses.dataclass(frozen=True)
class AccelOptions:
    """How a model is accelerated; recorded in every :class:`~mace_accel.surgery.PatchReport`.

    Attributes:
        backend: ``"cuda"`` (generated kernels), ``"reference"`` (the same ops in plain torch,
            any device: the oracle of the kernels, slower on a CPU than mace's own modules),
            ``"mace"`` (nothing patched: the model runs as mace built it, behind mace-accel's
            calculator, runs and batching) or ``"auto"`` (``cuda`` for a model on a GPU, else
            ``mace``).
        fallback: when the CUDA backend cannot run: ``"error"`` raises
            :class:`BackendUnavailableError`, ``"warn"`` warns and uses ``"reference"``.
        verify: compare the accelerated model with the unpatched one on a random structure
            and leave the model unpatched (raising) if they disagree beyond the tolerance table.
        deterministic: no float atomics in mace-accel's kernels (CUDA backend): forces and
            stress are bit-identical on repeats. Where mace-accel evaluates a ``MACE`` /
            ``ScaleShiftMACE`` (the calculator, CUDA graphs, batched and YAML runs) the energies
            are too: :mod:`mace_accel.models.energy_head` sums them in float64 without atomics.
            mace's own forward (the model called directly, or a model that energy head does not
            take) sums them with ``scatter_sum`` (torch's ``scatter_add_``, float atomics on a
            GPU): in float32 they can then differ in the last bits between calls, with or
            without mace-accel.
        check_indices: check edge indices before every launch (synchronises; for debugging).
        parts: which parts to fuse (a subset of :data:`PARTS`); the others are left as mace
            built them and reported so.
        recompute_tp_weights: where the radial MLP's last layer is folded into the conv, whether
            the per-edge TP weights are recomputed in the backward instead of kept: ``"auto"``
            (when one block's weights would exceed 1/8 of the GPU's memory; the largest systems),
            ``"always"`` (least memory, one more GEMM per block) or ``"never"`` (fastest).
        radial_table: on CUDA at inference, evaluate each interaction block's radial MLP as a
            table in the edge length (:mod:`mace_accel.ops.radial.table`) where its input is the
            model's fused radial embedding of the lengths: a Hermite spline built on first use
            in float64 from the block's own embedding and MLP, with cells doubled until it is
            within the tolerances of :data:`mace_accel.ops.radial.table.table.SPECS` between
            the nodes (float32 cubic, float64 quintic); one table per pair of elements where
            the weights depend on the pair (a distance transform, the non-linear blocks).
            Forces are the spline's exact gradient. ``False`` runs the MLP kernels. Training
            and weights the conv recomputes run the MLP either way.
    """

    backend: str = "cuda"
    fallback: str = "error"
    verify: bool = True
    deterministic: bool = True
    check_indices: bool = False
    parts: Tuple[str, ...] = PARTS
    recompute_tp_weights: str = "auto"
    radial_table: bool = True

    def __post_init__(self) -> None:
        check_choice("backend", self.backend, BACKEND_CHOICES)
        check_choice("recompute_tp_weights", self.recompute_tp_weights, RECOMPUTE_CHOICES)
        check_choice("fallback", self.fallback, FALLBACKS)
        for flag in ("verify", "deterministic", "check_indices", "radial_table"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        parts = tuple(self.parts)
        unknown = [p for p in parts if p not in PARTS]
        if unknown:
            raise ConfigError(f"unknown part(s) {unknown} in parts; choose from {', '.join(PARTS)}")
        object.__setattr__(self, "parts", tuple(p for p in PARTS if p in parts))

    def fuses(self, part: str) -> bool:
        return part in self.parts

    def replace(self, **changes: Any) -> "AccelOptions":
        return dataclasses.replace(self, **changes)

    def for_device(self, device: "torch.device") -> "AccelOptions":
        """``backend="auto"`` resolved for a model on ``device``: ``cuda`` on a GPU, ``mace``
        elsewhere."""
        if self.backend != "auto":
            return self
        import torch

        return self.replace(backend="cuda" if torch.device(device).type == "cuda"
                            else MACE_BACKEND)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["parts"] = list(self.parts)
        return out


def make_options(options: Optional[AccelOptions] = None, **overrides: Any) -> AccelOptions:
    """``options`` (default :class:`AccelOptions()`) with the keyword arguments not None."""
    base = options if options is not None else AccelOptions()
    if not isinstance(base, AccelOptions):
        raise ConfigError(f"options must be an AccelOptions, got {type(base).__name__}")
    changes = {k: v for k, v in overrides.items() if v is not None}
    return base.replace(**changes) if changes else base
