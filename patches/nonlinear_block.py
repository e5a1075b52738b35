"""The non-linear interaction block (mace's ``RealAgnosticResidualNonLinearInteractionBlock``:
MACE-MH-1, MACE-OMOL-0) without its per-edge concatenation.

mace's block builds, per edge, ``[radial features (B), source_embedding(sender) (F),
target_embedding(receiver) (F)]`` (``B + 2F = 1034`` values for MH-1) and feeds it to two
LayerNorm MLPs (``conv_tp_weights`` -> TP weights, ``density_fn`` -> one density term). Their
first layer is linear in that row, so here it is split (:class:`FusedLayerNormMLP`): the
embeddings' part is computed per *node* (``[N, F] x [F, hidden]``) and gathered per edge,
``h1 = feats W_b + P_src[sender] + P_tgt[receiver] + b``; the ``[E, B + 2F]`` row is never
formed. At CUDA inference the two MLPs are not run at all: their outputs, times the cutoff
where the block multiplies by it (``apply_cutoff=False``), are functions of the edge length and
its ordered pair of elements, looked up in one radial table per pair
(:mod:`mace_accel.patches.radial.table`).

The block's ``forward`` is replaced on the instance (:class:`NonLinearForward`, put back by
``revert``): the same steps in mace's order, with the two MLPs called through
:meth:`FusedLayerNormMLP.compute` and the density summed per receiver without atomics
(:func:`receiver_sums`). A call with LAMMPS ghost atoms runs mace's own forward.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, List, Optional, Tuple

import torch

from mace_accel.errors import InputError
from mace_accel.ops import gate as gate_ops
from mace_accel.ops import glue
from mace_accel.options import AccelOptions
from mace_accel.patches import gate as split_gate
from mace_accel.patches.radial import table as radial_table
from mace_accel.profiling import RADIAL_MLP, part_range
from mace_accel.patches.adopt import FusedModule, grads_wanted
from mace_accel.patches.registry import PartPlan

Tensor = torch.Tensor
PART = "radial_mlp"
WEIGHTS, DENSITY = "weights", "density"
FORWARD_ATTR = "forward"  # the instance attribute the fused forward is installed as
# the division, residual and gate in one kernel each way where they take the gate (a test hook:
# off, torch's ops, for A/B timings)
_FUSED_GATE = True


def layer_norm_mlp_reason(module: Any) -> Optional[str]:
    """Why ``module`` is not mace's ``RadialMLP`` (Linear -> LayerNorm -> SiLU ... -> Linear),
    or None."""
    cls = type(module)
    if cls.__name__ != "RadialMLP" or not cls.__module__.startswith("mace."):
        return f"{cls.__module__}.{cls.__name__} is not mace's RadialMLP"
    layers = list(getattr(module, "net", []))
    if not layers or not isinstance(layers[0], torch.nn.Linear) \
            or not isinstance(layers[-1], torch.nn.Linear):
        return "a RadialMLP whose net does not start and end with a Linear layer"
    for i, layer in enumerate(layers[1:-1]):
        expected = (torch.nn.Linear, torch.nn.LayerNorm, torch.nn.SiLU)[(i + 1) % 3]
        if not isinstance(layer, expected):
            return f"a RadialMLP layer {i + 1} is {type(layer).__name__}, not {expected.__name__}"
    return None


def plan_radial(block: torch.nn.Module, options: AccelOptions) -> Optional[PartPlan]:
    """The ``radial_mlp`` part of a non-linear block (None if ``block`` is not one): both
    LayerNorm MLPs become :class:`FusedLayerNormMLP`, or the reason they are left."""
    if not all(hasattr(block, n) for n in ("source_embedding", "target_embedding",
                                           "density_fn", "conv_tp_weights")):
        return None
    if not options.fuses(PART):
        return PartPlan.not_asked(PART)
    nets = {"conv_tp_weights": WEIGHTS, "density_fn": DENSITY}
    for name in nets:
        reason = layer_norm_mlp_reason(getattr(block, name))
        if reason is not None:
            return PartPlan(PART, reason=f"{name}: {reason}")
    width = int(block.edge_feats_irreps.num_irreps) if hasattr(block, "edge_feats_irreps") \
        else None
    feats = int(block.source_embedding.irreps_out.dim)
    if width is None or block.conv_tp_weights.net[0].in_features != width + 2 * feats:
        return PartPlan(PART, reason="conv_tp_weights does not take [radial features, source "
                                     "embedding, target embedding]")
    children = {name: (lambda n=name, kind=kind: FusedLayerNormMLP(
        getattr(block, n), kind, width, feats, options)) for name, kind in nets.items()}
    hs = [width + 2 * feats] + [m.out_features for m in block.conv_tp_weights.net
                                if isinstance(m, torch.nn.Linear)]
    detail = (f"conv_tp_weights: LayerNorm MLP {'->'.join(map(str, hs))} and density_fn with "
              f"their first layer split ({width} radial features per edge, the {feats}-wide "
              "element embeddings per node, gathered by index: no [E, "
              f"{width + 2 * feats}] row); at CUDA inference looked up in a table per ordered "
              "pair of elements; the density summed per receiver without atomics")
    return PartPlan(PART, children=children, detail=detail)


class FusedLayerNormMLP(FusedModule):
    """One of a non-linear block's two LayerNorm MLPs (``conv_tp_weights``: the TP weights,
    ``density_fn``: the edge density), its first layer split by input.

    Args:
        original: mace's ``RadialMLP`` (its ``net`` adopted, state dict unchanged).
        kind: ``"weights"`` (the output as it is) or ``"density"`` (``tanh(out^2)``, as the
            block takes it).
        n_radial: the radial features ``B`` at the start of the MLP's input row.
        n_embedding: the width ``F`` of each of the two element embeddings after them.
        options: the acceleration options.
    """

    part = PART
    uses_radial_tables = True

    def __init__(self, original: torch.nn.Module, kind: str, n_radial: int, n_embedding: int,
                 options: AccelOptions) -> None:
        super().__init__(original, options)
        self.kind, self.n_radial, self.n_embedding = kind, int(n_radial), int(n_embedding)
        self.hs = list(getattr(original, "hs", []))

    def describe(self) -> str:
        table = (radial_table.describe(self, f"{self.kind}:cutoff")
                 or radial_table.describe(self, f"{self.kind}:plain"))
        return (f"LayerNorm MLP ({self.kind}), first layer split"
                + ("" if table is None else f"; at inference: {table}"))

    def describe_radial(self) -> str:
        return f"the non-linear block's {self.kind} MLP"

    def forward(self, x: Tensor) -> Tensor:
        """mace's own ``RadialMLP`` on the full row ``x [E, B + 2F]`` (a call of this module
        from mace's forward; the fused block calls :meth:`compute`)."""
        return self.net(x)

    def _no_weight_grads(self) -> bool:
        return not grads_wanted(self.live_parameters())

    def compute(self, edge_feats: Tensor, node_attrs: Tensor, edge_index: Tensor,
                source: torch.nn.Module, target: torch.nn.Module,
                cutoff: Optional[Tensor]) -> Tensor:
        """``[E, out]``: the MLP of ``[edge_feats, source(node_attrs)[sender],
        target(node_attrs)[receiver]]`` (``tanh(.^2)`` for the density), times ``cutoff
        [E, 1]`` where given."""
        with part_range(RADIAL_MLP):  # called by the fused block, not through forward's hooks
            return self._compute(edge_feats, node_attrs, edge_index, source, target, cutoff)

    def _compute(self, edge_feats: Tensor, node_attrs: Tensor, edge_index: Tensor,
                 source: torch.nn.Module, target: torch.nn.Module,
                 cutoff: Optional[Tensor]) -> Tensor:
        tables = self._tables(edge_feats, source, target, cutoff is not None)
        if tables is not None:
            return radial_table.lookup(self, *tables)
        first = self.net[0]
        b, f = self.n_radial, self.n_embedding
        w = first.weight
        if edge_feats.dim() != 2 or edge_feats.shape[1] != b:
            raise InputError(f"edge_feats must have shape [n_edges, {b}], got "
                             f"{tuple(edge_feats.shape)}")
        per_node_src = torch.nn.functional.linear(source(node_attrs), w[:, b:b + f])
        per_node_tgt = torch.nn.functional.linear(target(node_attrs), w[:, b + f:])
        h = torch.nn.functional.linear(edge_feats, w[:, :b], first.bias)
        h = h + per_node_src[edge_index[0]] + per_node_tgt[edge_index[1]]
        out = self.net[1:](h)
        if self.kind == DENSITY:
            out = torch.tanh(out ** 2)
        return out if cutoff is None else out * cutoff

    def _tables(self, edge_feats: Tensor, source: torch.nn.Module, target: torch.nn.Module,
                with_cutoff: bool):
        """``(found, tables)`` for :func:`radial_table.lookup` where the tables run, else None."""
        params = self.live_parameters(source, target)
        if grads_wanted(params):
            return None
        found = radial_table.table_input(self, edge_feats)
        if found is None or found.pairs is None or found.pairs.kind != "ordered":
            return None
        tables = radial_table.tables_of(
            self, f"{self.kind}:{'cutoff' if with_cutoff else 'plain'}", params,
            lambda: self._pair_function(source, target, with_cutoff), found.pairs, edge_feats)
        return None if tables is None else (found, tables)

    def _pair_function(self, source: torch.nn.Module, target: torch.nn.Module,
                       with_cutoff: bool) -> Callable:
        """``pairs -> f(r, which)``: this MLP's output (times the cutoff) for edges from element
        ``pairs[which][0]`` to ``pairs[which][1]``, in float64 through float64 copies of mace's
        own modules (made once per build of the tables)."""
        embedding = self.embedding
        mlp = copy.deepcopy(self.sync_original()).double()
        src, tgt = copy.deepcopy(source).double(), copy.deepcopy(target).double()
        cutoff = embedding.table_cutoff()
        n_elements = int(src.irreps_in.dim)

        def of_pairs(pairs: Optional[List[Tuple[int, int]]]) -> Callable[[Tensor, Tensor], Tensor]:
            pairs = pairs or [(0, 0)]
            device = next(mlp.parameters()).device
            onehot = torch.eye(n_elements, dtype=torch.float64, device=device)
            with torch.no_grad():
                a = torch.tensor([p[0] for p in pairs], device=device)
                b = torch.tensor([p[1] for p in pairs], device=device)
                emb = torch.cat([src(onehot[a]), tgt(onehot[b])], dim=-1)  # [pairs, 2F]
            features = embedding.table_function(pairs if embedding.spec.transform is not None
                                                else None)

            def f(r: Tensor, which: Tensor) -> Tensor:
                x = features(r, which)
                out = mlp.net(torch.cat([x, emb[which]], dim=-1))
                if self.kind == DENSITY:
                    out = torch.tanh(out ** 2)
                return out * cutoff(r) if with_cutoff else out

            return f

        return of_pairs

    def __setstate__(self, state) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("embedding", None)


class _ReceiverSums(torch.autograd.Function):
    """:func:`receiver_sums` with its gradient written directly: each edge gets its receiver's
    gradient (one gather). The forward is one kernel on CUDA
    (:meth:`~mace_accel.ops.glue.CudaGlue.receiver_sums`; it was float64
    prefix sums and their differences, eleven kernels on the critical path of an MD-sized
    call, then a gather, two casts and a segmented sum), else a gather and a segmented float64
    sum. The gather is differentiable in the gradient, so double backward (training on forces)
    follows."""

    @staticmethod
    def forward(ctx, values: Tensor, edge_index: Tensor, n_nodes: int) -> Tensor:
        from mace_accel.ops.graph import graph_from_edge_index

        graph = graph_from_edge_index(edge_index, n_nodes)
        ctx.save_for_backward(edge_index)
        if glue.runs_on(values) and values.dim() == 2:
            return glue.kernels(values.dtype, values.device).receiver_sums(
                values.contiguous(), *graph.csr("receiver", torch.int32))
        ptr, perm = graph.csr("receiver", torch.int64)
        # each receiver's edges summed in order by one thread, in float64 (``unsafe``: no
        # check of the offsets, which would read them on the host: they are the graph's own)
        sums = torch.segment_reduce(values[perm].to(torch.float64), "sum", offsets=ptr,
                                    axis=0, unsafe=True)
        return sums.to(values.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (edge_index,) = ctx.saved_tensors
        return grad.index_select(0, edge_index[1]), None, None


def receiver_sums(values: Tensor, edge_index: Tensor, n_nodes: int) -> Tensor:
    """``[N, k]``: ``values [E, k]`` summed per receiver over its edges in receiver order (the
    convolution's own ordering, :func:`~mace_accel.ops.graph.graph_from_edge_index`), each
    sum in a fixed order: no float atomics, the same bits on a repeat, no wait for the device
    (CUDA graphs); mace's ``scatter_sum`` up to rounding. The gradient of an edge's value is
    its receiver's gradient, exactly."""
    return _ReceiverSums.apply(values, edge_index, n_nodes)


class _DivideRows(torch.autograd.Function):
    """:func:`divide_rows` with its gradient written directly: ``g / d`` and
    ``-<g, out> / d`` per row (autograd's division took five kernels, with ``-g x / d^2``
    formed whole before its sum). On a GPU, outside a double backward, one kernel
    (:meth:`~mace_accel.ops.glue.CudaGlue.divide_rows_backward`) instead of torch's four per
    block on an MD-sized call's critical path; with ``create_graph`` (training on forces) torch
    ops on the saved output, so the double backward follows."""

    @staticmethod
    def forward(ctx, x: Tensor, d: Tensor) -> Tensor:
        out = x / d
        ctx.save_for_backward(out, d)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        out, d = ctx.saved_tensors
        if not torch.is_grad_enabled() and glue.runs_on(out) and out.dim() == 2 \
                and ctx.needs_input_grad[1]:
            return glue.kernels(out.dtype, out.device).divide_rows_backward(
                g.contiguous(), out, d.contiguous(), want_x=ctx.needs_input_grad[0])
        grad_x = g / d if ctx.needs_input_grad[0] else None
        grad_d = None
        if ctx.needs_input_grad[1]:
            grad_d = -torch.linalg.vecdot(g, out, dim=-1).unsqueeze(-1) / d
        return grad_x, grad_d


def divide_rows(x: Tensor, d: Tensor) -> Tensor:
    """``x [N, k] / d [N, 1]`` (a block's messages over its receivers' density term; any other
    ``d`` divides as torch does)."""
    if d.dim() != x.dim() or d.shape[-1] != 1:
        return x / d
    return _DivideRows.apply(x, d)


def gated(gate: torch.nn.Module, x: Tensor, d: Tensor, res: Tensor) -> Tensor:
    """``gate(x / d + res)``: a block's messages ``x [N, D]`` over its density term ``d
    [N, 1]``, plus the residual ``res [N, r]`` (its leading ``r <= D`` columns, the rest zero),
    through its gated non-linearity; one kernel each way on a GPU where the gate's layout and
    activations allow (:func:`mace_accel.ops.gate.gate_residual`), else mace's steps."""
    spec = split_gate.spec_of(gate) if _FUSED_GATE else None
    if spec is not None and gate_ops.runs_on(x, d, res) and x.shape[1] == spec.d_in:
        return gate_ops.gate_residual(spec, x, d, res)
    return gate(divide_rows(x, d) + gate_ops.pad_residual(res, int(x.shape[1])))


def residual(linear_res: torch.nn.Module, node_feats: Tensor) -> Tensor:
    """``linear_res(node_feats)``: ``[N, r]``, its leading ``r`` columns, where it is a fused
    linear whose trailing output blocks no input feeds (they are zero: MH-1's 1o, 2e, 3o in
    the first block, 2e and 3o in the second), else ``[N, D]`` all of it."""
    fed = getattr(linear_res, "fed_columns", None)
    return linear_res(node_feats) if fed is None else fed(node_feats)


def convolve(block: torch.nn.Module, node_feats: Tensor, edge_attrs: Tensor,
             tp_weights: Tensor, edge_index: Tensor) -> Tensor:
    """``[N, irreps_mid]``: a block's messages summed per receiver, by its fused conv (gather,
    tensor product and sum in one op) where fused, else by mace's own three steps."""
    if hasattr(block, "conv_fusion"):
        return block.conv_tp(node_feats, edge_attrs, tp_weights, edge_index)
    from mace.tools.scatter import scatter_sum

    mji = block.conv_tp(node_feats[edge_index[0]], edge_attrs, tp_weights)
    return scatter_sum(src=mji, index=edge_index[1], dim=0, dim_size=node_feats.shape[0])


class BlockForward:
    """An interaction block's forward installed on the instance (``block.forward``): mace's own
    where LAMMPS exchanges ghost atoms between the steps, :meth:`fused` otherwise."""

    def __init__(self, block: torch.nn.Module) -> None:
        self.block = block

    def __call__(self, node_attrs: Tensor, node_feats: Tensor, edge_attrs: Tensor,
                 edge_feats: Tensor, edge_index: Tensor, cutoff: Optional[Tensor] = None,
                 lammps_class: Optional[Any] = None, lammps_natoms: Tuple[int, int] = (0, 0),
                 first_layer: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        if lammps_class is not None:
            return type(self.block).forward(self.block, node_attrs, node_feats, edge_attrs,
                                            edge_feats, edge_index, cutoff, lammps_class,
                                            lammps_natoms, first_layer)
        return self.fused(node_attrs, node_feats, edge_attrs, edge_feats, edge_index, cutoff)

    def fused(self, node_attrs: Tensor, node_feats: Tensor, edge_attrs: Tensor,
              edge_feats: Tensor, edge_index: Tensor,
              cutoff: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
        raise NotImplementedError


class NonLinearForward(BlockForward):
    """The fused forward of one non-linear block: mace's steps in mace's order, the LayerNorm
    MLPs split (:class:`FusedLayerNormMLP`)."""

    def fused(self, node_attrs: Tensor, node_feats: Tensor, edge_attrs: Tensor,
              edge_feats: Tensor, edge_index: Tensor,
              cutoff: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
        block = self.block
        n_nodes = node_feats.shape[0]
        sc = block.skip_tp(node_feats)
        node_feats = block.linear_up(node_feats)
        node_feats_res = residual(block.linear_res, node_feats)
        args = (edge_feats, node_attrs, edge_index, block.source_embedding,
                block.target_embedding, cutoff)
        tp_weights = block.conv_tp_weights.compute(*args)
        edge_density = block.density_fn.compute(*args)
        density = receiver_sums(edge_density, edge_index, n_nodes)
        message = convolve(block, node_feats, edge_attrs, tp_weights, edge_index)
        message = gated(block.equivariant_nonlin, block.linear_1(message),
                        density * block.beta + block.alpha, node_feats_res)
        message = block.linear_2(message)
        return block.reshape(message), sc


def install(block: torch.nn.Module) -> None:
    """Give ``block`` the fused forward where its LayerNorm MLPs are fused, and its gated
    non-linearity the one-split forward of :mod:`mace_accel.patches.gate`."""
    if isinstance(block._modules.get("conv_tp_weights"), FusedLayerNormMLP):
        block.__dict__[FORWARD_ATTR] = NonLinearForward(block)
        split_gate.install(block._modules.get("equivariant_nonlin"))


def remove(block: torch.nn.Module) -> None:
    """Put mace's own forward back (the class's) in place of any :class:`BlockForward` (the
    non-linear block's or a Density block's), and its gate's."""
    if isinstance(block.__dict__.get(FORWARD_ATTR), BlockForward):
        del block.__dict__[FORWARD_ATTR]
    split_gate.remove(block._modules.get("equivariant_nonlin"))
