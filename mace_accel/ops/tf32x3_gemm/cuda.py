"""The CUDA side of the 3xTF32 GEMMs: one generated kernel per spec and device, launched on
torch's current stream (allocates only its outputs; graph-capturable)."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import numpy as np
import torch

from mace_accel.errors import KernelError
from mace_accel.ops.runtime import Kernel, check_aligned, check_rows, check_tensor, device_limits, i32, \
    kernel_device, ptr
from mace_accel.ops.tf32x3_gemm import codegen
from mace_accel.ops.tf32x3_gemm.spec import GemmSpec, GroupedSpec, e3nn_misfit

Tensor = torch.Tensor


class CudaGemm:
    """``C [M, n] = A [M, k] . op(B)`` of one :class:`GemmSpec` on one device (float32), or the
    blocks of one :class:`GroupedSpec` (:meth:`apply_grouped`)."""

    def __init__(self, spec: Union[GemmSpec, GroupedSpec], device: torch.device,
                 geometry: Optional[Tuple[int, int, int, int, int, int]] = None) -> None:
        self.spec = spec
        self.device = kernel_device(torch.float32, device)
        self.plan = codegen.plan_kernel(spec, device_limits(self.device).arch, geometry)
        self._kernel: Optional[Kernel] = None

    def apply(self, a: Tensor, b: Tensor, z: Optional[Tensor] = None) -> Tensor:
        """``C [M, n]`` of ``a [M, k]`` and ``b`` (``[k, n]`` for layout ``"kn"``, ``[n, k]``
        for ``"nk"``), all contiguous float32 on the kernel's device; epilogue ``"silu_grad"``
        reads the pre-activations ``z [M, n]``, ``"silu"`` is :meth:`apply_silu`."""
        if (z is None) != (self.spec.epilogue == "none"):
            raise KernelError(f"{self.spec.describe()}: pre-activations are read by the "
                              "silu_grad epilogue only")
        out = self._empty(a)
        self._launch(a, b, out, z)
        return out

    def apply_silu(self, a: Tensor, b: Tensor) -> Tuple[Tensor, Tensor]:
        """``(z, silu(z))`` with ``z = a op(b)`` ``[M, n]`` (epilogue ``"silu"``)."""
        if self.spec.epilogue != "silu":
            raise KernelError(f"{self.spec.describe()} has no silu epilogue")
        z, out = self._empty(a), self._empty(a)
        self._launch(a, b, out, z)
        return z, out

    def apply_e3nn(self, x: Tensor, x_col: int, wt: Tensor, out: Tensor, out_col: int) -> None:
        """Writes the block of ``out [N, dim_out]`` that starts at column ``out_col`` (``n``
        channels of irrep dimension ``d`` in e3nn's layout) with the map of the ``k`` channels
        of ``x [N, dim_in]`` from column ``x_col``, weights ``wt [n, k]``:
        ``out[i, out_col + v d + c] = sum_u x[i, x_col + u d + c] wt[v, u]`` (layout ``"nk"``,
        :attr:`GemmSpec.irrep_dim` = ``d``). ``x`` and ``out`` contiguous float32;
        :func:`~.spec.e3nn_misfit` first."""
        s = self.spec
        d = s.irrep_dim
        if not d:
            raise KernelError(f"{s.describe()}: not a kernel of e3nn's layout")
        nodes = int(x.shape[0]) if x.dim() == 2 else -1
        check_tensor("x", x, (nodes, int(x.shape[-1])), torch.float32, self.device,
                     s.describe())
        check_tensor("out", out, (nodes, int(out.shape[-1])), torch.float32, self.device,
                     s.describe())
        check_tensor("wt", wt, (s.n, s.k), torch.float32, self.device, s.describe())
        check_aligned("wt", wt, "the 3xTF32 GEMM")
        why = e3nn_misfit(d, x, x_col, s.k, out, out_col, s.n)
        if why is not None:
            raise KernelError(f"{s.describe()}: {why}")
        m = nodes * d
        a = ptr(x) + np.uint64(4 * x_col)
        c = ptr(out) + np.uint64(4 * out_col)
        self._run(m, (a, ptr(wt), c, ptr(None), i32(m), np.int64(x.shape[1]),
                      np.int64(out.shape[1])))

    def apply_grouped(self, x: Tensor, w: Tensor, out: Tensor) -> None:
        """Writes every block of the :class:`GroupedSpec` into ``out [N, ldc]`` from
        ``x [N, lda]`` and the blocks' weights ``w [weight_numel]`` (block ``b``'s ``[n, k]`` at
        ``b.w_offset``), in one launch; the other columns of ``out`` are left alone. All
        contiguous float32, 16-byte aligned."""
        s = self.spec
        if not isinstance(s, GroupedSpec):
            raise KernelError(f"{s.describe()}: not a grouped kernel")
        nodes = int(x.shape[0]) if x.dim() == 2 else -1
        check_tensor("x", x, (nodes, s.lda), torch.float32, self.device, s.describe())
        check_tensor("out", out, (nodes, s.ldc), torch.float32, self.device, s.describe())
        check_tensor("w", w, (s.weight_numel,), torch.float32, self.device, s.describe())
        for name, t in (("x", x), ("out", out), ("w", w)):
            check_aligned(name, t, "the 3xTF32 GEMM")
        self._run(nodes * max(b.d for b in s.blocks), (ptr(x), ptr(w), ptr(out), i32(nodes)),
                  grid_rows=nodes)

    def _empty(self, a: Tensor) -> Tensor:
        return torch.empty((int(a.shape[0]), self.spec.n), dtype=torch.float32,
                           device=self.device)

    def _launch(self, a: Tensor, b: Tensor, out: Tensor, z: Optional[Tensor]) -> None:
        s = self.spec
        m = int(a.shape[0]) if a.dim() == 2 else -1
        check_tensor("a", a, (m, s.k), torch.float32, self.device, s.describe())
        check_tensor("b", b, (s.k, s.n) if s.b_layout == "kn" else (s.n, s.k), torch.float32,
                     self.device, s.describe())
        if z is not None:
            check_tensor("z", z, (m, s.n), torch.float32, self.device, s.describe())
        for name, t in (("a", a), ("b", b), ("z", z)):
            check_aligned(name, t, "the 3xTF32 GEMM")
        self._run(m, (ptr(a), ptr(b), ptr(out), ptr(z), i32(m)))

    def _run(self, m: int, args: tuple, grid_rows: Optional[int] = None) -> None:
        """The kernel (compiled on first use) over ``m`` rows with ``args``, after checking
        that the row count indexes in int32; ``grid_rows``: what the plan's grid counts, if
        not ``m`` (a grouped kernel's nodes)."""
        check_rows(m, self.plan.bm, "the 3xTF32 GEMM")  # offsets are 64-bit
        if m == 0:
            return
        if self._kernel is None:
            self._kernel = Kernel(codegen.render_kernel(self.plan), codegen.kernel_name(self.plan),
                                  self.device, self.plan.arch)
        self._kernel.launch(self.plan.grid(m if grid_rows is None else grid_rows),
                            self.plan.threads, args)
