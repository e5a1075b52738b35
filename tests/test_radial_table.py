"""The radial table (mace_accel.ops.radial.table, mace_accel.patches.radial.table) on the CPU:
building and evaluating tables, the kernels' plans and sources, and a patched model's tables
against its own radial MLPs (the kernels run in tests/test_gpu_radial_table.py)."""

from __future__ import annotations

import math

import pytest
import torch

import mace_accel
from mace_accel.errors import ConfigError
from mace_accel.models.architectures import small_test_model
from mace_accel.ops.radial.table import codegen
from mace_accel.ops.radial.table.order import ORDER_KEY_MAX
from mace_accel.ops.radial.table.table import (SPECS, TableError, TableSpec, build_table,
                                               build_tables, derivatives, evaluate,
                                               hermite_coefficients)
from mace_accel.options import AccelOptions
from mace_accel.patches.radial import table as table_patch
from mace_accel.patches.edge_features import FusedRadialEmbedding
from mace_accel.patches.radial.mlp import FusedRadialMLP

F64 = torch.float64
TOLERANCE = SPECS[torch.float32].tolerance  # of build_table's default spec


def _curve(r: torch.Tensor) -> torch.Tensor:
    """Three smooth columns of r, the kind of curve an embedding + MLP makes."""
    return torch.stack([torch.sin(2.1 * r) / r, torch.exp(-r) * r ** 2,
                        torch.tanh(r - 2.0)], dim=1)


def test_slopes_are_the_derivative():
    r = torch.linspace(0.5, 4.5, 9, dtype=F64)
    values, slopes = derivatives(_curve, r, 1)
    eps = 1e-6
    fd = (_curve(r + eps) - _curve(r - eps)) / (2 * eps)
    assert torch.allclose(values, _curve(r))
    assert float((slopes - fd).abs().max()) < 1e-8


def test_spline_meets_the_nodes_and_is_smooth_across_them():
    r = torch.linspace(1.0, 2.0, 11, dtype=F64)
    h = 0.1
    values, slopes = derivatives(_curve, r, 1)
    coeffs = hermite_coefficients(values, slopes * h)
    # at s = 0 and s = 1 each cell gives the node's value and slope
    s1 = coeffs.sum(1)
    d0, d1 = coeffs[:, 1], coeffs[:, 1] + 2 * coeffs[:, 2] + 3 * coeffs[:, 3]
    assert torch.allclose(coeffs[:, 0], values[:-1]) and torch.allclose(s1, values[1:])
    assert torch.allclose(d0, slopes[:-1] * h) and torch.allclose(d1, slopes[1:] * h)


def test_quintic_spline_meets_values_slopes_and_curvatures_at_the_nodes():
    r = torch.linspace(1.0, 2.0, 11, dtype=F64)
    h = 0.1
    v, d, a = derivatives(_curve, r, 2)
    eps = 1e-5
    fd = (derivatives(_curve, r + eps, 1)[1] - derivatives(_curve, r - eps, 1)[1]) / (2 * eps)
    assert float((a - fd).abs().max()) < 1e-8
    c = hermite_coefficients(v, d * h, a * h * h)
    k = torch.arange(6, dtype=F64)[None, :, None]
    assert torch.allclose(c.sum(1), v[1:])  # s = 1
    assert torch.allclose((k * c).sum(1), d[1:] * h)
    assert torch.allclose((k * (k - 1) * c).sum(1), a[1:] * h * h)
    assert torch.allclose(c[:, 0], v[:-1]) and torch.allclose(c[:, 1], d[:-1] * h)


def test_float64_tables_are_quintic_and_within_1e_13():
    spec = SPECS[torch.float64]
    table = build_table(_curve, 5.0, torch.zeros(1, dtype=F64), spec, torch.float64)
    assert table.degree == 5 and table.max_error <= spec.tolerance
    assert table.max_slope_error <= spec.slope_tolerance
    r = torch.linspace(0.6, 4.99, 3001, dtype=F64, requires_grad=True)
    w = evaluate(table.coeffs, table.inv_h, r)
    assert float((w.detach() - _curve(r.detach())).abs().max() / _curve(r.detach()).abs().max()
                 ) < 2e-13
    assert "quintic Hermite table" in table.describe(torch.float64)


def test_table_is_within_its_tolerance_and_differentiable():
    table = build_table(_curve, 5.0, torch.zeros(1, dtype=F64))
    assert table.cells >= 512 and table.max_error <= TOLERANCE
    r = torch.linspace(0.6, 4.99, 3001, dtype=F64, requires_grad=True)
    w = evaluate(table.coeffs, table.inv_h, r)
    scale = float(_curve(r.detach()).abs().max())
    assert float((w.detach() - _curve(r.detach())).abs().max()) / scale < 2 * TOLERANCE
    (dr,) = torch.autograd.grad(w.sum(), r)
    (want,) = torch.autograd.grad(_curve(r).sum(), r)
    assert float((dr - want).abs().max() / want.abs().max()) < 1e-6
    assert "cubic Hermite table" in table.describe()


def test_a_table_that_cannot_meet_the_tolerance_says_so():
    with pytest.raises(TableError, match="largest weight"):
        build_table(lambda r: torch.sin(400 * r)[:, None], 5.0, torch.zeros(1, dtype=F64),
                    TableSpec(3, 1e-7, 5e-7, max_cells=1024))
    with pytest.raises(TableError, match="r_max"):
        build_table(_curve, 0.0, torch.zeros(1, dtype=F64))


def test_lengths_past_the_table_stay_on_its_end():
    table = build_table(_curve, 5.0, torch.zeros(1, dtype=F64))
    end = evaluate(table.coeffs, table.inv_h, torch.tensor([5.0, 5.0 + 1e-9], dtype=F64))
    assert torch.allclose(end[0], end[1])


@pytest.mark.parametrize("n_out,vec", [(1280, 4), (90, 2), (45, 1)])
def test_plans_and_sources(n_out, vec):
    for direction in codegen.DIRECTIONS:
        plan = codegen.plan_kernel(direction, n_out)
        assert plan.vec == vec and plan.nq * vec == n_out
        src = codegen.render_kernel(plan)
        assert codegen.kernel_name(plan) in src and f"#define NQ {plan.nq}" in src
    with pytest.raises(ValueError, match="direction"):
        codegen.plan_kernel("sideways", n_out)
    with pytest.raises(ValueError, match="degree"):
        codegen.plan_kernel("forward", n_out, "float64", 4)
    quintic = codegen.plan_kernel("backward", n_out, "float64", 5)
    assert quintic.nc == 6 and quintic.vec == min(vec, 2)
    assert "typedef double real" in codegen.render_kernel(quintic)
    names = [name for name, _ in codegen.catalog_sources(None)]
    assert len(names) == len(set(names)) == 2 * 3 * len(codegen.CATALOG_WIDTHS)


@pytest.mark.parametrize("n_out,dtype,threads,chunks", [
    (1280, "float64", 224, 3), (1280, "float32", 160, 2), (512, "float64", 256, 1),
    (2560, "float64", 256, 5), (45, "float32", 64, 1)])
def test_sorted_backward_walks_the_row_in_chunks(n_out, dtype, threads, chunks):
    """The sorted backward: one vector column a thread, the row in chunks of at most 256
    vectors (whole warps), GROUP edges loaded at once; a block a run of positions."""
    plan = codegen.plan_kernel("sorted_backward", n_out, dtype, 5 if dtype == "float64" else 3)
    assert (plan.threads, plan.chunks) == (threads, chunks)
    assert plan.threads * plan.chunks >= plan.nq > plan.threads * (plan.chunks - 1)
    assert 1 << plan.log_group == plan.group <= 32 and plan.edges % plan.group == 0
    src = codegen.render_kernel(plan)
    assert f"#define CHUNKS {chunks}" in src and f"#define GROUP {plan.group}" in src
    assert codegen.grid(plan, 1000, 132) == -(-1000 // plan.edges)


def test_forward_takes_whole_rows_where_they_fit():
    """The forward's blocks write a whole row up to 640 vectors; wider rows split evenly."""
    fits = codegen.plan_kernel("forward", 1280, "float64", 5)
    assert (fits.chunks, fits.threads) == (1, 640)
    assert codegen.grid(fits, 1000, 132) == (-(-1000 // fits.edges), 1)
    wide = codegen.plan_kernel("forward", 1792, "float64", 5)  # 896 vectors
    assert (wide.chunks, wide.threads) == (2, 448)
    anyway = codegen.plan_kernel("backward", 1280, "float64", 5)
    assert anyway.threads == codegen.BACKWARD_THREADS and anyway.chunks == 1
    assert codegen.grid(anyway, 10 ** 7, 132) == 132 * 16


def test_option_is_checked():
    with pytest.raises(ConfigError, match="radial_table"):
        AccelOptions(radial_table="yes")


def _patched(interaction: str = "RealAgnosticResidualInteractionBlock"):
    model = small_test_model(interaction)
    for p in model.parameters():
        p.requires_grad_(False)
    mace_accel.accelerate(model, backend="reference", verify=False)
    return model


def test_link_gives_every_mlp_the_embedding_and_reports_only_for_cuda():
    model = _patched()
    embedding = next(m for m in model.modules() if isinstance(m, FusedRadialEmbedding))
    mlps = [m for m in model.modules() if isinstance(m, FusedRadialMLP)]
    assert len(mlps) == 2 and all(m.embedding is embedding for m in mlps)
    assert "embedding" not in dict(mlps[0].named_children())  # no second state-dict entry
    assert table_patch.link(model, AccelOptions(backend="reference")) is None
    assert table_patch.link(model, AccelOptions(backend="cuda", radial_table=False)) is None
    note = table_patch.link(model, AccelOptions(backend="cuda"))
    assert "Hermite table" in note and "radial MLPs" not in note


def test_embedding_hands_out_the_lengths_of_its_own_output_only():
    model = _patched()
    embedding = next(m for m in model.modules() if isinstance(m, FusedRadialEmbedding))
    lengths = torch.rand(7, 1, dtype=F64) * 3 + 0.5
    feats, _ = embedding(lengths)
    assert torch.equal(embedding.table_input(feats).lengths, lengths.reshape(-1))
    assert embedding.table_input(feats.clone()) is None
    order = embedding.length_order(embedding.table_input(feats).lengths)
    assert torch.equal(order.sort().values, torch.arange(7))  # a permutation
    step = embedding.spec.r_max / ORDER_KEY_MAX  # sorted to the keys' steps
    assert bool((lengths.reshape(-1)[order].diff() > -step).all())
    ties = torch.tensor([1.0, 1.0 + step / 4, 1.0 - step / 4, 0.2, 99.0], dtype=F64)
    walk = embedding.length_order(ties).tolist()  # within a step: any order; past r_max: last
    assert walk[0] == 3 and set(walk[1:4]) == {0, 1, 2} and walk[4] == 4
    feats.mul_(1.0)  # modified in place: no longer the embedding of those lengths
    assert embedding.table_input(feats) is None


@pytest.mark.parametrize("tables", [2, 15, 128, 129, 300])
def test_pair_table_walk_goes_by_table_then_length(tables):
    """Two radix passes (15-bit keys) up to 128 tables, the slot in the high bits; beyond, 32-bit
    keys: either way table by table, each in order of length to its keys' steps."""
    from mace_accel.ops.radial.table import order as walk

    g = torch.Generator().manual_seed(tables)
    lengths = torch.rand(5000, generator=g, dtype=F64) * 6.5  # some past r_max = 6
    slots = torch.randint(0, tables, (5000,), generator=g, dtype=torch.int32)
    slots[:2] = torch.tensor([0, tables - 1], dtype=torch.int32)
    order = walk.length_order(lengths, 6.0, slots, tables)
    assert torch.equal(order.sort().values, torch.arange(5000))
    s, r = slots[order], lengths[order].clamp(max=6.0)
    assert bool((s.diff() >= 0).all())
    step = 6.0 / walk.length_steps(tables)
    same = s[1:] == s[:-1]
    assert bool((r.diff()[same] > -step).all())
    assert walk.length_steps(tables) == {2: 16383, 15: 2047, 128: 255}.get(tables,
                                                                          walk.ORDER_KEY_MAX)
    with pytest.raises(ValueError, match="together"):
        walk.length_order(lengths, 6.0, slots)


def test_only_large_tables_are_walked_in_order_of_length():
    """A table that stays in L2 (float32 cubic, 21 MB) is walked as the edges come at any
    count; one that does not (float64 quintic, 126 MB) in order of length from 4,096 edges."""
    small = torch.empty(1024, 4, 1280, dtype=torch.float32, device="meta")  # 21 MB
    large = torch.empty(2048, 6, 1280, dtype=F64, device="meta")  # 126 MB
    assert not table_patch.walks_sorted(20000, small)
    assert not table_patch.walks_sorted(10 ** 7, small)
    assert table_patch.walks_sorted(20000, large)
    assert table_patch.walks_sorted(table_patch.SORT_MIN_EDGES, large)
    assert not table_patch.walks_sorted(table_patch.SORT_MIN_EDGES - 1, large)


def test_off_cuda_the_mlp_runs():
    model = _patched()
    embedding = next(m for m in model.modules() if isinstance(m, FusedRadialEmbedding))
    mlp = next(m for m in model.modules() if isinstance(m, FusedRadialMLP))
    feats, _ = embedding(torch.rand(5, 1, dtype=F64) + 1.0)
    assert table_patch.table_input(mlp, feats) is None


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 2e-7), (torch.float64, 1e-12)])
@pytest.mark.parametrize("interaction", ["RealAgnosticResidualInteractionBlock",
                                         "RealAgnosticInteractionBlock"])
def test_a_blocks_table_is_its_mlp_of_its_embedding(interaction, dtype, bound):
    """The table a block would look up, built from our reference embedding and the folded
    weights, against mace's own modules (the original embedding and e3nn MLP) in float64."""
    model = _patched(interaction)
    embedding = next(m for m in model.modules() if isinstance(m, FusedRadialEmbedding))
    like = torch.zeros(1, dtype=dtype)
    r = torch.linspace(0.5, embedding.spec.r_max * 0.999, 2001, dtype=F64)
    with torch.no_grad():
        feats = embedding.original(r[:, None], None, None, None)
        feats = feats[0] if isinstance(feats, tuple) else feats
    for mlp in (m for m in model.modules() if isinstance(m, FusedRadialMLP)):
        table, coeffs = table_patch.tables_of(mlp, "mlp", mlp.raw_weights(),
                                              lambda: table_patch.mlp_function(mlp), None, like)
        assert coeffs.dtype == dtype and table.max_error <= SPECS[dtype].tolerance
        with torch.no_grad():
            want = mlp.original(feats)
        got = evaluate(table.coeffs, table.inv_h, r)
        assert float((got - want).abs().max() / want.abs().max()) < bound
        assert "looked up in a cubic Hermite table" in mlp.describe() or \
            mlp.backend != "cuda"


def test_a_table_that_cannot_be_built_is_remembered_without_the_build():
    """The error kept for weights that cannot be tabulated carries no traceback: its frames
    would keep the build's float64 tensors (gigabytes on a GPU) alive with the model."""
    model = _patched()
    mlp = next(m for m in model.modules() if isinstance(m, FusedRadialMLP))

    def wild(pairs):  # no table of the allowed cells is within the tolerance
        return lambda r, which: torch.sin(400.0 * r)[:, None].expand(-1, 3)

    with pytest.warns(RuntimeWarning, match="runs as an MLP, not as tables"):
        got = table_patch.tables_of(mlp, "mlp", mlp.raw_weights(), lambda: wild, None,
                                    torch.zeros(1, dtype=torch.float64))
    assert got is None
    kept = [v[1] for k, v in mlp._kernels.items()
            if isinstance(k, str) and k.startswith("radial_table:mlp:")]
    assert len(kept) == 1 and isinstance(kept[0], TableError)
    assert kept[0].__traceback__ is None and kept[0].__context__ is None


def test_bessel_like_embedding_needs_few_cells():
    """MACE's 8 Bessel functions up to 6 Å into a random SiLU net: 1024 cells at most."""
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(8, 32, generator=g, dtype=F64) / 8 ** 0.5,
          torch.randn(32, 64, generator=g, dtype=F64) / 32 ** 0.5]
    n = torch.arange(1, 9, dtype=F64)

    def f(r):
        x = r / 6.0
        cut = 1 - 28 * x ** 6 + 48 * x ** 7 - 21 * x ** 8
        h = torch.sin(n * math.pi * r[:, None] / 6.0) / r[:, None] * cut[:, None]
        return torch.nn.functional.silu(h @ ws[0]) @ ws[1]

    assert build_table(f, 6.0, torch.zeros(1, dtype=F64)).cells <= 1024


# ----- tables per pair of elements (distance transforms, non-linear blocks) -------------------
def test_pair_sets_give_every_pair_one_slot():
    from mace_accel.ops.species import ORDERED, UNORDERED, PairSet

    unordered = PairSet(UNORDERED, (0, 2, 3), 4)
    assert unordered.count == 6 and unordered.pairs()[:3] == [(0, 0), (0, 2), (0, 3)]
    slots = unordered.slot_map()
    assert len(slots) == 16 and sorted({slots[a * 4 + b] for a, b in unordered.pairs()}) \
        == list(range(6))
    assert all(slots[a * 4 + b] == slots[b * 4 + a] for a in (0, 2, 3) for b in (0, 2, 3))
    ordered = PairSet(ORDERED, (1, 3), 4)
    assert ordered.count == 4 and ordered.slot_map()[3 * 4 + 1] == 2
    with pytest.raises(ValueError):
        PairSet("sideways", (), 1)


def test_tables_laid_end_to_end_are_read_by_slot():
    fs = [lambda r, k=k: _curve(r) * (1.0 + k) for k in range(3)]
    table = build_tables(lambda r, which: _curve(r) * (1.0 + which[:, None]), 3, 5.0,
                         torch.zeros(1, dtype=F64))
    assert table.tables == 3 and table.coeffs.shape[0] == 3 * table.cells
    r = torch.rand(40, dtype=F64) * 4.5 + 0.3
    slots = torch.randint(0, 3, (40,), dtype=torch.int32)
    got = evaluate(table.coeffs, table.inv_h, r, slots, 3)
    want = torch.stack([fs[int(k)](r[i:i + 1])[0] for i, k in enumerate(slots)])
    assert float((got - want).abs().max()) < 1e-6
    single = build_table(fs[2], 5.0, torch.zeros(1, dtype=F64))
    assert single.cells <= table.cells  # one grid fits the worst of the functions


def _transformed(interaction: str = "RealAgnosticDensityResidualInteractionBlock"):
    """A small Agnesi-transformed Density model (MACE-MPA-0's kind), patched, its embedding
    asked for the pairs of elements as on a GPU."""
    from mace_accel.models.architectures import Architecture, build_model

    arch = Architecture(hidden_irreps="8x0e+8x1o", r_max=4.0, elements=(1, 6, 8, 29),
                        max_ell=2, correlation=2, num_bessel=4, radial_mlp=(16, 16),
                        mlp_irreps="4x0e", interaction=interaction,
                        interaction_first="RealAgnosticDensityInteractionBlock",
                        avg_num_neighbors=8.0, distance_transform="Agnesi",
                        pair_repulsion=True)
    model = build_model(arch, dtype=F64)
    for p in model.parameters():
        p.requires_grad_(False)
    mace_accel.accelerate(model, backend="reference")
    embedding = next(m for m in model.modules() if isinstance(m, FusedRadialEmbedding))
    embedding.pair_kind = table_patch.pair_kind(model, embedding)
    return model, embedding


def test_embedding_covers_the_elements_of_each_call_and_names_each_edges_table():
    model, embedding = _transformed()
    assert embedding.pair_kind == "unordered" and embedding.pairs is None
    attrs = torch.eye(4, dtype=F64)[[0, 0, 3, 3, 1]]
    edge_index = torch.tensor([[0, 2, 3, 4, 1], [2, 0, 4, 3, 4]])
    lengths = torch.rand(5, 1, dtype=F64) + 1.0
    feats, _ = embedding(lengths, attrs, edge_index, None)
    found = embedding.table_input(feats)
    assert embedding.pairs.elements == (0, 1, 3) and embedding.generation == 1
    pairs = embedding.pairs.pairs()
    got = [pairs[int(k)] for k in found.slots]
    want = [tuple(sorted(p)) for p in [(0, 3), (3, 0), (3, 1), (1, 3), (0, 1)]]
    assert got == want and found.slots.dtype == torch.int32
    embedding(lengths, attrs, edge_index, None)  # the same attributes: nothing new
    assert embedding.generation == 1
    other = torch.eye(4, dtype=F64)[[2, 2, 3, 3, 1]]  # another structure: its own pairs
    embedding(lengths, other, edge_index, None)
    assert embedding.pairs.elements == (1, 2, 3) and embedding.generation == 2


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 2e-7), (torch.float64, 2e-12)])
def test_pair_tables_are_the_transformed_mlp_of_each_pair(dtype, bound):
    """Per pair of elements, the table of a transformed model's block against mace's own
    embedding (Agnesi with the pair's covalent radii) and MLP."""
    from mace_accel.ops.species import PairSet

    model, embedding = _transformed()
    pairs = PairSet("unordered", (0, 3), 4)
    numbers = model.atomic_numbers
    mlps = [m for m in model.modules() if isinstance(m, FusedRadialMLP)]
    assert len(mlps) == 4  # each block's TP weights and density_fn
    r = torch.linspace(0.6, embedding.spec.r_max * 0.999, 301, dtype=F64)
    for mlp in mlps:
        table, coeffs = table_patch.tables_of(mlp, "mlp", mlp.raw_weights(),
                                              lambda: table_patch.mlp_function(mlp), pairs,
                                              torch.zeros(1, dtype=dtype))
        assert table.tables == 3 and coeffs.dtype == dtype
        for slot, (a, b) in enumerate(pairs.pairs()):
            attrs = torch.eye(4, dtype=F64)[[a, b]]
            edge_index = torch.tensor([[0] * len(r), [1] * len(r)])
            with torch.no_grad():
                feats, _ = embedding.original(r[:, None], attrs, edge_index, numbers)
                want = mlp.original(feats)
            got = evaluate(table.coeffs, table.inv_h, r,
                           torch.full((len(r),), slot, dtype=torch.int32), table.tables)
            assert float((got - want).abs().max() / want.abs().max()) < bound
