"""Every generated kernel of the catalog compiles with nvcc for sm_90, without register spills.

Runs on CPU machines (nvcc only, no GPU). On CI (CI=true) a missing nvcc is a failure.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from mace_accel.catalog import UNIQUE
from mace_accel.codegen import (all_backward_needs, render_backward, render_forward,
                                render_sender_sum)
from mace_accel.schedule import DeviceLimits, plan_kernels
from mace_accel.spec import make_spec

NVCC = shutil.which("nvcc") or (
    "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
H100 = DeviceLimits(arch="sm_90", max_threads_per_block=1024, max_shared_per_block=48 * 1024)

if NVCC is None:
    if os.environ.get("CI"):
        pytest.fail("nvcc not found: CI must compile the kernel catalog", pytrace=False)
    pytest.skip("nvcc not found", allow_module_level=True)


def _sources():
    for name, problem in UNIQUE.items():
        spec = make_spec(*problem)
        for dtype in ("float32", "float64"):
            for plan in plan_kernels(spec, dtype, H100).launches:
                tag = f"{name}-{dtype}-g{plan.group}"
                yield f"{tag}-fwd", render_forward(plan)
                yield f"{tag}-sender-sum", render_sender_sum(plan)
                # every gradient selection on one problem; elsewhere those MACE uses
                selections = all_backward_needs() if name == "mp-medium-l2" else [
                    (True, True, True), (False, True, True)]
                for needs in selections:
                    yield f"{tag}-bwd{''.join(str(int(n)) for n in needs)}", \
                        render_backward(plan, needs)
                yield f"{tag}-bwd111-atomic", render_backward(plan, (True, True, True), atomic=True)


SOURCES = dict(_sources())


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_kernel_compiles_without_spills(name, tmp_path):
    src = tmp_path / "k.cu"
    src.write_text(SOURCES[name])
    proc = subprocess.run(
        [NVCC, "-arch=sm_90", "-std=c++17", "-cubin", "-Xptxas", "-v", "-Werror", "all-warnings",
         "-o", str(tmp_path / "k.cubin"), str(src)],
        capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"nvcc failed for {name}:\n{log}"
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    assert spills and max(spills) == 0, f"register spills in {name}:\n{log}"
    frames = [int(v) for v in re.findall(r"(\d+) bytes stack frame", log)]
    assert max(frames) == 0, f"local-memory stack frame in {name}:\n{log}"
