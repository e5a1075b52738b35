"""The CUDA source of the edge-vector kernels (template ``kernels/edge_vectors/``): one source per
dtype holds the forward (a thread per edge) and the backward (a warp per node)."""

from __future__ import annotations

from typing import Iterator, Tuple

from mace_accel.ops.limits import DeviceLimits
from mace_accel.ops.templates import render

THREADS = 256
FORWARD = "mace_edge_vectors_fwd"
BACKWARD = "mace_edge_vectors_bwd"


def kernel_name(which: str, dtype: str) -> str:
    return f"{FORWARD if which == 'forward' else BACKWARD}_{dtype}"


def render_kernels(dtype: str, arch: str = "sm_90") -> str:
    """Both kernels for ``dtype`` (``"float32"`` or ``"float64"``)."""
    return render("edge_vectors/edge_vectors.cu.j2", dtype=dtype, arch=arch, threads=THREADS,
                  real="double" if dtype == "float64" else "float",
                  forward_name=kernel_name("forward", dtype),
                  backward_name=kernel_name("backward", dtype))


def catalog_sources(limits: DeviceLimits) -> Iterator[Tuple[str, str]]:
    """``(name, source)`` for float32 and float64 (the CI compile and the pins)."""
    for dtype in ("float32", "float64"):
        yield f"edge_vectors/{dtype}", render_kernels(dtype, limits.arch)
