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


class VerificationError(MaceAccelError, RuntimeError):
    """The accelerated model disagreed with the unpatched model beyond the tolerance table."""
