"""The maths of the edge-feature kernels as sympy expressions: one source for CUDA and the tests.

Each kernel body is a :class:`Program`: straight-line code, a list of ``(name, expression)``
assignments over named inputs. :mod:`.codegen` prints a program as CUDA (common subexpressions
shared, every constant an exact hex literal); :meth:`Program.evaluate` runs the very same
expressions in numpy float64, so the CPU tests check the generated maths against e3nn/mace.

Spherical harmonics (``u`` = the normalised vector, ``c_l`` = the normalisation factor)::

    Y_k(u)             e3nn's polynomials (orders 0..4, its recursion with exact constants)
    G_j   = sum_k g_k dY_k/du_j                            (backward, before the chain rule)
    dg_k  = sum_j dY_k/du_j t_j                            (JVP along the tangent t = du/dv a)
    HT_i  = sum_j d/du_i G_j t_j                           (Hessian of <g, Y> times t)

and the chain rule through e3nn's ``u = v / d``, ``d = max(|v|, eps)`` (``di = 1 / d``; ``k`` = 1
where ``|v| >= eps``, 0 where the norm is clamped and the map is linear)::

    P w      = w - k u (u . w)
    dv       = P G di                                     (backward)
    t        = P a di                                     (double backward, a = upstream)
    d(v)     = (P HT - k (u . a) di P G - k (G . u) t - k (G . t) u) di

Radial basis (per Bessel function, ``S = sin(w r)``, ``Cw = cos(w r)``): sympy differentiates
``prefactor * sin(w r) / r`` and the cutoff polynomial; the mask ``m = (r < r_max)`` is a
runtime value with zero derivative (as in torch). With a distance transform the Bessel functions
take ``x = T(r, r0)`` (``S = sin(w x)``, ``ri = 1 / x``; ``r0`` per edge, from its elements):
sympy differentiates ``T`` in ``r`` (``X, DX, D2X``) and the chain rule carries the basis'
``x``-derivatives to ``r``; the cutoff still sees ``r``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, Sequence, Tuple

import sympy

from mace_accel.ops.edge_features.spec import RadialSpec, SHSpec

X, Y, Z = sympy.symbols("u0 u1 u2", real=True)
U = (X, Y, Z)


# -- programs ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Program:
    """Straight-line code: ``assignments`` in order, over the symbols named in ``inputs``.

    Attributes:
        inputs: names of the values the program reads (kernel locals set by the template).
        assignments: ``(name, expression)``; later expressions may use earlier names.
        outputs: the names (among the assignments) the template stores.
    """

    inputs: Tuple[str, ...]
    assignments: Tuple[Tuple[str, sympy.Expr], ...]
    outputs: Tuple[str, ...]

    def evaluate(self, values: Dict[str, "object"]) -> Dict[str, "object"]:
        """Run the program on numpy arrays (float64), e.g. ``{"u0": array, ...}``."""
        import numpy as np

        env = {name: np.asarray(values[name], dtype=np.float64) for name in self.inputs}
        shape = np.broadcast_shapes(*(v.shape for v in env.values()))
        for name, expr in self.assignments:
            symbols = sorted(expr.free_symbols, key=lambda s: s.name)
            fn = sympy.lambdify(symbols, expr, modules="numpy")
            value = np.asarray(fn(*(env[s.name] for s in symbols)), dtype=np.float64)
            env[name] = np.broadcast_to(value, shape)
        return {name: env[name] for name in self.outputs}


    def prune(self, keep: Sequence[str]) -> "Program":
        """The program computing only ``keep`` (assignments nothing kept depends on dropped)."""
        needed = set(keep)
        kept: List[Tuple[str, sympy.Expr]] = []
        for name, expr in reversed(self.assignments):
            if name in needed:
                kept.append((name, expr))
                needed |= {s.name for s in expr.free_symbols}
        return Program(self.inputs, tuple(reversed(kept)), tuple(keep))


def _names(prefix: str, n: int) -> List[sympy.Symbol]:
    return list(sympy.symbols(" ".join(f"{prefix}{i}" for i in range(n)), real=True)) \
        if n > 1 else [sympy.Symbol(f"{prefix}0", real=True)]


def cse_program(inputs: Sequence[str], outputs: Sequence[Tuple[str, sympy.Expr]],
                prefix: str = "c") -> Program:
    """A :class:`Program` computing ``outputs`` with common subexpressions shared."""
    names = [n for n, _ in outputs]
    exprs = [e for _, e in outputs]
    gen = sympy.numbered_symbols(prefix)
    replacements, reduced = sympy.cse(exprs, symbols=gen, optimizations="basic", order="none")
    assignments = [(s.name, e) for s, e in replacements] + list(zip(names, reduced))
    return Program(tuple(inputs), tuple(assignments), tuple(names))


def chain(*programs: Program) -> Program:
    """One program running ``programs`` in order (outputs of earlier ones are inputs later);
    its outputs are all of theirs."""
    inputs: List[str] = []
    produced: set = set()
    assignments: List[Tuple[str, sympy.Expr]] = []
    outputs: List[str] = []
    for prog in programs:
        inputs += [n for n in prog.inputs if n not in produced and n not in inputs]
        assignments += list(prog.assignments)
        produced |= {n for n, _ in prog.assignments}
        outputs += list(prog.outputs)
    return Program(tuple(inputs), tuple(assignments), tuple(outputs))


# -- spherical harmonics -----------------------------------------------------------------------
def _sqrt(v) -> sympy.Expr:
    return sympy.sqrt(sympy.nsimplify(v))


@functools.lru_cache(maxsize=None)
def sh_polynomials(lmax: int) -> Tuple[sympy.Expr, ...]:
    """e3nn's ``_spherical_harmonics`` for orders ``0..lmax`` (un-normalised), in ``u0, u1, u2``.

    Written as e3nn writes them (order 4 from order 3 by its recursion); e3nn's 15-digit
    decimals of order 4 are the exact square roots given here (they agree to 1e-15).
    """
    x, y, z = U
    sh = [sympy.Integer(1)]
    if lmax >= 1:
        sh += [x, y, z]
    if lmax >= 2:
        s3 = sympy.sqrt(3)
        y2, x2z2 = y**2, x**2 + z**2
        sh2 = [s3 * x * z, s3 * x * y, y2 - x2z2 / 2, s3 * y * z, s3 / 2 * (z**2 - x**2)]
        sh += sh2
    if lmax >= 3:
        s20, s24 = sh2[0], sh2[4]
        sh3 = [
            _sqrt("5/6") * (s20 * z + s24 * x),
            sympy.sqrt(5) * s20 * y,
            _sqrt("3/8") * (4 * y2 - x2z2) * x,
            sympy.Rational(1, 2) * y * (2 * y2 - 3 * x2z2),
            _sqrt("3/8") * z * (4 * y2 - x2z2),
            sympy.sqrt(5) * s24 * y,
            _sqrt("5/6") * (s24 * z - s20 * x),
        ]
        sh += sh3
    if lmax >= 4:
        a, b, c, d, e, f, g = sh3
        q = sympy.sqrt
        sh += [
            q(14) / 4 * (a * z + g * x),
            q(7) / 4 * a * y + q(42) / 8 * (b * z + f * x),
            -q(2) / 8 * a * z + q(3) / 2 * b * y + q(30) / 8 * (c * z + e * x) + q(2) / 8 * g * x,
            -q(6) / 8 * b * z + q(15) / 4 * c * y + q(10) / 4 * d * x + q(6) / 8 * f * x,
            -q(6) / 4 * c * x + d * y - q(6) / 4 * e * z,
            -q(6) / 8 * b * x + q(10) / 4 * d * z + q(15) / 4 * e * y - q(6) / 8 * f * z,
            -q(2) / 8 * a * x - q(30) / 8 * c * x + q(30) / 8 * e * z + q(3) / 2 * f * y
            - q(2) / 8 * g * z,
            -q(42) / 8 * b * x + q(42) / 8 * f * z + q(7) / 4 * g * y,
            -q(14) / 4 * a * x + q(14) / 4 * g * z,
        ]
    if lmax > 4:
        raise ValueError(f"spherical harmonics are generated for lmax <= 4, got {lmax}")
    return tuple(sympy.expand(p) for p in sh)


def sh_factor(l: int, normalization: str) -> sympy.Expr:  # e3nn's name for the order
    """e3nn's per-order output factor."""
    if normalization == "component":
        return sympy.sqrt(2 * l + 1)
    if normalization == "integral":
        return sympy.sqrt(2 * l + 1) / (2 * sympy.sqrt(sympy.pi))
    if normalization == "norm":
        return sympy.Integer(1)
    raise ValueError(f"unknown normalization {normalization!r}")


@functools.lru_cache(maxsize=None)
def sh_values(spec: SHSpec) -> Tuple[sympy.Expr, ...]:
    """``Y_k(u)``, normalisation factor included, ``k = 0..dim-1``."""
    polys = sh_polynomials(spec.lmax)
    return tuple(sympy.expand(sh_factor(l, spec.normalization) * polys[l * l + m])
                 for l in range(spec.lmax + 1) for m in range(2 * l + 1))


def sh_jacobian(spec: SHSpec) -> List[List[sympy.Expr]]:
    """``dY_k/du_j`` as ``[k][j]``."""
    return [[sympy.diff(yk, uj) for uj in U] for yk in sh_values(spec)]


def _dot(a: Sequence[sympy.Expr], b: Sequence[sympy.Expr]) -> sympy.Expr:
    return sympy.Add(*[p * q for p, q in zip(a, b)])


def g_names(spec: SHSpec) -> List[str]:
    return [f"g{k}" for k in range(spec.dim)]


def sh_forward_program(spec: SHSpec) -> Program:
    """``y{k} = Y_k(u)`` (inputs ``u0, u1, u2``)."""
    return cse_program([s.name for s in U], [(f"y{k}", e) for k, e in enumerate(sh_values(spec))])


def sh_gradient(spec: SHSpec) -> List[sympy.Expr]:
    """``G_j = sum_k g_k dY_k/du_j``."""
    g = _names("g", spec.dim)
    jac = sh_jacobian(spec)
    return [sympy.expand(_dot(g, [row[j] for row in jac])) for j in range(3)]


def sh_backward_program(spec: SHSpec) -> Program:
    """``G0..G2`` from ``u`` and ``g`` (inputs ``u0..2``, ``g0..g{dim-1}``)."""
    return cse_program([s.name for s in U] + g_names(spec),
                       [(f"G{j}", e) for j, e in enumerate(sh_gradient(spec))])


def sh_double_backward_program(spec: SHSpec) -> Program:
    """``G0..2``, ``HT0..2`` and ``dg0..`` from ``u``, ``g`` and the tangent ``t0..2``."""
    t = _names("t", 3)
    grad = sh_gradient(spec)
    jac = sh_jacobian(spec)
    scalar = _dot(grad, t)
    outputs = [(f"G{j}", e) for j, e in enumerate(grad)]
    outputs += [(f"HT{i}", sympy.expand(sympy.diff(scalar, U[i]))) for i in range(3)]
    outputs += [(f"dg{k}", sympy.expand(_dot(row, t))) for k, row in enumerate(jac)]
    return cse_program([s.name for s in U] + g_names(spec) + ["t0", "t1", "t2"], outputs)


# the chain rule through e3nn's normalisation (see the module docstring); inputs: u (the
# normalised vector), d (the divisor max(|v|, eps)), k (1 unless the norm is clamped)
_di, _k = sympy.symbols("di k", positive=True)  # 1 / d (one division per edge, in the kernel)
_G = _names("G", 3)
_HT = _names("HT", 3)
_A = _names("a", 3)


def _project(w: Sequence[sympy.Expr]) -> List[sympy.Expr]:
    dot = _dot(U, w)
    return [w[i] - _k * U[i] * dot for i in range(3)]


def normalize_backward_program() -> Program:
    """``gv0..2`` = d/dv of ``<g, Y(v / d)>`` from ``G`` (inputs ``u, di = 1/d, k, G``)."""
    return cse_program(["u0", "u1", "u2", "di", "k", "G0", "G1", "G2"],
                       [(f"gv{i}", e * _di) for i, e in enumerate(_project(_G))], prefix="n")


def normalize_tangent_program() -> Program:
    """``t0..2`` = du/dv a (inputs ``u, di, k, a``)."""
    return cse_program(["u0", "u1", "u2", "di", "k", "a0", "a1", "a2"],
                       [(f"t{i}", e * _di) for i, e in enumerate(_project(_A))], prefix="m")


def normalize_double_backward_program() -> Program:
    """``dv0..2`` = the Hessian of ``<g, Y(v / d)>`` times ``a`` (inputs ``u, di, k, a, t, G,
    HT``)."""
    t = _names("t", 3)
    p_ht, p_g = _project(_HT), _project(_G)
    ua, gu, gt = _dot(U, _A), _dot(_G, U), _dot(_G, t)
    out = [(p_ht[i] - _k * ua * _di * p_g[i] - _k * gu * t[i] - _k * gt * U[i]) * _di
           for i in range(3)]
    return cse_program(["u0", "u1", "u2", "di", "k", "a0", "a1", "a2", "t0", "t1", "t2",
                        "G0", "G1", "G2", "HT0", "HT1", "HT2"],
                       [(f"dv{i}", e) for i, e in enumerate(out)], prefix="h")


# -- radial basis ------------------------------------------------------------------------------
RINV = sympy.Symbol("ri", positive=True)      # 1 / r, computed once per edge
SR = sympy.Symbol("s", positive=True)         # r / r_max, computed as torch does
S, CW = sympy.symbols("S Cw", real=True)      # sin(w r), cos(w r) of one Bessel function
MASK = sympy.Symbol("m", real=True)           # (r < r_max): a step, zero derivative (as in torch)
# constants of the spec, kept as symbols so sympy never folds them into huge exact rationals;
# the code generator prints them as exact hex literals (one set of values per basis function)
PF, WF, IRM = sympy.symbols("PF WF IRM", positive=True)  # prefactor, frequency, 1 / r_max
_R, _W = sympy.symbols("r w", positive=True)


def radial_constants(spec: RadialSpec, basis: int = 0) -> Dict[str, float]:
    """Values of the constant symbols for basis function ``basis``."""
    return {"PF": spec.prefactor, "WF": spec.frequencies[basis], "IRM": 1.0 / spec.r_max}


def envelope(spec: RadialSpec) -> sympy.Expr:
    """mace's cutoff polynomial (without the mask) in ``s = r / r_max``, in Horner form."""
    c1, c2, c3 = (sympy.nsimplify(c) for c in spec.envelope_coefficients())  # small integers
    return 1 + SR**spec.p * (-c1 + SR * (c2 - c3 * SR))


@functools.lru_cache(maxsize=None)
def envelope_program(spec: RadialSpec, order: int) -> Program:
    """``C`` and up to ``order`` r-derivatives ``dC``, ``d2C`` (inputs ``s``, ``m``, ``IRM``)."""
    env = envelope(spec)
    outputs = [("C", env * MASK)]
    if order >= 1:
        outputs.append(("dC", sympy.diff(env, SR) * IRM * MASK))
    if order >= 2:
        outputs.append(("d2C", sympy.diff(env, SR, 2) * IRM**2 * MASK))
    return cse_program(["s", "m", "IRM"], outputs, prefix="e")


def bessel_derivatives(order: int) -> List[sympy.Expr]:
    """``PF sin(WF r) / r`` and its first ``order`` r-derivatives, in ``S, Cw, WF, PF, ri``."""
    f = PF * sympy.sin(_W * _R) / _R
    out = [f] + [sympy.diff(f, _R, n) for n in range(1, order + 1)]
    subs = {sympy.sin(_W * _R): S, sympy.cos(_W * _R): CW}
    return [sympy.expand(e.subs(subs).subs({_R: 1 / RINV, _W: WF})) for e in out]


# a transform's constants, kept as symbols (printed as literals, as the spec's constants)
TQ, TP, TA, TALPHA = sympy.symbols("TQ TP TA TALPHA", positive=True)
R0 = sympy.Symbol("r0", positive=True)  # the edge's length scale, read per edge


def transform_constants(spec: RadialSpec) -> Dict[str, float]:
    """Values of the transform's constant symbols (none without a transform)."""
    t = spec.transform
    if t is None:
        return {}
    return dict(zip(("TQ", "TP", "TA") if t.kind == "Agnesi" else ("TALPHA",), t.params))


def transform_expression(kind: str) -> sympy.Expr:
    """mace's ``AgnesiTransform`` / ``SoftTransform`` of ``r`` with the edge's ``r0``
    (:func:`~mace_accel.ops.edge_features.reference.distance_transform`)."""
    if kind == "Agnesi":
        ratio = _R / R0
        return 1 / (1 + TA * ratio**TQ / (1 + ratio**(TQ - TP)))
    p0, p1 = sympy.Rational(3, 4) * R0, sympy.Rational(4, 3) * R0
    m = (p0 + p1) / 2
    return p0 + (_R - p0) * (1 + sympy.tanh(TALPHA / (p1 - p0) * (_R - m))) / 2


@functools.lru_cache(maxsize=None)
def transform_program(spec: RadialSpec, order: int) -> Program:
    """``X = T(r, r0)`` and up to ``order`` r-derivatives ``DX``, ``D2X`` (inputs ``r``,
    ``r0`` and the transform's constants)."""
    x = transform_expression(spec.transform.kind)
    outputs = [("X", x)] + [(name, sympy.diff(x, _R, n))
                            for n, name in ((1, "DX"), (2, "D2X")) if n <= order]
    return cse_program(["r", "r0", *transform_constants(spec)], outputs, prefix="t")


@functools.lru_cache(maxsize=None)
def radial_basis_program(spec: RadialSpec, which: str) -> Program:
    """Per-basis code of one kernel (inputs ``S, Cw, ri, C, dC, d2C, PF, WF``; with a
    transform also ``DX, D2X``, and ``S, Cw, ri`` of ``x``).

    ``which``: ``"forward"`` -> ``F`` (the output value); ``"backward"`` -> ``dF`` (its
    r-derivative); ``"double_backward"`` -> ``dF`` and ``d2F``. With ``apply_cutoff`` the
    function is ``PF sin(WF x) / x * C``, else ``PF sin(WF x) / x`` (``x = r`` without a
    transform).
    """
    order = {"forward": 0, "backward": 1, "double_backward": 2}[which]
    f = bessel_derivatives(order)
    inputs = ["S", "Cw", "ri", "C", "dC", "d2C", "PF", "WF"]
    if spec.transform is not None:  # d/dr of f(x(r)) from the x-derivatives
        dx, d2x = sympy.symbols("DX D2X", real=True)
        f = [f[0]] + ([f[1] * dx] if order >= 1 else []) + \
            ([f[2] * dx**2 + f[1] * d2x] if order >= 2 else [])
        inputs += ["DX", "D2X"]
    if spec.apply_cutoff:
        c, dc, d2c = sympy.symbols("C dC d2C", real=True)
        f = [f[0] * c] + ([f[1] * c + f[0] * dc] if order >= 1 else []) + \
            ([f[2] * c + 2 * f[1] * dc + f[0] * d2c] if order >= 2 else [])
    outputs = list(zip(["F", "dF", "d2F"], f))
    if which != "forward":
        outputs = outputs[1:]
    return cse_program(inputs, outputs, prefix="b")
