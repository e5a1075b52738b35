"""A MACE model made ready to evaluate: loaded, cast, moved, accelerated, its head chosen.

Shared by every way of evaluating a model (the ASE calculator, batched evaluation, the torch-sim
interface) so that each loads, checks and patches a model the same way.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Optional, Union

import torch

from mace_accel.errors import UnsupportedModelError
from mace_accel.models.batch import ModelInfo, model_info
from mace_accel.models.checkpoint import default_model_path, load_model
from mace_accel.models.validation import validate_head
from mace_accel.options import MACE_BACKEND, AccelOptions, resolve_device, resolve_dtype

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PreparedModel:
    """An accelerated energy model and what it was prepared with.

    Attributes:
        model: the MACE module (patched in place; parameters do not require grad).
        info: its elements, cutoff, heads and dtype.
        head: the head evaluated.
        report: the surgery's :class:`~mace_accel.surgery.PatchReport`.
        device, dtype: where and in which precision it runs.
    """

    model: torch.nn.Module
    info: ModelInfo
    head: str
    report: object
    device: torch.device
    dtype: torch.dtype

    @property
    def backend(self) -> str:
        """The backend that runs: ``"cuda"`` (fused kernels) or ``"reference"`` (plain torch)."""
        return self.report.backend

    @property
    def options(self) -> AccelOptions:
        return self.report.options


def prepare_model(model: Union[str, Path, torch.nn.Module, None], device: Union[str, torch.device],
                  default_dtype: str, head: Optional[str], options: AccelOptions) -> PreparedModel:
    """Load (path, or None for the bundled model), cast, move and accelerate ``model``.

    A model saved accelerated is reverted first and patched again with ``options``. The backend
    in use is logged (a warning when it is the plain-torch reference backend).

    Raises:
        UnsupportedModelError: the model predicts no energies.
        InputError: ``head`` is not one of the model's heads.
    """
    from mace_accel.surgery import accelerate, is_accelerated, revert

    dtype = resolve_dtype(default_dtype)
    device = resolve_device(device)
    module = load_model(default_model_path() if model is None else model, device=device,
                        dtype=dtype)
    if not hasattr(module, "atomic_energies_fn"):
        raise UnsupportedModelError(
            f"{type(module).__name__} does not predict energies (no atomic_energies_fn); "
            "mace-accel evaluates energy models (MACE, ScaleShiftMACE, ...)")
    for p in module.parameters():  # forces/stress need gradients of inputs only
        p.requires_grad_(False)
    info = model_info(module)
    chosen = validate_head(head, info)
    if is_accelerated(module):
        # saved accelerated (maybe with another backend or options): patch it afresh with the
        # options asked for here; the originals are inside, so nothing is lost
        restored = revert(module)
        log.info("mace-accel: the model was saved accelerated; re-patched %d module(s) with the "
                 "options asked for", restored)
    report = accelerate(module, options=options)
    if report.backend == MACE_BACKEND:
        log.warning("mace-accel: no GPU: the model runs as mace built it on %s (mace's own "
                    "modules, faster on a CPU than mace-accel's reference backend, which "
                    "backend='reference' runs); the fused CUDA kernels need an NVIDIA GPU",
                    device)
    elif report.backend != "cuda":
        log.warning("mace-accel: running the %r backend (plain torch) on %s; the fused CUDA "
                    "kernels need a machine with an NVIDIA GPU (device='cuda' or 'auto')",
                    report.backend, device)
    else:
        log.info("mace-accel: running the 'cuda' backend on %s", device)
    return PreparedModel(module, info, chosen, report, device, info.dtype)
