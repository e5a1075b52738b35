"""Exceptions raised by mace-accel.

Every error says what was wrong and how to fix it. They all derive from :class:`MaceAccelError`
so callers can catch the project's failures in one place; most also derive from the builtin
exception a Python user would expect (``ValueError``, ``RuntimeError``, ...).
"""

from __future__ import annotations


class MaceAccelError(Exception):
    """Base class of every error raised by mace-accel."""


class InputError(MaceAccelError, ValueError):
    """A structure, tensor or option given by the user is invalid."""


class ConfigError(MaceAccelError, ValueError):
    """A YAML run configuration or an accelerate() option is invalid."""


class CheckpointError(MaceAccelError, ValueError):
    """A model file is missing, corrupt or does not hold a MACE model."""


class UnsupportedModelError(MaceAccelError, TypeError):
    """The module handed to accelerate() is not a MACE model we know how to patch."""


class BackendUnavailableError(MaceAccelError, RuntimeError):
    """The requested backend (e.g. ``cuda``) cannot run in this environment."""


class KernelError(MaceAccelError, RuntimeError):
    """A generated kernel failed to build, or its inputs failed the pre-launch checks."""


class KernelSizeError(KernelError):
    """A system too large for a kernel's int32 indices: a capacity limit, like running out of
    memory (``mace-accel bench --max-size`` counts it as "does not fit")."""


class VerificationError(MaceAccelError, RuntimeError):
    """The accelerated model disagreed with the unpatched model beyond the tolerance table."""


class OutputError(MaceAccelError, OSError):
    """An output path cannot be written: it is a file where a folder is needed (or the other way
    round), its folder is missing or not writable, it exists and may not be replaced, or another
    run holds it."""


class OutputWriteError(OutputError):
    """Writing an output failed part-way (the disk is full, a quota is exceeded, the filesystem
    turned read-only, an I/O error). The message names the file, why, and what was kept: every
    file ends with its last whole record."""


class SimulationError(MaceAccelError, RuntimeError):
    """A simulation became unphysical part-way (an MD run diverged, an optimiser moved atoms onto
    each other). The message names the step, the likely cause and the files kept."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with a note on what was left on disk (``note``), for the command line to print.

    Not a :class:`MaceAccelError`: an interrupt is not a mistake. It is still a
    ``KeyboardInterrupt``, so code that handles those keeps working.
    """

    def __init__(self, note: str = "") -> None:
        super().__init__(note)
        self.note = note
