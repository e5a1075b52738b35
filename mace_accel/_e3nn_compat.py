"""The one place that makes e3nn 0.4.4 importable under torch >= 2.6.

e3nn 0.4.4 reads its Wigner constants at import with a bare ``torch.load``; torch >= 2.6 defaults
to ``weights_only=True`` and rejects the ``slice`` objects in that file. Importing mace first
works around it (mace sets an environment variable), but we must not depend on import order, so
every module of ours that needs e3nn gets it through :func:`o3`, which allow-lists ``slice`` for
the weights-only unpickler (a type with no code path, safe to allow) right before the first import.
Nothing happens at import time of this module.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
from types import ModuleType

from mace_accel._lazy_package import install_lazy

_READY = False


def _allow_e3nn_constants() -> None:
    global _READY
    if _READY:
        return
    import torch

    add_safe_globals = getattr(torch.serialization, "add_safe_globals", None)
    if add_safe_globals is not None:  # torch >= 2.4; older torch has no weights-only default
        add_safe_globals([slice])
    _READY = True


def o3() -> ModuleType:
    """Return ``e3nn.o3``, importing it safely on any supported torch version."""
    _allow_e3nn_constants()
    return importlib.import_module("e3nn.o3")


# what mace prints on stdout when it is imported (mace/tools/cg.py without cuequivariance);
# silenced so that stdout carries only our commands' output (``info --json`` must be JSON)
_MACE_IMPORT_NOTICES = ("cuequivariance or cuequivariance_torch is not available",)
_MACE_NOTICE_MODULE = "mace.tools.cg"


def import_mace() -> ModuleType:
    """Import ``mace`` (which imports e3nn) after making e3nn's constants loadable.

    The first call makes ``mace.tools`` a lazy package where nothing imported it yet
    (:func:`~mace_accel._lazy_package.install_lazy`: its trainer and torchmetrics are imported
    only if asked for), then imports ``mace.tools.cg`` with stdout captured: mace prints a notice
    there when cuequivariance is not installed. The known notice is dropped; anything else mace
    prints is passed on to stderr, and errors propagate unchanged.
    """
    _allow_e3nn_constants()
    if _MACE_NOTICE_MODULE in sys.modules:
        return importlib.import_module("mace")
    install_lazy("mace.tools")  # mace's models need a few submodules, not its trainer
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            module = importlib.import_module("mace")
            importlib.import_module(_MACE_NOTICE_MODULE)
    finally:
        rest = [line for line in captured.getvalue().splitlines()
                if line.strip() and not line.startswith(_MACE_IMPORT_NOTICES)]
        if rest:
            print("\n".join(rest), file=sys.stderr)
    return module
