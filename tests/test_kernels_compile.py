"""Generated kernels of the catalog compile with nvcc for sm_90 (the wgmma ones for sm_90a),
without register spills, stack frames, or ptxas's wgmma performance notes (C7511-C7519:
wgmmas serialized, fences injected).

By default one kernel of each kind compiles. A kind is a family, dtype, direction and variant:
the kernel's name without its problem and size (:func:`kind`); of each kind the kernel with the
longest source compiles (the most unrolled code, the likeliest to spill). Every kernel CI
compiles (``catalog_sources(compiled_in_ci=True)``) compiles in the tests marked ``slow``:

    python -m pytest -q tests/test_kernels_compile.py --run-slow

Collection renders nothing: the names come from the pins (tests/data/kernel_sources.json, which
tests/test_codegen_pinned.py keeps equal to the catalog). Rendering and nvcc run in a process of
their own at the lowest priority, started as soon as the run's tests are known (conftest's
``pytest_collection_finish`` calls :func:`start_background`), one nvcc on each core but one: they
take the cores that the other tests, run on one thread meanwhile, leave idle. This module's tests
read the results.

Runs on CPU machines (nvcc only, no GPU). On CI (CI=true) a missing nvcc is a failure.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Tuple

import pytest
import torch

from mace_accel.ops.sources import catalog_sources

NVCC = shutil.which("nvcc") or (
    "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)

if NVCC is None:
    if os.environ.get("CI"):
        pytest.fail("nvcc not found: CI must compile the kernel catalog", pytrace=False)
    pytest.skip("nvcc not found", allow_module_level=True)

PINS = Path(__file__).parent / "data" / "kernel_sources.json"

# per family, the (pattern, replacement) steps that take the problem and size out of a kernel's
# name (after "family/"); a family not listed: every kernel is a kind of its own
_NOT_KIND = {
    # <problem>-<dtype>[-staged]-g<group>-<variant>, <problem>-<dtype>-sender-sum
    "conv_tp": [(r"^.+?-(?=float(32|64)-)", ""), (r"-g\d+(?=-)", "")],
    "edge_features": [(r"^.+?-(?=float(32|64)-)", "")],
    "symmetric_contraction": [(r"^.+?-(?=float(32|64)-)", "")],
    # <map>[_t]_<dtype>; the grouped 3xFP16 maps (<map>_fp16x3[_wgmma]) each a kind of its own
    "irreps_linear": [(r"^\w+?_(?=(t_)?float(32|64)$)", "")],
    "radial_table": [(r"_n\d+$", "")],
}


def kind(name: str) -> str:
    """``family/kind`` of a catalog kernel's name, e.g. ``conv_tp/float64-staged-bwd011`` for
    ``conv_tp/mp-large-l2-float64-staged-g1-bwd011``."""
    family, kernel = name.split("/", 1)
    for pattern, replacement in _NOT_KIND.get(family, ()):
        kernel = re.sub(pattern, replacement, kernel)
    return f"{family}/{kernel}"


PINNED = sorted(json.loads(PINS.read_text()))
KINDS = sorted({kind(name) for name in PINNED})


def _nvcc(source: str, folder: Path) -> Tuple[int, str]:
    folder.mkdir(parents=True)
    src = folder / "k.cu"
    src.write_text(source)
    # the wgmma kernels exist only on sm_90a (ops/irreps_linear/fp16x3_wgmma.py); the rest on sm_90
    arch = "sm_90a" if "wgmma.mma_async" in source else "sm_90"
    proc = subprocess.run(
        [NVCC, f"-arch={arch}", "-std=c++17", "-cubin", "-Xptxas", "-v", "-Werror", "all-warnings",
         "-o", str(folder / "k.cubin"), str(src)],
        capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def _compile(out: Path) -> None:
    """The background process: render what CI compiles, take the kernel with the longest source
    of each requested kind and every requested name, run nvcc on them, one on each core but one
    (the tests keep one; at most 8), and write ``{"kinds": {kind: name}, "compiled": {name:
    [exit code, log]}}``."""
    request = json.loads((out / "request.json").read_text())
    sources = dict(catalog_sources(compiled_in_ci=True))
    chosen = {}
    for kernel_kind in request["kinds"]:
        names = [name for name in sources if kind(name) == kernel_kind]
        chosen[kernel_kind] = max(names, key=lambda n: (len(sources[n]), n)) if names else None
    todo = sorted({n for n in chosen.values() if n} | {n for n in request["names"] if n in sources})
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with concurrent.futures.ThreadPoolExecutor(max(1, min(8, (cores or 1) - 1))) as pool:
        logs = pool.map(lambda i: _nvcc(sources[todo[i]], out / str(i)), range(len(todo)))
        results = {"kinds": chosen, "compiled": dict(zip(todo, logs))}
    (out / "results.part").write_text(json.dumps(results))
    (out / "results.part").rename(out / "results.json")


class _Compiles:
    """The process of :func:`_compile`, at the lowest priority, its files in a temporary folder
    (removed at exit). While it runs, torch in the test process keeps to one thread: with nvcc
    on the other core, torch's OpenMP threads wait for each other (the tests took several times
    longer)."""

    def __init__(self, request: dict):
        self.out = Path(tempfile.mkdtemp(prefix="mace-accel-nvcc-"))
        (self.out / "request.json").write_text(json.dumps(request))
        nice = shutil.which("nice")
        with open(self.out / "stderr", "w") as stderr:
            self.proc = subprocess.Popen(
                [*([nice, "-n", "19"] if nice else []), sys.executable, __file__, str(self.out)],
                stdout=stderr, stderr=stderr, start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)
        atexit.register(self.stop)

    def poll(self) -> bool:
        """Whether it has finished (then torch has its threads back)."""
        if self.proc.poll() is None:
            return False
        if self.threads:
            torch.set_num_threads(self.threads)
            self.threads = 0
        return True

    def results(self) -> dict:
        self.proc.wait()
        self.poll()
        assert (self.out / "results.json").exists(), (self.out / "stderr").read_text()
        return json.loads((self.out / "results.json").read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:  # the run ended first (interrupted): stop it and its nvcc
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait()
        shutil.rmtree(self.out, ignore_errors=True)


_STARTED: list = []


def start_background(items) -> Optional[_Compiles]:
    """Start the compiles that the selected ``items`` of this module check, if any (conftest
    calls it once the run's tests are known, and polls the result before each test)."""
    request = {"kinds": [], "names": []}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "kernel_kind" in params:
            request["kinds"].append(params["kernel_kind"])
        elif "name" in params:
            request["names"].append(params["name"])
    if not (request["kinds"] or request["names"]):
        return None
    _STARTED.append(_Compiles(request))
    return _STARTED[-1]


@pytest.fixture(scope="module")
def nvcc_results(request) -> dict:
    """The background process's results, once it has finished."""
    if not _STARTED:  # not started by conftest's hook
        start_background([item for item in request.session.items
                          if getattr(item, "module", None) is request.module])
    return _STARTED[-1].results()


def _check(name: str, returncode: int, log: str) -> None:
    assert returncode == 0, f"nvcc failed for {name}:\n{log}"
    spills = [int(v) for v in re.findall(r"(\d+) bytes spill (?:stores|loads)", log)]
    assert spills and max(spills) == 0, f"register spills in {name}:\n{log}"
    frames = [int(v) for v in re.findall(r"(\d+) bytes stack frame", log)]
    assert max(frames) == 0, f"local-memory stack frame in {name}:\n{log}"
    assert not re.search(r"C751[1-9]", log), \
        f"ptxas serializes or fences the wgmmas of {name}:\n{log}"


def test_kinds_keep_family_and_dtype():
    """A kind keeps its kernels' family and dtype, and groups the sizes of one variant."""
    for name in PINNED:
        dtype = re.search(r"float(32|64)", name)
        assert kind(name).startswith(name.split("/")[0] + "/"), name
        assert dtype is None or dtype.group() in kind(name), name
    assert kind("conv_tp/mp-large-l2-float64-staged-g1-bwd011") == "conv_tp/float64-staged-bwd011"
    assert len(KINDS) < len(PINNED) / 4, "kernel names no longer match the kind patterns"


@pytest.mark.parametrize("kernel_kind", KINDS)
def test_one_kernel_of_each_kind_compiles_without_spills(kernel_kind, nvcc_results):
    name = nvcc_results["kinds"][kernel_kind]
    assert name is not None, (f"no kernel of kind {kernel_kind} among those CI compiles: are "
                              "the pins stale (tests/test_codegen_pinned.py)?")
    _check(name, *nvcc_results["compiled"][name])


@pytest.mark.slow
@pytest.mark.parametrize("name", PINNED)
def test_kernel_compiles_without_spills(name, nvcc_results):
    if name not in nvcc_results["compiled"]:
        pytest.skip("not compiled by CI (catalog_sources(compiled_in_ci=True)), or stale pins")
    _check(name, *nvcc_results["compiled"][name])


if __name__ == "__main__":  # the background process of start_background
    _compile(Path(sys.argv[1]))
