"""The CUDA templates of ``kernels/`` (shipped as ``mace_accel.kernels``), rendered with jinja2.

Templates are read through :mod:`importlib.resources`, so they are found in a wheel, an editable
install or a zip alike. ``StrictUndefined``: a name the code generator forgot is an error, never
an empty string in the generated source.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any


@functools.lru_cache(maxsize=None)
def _source(name: str) -> str:
    return resources.files("mace_accel.kernels").joinpath(name).read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def _environment():
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FunctionLoader(lambda name: (_source(name), None, lambda: True)),
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
        keep_trailing_newline=True)


def render(template: str, **context: Any) -> str:
    """Render ``kernels/<template>`` (e.g. ``"conv_tp/forward.cu.j2"``) with ``context``."""
    return _environment().get_template(template).render(**context)


def literal(value: float) -> str:
    """Exact C++ literal of a float64 value (hex float), cast to the kernel's ``real``."""
    return f"((real){float(value).hex()})"


class RealType:
    """Mixin for kernel plans with a ``dtype`` field (``"float32"`` or ``"float64"``): the C type
    the templates print for it and its size."""

    dtype: str

    @property
    def real(self) -> str:
        return "double" if self.dtype == "float64" else "float"

    @property
    def real_bytes(self) -> int:
        return 8 if self.dtype == "float64" else 4
