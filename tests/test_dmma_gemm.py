"""The float64 tensor-core GEMM without a GPU: the fragment buffer and the kernel's data flow,
emulated lane by lane with the m16n8k8 layout of the PTX ISA and the kernel's ring addressing,
equal ``a @ W``; plans, geometry checks, sources, the pick of the path (``g @ W^T`` on cuBLAS).
test_gpu_dmma_gemm.py runs the kernel itself."""

from __future__ import annotations

import pytest
import torch

from mace_accel.errors import UnsupportedModelError
from mace_accel.ops.radial.dmma_gemm import autograd, codegen
from mace_accel.ops.radial.dmma_gemm.spec import DmmaGemmSpec, pack, unsupported_reason
from mace_accel.ops.radial.silu_mlp.spec import FRAG

from dmma_emulation import load, mma, store


def _operands(spec, rows=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(spec.narrow, spec.wide, generator=gen, dtype=torch.float64)
    a = torch.randn(rows, spec.narrow, generator=gen, dtype=torch.float64)
    return w, a


def _ring(plan, frag):
    """The walk the kernel takes over the wide dimension's ``plan.tw`` tiles: chunk ``c`` of
    ``plan.chunk`` tiles in a stage, tile ``j`` of it at ``stage[(j TN + i) 32 + lane]``.
    Yields ``(tile index, its TN fragments [TN, 32, 2])``."""
    for c in range(plan.chunks):
        stage = frag[c * plan.chunk * plan.tn:]
        for j in range(plan.chunk):
            tile = c * plan.chunk + j
            if tile >= plan.tw:
                return
            yield tile, stage[j * plan.tn:(j + 1) * plan.tn]


def _emulate_forward(plan, packed, a):
    """The forward kernel on one m-tile (16 rows): A fragments of ``a`` in registers, the W
    chunks read at the template's addresses ``stage[(j TN + kt) 32 + lane]``."""
    x = load(a, plan.tn)
    out = torch.zeros(16, FRAG * plan.tw, dtype=torch.float64)
    for nt, tiles in _ring(plan, packed.view(-1, 32, 2)):  # double2 per lane
        acc = torch.zeros(32, 4, dtype=torch.float64)
        for kt in range(plan.tn):
            acc += mma(x[kt][:, [0, 2, 1, 3]], tiles[kt])
        out[:, FRAG * nt:FRAG * nt + FRAG] = store(acc.unsqueeze(0), FRAG)
    return out[:, :plan.wide]


# the wider catalog shapes take the same code paths with more tiles (slow to emulate)
EMULATED = ("mp_l1", "ragged", "small")


@pytest.mark.parametrize("name", EMULATED)
@pytest.mark.parametrize("geometry", [None, (4, 1, 3, 2)])
def test_emulated_kernel_equals_the_product(name, geometry):
    spec = codegen.CATALOG[name]
    w, a = _operands(spec)
    packed = pack(spec, w)
    assert packed.shape == (spec.packed_numel,)
    plan = codegen.plan_kernel(spec, geometry=geometry)
    torch.testing.assert_close(_emulate_forward(plan, packed, a), a @ w, rtol=1e-12, atol=1e-12)


def test_unsupported_widths_say_why():
    assert "even" in unsupported_reason(64, 1281)
    assert "64" in unsupported_reason(65, 128)
    assert unsupported_reason(64, 1280) is None
    with pytest.raises(UnsupportedModelError, match="even"):
        DmmaGemmSpec(8, 15)
    with pytest.raises(UnsupportedModelError, match="shape"):
        pack(DmmaGemmSpec(8, 16), torch.zeros(16, 8, dtype=torch.float64))


def test_plans_fit_and_bad_geometry_is_refused():
    for spec in codegen.CATALOG.values():
        for geometry in (None, codegen.SMALL_GEOMETRY, codegen.TESTED_GEOMETRY):
            plan = codegen.plan_kernel(spec, geometry=geometry)
            assert plan.shared_bytes <= codegen.SHARED_LIMIT
            assert plan.grid(1) == 1 and plan.grid(10 ** 7, 132) == 132
    spec = codegen.CATALOG["large"]
    with pytest.raises(ValueError, match="shared memory"):
        codegen.plan_kernel(spec, geometry=(16, 1, 64, 4))
    with pytest.raises(ValueError, match="geometry"):
        codegen.plan_kernel(spec, geometry=(8, 2, 4, 1))


def test_sources_are_in_the_catalog_and_only_for_sm90(rendered_catalog):
    names = [n for n in rendered_catalog if n.startswith("dmma_gemm/")]
    assert len(names) == len(codegen.CATALOG) * 3  # default, small, tested geometry
    src = rendered_catalog["dmma_gemm/mp_l2_forward"]
    assert "mma.sync.aligned.m16n8k8.row.col.f64" in src and "cp.async" in src
    from mace_accel.ops.limits import DeviceLimits
    assert list(codegen.catalog_sources(DeviceLimits(arch="sm_80"))) == []


def test_runs_only_on_float64_cuda():
    cpu = torch.zeros(4, 64, dtype=torch.float64)
    assert not autograd.runs_on(cpu, 64, 1280)
    assert not autograd.runs_on(cpu.float(), 64, 1280)


def test_resident_blocks_count_registers_shared_memory_and_threads(monkeypatch):
    from mace_accel.ops.runtime import Kernel

    kernel = object.__new__(Kernel)
    kernel.dynamic_shared = 32 * 1024
    monkeypatch.setattr(Kernel, "registers", lambda self: 126)  # 128 a thread, per warp
    assert kernel.resident_blocks(128) == 4  # 65536 / (4 warps x 4096): 4; shared: 6
    kernel.dynamic_shared = 100 * 1024
    assert kernel.resident_blocks(128) == 2  # shared: 228 KB / 101 KB
    monkeypatch.setattr(Kernel, "registers", lambda self: 32)
    kernel.dynamic_shared = 0
    assert kernel.resident_blocks(1024) == 2  # threads: 2048 an SM


class _StandIn:
    """The CUDA kernel's stand-in on the CPU: checks the packed buffer it is handed, multiplies
    with torch."""

    def __init__(self, w):
        self.w, self.calls = w, []

    def forward(self, a, packed):
        spec = DmmaGemmSpec(*self.w.shape)
        assert torch.equal(packed, pack(spec, self.w))
        self.calls.append("forward")
        return a @ self.w


def test_the_radial_mlp_picks_and_wires_the_kernel(monkeypatch):
    """float64 where the kernels run: the last layer's forward on them (its packed weight cached
    with the module), its input gradient on cuBLAS; the conv's recomputed weights told which
    GEMM runs; the report says so, and why not for an odd width."""
    from test_radial_tc import _fused_mlp

    fused = _fused_mlp(hs=(8, 16, 16, 12))
    x = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    assert fused.last_gemm(x) == "cublas"  # a CPU tensor
    assert "float64 tensor-core GEMM kernel" in fused.describe()
    assert "float64 on cuBLAS (the float64 tensor-core GEMM needs an even output width" in \
        _fused_mlp(hs=(8, 16, 16, 13)).describe()
    monkeypatch.setattr(autograd, "runs_on", lambda t, narrow, wide: t.dtype == torch.float64)
    w = fused.last_weight(torch.float64).detach()
    stand_in = _StandIn(w)
    monkeypatch.setattr(autograd, "_kernels", lambda narrow, wide, device: stand_in)
    assert fused.last_gemm(x) == "dmma" and fused.last_gemm(x.float()) == "cublas"
    for p in fused.parameters():
        p.requires_grad_(False)
    out = fused.last_layer(x)
    (gx,) = torch.autograd.grad(out.sum(), x)
    assert stand_in.calls == ["forward"]  # the input gradient on cuBLAS
    torch.testing.assert_close(out, x @ w)
    torch.testing.assert_close(gx, torch.ones(6, 12, dtype=torch.float64) @ w.t())
    assert fused._packed_last(torch.float64) is fused._packed_last(torch.float64)  # cached


def test_the_folded_conv_runs_its_weights_on_the_named_gemm(monkeypatch):
    """``folded_conv_tp(gemm="dmma")`` packs W_last once per call, makes each chunk's weights on
    the kernel and its d h on cuBLAS; results and gradients as with cuBLAS; an unknown name is
    refused."""
    from test_folded_conv import _problem

    from mace_accel.ops.conv_tp.folded import folded_conv_tp

    key, graph, (x, y, h, w) = _problem()
    stand_in = _StandIn(w.detach())
    monkeypatch.setattr(autograd, "_kernels", lambda narrow, wide, device: stand_in)
    results = []
    for gemm in ("cublas", "dmma"):
        out = folded_conv_tp(key, graph, x, y, h, w, backend="reference", max_edges=11,
                             gemm=gemm)
        results.append((out, *torch.autograd.grad(out.sum(), (x, y, h, w))))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert set(stand_in.calls) == {"forward"}
    with pytest.raises(ValueError, match="gemm must be one of"):
        folded_conv_tp(key, graph, x, y, h, w, backend="reference", gemm="cutlass")


def test_a_misaligned_view_is_copied_before_the_kernels(monkeypatch):
    seen = []

    class Aligned(_StandIn):
        def forward(self, a, packed):
            seen.append(a.data_ptr() % 16)
            return super().forward(a, packed)

    w = torch.randn(8, 16, dtype=torch.float64)
    monkeypatch.setattr(autograd, "_kernels", lambda narrow, wide, device: Aligned(w))
    flat = torch.randn(8 * 5 + 1, dtype=torch.float64)
    a = flat[1:].view(5, 8)  # starts 8 bytes into the buffer
    out = autograd.mm(a, autograd.pack_weight(w), w)
    torch.testing.assert_close(out, a @ w)
    assert seen == [0]
