"""The grouped 3xFP16 kernels of the equivariant linear maps on the GPU (``mma.sync``, and
``wgmma`` on Hopper): float32's accuracy against float64 on inputs of wide magnitudes, the
columns outside the blocks untouched, bit-identical repeats in a CUDA graph, the two kernels
within 1e-6 of each other on MH-1's linear_2 (what they refuse before a launch:
tests/test_grouped_gemm.py)."""

from __future__ import annotations

import pytest
import torch

from mace_accel.bench.timing import capture_graph
from mace_accel.ops.irreps_linear import fp16x3, fp16x3_wgmma
from mace_accel.ops.irreps_linear.grouped import GROUPED_CATALOG, E3nnBlock, GroupedSpec

pytestmark = pytest.mark.gpu

TOLERANCE = 1e-5  # the tolerance table's float32 forward (relative L-infinity)


def _err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative L-infinity error (the tolerance table's float32 measure)."""
    return float((a.double().cpu() - ref).abs().max() / ref.abs().max())


def _fp16x3_runner(kernel: str, spec, w):
    """``run(x, out)`` of the 3xFP16 kernel ``kernel`` (``"mma"`` or ``"wgmma"``) with the
    weights ``w`` split (and packed) for it."""
    split = fp16x3.split_weights(spec, w)
    if kernel == "mma":
        return lambda x, out: fp16x3.mm_grouped_fp16x3(spec, x, split, out)
    if torch.cuda.get_device_capability(w.device) != (9, 0):
        pytest.skip("the wgmma kernel runs on sm_90 (H100, H200)")
    packed = fp16x3_wgmma.pack_weights(fp16x3_wgmma.plan_wgmma(spec), split)
    return lambda x, out: fp16x3_wgmma.mm_grouped_fp16x3_wgmma(spec, x, packed, out)


@pytest.mark.parametrize("kernel", ["mma", "wgmma"])
@pytest.mark.parametrize("name", sorted(GROUPED_CATALOG))
@pytest.mark.parametrize("nodes", [1, 37, 1500])
def test_fp16x3_grouped_kernel_keeps_float32_accuracy(name, nodes, kernel):
    """The 3xFP16 kernels (``mma.sync``; ``wgmma`` on Hopper) against float64 on rows whose
    magnitudes span 1e-8 to 1e8 (one row zero, one 1e30): within the float32 tolerance of the
    largest output, the zero row exactly zero, the huge row finite and accurate on its own
    scale, the columns outside the blocks untouched; the same bits on a repeat in a CUDA
    graph."""
    spec = GROUPED_CATALOG[name]
    gen = torch.Generator().manual_seed(nodes)
    x64 = torch.randn(nodes, spec.lda, generator=gen, dtype=torch.float64)
    magnitudes = torch.logspace(-8, 8, nodes, dtype=torch.float64)
    x64 *= magnitudes[torch.randperm(nodes, generator=gen)][:, None]
    if nodes > 2:
        x64[1], x64[2] = 0.0, x64[2] / x64[2].abs().max() * 1e30
    w64 = torch.randn(spec.weight_numel, generator=gen, dtype=torch.float64) / 16
    x, w = x64.float().cuda(), w64.float().cuda()
    run = _fp16x3_runner(kernel, spec, w)
    out = torch.full((nodes, spec.ldc), 7.0, device="cuda")
    run(x, out)
    untouched = torch.ones(spec.ldc, dtype=torch.bool)
    for b in spec.blocks:
        block = x64[:, b.x_col:b.x_col + b.k * b.d].view(nodes, b.k, b.d)
        wt = w64[b.w_offset:b.w_offset + b.n * b.k].view(b.n, b.k)
        want = torch.einsum("nud,vu->nvd", block, wt).reshape(nodes, b.n * b.d)
        got = out[:, b.out_col:b.out_col + b.n * b.d]
        assert _err(got, want) < TOLERANCE, b
        if nodes > 2:
            assert bool((got[1] == 0).all()) and _err(got[2:3], want[2:3]) < TOLERANCE, b
        untouched[b.out_col:b.out_col + b.n * b.d] = False
    assert bool((out[:, untouched.cuda()] == 7.0).all())
    again = torch.full_like(out, 7.0)
    graph, _ = capture_graph(lambda: run(x, again))
    again.fill_(7.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(again, out)


@pytest.mark.parametrize("nodes", [64, 6912])
def test_fp16x3_wgmma_matches_mma_sync_on_mh1_linear(nodes):
    """MH-1's linear_2 (512 channels of 0e..3o; every row tile full, and 6,912 nodes: 16 K
    slices, many tiles an SM) on both 3xFP16 kernels: each within the float32 tolerance of
    float64, the two within 1e-6 of each other's largest output (their scale groups and sums
    differ: 16 rows a warp against 8)."""
    blocks, col, off = [], 0, 0
    for d in (1, 3, 5, 7):
        blocks.append(E3nnBlock(d, 512, 512, col, col, off))
        col, off = col + 512 * d, off + 512 * 512
    spec = GroupedSpec(tuple(blocks), col, col)
    gen = torch.Generator().manual_seed(3)
    x64 = torch.randn(nodes, spec.lda, generator=gen, dtype=torch.float64)
    w64 = torch.randn(spec.weight_numel, generator=gen, dtype=torch.float64) / 22
    x, w = x64.float().cuda(), w64.float().cuda()
    outs = {}
    for kernel in ("mma", "wgmma"):
        outs[kernel] = torch.zeros(nodes, spec.ldc, device="cuda")
        _fp16x3_runner(kernel, spec, w)(x, outs[kernel])
    want = torch.cat([torch.einsum("nud,vu->nvd", x64[:, b.x_col:b.x_col + 512 * b.d].view(
        nodes, 512, b.d), w64[b.w_offset:b.w_offset + 512 * 512].view(512, 512)).reshape(
        nodes, -1) for b in spec.blocks], dim=1)
    for kernel, out in outs.items():
        assert _err(out, want) < TOLERANCE, kernel
    assert _err(outs["wgmma"], outs["mma"].double().cpu()) < 1e-6

