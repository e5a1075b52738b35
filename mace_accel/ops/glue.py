"""The small CUDA kernels between the fused ops of the Density and non-linear blocks (template
``kernels/glue/glue.cu.j2``, one source per dtype): per-receiver sums of edge values (the
blocks' densities), each edge's pair of elements (a distance transform's ``r0`` and a radial
table's slot) and the backward of the blocks' division by their density. Each was a chain of
torch's kernels on the critical path of an MD-sized call. Launched on torch's current stream;
outputs from ``torch.empty``, every element written; nothing synchronises (CUDA graphs). The
torch formulas they replace stay the reference and the CPU path
(:func:`mace_accel.patches.nonlinear_block.receiver_sums`,
:func:`mace_accel.ops.species.edge_slots`,
:func:`mace_accel.ops.edge_features.reference.pair_r0`, the torch ops of
``nonlinear_block._DivideRows.backward``)."""

from __future__ import annotations

from typing import Iterator, Optional, Tuple

import numpy as np
import torch

from mace_accel.errors import KernelSizeError
from mace_accel.ops import registry
from mace_accel.ops.limits import DeviceLimits
from mace_accel.ops.runtime import INT32_MAX, CudaKernels, compile_soon, device_limits, i32, \
    kernel_device, ptr
from mace_accel.ops.templates import render
from mace_accel.options import dtype_name

Tensor = torch.Tensor
THREADS = 256
WHAT = "glue kernels"
KERNELS = ("receiver_sums", "edge_pairs", "divide_rows_backward")


def kernel_name(which: str, dtype: str) -> str:
    """The kernel ``which`` (one of :data:`KERNELS`) of ``dtype``."""
    return f"mace_{which}_{dtype}"


def render_kernels(dtype: str) -> str:
    """The kernels for ``dtype`` (``"float32"`` or ``"float64"``)."""
    sums, pairs, divide = (kernel_name(k, dtype) for k in KERNELS)
    return render("glue/glue.cu.j2", dtype=dtype, threads=THREADS, sums_name=sums,
                  pairs_name=pairs, divide_name=divide,
                  real="double" if dtype == "float64" else "float")


def catalog_sources(limits: DeviceLimits) -> Iterator[Tuple[str, str]]:
    """``(name, source)`` for float32 and float64 (the CI compile and the pins)."""
    del limits  # any sm_80+ GPU alike
    for dtype in ("float32", "float64"):
        yield f"glue/{dtype}", render_kernels(dtype)


class CudaGlue(CudaKernels):
    """The kernels for ``dtype`` on ``device``."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(dtype, device, WHAT)
        source = render_kernels(dtype_name(dtype))
        self.kernels = {k: self._load(source, kernel_name(k, dtype_name(dtype))) for k in KERNELS}
        self._real = np.float64 if dtype == torch.float64 else np.float32

    def _grid(self, threads: int) -> int:
        return self._blocks(-(-threads // THREADS))

    def receiver_sums(self, values: Tensor, row_ptr: Tensor, perm: Tensor) -> Tensor:
        """``[N, k]``: ``values [E, k]`` summed over each receiver's edges (the int32 receiver
        CSR ``row_ptr [N + 1]``, ``perm [E]``: not range-checked, which would synchronise;
        they are the graph's own), in float64."""
        e, k = int(values.shape[0]), int(values.shape[1])
        n = int(row_ptr.shape[0]) - 1
        self._check_tensor("values", values, (e, k))
        self._check_tensor("row_ptr", row_ptr, (n + 1,), torch.int32)
        self._check_tensor("perm", perm, (e,), torch.int32)
        if e * max(k, 1) > INT32_MAX:
            raise KernelSizeError(f"{e} edges x {k} values exceed the receiver sums' int32 "
                                  "range")
        out = self._empty(n, k)
        if n and k:
            self.kernels["receiver_sums"].launch(self._grid(32 * n), THREADS, (
                ptr(values), ptr(row_ptr), ptr(perm), ptr(out), i32(n), i32(k)))
        return out

    def edge_pairs(self, elements: Tensor, sender: Tensor, receiver: Tensor,
                   radii: Optional[Tensor], scale: float, slot_map: Optional[Tensor],
                   n_elements: int) -> Tuple[Optional[Tensor], Optional[Tensor]]:
        """``(r0 [E, 1] or None, slots [E] int32 or None)`` of the edges ``sender`` /
        ``receiver [E]`` (int32) between atoms of ``elements [N]`` (int64): ``r0 = scale
        (radii[a] + radii[b])`` where ``radii`` (per element) is given, the slot
        ``slot_map[a n_elements + b]`` (int32 ``[n_elements^2]``) where that is."""
        n, e = int(elements.shape[0]), int(sender.shape[0])
        self._check_tensor("elements", elements, (n,), torch.int64)
        self._check_tensor("sender", sender, (e,), torch.int32)
        self._check_tensor("receiver", receiver, (e,), torch.int32)
        r0 = slots = None
        if radii is not None:
            self._check_tensor("radii", radii, (int(radii.shape[0]),))
            r0 = self._empty(e, 1)
        if slot_map is not None:
            self._check_tensor("slot_map", slot_map, (n_elements * n_elements,), torch.int32)
            slots = torch.empty((e,), dtype=torch.int32, device=self.device)
        if e and (r0 is not None or slots is not None):
            self.kernels["edge_pairs"].launch(self._grid(e), THREADS, (
                ptr(elements), ptr(sender), ptr(receiver), ptr(radii), self._real(scale),
                ptr(slot_map), i32(n_elements), ptr(r0), ptr(slots), i32(e)))
        return r0, slots

    def divide_rows_backward(self, g: Tensor, out: Tensor, d: Tensor,
                             want_x: bool = True) -> Tuple[Optional[Tensor], Tensor]:
        """``(grad_x [N, k] or None, grad_d [N, 1])``: the gradients of ``out = x / d`` (``x,
        out [N, k]``, ``d [N, 1]``) from ``g = dL/dout [N, k]``: ``g / d`` (where ``want_x``)
        and ``-<g, out> / d``, the dot summed in float64 in a fixed order."""
        n, k = int(out.shape[0]), int(out.shape[1])
        self._check_tensor("g", g, (n, k))
        self._check_tensor("out", out, (n, k))
        self._check_tensor("d", d, (n, 1))  # rows index with size_t: no int32 bound on n k
        grad_x = torch.empty_like(out) if want_x else None
        grad_d = self._empty(n, 1)
        if n:
            self.kernels["divide_rows_backward"].launch(self._blocks(n), THREADS, (
                ptr(g), ptr(out), ptr(d), ptr(grad_x), ptr(grad_d), i32(n), i32(k)))
        return grad_x, grad_d


def runs_on(t: Tensor) -> bool:
    """Whether the kernels take ``t``: a float32 or float64 CUDA tensor, outside a
    ``torch.compile`` trace (there the torch formulas run: dynamo traces them, not a launch)."""
    return t.is_cuda and t.dtype in (torch.float32, torch.float64) \
        and not torch.compiler.is_compiling()


def kernels(dtype: torch.dtype, device: torch.device) -> CudaGlue:
    """The kernels of ``dtype`` on ``device``, made once."""
    return registry.cached(("glue", dtype, torch.device(device)),
                           lambda: CudaGlue(dtype, device))


def start_compiles(dtype: torch.dtype, device: torch.device) -> None:
    """Start compiling the kernels for ``dtype`` on ``device`` without loading them."""
    arch = device_limits(kernel_device(dtype, device)).arch
    compile_soon(render_kernels(dtype_name(dtype)), arch)
