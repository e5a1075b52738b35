"""The generated linear kernel on the GPU equals the plain-torch reference: forward, backward
(the transposed kernel), shared and element-indexed weights, float32 and float64."""

from __future__ import annotations

import pytest
import torch

from mace_accel.ops.irreps_linear import autograd, gemm
from mace_accel.ops.irreps_linear.catalog import CATALOG
from mace_accel.ops.irreps_linear.spec import transpose_weights

pytestmark = pytest.mark.gpu

SPECS = CATALOG


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("n_nodes", [1, 13, 1000, 2500])
def test_kernel_equals_reference(name, dtype, n_nodes):
    """(At 2,500 nodes: float64 maps with shared weights as cuBLAS GEMMs, float32 ones with
    many weights as 3xTF32 GEMMs.)"""
    spec = SPECS[name]
    key = autograd.register_spec(spec)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n_nodes, spec.dim_in, generator=gen, dtype=torch.float64)
    w = torch.randn(spec.weight_numel, generator=gen, dtype=torch.float64) * 0.1
    elem = torch.randint(0, spec.num_elements, (n_nodes,), generator=gen, dtype=torch.int32)
    g = torch.randn(n_nodes, spec.dim_out, generator=gen, dtype=torch.float64)
    results = {}
    for backend, device in (("reference", "cpu"), ("cuda", "cuda")):
        xd = x.to(device, dtype).requires_grad_(True)
        wd = w.to(device, dtype)
        out = autograd.irreps_linear(key, xd, wd, transpose_weights(spec, wd).contiguous(),
                                     elem.to(device), backend)
        (gx,) = torch.autograd.grad(out, xd, g.to(device, dtype))
        results[backend] = (out.double().cpu(), gx.double().cpu())
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    for a, b in zip(results["cuda"], results["reference"]):
        assert (a - b).norm() <= tol * b.norm()
    cuda = autograd._cuda(key, x.to("cuda", dtype))
    assert cuda.runs_gemm(n_nodes) == gemm.takes(spec, dtype, n_nodes, gemm.MIN_NODES_FLOAT64)
    assert not gemm.takes(spec, dtype, n_nodes, gemm.MIN_NODES_FLOAT64) or not spec.indexed
