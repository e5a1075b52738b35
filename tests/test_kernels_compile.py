"""Every generated kernel of the catalog compiles with nvcc for sm_90 (the wgmma ones for
sm_90a), without register spills, stack frames, or ptxas's wgmma performance notes (C7511-C7519:
wgmmas serialized, fences injected).

Runs on CPU machines (nvcc only, no GPU). On CI (CI=true) a missing nvcc is a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from mace_accel.ops.sources import catalog_sources

NVCC = shutil.which("nvcc") or (
    "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)

if NVCC is None:
    if os.environ.get("CI"):
        pytest.fail("nvcc not found: CI must compile the kernel catalog", pytrace=False)
    pytest.skip("nvcc not found", allow_module_level=True)


SOURCES = dict(catalog_sources(compiled_in_ci=True))


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_kernel_compiles_without_spills(name, tmp_path):
    src = tmp_path / "k.cu"
    src.write_text(SOURCES[name])
    # the wgmma kernels exist only on sm_90a (ops/radial_tc/wgmma.py); the rest on sm_90
    arch = "sm_90a" if "wgmma.mma_async" in SOURCES[name] else "sm_90"
    proc = subprocess.run(
        [NVCC, f"-arch={arch}", "-std=c++17", "-cubin", "-Xptxas", "-v", "-Werror", "all-warnings",
         "-o", str(tmp_path / "k.cubin"), str(src)],
        capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"nvcc failed for {name}:\n{log}"
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    assert spills and max(spills) == 0, f"register spills in {name}:\n{log}"
    frames = [int(v) for v in re.findall(r"(\d+) bytes stack frame", log)]
    assert max(frames) == 0, f"local-memory stack frame in {name}:\n{log}"
    assert not re.search(r"C751[1-9]", log), \
        f"ptxas serializes or fences the wgmmas of {name}:\n{log}"
