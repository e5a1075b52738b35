"""Every generated kernel source of every op family's catalog, by name.

One list for the three places that need it: the nvcc compile test (CI compiles one kernel of each
kind for sm_90, every kernel with ``--run-slow``, and fails on errors, spills or stack frames),
the pinned-source test (a hash per kernel, so a change to generated code is deliberate), and
``scripts/pin_kernels.py`` (which rewrites the pins).
"""

from __future__ import annotations

import hashlib
from typing import Dict, Iterator, Mapping, Optional, Tuple

from mace_accel.ops.limits import STATIC_SHARED, DeviceLimits

# the GPU the pins and the CI compile are made for (H100/H200); the runtime reads the real one
PIN_LIMITS = DeviceLimits(arch="sm_90", max_threads_per_block=1024,
                          max_shared_per_block=STATIC_SHARED)


def catalog_sources(limits: DeviceLimits = PIN_LIMITS,
                    compiled_in_ci: bool = False) -> Iterator[Tuple[str, str]]:
    """``(family/kernel-name, CUDA source)`` for every family's catalog.

    Args:
        compiled_in_ci: only what CI's nvcc test compiles: of the symmetric contraction, the
            problems tagged ``nvcc`` (see its catalog for why the others are left out).
    """
    from mace_accel.ops.conv_tp import codegen as conv_tp
    from mace_accel.ops.conv_tp import staged as conv_tp_staged
    from mace_accel.ops.edge_features import codegen as edge_features_codegen
    from mace_accel.ops.edge_vectors import codegen as edge_vectors
    from mace_accel.ops import gate, glue
    from mace_accel.ops.irreps_linear import catalog as irreps_linear
    from mace_accel.ops.pair_repulsion import codegen as pair_repulsion
    from mace_accel.ops.radial.table import codegen as radial_table
    from mace_accel.ops.symmetric_contraction import codegen as symmetric_contraction

    yield from conv_tp.catalog_sources(limits)
    yield from conv_tp_staged.catalog_sources(limits)
    yield from edge_features_codegen.catalog_sources(limits)
    yield from edge_vectors.catalog_sources(limits)
    yield from glue.catalog_sources(limits)
    yield from gate.catalog_sources(limits)
    yield from irreps_linear.catalog_sources(limits)
    yield from pair_repulsion.catalog_sources(limits)
    yield from radial_table.catalog_sources(limits)
    yield from symmetric_contraction.catalog_sources(limits,
                                                     *(("nvcc",) if compiled_in_ci else ()))


def source_hashes(limits: DeviceLimits = PIN_LIMITS,
                  sources: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """``{name: sha256 of the source}`` of :func:`catalog_sources`, or of ``sources`` (``{name:
    source}`` already rendered: rendering the whole catalog takes a while)."""
    pairs = sources.items() if sources is not None else catalog_sources(limits)
    return {name: hashlib.sha256(src.encode()).hexdigest() for name, src in pairs}
