"""The glue kernels' sources (CPU): both per dtype, in the catalog CI compiles and pins."""

from __future__ import annotations

import pytest

from mace_accel.ops import glue
from mace_accel.ops.sources import PIN_LIMITS


@pytest.mark.parametrize("dtype,real", [("float32", "float"), ("float64", "double")])
def test_every_kernel_renders_per_dtype(dtype, real):
    src = glue.render_kernels(dtype)
    for which in glue.KERNELS:
        assert f"{glue.kernel_name(which, dtype)}(" in src
    assert f"typedef {real} real;" in src and "__shfl_xor_sync" in src and "atomic" not in src


def test_catalog_has_both_dtypes():
    names = [name for name, _ in glue.catalog_sources(PIN_LIMITS)]
    assert names == ["glue/float32", "glue/float64"]


def test_kernels_take_cuda_floats_outside_a_compile_trace(monkeypatch):
    import torch

    assert not glue.runs_on(torch.zeros(2))  # CPU: the torch formulas
    fake_cuda = type("T", (), {"is_cuda": True, "dtype": torch.float32})()
    assert glue.runs_on(fake_cuda)
    assert not glue.runs_on(type("T", (), {"is_cuda": True, "dtype": torch.float16})())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not glue.runs_on(fake_cuda)
