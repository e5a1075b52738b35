"""KernelPlan -> CUDA C++ source, through the jinja2 templates in ``kernels/conv_tp/``.

All decisions are made here in Python (which products to sum, which registers to keep); the
template only loops and prints. CG coefficients (times path weight) are printed as exact
hexadecimal float literals, so float64 kernels use the very bits of the spec.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Sequence, Tuple

from mace_accel.ops.conv_tp.schedule import KernelPlan, PathPlan, SegmentPlan
from mace_accel.ops.templates import literal, render

Needs = Tuple[bool, bool, bool]


def _sum(products: Sequence[str]) -> str:
    return " + ".join(products) if products else "(real)0"


def _y_cols(seg: SegmentPlan, paths: Optional[Sequence[PathPlan]] = None) -> List[int]:
    """The edge-attribute columns the paths (default: all of the segment's) read."""
    return sorted({p.y_offset + b for p in (seg.paths if paths is None else paths)
                   for _, b, _, _ in p.terms})


def _by_ak(p: PathPlan) -> Dict[Tuple[int, int], List[Tuple[int, float]]]:
    """CG terms of a path grouped by (a, k): ``u[a][k] = sum_b coef * y[y_offset + b]``."""
    out: Dict[Tuple[int, int], List[Tuple[int, float]]] = {}
    for a, b, k, c in p.terms:
        out.setdefault((a, k), []).append((p.y_offset + b, c))
    return out


def _u_lines(p: PathPlan, indent: str = "  ") -> List[str]:
    """``u{a}_{k} = sum_b C[a,b,k] y_b``: the factor shared by forward, d(x) and d(w).

    Factoring the trilinear form through ``u`` costs one FMA per CG term, instead of re-forming
    ``C * x * y * g`` for each of the three gradients (fp math is not reassociated by nvcc).
    """
    return [f"{indent}const real u{a}_{k} = {_sum([f'{literal(c)} * y{col}' for col, c in terms])};"
            for (a, k), terms in sorted(_by_ak(p).items())]


def fwd_path_lines(seg: SegmentPlan, p: PathPlan, w_value: str,
                   j: int = 0) -> Tuple[List[str], List[str], List[str]]:
    """Accumulator names, per-edge body and final store of path ``p`` of segment ``seg``
    (path number ``j``), its weight read as ``w_value``; the body expects ``xr`` and ``yr``."""
    accs, body, store = [], [], []
    pairs = _by_ak(p)
    body.append("{")
    body.append(f"  const real wv = {w_value};")
    body += _u_lines(p)
    for k in range(p.out_dim):
        name = f"acc{j}_{k}"
        accs.append(name)
        prods = [f"x{a} * u{a}_{k}" for a in range(seg.x_dim) if (a, k) in pairs]
        if prods:
            body.append(f"  {name} += wv * ({_sum(prods)});")
        store.append(f"orow[{p.out_offset} + u * {p.out_dim} + {k}] = {name};")
    body.append("}")
    return accs, body, store


# Accumulators (values) a segment's staged forward may keep of ``M[a][b] = sum_e w x[a] y[b]``
# (the per-receiver outer product, contracted with the CG tensor once per node at the store):
# one FMA per (a, b) pair an edge, instead of forming ``u[a][k] = sum_b C y_b`` per CG term and
# ``sum_a x[a] u[a][k]`` per (a, k) pair. The 128x1o segment of MACE-MP-medium keeps 60.
# Only the staged forward gains (scripts/bench_kernels.py conv-staged); the plain forwards lose (the
# accumulators cost them occupancy), so they keep ``u``.
OUTER_FWD_VALUES = 64


def _keeps_outer(seg: SegmentPlan) -> bool:
    """Whether the forward of ``seg`` accumulates ``M`` (:data:`OUTER_FWD_VALUES`)."""
    return sum(len(_h_pairs(p)) for p in seg.paths) <= OUTER_FWD_VALUES


def fwd_outer_lines(seg: SegmentPlan, p: PathPlan, w_value: str,
                    j: int = 0) -> Tuple[List[str], List[str], List[str]]:
    """Like :func:`fwd_path_lines`, accumulating ``m{j}_{a}_{b} += (w x[a]) y[b]`` per edge;
    the store applies the CG tensor: ``out[k] = sum_{a,b} C[a, b, k] M[a][b]``."""
    pairs = _h_pairs(p)
    accs = [f"m{j}_{a}_{b}" for a, b in sorted(pairs)]
    a_used = sorted({a for a, _ in pairs})
    body = ["{", f"  const real wv = {w_value};"]
    body += [f"  const real wx{a} = wv * x{a};" for a in a_used]
    body += [f"  m{j}_{a}_{b} += wx{a} * y{p.y_offset + b};" for a, b in sorted(pairs)]
    body.append("}")
    by_k: Dict[int, List[str]] = {}
    for a, b, k, c in p.terms:
        by_k.setdefault(k, []).append(f"{literal(c)} * m{j}_{a}_{b}")
    store = [f"orow[{p.out_offset} + u * {p.out_dim} + {k}] = {_sum(by_k.get(k, []))};"
             for k in range(p.out_dim)]
    return accs, body, store


def y_loads(cols: Sequence[int], per_vector: int = 0) -> List[str]:
    """The per-edge loads (from ``yr``) of the edge-attribute columns ``cols``: one each, or
    (``per_vector`` = 4 floats / 2 doubles) as 16-byte vectors of a 16-byte aligned row, one
    shared-memory load per vector (the staged kernels)."""
    if not per_vector:
        return [f"const real y{c} = yr[{c}];" for c in cols]
    vec = "float4" if per_vector == 4 else "double2"
    lines = [f"const {vec} yq{q} = reinterpret_cast<const {vec}*>(yr)[{q}];"
             for q in sorted({c // per_vector for c in cols})]
    return lines + [f"const real y{c} = yq{c // per_vector}.{'xyzw'[c % per_vector]};"
                    for c in cols]


def fwd_y_loads(seg: SegmentPlan, paths: Sequence[PathPlan], per_vector: int = 0) -> List[str]:
    """The per-edge loads (from ``yr``) of the edge attributes ``paths`` read (:func:`y_loads`)."""
    return y_loads(_y_cols(seg, paths), per_vector)


def _fwd_lines(seg: SegmentPlan, w_value: Optional[Callable[[PathPlan], str]] = None,
               outer: bool = False, per_vector: int = 0) -> Tuple[List[str], List[str], List[str]]:
    """Accumulator names, per-edge body and final store of one segment's forward; the body
    reads ``xr`` and ``yr`` (``per_vector``: see :func:`y_loads`), and path ``p``'s weight as
    ``w_value(p)`` (default: streamed from the global row ``wr``); ``outer``: accumulate ``M``
    (:func:`fwd_outer_lines`)."""
    if w_value is None:
        w_value = lambda p: _stream_load(f"wr + {p.w_offset}")  # noqa: E731
    accs, store = [], []
    body = [f"const real x{a} = xr[{a}];" for a in range(seg.x_dim)] \
        + fwd_y_loads(seg, seg.paths, per_vector)
    path_lines = fwd_outer_lines if outer else fwd_path_lines
    for j, p in enumerate(seg.paths):
        a, b, s = path_lines(seg, p, w_value(p), j)
        accs, body, store = accs + a, body + b, store + s
    return accs, body, store


# The per-edge streams (the TP weights read, d(tp_weights) and the d(node_feats) messages
# written, the messages read back by the per-sender sum) are touched once each and are far
# larger than the L2 at scale: they are loaded and stored with the evict-first hints, so the
# lines the kernels reuse (the gathered node features, the node's output gradient) stay: a
# few percent of the fwd+bwd time on large graphs in both dtypes, with the same bits
# (scripts/bench_kernels.py conv).
def _stream_load(address: str) -> str:
    return f"__ldcs({address})"


def _stream_store(address: str, value: str) -> str:
    return f"__stcs({address}, {value});"


def _w_row(w_sorted: bool, t: str = "t") -> str:
    """The row of ``w`` (and ``d w``) of the tile's edge ``t``: its edge id, or (``w_sorted``)
    its position in receiver order relative to the chunk's first edge ``w_row0``."""
    return f"(t0 + {t} - w_row0)" if w_sorted else f"es[{t}]"


def _w_row0_arg(w_sorted: bool) -> str:
    return ", const int w_row0" if w_sorted else ""


# Registers (32-bit words) a segment may spend on its node's output gradient in the backward:
# the 128x1o segment of MACE-MP-medium holds 24 values (48 words in float64, 198 registers in
# all); the float64 L=2/3 segments of the catalog, 31-50 values, spilled at 255 registers.
HOIST_G_WORDS = 48
# Values a segment may hold of ``h[a][b] = sum_k C[a, b, k] g_k`` (the node's output gradient
# contracted with the CG tensor, once per node; 64 registers in float32, 128 in float64): the
# 128x1o segment of MACE-MP-medium holds 60. With ``h`` held, each edge costs one FMA per
# (a, b) pair for d(x)/d(w) and one for d(y), instead of re-forming ``u[a][k] = sum_b C y_b``
# and ``x[a] g[k]`` per CG term (the backward is bound by issuing those instructions;
# scripts/bench_kernels.py conv-staged).
HOIST_H_VALUES = 64


def _h_pairs(p: PathPlan) -> Dict[Tuple[int, int], List[Tuple[int, float]]]:
    """CG terms of a path grouped by (a, b): ``h[a][b] = sum_k coef * g[k]``."""
    out: Dict[Tuple[int, int], List[Tuple[int, float]]] = {}
    for a, b, k, c in p.terms:
        out.setdefault((a, b), []).append((k, c))
    return out


def _holds_h(seg: SegmentPlan) -> bool:
    """Whether the backward of ``seg`` holds ``h`` (see :data:`HOIST_H_VALUES`) in registers."""
    return sum(len(_h_pairs(p)) for p in seg.paths) <= HOIST_H_VALUES


def _g_sources(i: int, seg: SegmentPlan, real_words: int) -> Tuple[Dict[Tuple[int, int], str], bool]:
    """Where the backward reads the node's output gradient, by (path, k), and whether those
    values are held in registers (``gh{i}_{j}_{k}``, :data:`HOIST_G_WORDS`) instead."""
    g_src = {(j, k): f"gr[{p.out_offset} + u * {p.out_dim} + {k}]"
             for j, p in enumerate(seg.paths) for k in sorted({k for _, k in _by_ak(p)})}
    return g_src, len(g_src) * real_words <= HOIST_G_WORDS


def _bwd_operands(needs: Needs) -> Tuple[bool, bool]:
    """Whether the backward reads (the TP weights, the sender features) for ``needs``: d(x) and
    d(y) need the weights, d(y) and d(w) the sender features (d(node_feats) alone needs no x)."""
    need_x, need_y, need_w = needs
    return need_x or need_y, need_y or need_w


def _bwd_math(i: int, seg: SegmentPlan, needs: Needs, atomic: bool, w_sorted: bool,
              real_words: int, per_vector: int = 0) -> List[str]:
    """The arithmetic and stores of one edge ``t`` of segment ``i``'s backward, given its
    operands in ``cw{j}`` (weight of path ``j``) and ``xs{i}_{a}`` (sender features) where
    :func:`_bwd_operands` asks for them, ``ys`` (the tile's staged edge attributes), ``es`` /
    ``ss`` (the tile's edge ids / senders) and ``gr`` (the node's output-gradient row);
    ``per_vector``: how the edge attributes are loaded (:func:`y_loads`).

    With ``s[a] = sum_{b,k} C[a,b,k] y_b g_k``: d(x)[a] += w s[a];  d(w) = sum_a x[a] s[a];
    d(y)[b] += w sum_{a,k} C x[a] g[k]. Where the segment holds ``h = C g``
    (:func:`_holds_h`), ``s[a] = sum_b y_b h[a][b]`` and d(y)[b] += w sum_a x[a] h[a][b]
    (:func:`_h_path_lines`); else ``s[a] = sum_k g_k u[a][k]`` with ``u[a][k] = sum_b C y_b``.
    """
    need_x, need_y, need_w = needs
    load_w, _ = _bwd_operands(needs)
    x = [f"xs{i}_{a}" for a in range(seg.x_dim)]
    gx = [f"gx{i}_{a}" for a in range(seg.x_dim)]
    g_src, hoist = _g_sources(i, seg, real_words)
    holds_h = _holds_h(seg)
    cols = _y_cols(seg)
    body = []
    if need_w:
        body.append(f"real* gwr = gw + (long long){_w_row(w_sorted)} * WN + u;")
    if need_x or need_w:  # d(edge_attrs) alone needs no edge attributes
        body.append("const real* yr = ys + t * DIM2;")
        body += y_loads(cols, per_vector)
    if need_x:
        body += [f"real {v} = 0;" for v in gx]
    for j, p in enumerate(seg.paths):
        if holds_h:
            body += _h_path_lines(i, j, p, needs, load_w, x, gx)
            continue
        pairs = _by_ak(p)
        ks = sorted({k for _, k in pairs})
        body.append("{")
        body += [f"  const real g{k} = {f'gh{i}_{j}_{k}' if hoist else g_src[j, k]};"
                 for k in ks]
        if load_w:
            body.append(f"  const real wv = cw{j};")
        if need_x or need_w:
            body += _u_lines(p)
            a_used = sorted({a for a, _ in pairs})
            for a in a_used:
                body.append(f"  const real s{a} = {_sum([f'g{k} * u{a}_{k}' for k in ks if (a, k) in pairs])};")
            body += _s_uses(p, a_used, x, gx, need_x, need_w)
        if need_y:
            body += [f"  const real xg{a}_{k} = {x[a]} * g{k};" for a, k in sorted(pairs)]
            by_col: Dict[int, List[str]] = {}
            for a, b, k, c in p.terms:
                by_col.setdefault(p.y_offset + b, []).append(f"{literal(c)} * xg{a}_{k}")
            for col in sorted(by_col):
                body.append(f"  py{col} += wv * ({_sum(by_col[col])});")
        body.append("}")
    if need_x and atomic:  # straight into d(node_feats) of the sender: fast, order not fixed
        body.append(f"real* gxr = gxm + (long long)ss[t] * DIM1 + {seg.x_offset} + u * {seg.x_dim};")
        body += [f"atomicAdd(gxr + {a}, {gx[a]});" for a in range(seg.x_dim)]
    elif need_x:
        body.append(f"real* gxr = gxm + (long long)es[t] * DIM1 + {seg.x_offset} + u * {seg.x_dim};")
        body += [_stream_store(f"gxr + {a}", gx[a]) for a in range(seg.x_dim)]
    return body


def _s_uses(p: PathPlan, a_used: List[int], x: List[str], gx: List[str], need_x: bool,
           need_w: bool) -> List[str]:
    """Path ``p``'s uses of ``s[a]``: d(x)[a] += w s[a] and the store of d(w) = sum_a x[a] s[a]."""
    lines = [f"  {gx[a]} += wv * s{a};" for a in a_used] if need_x else []
    if need_w:
        lines.append("  " + _stream_store(f"gwr + {p.w_offset}",
                                          _sum([f"{x[a]} * s{a}" for a in a_used])))
    return lines


def _h_path_lines(i: int, j: int, p: PathPlan, needs: Needs, load_w: bool, x: List[str],
                  gx: List[str]) -> List[str]:
    """Path ``j``'s part of one edge's backward from the held ``hh{i}_{j}_{a}_{b}``:
    ``s[a] = sum_b y_b h[a][b]``; d(x)[a] += w s[a]; d(w) = sum_a x[a] s[a];
    d(y)[b] += w sum_a x[a] h[a][b]."""
    need_x, need_y, need_w = needs
    pairs = _h_pairs(p)
    a_used = sorted({a for a, _ in pairs})
    b_used = sorted({b for _, b in pairs})
    lines = ["{"]
    if load_w:
        lines.append(f"  const real wv = cw{j};")
    if need_x or need_w:
        for a in a_used:
            terms = [f"y{p.y_offset + b} * hh{i}_{j}_{a}_{b}" for b in b_used if (a, b) in pairs]
            lines.append(f"  const real s{a} = {_sum(terms)};")
        lines += _s_uses(p, a_used, x, gx, need_x, need_w)
    if need_y:
        for b in b_used:
            terms = [f"{x[a]} * hh{i}_{j}_{a}_{b}" for a in a_used if (a, b) in pairs]
            lines.append(f"  py{p.y_offset + b} += wv * ({_sum(terms)});")
    lines.append("}")
    return lines


def _g_hoist(i: int, seg: SegmentPlan, real_words: int) -> List[Tuple[str, str]]:
    """``(register, source)`` of the values segment ``i`` holds in registers for a node: ``h``
    where it fits (:data:`HOIST_H_VALUES`), else the output gradient where that fits."""
    g_src, hoist = _g_sources(i, seg, real_words)
    if _holds_h(seg):
        out = []
        for j, p in enumerate(seg.paths):
            for (a, b), terms in sorted(_h_pairs(p).items()):
                src = _sum([f"{literal(c)} * {g_src[j, k]}" for k, c in terms])
                out.append((f"hh{i}_{j}_{a}_{b}", src))
        return out
    return [(f"gh{i}_{j}_{k}", src) for (j, k), src in g_src.items()] if hoist else []


def _bwd_lines(i: int, seg: SegmentPlan, needs: Needs, atomic: bool, w_sorted: bool = False,
               real_words: int = 1) -> Dict[str, List[str]]:
    """Per-edge body of one segment's backward (``i`` = segment number), see :func:`_bwd_math`.

    Per edge ``t`` of the receiver ``node``: x gathered from the sender, g from the node's row.
    Latency: what :func:`_g_hoist` holds (``h``, else the node's output gradient where it fits,
    else nothing: read per edge) is formed once per tile of edges (``tile_loads``), and each
    edge's weights and sender features are loaded one edge ahead into the ``n*`` registers
    (``prefetch``, given the edge index ``tt``), so the body of edge ``t`` runs while edge
    ``t + 1``'s loads are in flight.
    """
    need_x, need_y, need_w = needs
    load_w, load_x = _bwd_operands(needs)
    w_next = [f"nw{i}_{j}" for j in range(len(seg.paths))] if load_w else []
    x_next = [f"nxs{i}_{a}" for a in range(seg.x_dim)] if load_x else []
    prefetch = []
    if load_w:
        prefetch.append(f"const real* wr = w + (long long){_w_row(w_sorted, 'tt')} * WN + u;")
        prefetch += [f"{v} = {_stream_load(f'wr + {p.w_offset}')};"
                     for v, p in zip(w_next, seg.paths)]
    if load_x:
        prefetch.append(f"const real* xr = x + (long long)ss[tt] * DIM1 + {seg.x_offset}"
                        f" + u * {seg.x_dim};")
        prefetch += [f"{v} = xr[{a}];" for a, v in enumerate(x_next)]
    body = [f"const real cw{j} = {v};" for j, v in enumerate(w_next)]
    body += [f"const real xs{i}_{a} = {v};" for a, v in enumerate(x_next)]
    body.append("if (t + 1 < cnt) {")
    body.append("  const int tt = t + 1;")
    body += ["  " + line for line in prefetch]
    body.append("}")
    body += _bwd_math(i, seg, needs, atomic, w_sorted, real_words)
    g_rows = _g_hoist(i, seg, real_words)
    return {"gy_regs": [f"py{c}" for c in _y_cols(seg)] if need_y else [], "bwd_body": body,
            "tile_regs": [v for v, _ in g_rows] + w_next + x_next,
            "tile_loads": [f"{v} = {src};" for v, src in g_rows]
            + ["const int tt = 0;"] + prefetch, "cols": _y_cols(seg)}


def _gy_reduce(cols: Sequence[int], dim2: int) -> List[str]:
    """Warp-sum the partial d(edge_attrs) columns and park them in shared memory.

    Transposed butterfly: at each of the first log2(n) steps every lane sends half of its
    values and keeps the other half, so reducing n columns over 32 lanes takes n + log2 steps'
    worth of shuffles instead of 5n; afterwards lane ``l`` holds one column's full sum. The
    order is fixed, so the result is deterministic. Unused columns are sent as zeros.
    """
    n = 1
    while n < dim2:
        n *= 2
    if n > 32:
        raise ValueError(f"edge attributes of {dim2} columns exceed one warp's reduction")
    v = [f"py{c}" if c in cols else "(real)0" for c in range(dim2)] + ["(real)0"] * (n - dim2)
    lines = ["{", "  " + " ".join(f"real v{i} = {v[i]};" for i in range(n))]
    steps, half, offset = 0, n // 2, 16
    while half >= 1:
        lines.append(f"  {{ const bool hi = (lane & {offset}) != 0;")
        for i in range(half):
            lines.append(f"    {{ const real s = hi ? v{i} : v{i + half}; const real k = hi ? "
                         f"v{i + half} : v{i}; v{i} = k + __shfl_xor_sync(0xffffffffu, s, {offset}); }}")
        lines.append("  }")
        steps, half, offset = steps + 1, half // 2, offset // 2
    while offset >= 1:  # lanes still holding partial sums of the same column
        lines.append(f"  v0 += __shfl_xor_sync(0xffffffffu, v0, {offset});")
        offset //= 2
    terms = [f"((lane & {16 >> j}) ? {n >> (j + 1)} : 0)" for j in range(steps)]
    column = " + ".join(terms) if terms else "0"
    writer = (16 >> (steps - 1)) - 1 if steps else 31
    lines.append(f"  const int c = {column};")
    lines.append(f"  if ((lane & {writer}) == 0 && c < DIM2) red[(warp * TILE + t) * DIM2 + c] = v0;")
    lines.append("}")
    return lines


def forward_name(plan: KernelPlan, w_sorted: bool = False) -> str:
    return f"mace_conv_fwd_g{plan.group}" + ("_ws" if w_sorted else "")


def render_forward(plan: KernelPlan, w_sorted: bool = False) -> str:
    """CUDA source of the forward kernel of one launch (``w_sorted``: see :func:`_w_row`)."""
    name = forward_name(plan, w_sorted)
    segments = []
    for seg in plan.segments:
        accs, body, store = _fwd_lines(seg)
        segments.append(dict(warp_begin=seg.warp_begin, warp_end=seg.warp_end, mul=seg.mul,
                             x_offset=seg.x_offset, x_dim=seg.x_dim, accumulators=accs,
                             fwd_body=body, fwd_store=store))
    return render("conv_tp/forward.cu.j2", plan=plan, name=name, segments=segments,
                  real=_real(plan), w_row=_w_row(w_sorted), w_row0_arg=_w_row0_arg(w_sorted))


def backward_name(plan: KernelPlan, needs: Needs, atomic: bool = False,
                  w_sorted: bool = False) -> str:
    return "mace_conv_bwd_g{}_x{}y{}w{}{}{}".format(plan.group, *(int(n) for n in needs),
                                                  "_atomic" if atomic else "",
                                                  "_ws" if w_sorted else "")


def render_backward(plan: KernelPlan, needs: Needs, atomic: bool = False,
                    w_sorted: bool = False) -> str:
    """CUDA source of the backward kernel for the gradients selected by ``needs`` (x, y, w).

    ``atomic``: d(node_feats) is added into the sender rows with float atomics (not
    bit-reproducible) instead of per-edge messages summed by :func:`render_sender_sum`.
    ``w_sorted``: ``w`` and ``d w`` rows in receiver order (see :func:`_w_row`).
    """
    segments = []
    for i, seg in enumerate(plan.segments):
        parts = _bwd_lines(i, seg, needs, atomic, w_sorted, plan.real_bytes // 4)
        parts["gy_reduce"] = _gy_reduce(parts.pop("cols"), plan.dim_in2) if needs[1] else []
        segments.append(dict(warp_begin=seg.warp_begin, warp_end=seg.warp_end, mul=seg.mul,
                             x_offset=seg.x_offset, x_dim=seg.x_dim, **parts))
    return render("conv_tp/backward.cu.j2", plan=plan,
                  name=backward_name(plan, needs, atomic, w_sorted), segments=segments,
                  real=_real(plan), needs=needs, atomic=atomic, w_row0_arg=_w_row0_arg(w_sorted))


SENDER_SUM = "mace_conv_sender_sum"


def render_sender_sum(plan: KernelPlan) -> str:
    """CUDA source of the deterministic per-sender sum of d(node_feats) edge messages."""
    return render("conv_tp/sender_sum.cu.j2", plan=plan, name=SENDER_SUM, real=_real(plan))


def _real(plan: KernelPlan) -> str:
    return "double" if plan.dtype == "float64" else "float"


def all_backward_needs() -> List[Needs]:
    """Every non-empty selection of gradients (x, y, w) a backward kernel can be built for."""
    return [(bool(a), bool(b), bool(c)) for a in (0, 1) for b in (0, 1) for c in (0, 1)
            if a or b or c]


__all__ = ["SENDER_SUM", "all_backward_needs", "backward_name", "catalog_sources", "forward_name",
           "render_backward", "render_forward", "render_sender_sum"]


def _needs_tag(needs: Needs) -> str:
    return "".join(str(int(n)) for n in needs)


def catalog_sources(limits, problems=None):
    """``(name, source)`` of every kernel the catalog's problems generate (all launches, both
    dtypes; every gradient selection for ``mp-medium-l2``, the ones MACE uses elsewhere)."""
    from mace_accel.ops.conv_tp.catalog import select, unique
    from mace_accel.ops.conv_tp.schedule import plan_kernels
    from mace_accel.ops.conv_tp.spec import make_spec

    for problem in problems if problems is not None else unique(select()):
        spec = make_spec(*problem.irreps)
        for dtype in ("float32", "float64"):
            conv = plan_kernels(spec, dtype, limits)
            base = f"conv_tp/{problem.name}-{dtype}"
            yield f"{base}-sender-sum", render_sender_sum(conv.backward_launches[0])
            for plan in conv.forward_launches:
                tag = f"{base}-g{plan.group}"
                yield f"{tag}-fwd", render_forward(plan)
                # the radial MLP's last layer folded in (weights of a chunk of receivers)
                yield f"{tag}-ws-fwd", render_forward(plan, w_sorted=True)
            for plan in conv.backward_launches:
                tag = f"{base}-g{plan.group}"
                selections = all_backward_needs() if problem.name == "mp-medium-l2" else [
                    (True, True, True), (False, True, True)]
                for needs in selections:
                    yield (f"{tag}-bwd{_needs_tag(needs)}",
                           render_backward(plan, needs))
                yield f"{tag}-bwd111-atomic", render_backward(plan, (True, True, True),
                                                               atomic=True)
                for needs in ((True, True, True), (False, True, True)):
                    yield (f"{tag}-ws-bwd{_needs_tag(needs)}",
                           render_backward(plan, needs, w_sorted=True))
