"""SCSpec -> CUDA C++ source: the product-basis polynomial as straight-line code per channel.

One thread owns one (node, channel): it loads the channel's ``D`` components and the weights of
its node's element, and evaluates every output irrep's polynomial in registers (no
intermediate touches memory). All decisions are made here (which monomials, which products are
shared); the one template, ``kernels/symmetric_contraction/kernel.cu.j2``, only loops over nodes
and prints.

Kernels (one launch each, all outputs and degrees together):

* ``forward``: ``out[n, c, m] = sum_t mono_t(x) * E_t,m`` with ``E_t,m = sum_K C[m,t,K] W[z,K,c]``;
* ``backward``: ``d x_i = sum_t A_t d mono_t / d x_i`` with ``A_t = sum_m g_m E_t,m``;
* ``weight_grad``: per node ``Q[n, K, c] = sum_m g_m sum_t C[m,t,K] mono_t`` (the weight
  gradient is then ``onehot(z)^T Q``, a GEMM); with ``directional`` it uses the directional
  derivative ``d mono_t[v]`` instead of ``mono_t`` (the double backward's weight term);
* ``double_backward``: for an upstream ``v`` of ``d x``: ``d g_m = sum_t E_t,m d mono_t[v]`` and
  ``d x_i = sum_t A_t d^2 mono_t[v] / d x_i``.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Dict, Iterator, List, Sequence, Tuple

from mace_accel.errors import KernelError
from mace_accel.ops.limits import BLOCKS_PER_SM, DEFAULT_SMS, WARP, DeviceLimits
from mace_accel.ops.symmetric_contraction.spec import OutputIrrep, Polynomial, SCSpec
from mace_accel.ops.templates import RealType, literal, render


@dataclasses.dataclass(frozen=True)
class SCPlan(RealType):
    """Launch geometry and layout of the symmetric-contraction kernels of one spec and dtype.

    Attributes:
        threads: threads per block (the channels, rounded up to whole warps); one block per
            node in a grid-stride loop.
        vector: components loaded/stored per vector access (1 = scalar accesses).
        k_chunk: per kernel kind, how many weights (or weight gradients) are held in registers
            at once; a part with more is evaluated in chunks of them, recomputing the
            (cheap) monomials per chunk. 0 = no chunking. Chosen so that no kernel of the
            catalog spills (checked by the nvcc test): float64 halves the registers per value.
        t_chunk: per kernel kind, at most this many monomials are evaluated in one block of
            code (each block loads its own inputs behind a compiler fence), which bounds what
            the compiler can interleave and keep alive at once. 0 = no limit.
    """

    spec_key: str
    dtype: str
    arch: str
    channels: int
    components: int
    dim_out: int
    num_elements: int
    threads: int
    vector: int
    k_chunk: Tuple[Tuple[str, int], ...]
    t_chunk: Tuple[Tuple[str, int], ...]
    shared_accumulators: bool = False
    max_blocks: int = BLOCKS_PER_SM * DEFAULT_SMS

    def blocks(self, n_nodes: int) -> int:
        """Grid size for ``n_nodes`` nodes (one block per node, grid-stride past ``max_blocks``)."""
        return max(1, min(self.max_blocks, n_nodes))

    @property
    def accumulator_bytes(self) -> int:
        """Dynamic shared memory of a kernel with shared accumulators (:func:`accumulators`)."""
        return self.components * self.threads * 8 if self.shared_accumulators else 0

    def chunk(self, kind: str) -> int:
        return dict(self.k_chunk)[kind]

    def monomial_chunk(self, kind: str) -> int:
        return dict(self.t_chunk)[kind]



def plan_kernels(spec: SCSpec, dtype: str, limits: DeviceLimits = DeviceLimits()) -> SCPlan:
    """The plan for ``spec`` in ``dtype`` (``"float32"|"float64"``) under ``limits`` (whose SM
    count sets the grid size; it does not change the source).

    Raises:
        KernelError: the channels do not fit one block.
    """
    if dtype not in ("float32", "float64"):
        raise KernelError(f"dtype must be float32 or float64, got {dtype!r}")
    threads = -(-spec.num_features // WARP) * WARP
    if threads > limits.max_threads_per_block:
        raise KernelError(f"{spec.describe()}: {spec.num_features} channels exceed one block "
                          f"({limits.max_threads_per_block} threads)")
    real_bytes = 8 if dtype == "float64" else 4
    vec = 16 // real_bytes
    vector = vec if (spec.num_components * real_bytes) % 16 == 0 else 1
    return SCPlan(spec_key=spec.key(), dtype=dtype, arch=limits.arch,
                  channels=spec.num_features, components=spec.num_components,
                  dim_out=spec.dim_out, num_elements=spec.num_elements, threads=threads,
                  vector=vector, k_chunk=_K_CHUNK[dtype], t_chunk=_T_CHUNK[dtype],
                  shared_accumulators=dtype == "float64",
                  max_blocks=BLOCKS_PER_SM * max(1, int(limits.multiprocessors)))




_T_CHUNK = {
    "float32": (("forward", 0), ("backward", 0), ("weight_grad", 0), ("double_backward", 64)),
    "float64": (("forward", 48), ("backward", 32), ("weight_grad", 32),
                ("double_backward", 16)),
}
_K_CHUNK = {
    "float32": (("forward", 0), ("backward", 0), ("weight_grad", 32), ("double_backward", 32)),
    "float64": (("forward", 12), ("backward", 12), ("weight_grad", 12),
                ("double_backward", 8)),
}


# -- shared pieces -------------------------------------------------------------------------------
def _sum(products: Sequence[str]) -> str:
    return " + ".join(products) if products else "(real)0"


def _prod(names: Sequence[str]) -> str:
    return " * ".join(names) if names else "(real)1"


def _by_tuple(part: Polynomial, ks: range) -> Dict[Tuple[int, ...],
                                                  Dict[int, List[Tuple[int, float]]]]:
    """``{t: {m: [(K, C[m,t,K]), ...]}}`` of one part for ``K`` in ``ks``, ``t`` sorted."""
    out: Dict[Tuple[int, ...], Dict[int, List[Tuple[int, float]]]] = {}
    for m, t, k, value in part.terms:
        if k in ks:
            out.setdefault(t, {}).setdefault(m, []).append((k, value))
    return dict(sorted(out.items()))


def _chunks(part: Polynomial, size: int) -> List[range]:
    """The weight ranges a part is evaluated in (one range when ``size`` is 0)."""
    n = part.num_params
    if size <= 0 or n <= size:
        return [range(n)]
    return [range(k, min(n, k + size)) for k in range(0, n, size)]


def _e_expr(entries: List[Tuple[int, float]], seed: str) -> str:
    """``E_t,m = sum_K C[m,t,K] w_K`` as one fma chain around ``seed``.

    ``seed`` is an opaque zero unique to the monomial (``mo * 0``, which the compiler may not
    fold under IEEE rules): without it, products ``C * w_K`` that recur in many monomials are
    common subexpressions the compiler keeps alive across the whole kernel, and the register
    file overflows. With it every chain is distinct and its values die where they are used.
    """
    expr = seed
    for k, c in entries:
        expr = f"FMA({literal(c)}, w{k}, {expr})"
    return expr


def _weight_loads(index: int, part: Polynomial, ks: Sequence[int]) -> List[str]:
    base = f"W{index} + (long long)z * {part.num_params} * C + c"
    lines = [f"const real* wp = {base};"]
    lines += [f"const real w{k} = wp[{k} * C];" for k in ks]
    return lines


def _group_names(prefix: Tuple[int, ...]) -> Tuple[str, str]:
    tag = "_".join(str(i) for i in prefix)
    return f"p{tag}", f"dp{tag}"


def _walk(tuples, visit) -> List[str]:
    """Visit the monomials ``tuples`` (sorted), grouped by all but their last index.

    ``visit(t, names, lines)`` appends the body for tuple ``t``. ``names`` holds ``mono`` (the
    monomial's expression), ``p`` (the product of the group's indices) and ``dp`` (that
    product's directional derivative along ``v``); ``p`` and ``dp`` are group variables for
    degree >= 3, declared only where a body uses them.
    """
    lines: List[str] = []
    groups: Dict[Tuple[int, ...], List[Tuple[int, ...]]] = {}
    for t in tuples:
        groups.setdefault(t[:-1], []).append(t)
    for prefix, group in groups.items():
        shared = len(prefix) >= 2
        p_name, dp_name = _group_names(prefix) if shared else (
            _prod([f"x{i}" for i in prefix]), _dprod(prefix))
        inner: List[str] = []
        for t in group:
            names = {"mono": f"{p_name} * x{t[-1]}" if prefix else f"x{t[-1]}",
                     "p": p_name, "dp": dp_name}
            body: List[str] = []
            visit(t, names, body)
            inner += ["  {"] + ["    " + b for b in body] + ["  }"]
        lines.append("{")
        if shared and any(p_name in line for line in inner):
            lines.append(f"  const real {p_name} = {_prod([f'x{i}' for i in prefix])};")
        if shared and any(dp_name in line for line in inner):
            lines.append(f"  const real {dp_name} = {_dprod(prefix)};")
        lines += inner
        lines.append("}")
    return lines


def _dprod(q: Tuple[int, ...]) -> str:
    """Directional derivative along ``v`` of ``prod_p x_{q_p}``."""
    if not q:
        return "(real)0"
    return _sum([_prod([f"v{q[p]}"] + [f"x{q[r]}" for r in range(len(q)) if r != p])
                 for p in range(len(q))])


def _times(head: str, factors: Sequence[str]) -> str:
    """``head * f1 * f2 ...`` evaluated left to right (``head`` unique per monomial, so no
    product is shared across monomials)."""
    return " * ".join([head, *factors])


def _grad_terms(t: Tuple[int, ...], names: dict) -> List[Tuple[int, List[str]]]:
    """``(i, factors)`` with ``d mono_t / d x_i = prod(factors)`` for every position of ``t``."""
    out = []
    for p in range(len(t)):
        keep = [q for q in range(len(t)) if q != p]
        if len(t) >= 3 and keep == list(range(len(t) - 1)):
            out.append((t[p], [names["p"]]))
        else:
            out.append((t[p], [f"x{t[q]}" for q in keep]))
    return out


def _dmono(t: Tuple[int, ...], names: dict) -> str:
    """``d mono_t[v] = v_last * p + dp * x_last`` (``p``, ``dp``: the group's product and its
    directional derivative)."""
    if len(t) == 1:
        return f"v{t[0]}"
    return f"v{t[-1]} * {names['p']} + {names['dp']} * x{t[-1]}"


def _second_terms(t: Tuple[int, ...]) -> List[Tuple[int, List[str]]]:
    """``(i, factors)``: ``d/dx_i d mono_t[v] = sum_p sum_{q != p, t_q = i} v_{t_p}
    prod_{r != p,q}``."""
    out = []
    for p in range(len(t)):
        for q in range(len(t)):
            if q != p:
                out.append((t[q], [f"v{t[p]}"] + [f"x{t[r]}" for r in range(len(t))
                                                  if r not in (p, q)]))
    return out


def _parts(spec: SCSpec) -> Iterator[Tuple[int, int, OutputIrrep, Polynomial]]:
    """``(weight index, output offset, output, part)`` in the ops' weight order."""
    index, offset = 0, 0
    for output in spec.outputs:
        for part in output.parts:
            yield index, offset, output, part
            index += 1
        offset += spec.num_features * output.dim


def _params(what: str, n_weights: int, directional: bool = False) -> List[str]:
    """The kernel's parameter list, one entry a line of its signature (``kernel.cu.j2`` joins
    them): ``x`` (and ``v``), the element and weights where the kernel reads weights, then its
    outputs."""
    weights = [f"const real* __restrict__ W{j}," for j in range(n_weights)]
    x_elem = "const real* __restrict__ x, const int* __restrict__ elem,"
    if what == "forward":
        return [x_elem, *weights, "real* __restrict__ out, const int n_nodes"]
    if what == "backward":
        return [x_elem, *weights,
                "const real* __restrict__ g, real* __restrict__ gxr, const int n_nodes"]
    if what == "double_backward":
        return ["const real* __restrict__ x, const real* __restrict__ v,",
                "const int* __restrict__ elem,", *weights,
                "const real* __restrict__ g, real* __restrict__ dxr, real* __restrict__ dg,",
                "const int n_nodes"]
    # weight_grad reads no weights; its signature has always been printed as this one line (the
    # pinned sources hash it)
    v = " const real* __restrict__ v," if directional else ""
    return [f"const real* __restrict__ x,{v}           "
            "const real* __restrict__ g, real* __restrict__ q, const int n_nodes"]


def _header(plan: SCPlan, spec: SCSpec, what: str, shared: Sequence[str] = (),
            directional: bool = False) -> dict:
    """The context of ``kernel.cu.j2`` shared by every kernel."""
    return dict(plan=plan, real=plan.real, what=what, shared=list(shared),
                params=_params(what, len(spec.weight_shapes), directional))


# -- kernels ---------------------------------------------------------------------------------------
def _chunk_fence(plan: SCPlan, reload: Sequence[str], serial: int) -> List[str]:
    """Start of a weight chunk: a compiler memory fence, then the inputs loaded (from L1).

    Every chunk loads its own copy of the inputs: the fence keeps the chunk's weight loads
    inside the chunk, and the loads are new values (their address differs by an opaque zero),
    so neither the inputs nor the monomials recomputed per chunk are merged with another
    chunk's, which would keep them all alive across chunks and overflow the registers.
    ``serial`` numbers the chunks of a kernel.
    """
    lines = ['asm volatile("" ::: "memory");']
    for name in reload:
        lines += load_components(plan, name, name, reload=serial)
    return lines


def _serials() -> "itertools.count[int]":
    """Chunk numbers for one kernel (1000, 1001, ...): each render starts its own count, so a
    kernel's source does not depend on what was rendered before it (the pins need that). They
    start high: with small multipliers (``OPAQUE_ZERO * 1`` is just ``OPAQUE_ZERO``) ptxas
    merges the reloads' address arithmetic and some float64 kernels spill."""
    return itertools.count(1000)


def _chunked_parts(plan: SCPlan, spec: SCSpec, output: OutputIrrep, kind: str, visit_for,
                   serial, with_weights: bool = True,
                   reload: Sequence[str] = ("x",)) -> List[str]:
    """The code of every part of ``output``, one block per weight chunk.

    ``visit_for(by_t)`` returns the monomial visitor for one chunk's ``{t: {m: [(K, C)]}}``;
    ``reload``: the inputs reloaded at the start of each chunk (see :func:`_chunk_fence`).
    """
    lines: List[str] = []
    for index, _, out, part in _parts(spec):
        if out is not output or not part.terms:
            continue
        for ks in _chunks(part, plan.chunk(kind)):
            by_t = _by_tuple(part, ks)
            for tuples in _monomial_blocks(list(by_t), plan.monomial_chunk(kind)):
                used = sorted({k for t in tuples for es in by_t[t].values() for k, _ in es})
                lines.append("{")
                lines += _indent(_chunk_fence(plan, reload, next(serial)))
                if with_weights:
                    lines += ["  " + line for line in _weight_loads(index, part, used)]
                lines += ["  " + line for line in _walk(tuples, visit_for(by_t))]
                lines.append("}")
    return lines


def _monomial_blocks(tuples: List[Tuple[int, ...]], size: int) -> List[List[Tuple[int, ...]]]:
    """``tuples`` in blocks of at most ``size`` (all at once when 0), never splitting a group of
    monomials that share all but their last index."""
    if size <= 0:
        return [tuples] if tuples else []
    blocks: List[List[Tuple[int, ...]]] = [[]]
    for t in tuples:
        if len(blocks[-1]) >= size and blocks[-1][-1][:-1] != t[:-1]:
            blocks.append([])
        blocks[-1].append(t)
    return [b for b in blocks if b]


def _indent(lines: List[str], by: str = "  ") -> List[str]:
    return [by + line for line in lines]


def _load_g(spec: SCSpec, output_index: int, output: OutputIrrep) -> List[str]:
    offset = _output_offset(spec, output_index)
    return ([f"const real* gr = g + (long long)node * DIM_OUT + {offset} + c * {output.dim};"]
            + [f"const real g{m} = gr[{m}];" for m in range(output.dim)])


def forward_name(plan: SCPlan) -> str:
    return "mace_sc_fwd"


def render_forward(plan: SCPlan, spec: SCSpec) -> str:
    """``out [N, DIM_OUT]``: every output irrep's polynomial (see the module docstring)."""
    serial = _serials()
    body: List[str] = []

    def visit_for(by_t):
        def visit(t, names, lines):
            lines.append(f"const real mo = {names['mono']};")
            lines.append("const real z0 = mo * (real)0;")
            for m, entries in sorted(by_t[t].items()):
                lines.append(f"acc{m} = FMA(mo, {_e_expr(entries, 'z0')}, acc{m});")
        return visit

    for output_index, output in enumerate(spec.outputs):
        offset = _output_offset(spec, output_index)
        body.append("{")
        body += [f"  real acc{m} = 0;" for m in range(output.dim)]
        body += _indent(_chunked_parts(plan, spec, output, "forward", visit_for, serial))
        body.append(f"  real* o = out + (long long)node * DIM_OUT + {offset} + c * {output.dim};")
        body += [f"  o[{m}] = acc{m};" for m in range(output.dim)]
        body.append("}")
    return render("symmetric_contraction/kernel.cu.j2", name=forward_name(plan), body=body,
                  **_header(plan, spec, "forward"))


def backward_name(plan: SCPlan) -> str:
    return "mace_sc_bwd"


def render_backward(plan: SCPlan, spec: SCSpec) -> str:
    """``d x [N, C, D]`` of ``<g, out>``."""
    serial = _serials()
    decls, body = accumulators(plan, "gx")

    def visit_for(by_t):
        def visit(t, names, lines):
            lines.append(f"const real z0 = {names['mono']} * (real)0;")
            a = _sum([f"g{m} * {_e_expr(entries, 'z0')}"
                      for m, entries in sorted(by_t[t].items())])
            lines.append(f"const real A = {a};")
            for i, factors in _grad_terms(t, names):
                lines.append(f"gx{i} += {_times('A', factors)};")
        return visit

    for output_index, output in enumerate(spec.outputs):
        body.append("{")
        body += _indent(_load_g(spec, output_index, output))
        body += _indent(_chunked_parts(plan, spec, output, "backward", visit_for, serial))
        body.append("}")
    body += _store_components(plan, "gx", "gxr")
    return render("symmetric_contraction/kernel.cu.j2", name=backward_name(plan), body=body,
                  **_header(plan, spec, "backward", decls))


def weight_grad_name(plan: SCPlan, directional: bool) -> str:
    return "mace_sc_wgrad" + ("_dir" if directional else "")


def render_weight_grad(plan: SCPlan, spec: SCSpec, directional: bool = False) -> str:
    """Per-node weight gradients ``Q [N, K_total, C]`` (see the module docstring)."""
    serial = _serials()
    body: List[str] = []
    k_offset = 0
    for output_index, output in enumerate(spec.outputs):
        body.append("{")
        body += _indent(_load_g(spec, output_index, output))
        for _, _, out, part in _parts(spec):
            if out is not output:
                continue
            for ks in _chunks(part, plan.chunk("weight_grad")):
                by_t = _by_tuple(part, ks)
                blocks = _monomial_blocks(list(by_t), plan.monomial_chunk("weight_grad"))

                def visit(t, names, lines, by_t=by_t):
                    mono = _dmono(t, names) if directional else names["mono"]
                    lines.append(f"const real mo = {mono};")
                    for m, entries in sorted(by_t[t].items()):
                        lines.append(f"{{ const real gm = g{m} * mo;")
                        lines += [f"  q{k} = FMA({literal(c)}, gm, q{k});" for k, c in entries]
                        lines.append("}")

                body.append("  {")
                body += [f"    real q{k} = 0;" for k in ks]
                for tuples in blocks:
                    body.append("    {")
                    body += _indent(_chunk_fence(plan, ("x", "v") if directional else ("x",),
                                                 next(serial)), "      ")
                    body += _indent(_walk(tuples, visit), "      ")
                    body.append("    }")
                body.append(f"    real* qr = q + ((long long)node * K_TOTAL + {k_offset}) * C + c;")
                body += [f"    qr[{k} * C] = q{k};" for k in ks]
                body.append("  }")
            k_offset += part.num_params
        body.append("}")
    return render("symmetric_contraction/kernel.cu.j2",
                  name=weight_grad_name(plan, directional), body=body, k_total=k_offset,
                  **_header(plan, spec, "weight_grad", directional=directional))


def double_backward_name(plan: SCPlan, need_x: bool, need_g: bool) -> str:
    return f"mace_sc_dbwd_x{int(need_x)}g{int(need_g)}"


def render_double_backward(plan: SCPlan, spec: SCSpec, need_x: bool, need_g: bool) -> str:
    """For an upstream ``v [N, C, D]`` of ``d x``: ``d x`` (Hessian-vector) and ``d g``."""
    serial = _serials()
    decls, body = accumulators(plan, "dx") if need_x else ([], [])

    def visit_for(by_t):
        def visit(t, names, lines):
            entries = sorted(by_t[t].items())
            lines.append(f"const real z0 = {names['mono']} * (real)0;")
            lines += [f"const real e{m} = {_e_expr(e, 'z0')};" for m, e in entries]
            if need_g:
                lines.append(f"const real dm = {_dmono(t, names)};")
                lines += [f"dg{m} = FMA(e{m}, dm, dg{m});" for m, _ in entries]
            if need_x and len(t) >= 2:
                lines.append(f"const real A = {_sum([f'g{m} * e{m}' for m, _ in entries])};")
                lines += [f"dx{i} += {_times('A', factors)};"
                          for i, factors in _second_terms(t)]
        return visit

    for output_index, output in enumerate(spec.outputs):
        offset = _output_offset(spec, output_index)
        body.append("{")
        # the Hessian term needs g only where a monomial has degree >= 2 (correlation 1 is linear)
        if need_x and any(part.nu >= 2 and part.terms for part in output.parts):
            body += _indent(_load_g(spec, output_index, output))
        if need_g:
            body += [f"  real dg{m} = 0;" for m in range(output.dim)]
        body += _indent(_chunked_parts(plan, spec, output, "double_backward", visit_for, serial,
                                       reload=("x", "v")))
        if need_g:
            body.append(f"  real* dgr = dg + (long long)node * DIM_OUT + {offset} + c * "
                        f"{output.dim};")
            body += [f"  dgr[{m}] = dg{m};" for m in range(output.dim)]
        body.append("}")
    if need_x:
        body += _store_components(plan, "dx", "dxr")
    return render("symmetric_contraction/kernel.cu.j2",
                  name=double_backward_name(plan, need_x, need_g), body=body,
                  **_header(plan, spec, "double_backward", decls))


def _output_offset(spec: SCSpec, output_index: int) -> int:
    return spec.num_features * sum(o.dim for o in spec.outputs[:output_index])


def _store_components(plan: SCPlan, prefix: str, pointer: str) -> List[str]:
    """Store ``{prefix}0..D-1`` of this channel at ``{pointer}`` (vectorised where aligned)."""
    d = plan.components
    lines = [f"real* {pointer}_row = {pointer} + ((long long)node * C + c) * D;"]
    if plan.vector == 1:
        return lines + [f"{pointer}_row[{i}] = {prefix}{i};" for i in range(d)]
    vt = "double2" if plan.real == "double" else "float4"
    for j in range(d // plan.vector):
        fields = ", ".join(f"{prefix}{j * plan.vector + q}" for q in range(plan.vector))
        lines.append(f"reinterpret_cast<{vt}*>({pointer}_row)[{j}] = make_{vt}({fields});")
    return lines


def load_components(plan: SCPlan, prefix: str, pointer: str, reload: int = 0) -> List[str]:
    """Load ``{prefix}0..D-1`` of this channel from ``{pointer}`` (vectorised where aligned).

    ``reload > 0`` marks a reload inside a weight chunk (see :func:`_chunk_fence`): the address
    is offset by ``OPAQUE_ZERO * reload`` (zero at run time, unknown to the compiler) so the
    compiler cannot merge it with an earlier load, and the values may go unused.
    """
    d = plan.components
    attr = "[[maybe_unused]] " if reload else ""
    offset = f" + OPAQUE_ZERO * {reload}" if reload else ""
    lines = [f"const real* {prefix}r = {pointer} + ((long long)node * C + c) * D{offset};"]
    if plan.vector == 1:
        return lines + [f"{attr}const real {prefix}{i} = {prefix}r[{i}];" for i in range(d)]
    vt = "double2" if plan.real == "double" else "float4"
    fields = "xy" if plan.vector == 2 else "xyzw"
    for j in range(d // plan.vector):
        lines.append(f"const {vt} {prefix}v{j} = reinterpret_cast<const {vt}*>({prefix}r)[{j}];")
        lines += [f"{attr}const real {prefix}{j * plan.vector + q} = {prefix}v{j}.{fields[q]};"
                  for q in range(plan.vector)]
    return lines


def accumulators(plan: SCPlan, name: str) -> Tuple[List[str], List[str]]:
    """``(declarations, zeroing)`` of the ``{name}0..D-1`` gradient accumulators: registers, or
    (``plan.shared_accumulators``) this thread's column of a shared array behind macros."""
    d = plan.components
    if not plan.shared_accumulators:
        return [], [f"real {name}{i} = 0;" for i in range(d)]
    # dynamic shared memory (the launch gives :meth:`SCPlan.accumulator_bytes`): MACE-MH-1's
    # 512 channels x 16 components need 64 KB, over the 48 KB of a static array
    decls = [f"extern __shared__ real {name}s[];  // [D * THREADS]"]
    decls += [f"#define {name}{i} ({name}s[{i} * THREADS + c])" for i in range(d)]
    return decls, [f"{name}{i} = 0;" for i in range(d)]


def all_kernels(plan: SCPlan, spec: SCSpec) -> Iterator[Tuple[str, str]]:
    """``(name, source)`` of every kernel of one spec and dtype."""
    yield forward_name(plan), render_forward(plan, spec)
    yield backward_name(plan), render_backward(plan, spec)
    for directional in (False, True):
        yield weight_grad_name(plan, directional), render_weight_grad(plan, spec, directional)
    for need_x, need_g in ((True, True), (True, False), (False, True)):
        yield (double_backward_name(plan, need_x, need_g),
               render_double_backward(plan, spec, need_x, need_g))


def catalog_sources(limits: DeviceLimits, *tags: str) -> Iterator[Tuple[str, str]]:
    """``(name, source)`` of every kernel of the catalog's problems carrying all ``tags``, both
    dtypes."""
    from mace_accel.ops.symmetric_contraction.catalog import catalog_specs

    for name, spec in catalog_specs(*tags):
        for dtype in ("float32", "float64"):
            plan = plan_kernels(spec, dtype, limits)
            for kernel, source in all_kernels(plan, spec):
                yield f"symmetric_contraction/{name}-{dtype}-{kernel}", source
