"""Registry of model patches: each finds one MACE block family and swaps in fused modules."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from mace_accel.spec import TPSpec


@dataclasses.dataclass
class PatchRecord:
    """One block that was considered: what was done to it, or why it was left."""

    path: str
    block: str
    patch: str
    spec: Optional[TPSpec] = None
    backend: Optional[str] = None
    skipped: Optional[str] = None  # the reason, when the block was left as it was

    @property
    def patched(self) -> bool:
        return self.skipped is None


class BlockPatch:
    """Base class: subclasses say which modules they match and how to (un)patch them."""

    name = "patch"

    def matches(self, module: torch.nn.Module) -> bool:
        raise NotImplementedError

    def skip_reason(self, module: torch.nn.Module) -> Optional[str]:
        """Why this matching module must be left unpatched, or None."""
        raise NotImplementedError

    def apply(self, path: str, module: torch.nn.Module, backend: str, **options) -> PatchRecord:
        raise NotImplementedError

    def revert(self, module: torch.nn.Module) -> Any:
        """Restore the original; returns what :meth:`reattach` needs to undo the revert."""
        raise NotImplementedError

    def reattach(self, module: torch.nn.Module, state: Any) -> None:
        """Put back what :meth:`revert` returned (for temporary side-by-side comparisons)."""
        raise NotImplementedError

    def is_applied(self, module: torch.nn.Module) -> bool:
        from mace_accel.patches.conv_tp import FusedConvTP

        return isinstance(getattr(module, "conv_tp", None), FusedConvTP)
