"""The generated linear kernel on the GPU equals the plain-torch reference: forward, backward
(the transposed kernel), shared and element-indexed weights, float32 and float64."""

from __future__ import annotations

import pytest
import torch

from mace_accel.ops.irreps_linear import autograd, gemm
from mace_accel.ops.irreps_linear.catalog import CATALOG
from mace_accel.ops.irreps_linear.spec import Block, LinearInstruction, LinearSpec, \
    transpose_weights

pytestmark = pytest.mark.gpu

SPECS = CATALOG


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("n_nodes", [1, 13, 1000, 2500])
def test_kernel_equals_reference(name, dtype, n_nodes, monkeypatch):
    """(At 2,500 nodes: float64 maps with shared weights as cuBLAS GEMMs, float32 ones with
    many weights whose blocks all go in one launch on the grouped 3xFP16 kernel.)"""
    # the catalog's maps are under float64's 2^18 weights: take them to cuBLAS all the same
    monkeypatch.setattr(gemm, "MIN_WEIGHTS_FLOAT64", 1)
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
    takes = gemm.takes(spec, dtype, n_nodes, gemm.MIN_NODES_FLOAT64,
                       gemm.grouped_in_float32(spec))
    assert cuda.runs_gemm(n_nodes) == takes
    assert not takes or not spec.indexed


# MACE-MH-1-like: two scalar blocks side by side into 512 scalars, two vector blocks into 512
# vectors, an l = 2 and an l = 3 block (2.8e5 weights)
SIDE_BY_SIDE = LinearSpec(
    (Block(0, 128, 1), Block(128, 128, 1), Block(256, 128, 3), Block(640, 128, 3),
     Block(1024, 64, 5), Block(1344, 32, 7)),
    (Block(0, 512, 1), Block(512, 512, 3), Block(2048, 64, 5), Block(2368, 32, 7)),
    (LinearInstruction(0, 0, 0), LinearInstruction(1, 0, 65536),
     LinearInstruction(2, 1, 131072), LinearInstruction(3, 1, 196608),
     LinearInstruction(4, 2, 262144), LinearInstruction(5, 3, 266240)))


@pytest.mark.parametrize("wgmma", [True, False], ids=["wgmma", "mma"])
@pytest.mark.parametrize("name", ["side_by_side", "message"])
def test_float32_gemm_path_reads_and_writes_e3nn_layout_in_place(name, wgmma, monkeypatch):
    """At 2,500 nodes in float32 a map with many weights whose blocks lie side by side runs on
    the grouped 3xFP16 kernel (its wgmma form on Hopper), read and written in place, all blocks
    in one launch; a map with blocks apart (the message map's two scalar inputs) is not taken
    (:func:`gemm.takes`), and :func:`gemm.apply` still maps it: the blocks it can group in one
    launch, the scalars on cuBLAS through stacked copies. Both equal the reference, and so
    does the backward (the transposed map)."""
    from mace_accel.ops.irreps_linear import fp16x3, fp16x3_wgmma

    spec = SIDE_BY_SIDE if name == "side_by_side" else CATALOG[name]
    launches, kernels = [], []
    for module, grouped_kernel in ((fp16x3, "mm_grouped_fp16x3"),
                                   (fp16x3_wgmma, "mm_grouped_fp16x3_wgmma")):
        real_grouped = getattr(module, grouped_kernel)
        monkeypatch.setattr(module, grouped_kernel, lambda s, *a, real_grouped=real_grouped,
                            kernel=grouped_kernel: (kernels.append(kernel) or launches.append(
                                [b.d for b in s.blocks]) or real_grouped(s, *a)))
    monkeypatch.setattr(gemm, "MIN_WEIGHTS_FLOAT32", 1)
    monkeypatch.setattr(gemm, "_WGMMA", wgmma)
    gen = torch.Generator().manual_seed(4)
    n = 2500
    x = torch.randn(n, spec.dim_in, generator=gen, dtype=torch.float64)
    w = torch.randn(spec.weight_numel, generator=gen, dtype=torch.float64) / 16
    g = torch.randn(n, spec.dim_out, generator=gen, dtype=torch.float64)
    elem = torch.zeros(n, dtype=torch.int32)
    want = autograd.reference(spec, x, w, elem)
    want_t = autograd.reference(spec.transposed(), g, transpose_weights(spec, w), elem)
    assert gemm.takes(spec, torch.float32, n, gemm.MIN_NODES_FLOAT64,
                      gemm.grouped_in_float32(spec)) == (name == "side_by_side")
    got = gemm.apply(spec, x.float().cuda(), w.float().cuda())
    got_t = gemm.apply(spec.transposed(), g.float().cuda(),
                       transpose_weights(spec, w).float().cuda())
    for a, b in ((got, want), (got_t, want_t)):
        assert (a.double().cpu() - b).norm() <= 2e-6 * b.norm()
    # one launch a direction, largest irreps first; the message's scalars (fed by two blocks
    # apart) outside it in the forward
    want_dims = {"side_by_side": [[7, 5, 3, 1], [7, 5, 3, 3, 1, 1]],
                 "message": [[7, 5, 3], [7, 5, 3, 1, 1]]}[name]
    assert launches == want_dims
    hopper = torch.cuda.get_device_capability() == (9, 0)
    want_kernel = "mm_grouped_fp16x3_wgmma" if wgmma and hopper else "mm_grouped_fp16x3"
    assert kernels == [want_kernel] * 2
    assert fp16x3_wgmma.DEVICE_ARCH == "sm_90"


def test_grouped_map_takes_a_view_off_the_16_byte_boundary(monkeypatch):
    """A float32 map planned for the grouped kernel runs there even where its input is a view
    that starts 4 bytes off a 16-byte boundary (copied once, not sent to cuBLAS block by block),
    and equals the reference."""
    from mace_accel.ops.irreps_linear import fp16x3, fp16x3_wgmma

    launches = []
    for module, name in ((fp16x3, "mm_grouped_fp16x3"),
                         (fp16x3_wgmma, "mm_grouped_fp16x3_wgmma")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real: launches.append(1) or real(*a))
    spec = SIDE_BY_SIDE
    gen = torch.Generator().manual_seed(5)
    n = 300
    x = torch.randn(n, spec.dim_in, generator=gen, dtype=torch.float64)
    w = torch.randn(spec.weight_numel, generator=gen, dtype=torch.float64) / 16
    base = torch.empty(n * spec.dim_in + 1, dtype=torch.float32, device="cuda")
    shifted = base[1:].view(n, spec.dim_in)
    shifted.copy_(x)
    assert shifted.is_contiguous() and not gemm._fits_grouped(shifted, shifted)
    got = gemm.apply(spec, shifted, w.float().cuda())
    want = autograd.reference(spec, x, w, torch.zeros(n, dtype=torch.int32))
    assert launches == [1]
    assert (got.double().cpu() - want).norm() <= 2e-6 * want.norm()
