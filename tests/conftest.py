"""Shared fixtures: tiny MACE models, two small structures, the rendered kernel catalog; skipping
of GPU tests and leaving out of slow ones."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true",
                     help="also run the tests marked slow (left out unless -m names slow)")


def pytest_sessionstart(session):
    """Import mace (and through it the optional backends it probes) before any test runs.
    OpenEquivariance keeps the exception of its failed extension build in a module global; its
    traceback holds the frames of whatever first imported it: a test's frame would keep that
    test's models and radial tables on the GPU for the rest of the session."""
    from mace_accel._e3nn_compat import import_mace

    import_mace()
    import mace.modules  # noqa: F401  (imports mace's wrapper_ops, which probe the backends)


def pytest_collection_modifyitems(config, items):
    """Leave out the tests marked ``slow`` (reported as deselected) unless ``--run-slow`` is
    given or the ``-m`` expression names ``slow``; skip those marked ``gpu`` when torch sees no
    CUDA device."""
    if not (config.getoption("--run-slow") or "slow" in (config.getoption("markexpr") or "")):
        slow = [item for item in items if item.get_closest_marker("slow") is not None]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if item.get_closest_marker("slow") is None]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_BACKGROUND = []  # work started by test modules, until its poll() says it has finished


def pytest_collection_finish(session):
    """Once the run's tests are known, a test module with a ``start_background(items)`` gets its
    selected tests, to start work that runs beside the others (tests/test_kernels_compile.py:
    rendering and nvcc, at the lowest priority)."""
    if session.config.option.collectonly:
        return
    by_module = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if hasattr(module, "start_background"):
            by_module.setdefault(module, []).append(item)
    started = (module.start_background(items) for module, items in by_module.items())
    _BACKGROUND.extend(work for work in started if work is not None)


def pytest_runtest_setup(item):
    """Poll the background work: once finished, it gives back what it held (torch's threads)."""
    _BACKGROUND[:] = [work for work in _BACKGROUND if not work.poll()]


@pytest.fixture(scope="session")
def rendered_catalog():
    """``{name: CUDA source}`` of every kernel of the catalog
    (:func:`mace_accel.ops.sources.catalog_sources`), rendered once, by the first test that
    asks (collection renders nothing)."""
    from mace_accel.ops.sources import catalog_sources

    return dict(catalog_sources())


@pytest.fixture(scope="session")
def tiny_model():
    """Factory ``make_tiny_model(interaction=..., hidden_irreps=..., heads=..., dtype=...)``.

    Builds :func:`mace_accel.models.small_test_model` (elements H, C, O, Cu; r_max 4 Å) once per
    set of arguments in the session and returns a deep copy, so tests may patch or cast it.
    The model is built with torch's default dtype set to ``dtype`` (restored right after), as
    mace trains, so its constants (CG/U matrices) are exact in that dtype: a float64 model built
    under a float32 default is only equivariant to ~1e-10.
    """
    from helpers import default_dtype

    from mace_accel.models.architectures import small_test_model

    cache = {}

    def make_tiny_model(interaction: str = "RealAgnosticResidualInteractionBlock",
                        hidden_irreps: str = "8x0e+8x1o", heads=("Default",),
                        dtype: torch.dtype = torch.float64, **kwargs) -> torch.nn.Module:
        key = (interaction, hidden_irreps, tuple(heads), dtype, tuple(sorted(kwargs.items())))
        if key not in cache:
            with default_dtype(dtype):
                cache[key] = small_test_model(interaction, hidden_irreps=hidden_irreps,
                                              heads=tuple(heads), dtype=dtype, **kwargs)
        return copy.deepcopy(cache[key])

    return make_tiny_model


@pytest.fixture
def cu_atoms():
    """8 Cu atoms: fcc (a = 3.6 Å) 2x1x1 cubic supercell, periodic, slightly rattled."""
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat((2, 1, 1))
    atoms.rattle(stdev=0.05, seed=1)
    return atoms


@pytest.fixture
def molecule_atoms():
    """Methanol (H, C, O), not periodic, slightly rattled."""
    from ase.build import molecule

    atoms = molecule("CH3OH")
    atoms.rattle(stdev=0.02, seed=2)
    atoms.positions += np.array([0.1, -0.2, 0.3])
    return atoms


@pytest.fixture(scope="session")
def model_file(tmp_path_factory):
    """A tiny float64 Cu/Ni model (4x0e+4x1o, random weights, seed 5) saved to disk, for runs
    and command-line tests (modules may define their own ``model_file``).

    Random weights give no physical minimum near fcc; with this seed the example structure
    relaxes smoothly (other seeds let FIRE collapse atom pairs within a few dozen steps).
    """
    from mace_accel.models.architectures import small_test_model

    model = small_test_model("RealAgnosticResidualInteractionBlock", elements=(28, 29),
                             hidden_irreps="4x0e+4x1o", seed=5)
    path = tmp_path_factory.mktemp("model") / "cuni.model"
    torch.save(model, path)
    return path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """After each GPU test, once pytest has let go of its fixtures: collect the test's objects
    and hand torch's cached blocks back to the driver, so that one test's peak (radial tables,
    6,912-atom calls) is not held by torch's allocator when a later test's kernels allocate
    through CuPy or the driver. ``MACE_ACCEL_GPU_MEMORY_LOG=path`` appends each GPU test's live
    and reserved memory afterwards (and the largest tensors still alive), to find what a test
    leaves behind."""
    yield
    if "gpu" not in item.keywords or not torch.cuda.is_available():
        return
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    path = os.environ.get("MACE_ACCEL_GPU_MEMORY_LOG")
    if path:
        live = torch.cuda.memory_allocated()
        lines = [f"{item.nodeid}: {live / 2**30:.2f} GiB live, "
                 f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved"]
        if torch.cuda.memory_reserved() > 2**34:  # where the reserved memory sits
            by_place = {}
            for seg in torch.cuda.memory_snapshot():
                place = (seg.get("stream"), tuple(seg.get("segment_pool_id") or ()))
                total, used = by_place.get(place, (0, 0))
                by_place[place] = (total + seg["total_size"], used + seg["allocated_size"])
            for (stream, pool), (total, used) in sorted(by_place.items(),
                                                        key=lambda kv: -kv[1][0])[:4]:
                lines.append(f"    stream {stream} pool {pool}: {total / 2**30:.2f} GiB "
                             f"reserved, {used / 2**30:.2f} GiB in use")
        if live > 2**31:
            big = sorted((o for o in gc.get_objects() if torch.is_tensor(o) and o.is_cuda
                          and o.numel() * o.element_size() > 2**26),
                         key=lambda t: -t.numel() * t.element_size())[:5]
            for t in big:
                owners = [type(r).__name__ for r in gc.get_referrers(t)][:6]
                lines.append(f"    {tuple(t.shape)} {t.dtype} held by {owners}")
        with open(path, "a") as f:
            f.write("\n".join(lines) + "\n")
