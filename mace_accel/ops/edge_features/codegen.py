"""Edge-feature specs -> CUDA sources, through the ``kernels/edge_features/`` templates.

The maths comes from :mod:`.symbolic` (sympy, derivatives included); this module prints its
straight-line programs as CUDA C++ with a small printer of its own: every number is an exact hex
literal (:func:`~mace_accel.ops.templates.literal`), integer powers are products, and nothing
depends on sympy's own C printer. The templates only loop and print.

Kernels (one thread per edge; wide output rows staged in shared memory, see :mod:`.schedule`):
    sh forward          vectors [E, 3]                          -> edge_attrs [E, dim]
    sh backward         vectors, grad [E, dim]                  -> d vectors [E, 3]
    sh double backward  vectors, grad, a [E, 3]                 -> d vectors [E, 3], d grad [E, dim]
    radial forward      lengths [E, 1]                          -> feats [E, B] (, cutoff [E, 1])
    radial backward     lengths, g_feats [E, B] (, g_cutoff)    -> d lengths [E, 1]
    radial double bwd   lengths, g_feats (, g_cutoff), a [E, 1]
                                                            -> d lengths, d g_feats (, d g_cutoff)
(the radial kernels also read each edge's ``r0 [E, 1]`` where the spec has a distance transform)
"""

from __future__ import annotations

import functools
import math
from typing import Iterator, List, Mapping, Optional, Tuple

import sympy

from mace_accel.ops.edge_features import symbolic
from mace_accel.ops.edge_features.schedule import EdgePlan, plan_for
from mace_accel.ops.edge_features.spec import NORMALIZE_EPS, RadialSpec, SHSpec
from mace_accel.ops.limits import DeviceLimits
from mace_accel.ops.templates import literal, render

PASSES = ("forward", "backward", "double_backward")
_SMALL_INT = 2**24  # integers printed as (real)n are exact in float32 too


# -- printer -------------------------------------------------------------------------------------
def _number(value: sympy.Expr) -> str:
    if value.is_Integer and abs(int(value)) < _SMALL_INT:
        return f"((real){int(value)})"
    return literal(float(sympy.N(value, 40)))


def c_expr(expr: sympy.Expr, constants: Mapping[str, float]) -> str:
    """CUDA C++ for ``expr``: symbols by name (``constants`` as literals), numbers exact."""
    if expr.is_Symbol:
        return literal(constants[expr.name]) if expr.name in constants else expr.name
    if expr.is_number:
        return _number(expr)
    if expr.is_Add:
        terms = list(expr.as_ordered_terms())
        out = c_expr(terms[0], constants)
        for term in terms[1:]:
            if term.could_extract_minus_sign():
                out += f" - {_atom(-term, constants)}"
            else:
                out += f" + {_atom(term, constants)}"
        return f"({out})"
    if expr.is_Mul:
        coeff = expr.as_independent(*expr.free_symbols, as_Add=False)[0]
        if coeff.is_number and coeff < 0:
            return f"(-{_atom(-expr, constants)})"
        num, den = [], []
        for factor in expr.as_ordered_factors():
            if factor.is_Pow and factor.exp.is_Integer and factor.exp < 0:
                den.append(_power(factor.base, -int(factor.exp), constants))
            else:
                num.append(_atom(factor, constants))
        text = " * ".join(num) if num else "((real)1)"
        if den:
            text = f"{text} / ({' * '.join(den)})"
        return f"({text})"
    if expr.is_Pow:
        exp = expr.exp
        if exp.is_Integer and exp > 0:
            return _power(expr.base, int(exp), constants)
        if exp.is_Integer and exp < 0:
            return f"(((real)1) / {_power(expr.base, -int(exp), constants)})"
        if exp == sympy.Rational(1, 2):
            return f"sqrt({c_expr(expr.base, constants)})"
        if not exp.is_number:  # a distance transform's real exponent
            return f"real_pow({c_expr(expr.base, constants)}, {c_expr(exp, constants)})"
    if isinstance(expr, sympy.tanh):
        return f"real_tanh({c_expr(expr.args[0], constants)})"
    raise ValueError(f"the edge-feature printer cannot print {expr!r} ({type(expr).__name__})")


def _atom(expr: sympy.Expr, constants: Mapping[str, float]) -> str:
    text = c_expr(expr, constants)
    return text if text.startswith("(") or text.isidentifier() else f"({text})"


def _power(base: sympy.Expr, n: int, constants: Mapping[str, float]) -> str:
    b = _atom(base, constants)
    return "(" + " * ".join([b] * n) + ")" if n > 1 else b


def program_lines(program: symbolic.Program,
                  constants: Optional[Mapping[str, float]] = None) -> List[str]:
    """``const real name = expr;`` for every assignment of ``program``."""
    constants = constants or {}
    return [f"const real {name} = {c_expr(expr, constants)};"
            for name, expr in program.assignments]


# -- spherical harmonics ---------------------------------------------------------------------------
SH_KERNELS = {"forward": "mace_edge_sh_fwd", "backward": "mace_edge_sh_bwd",
              "double_backward": "mace_edge_sh_dbwd"}
RADIAL_KERNELS = {"forward": "mace_edge_radial_fwd", "backward": "mace_edge_radial_bwd",
                  "double_backward": "mace_edge_radial_dbwd"}


def kernel_name(family: str, which: str) -> str:
    """The ``extern "C"`` name of a kernel (``family``: ``"sh"`` or ``"radial"``)."""
    return (SH_KERNELS if family == "sh" else RADIAL_KERNELS)[which]


def render_sh(spec: SHSpec, plan: EdgePlan, which: str) -> str:
    """CUDA source of one spherical-harmonics kernel (``which`` in :data:`PASSES`)."""
    _check(spec, which)
    program = sh_program(spec, which)
    used = {s.name for _, expr in program.assignments for s in expr.free_symbols}
    g_used = [k for k in range(spec.dim) if f"g{k}" in used]  # d Y_0 = 0: g0 is never read
    return render(f"edge_features/sh_{which}.cu.j2", plan=plan, spec=spec, real=plan.real,
                  name=kernel_name("sh", which), body=program_lines(program), g_used=g_used,
                  eps=literal(NORMALIZE_EPS), key=spec.key(), describe=spec.describe())


@functools.lru_cache(maxsize=None)
def sh_program(spec: SHSpec, which: str) -> symbolic.Program:
    """The whole per-edge program of one kernel, from the unit vector ``u`` (and ``di``, ``k``
    of the normalisation) to the stored outputs (``y*``; ``gv*`` or ``G*``; ``dv*`` or ``HT*``
    and ``dg*``). :meth:`~.symbolic.Program.evaluate` runs it in numpy for the tests."""
    if which == "forward":
        return symbolic.sh_forward_program(spec)
    if which == "backward":
        programs = [symbolic.sh_backward_program(spec)]
        if spec.normalize:
            programs.append(symbolic.normalize_backward_program())
    else:
        programs = [symbolic.normalize_tangent_program()] if spec.normalize else []
        programs.append(symbolic.sh_double_backward_program(spec))
        if spec.normalize:
            programs.append(symbolic.normalize_double_backward_program())
    return symbolic.chain(*programs).prune(sh_stored(spec, which))


def sh_stored(spec: SHSpec, which: str) -> List[str]:
    """The program values a spherical-harmonics kernel stores, in output order."""
    if which == "forward":
        return [f"y{k}" for k in range(spec.dim)]
    v = ("gv" if spec.normalize else "G") if which == "backward" else \
        ("dv" if spec.normalize else "HT")
    out = [f"{v}{i}" for i in range(3)]
    return out if which == "backward" else out + [f"dg{k}" for k in range(spec.dim)]


# -- radial basis ----------------------------------------------------------------------------------
def render_radial(spec: RadialSpec, plan: EdgePlan, which: str) -> str:
    """CUDA source of one radial-basis kernel (``which`` in :data:`PASSES`)."""
    _check(spec, which)
    order = PASSES.index(which)
    per_basis = symbolic.radial_basis_program(spec, which)
    bases = [{"index": b, "body": program_lines(per_basis, symbolic.radial_constants(spec, b)),
              "w_over_pi": literal(spec.frequencies[b] / math.pi)}
             for b in range(spec.num_basis)]
    envelope = program_lines(symbolic.envelope_program(spec, order),
                             symbolic.radial_constants(spec))
    transform = [] if spec.transform is None else program_lines(
        symbolic.transform_program(spec, order), symbolic.transform_constants(spec))
    return render(f"edge_features/radial_{which}.cu.j2", plan=plan, spec=spec, real=plan.real,
                  name=kernel_name("radial", which), envelope=envelope, bases=bases,
                  transform=transform, r_max=literal(spec.r_max), key=spec.key(),
                  describe=spec.describe())


def _check(spec, which: str) -> None:
    if which not in PASSES:
        raise ValueError(f"which must be one of {PASSES}, got {which!r}")
    reason = spec.unsupported_reason()
    if reason is not None:
        raise ValueError(f"{spec.describe()} cannot be fused: {reason}")


# -- catalog ---------------------------------------------------------------------------------------
def catalog_sources(limits: DeviceLimits,
                    problems: Optional[List] = None) -> Iterator[Tuple[str, str]]:
    """``(name, source)`` of every kernel of the catalog's problems, both dtypes.

    Names: ``edge_features/<problem>-<dtype>-sh-<pass>`` and ``...-radial-<pass>``, with
    ``pass`` in ``fwd``, ``bwd``, ``dbwd``; a spec shared by several problems is rendered once.
    """
    from mace_accel.ops.edge_features.catalog import select, unique_radial, unique_sh

    chosen = problems if problems is not None else select()
    short = {"forward": "fwd", "backward": "bwd", "double_backward": "dbwd"}
    for dtype in ("float32", "float64"):
        for problem in unique_sh(chosen):
            spec = problem.sh_spec()
            plan = plan_for(spec, dtype, limits)
            for which in PASSES:
                yield (f"edge_features/{problem.name}-{dtype}-sh-{short[which]}",
                       render_sh(spec, plan, which))
        for problem in unique_radial(chosen):
            spec = problem.radial_spec()
            plan = plan_for(spec, dtype, limits)
            for which in PASSES:
                yield (f"edge_features/{problem.name}-{dtype}-radial-{short[which]}",
                       render_radial(spec, plan, which))
