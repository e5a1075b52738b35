"""TPSpec from e3nn and the plain-torch reference convolution, checked against e3nn itself.

Problems are MACE conv tensor products (built by MACE's own instruction helper) with odd
multiplicities, mixed parities and L up to 3 in edge attributes, node features and outputs.
"""

from __future__ import annotations

import pytest
import torch
from helpers import default_dtype

from mace_accel._e3nn_compat import o3
from mace_accel.errors import UnsupportedModelError
from mace_accel.ops.conv_tp import reference
from mace_accel.ops.conv_tp.catalog import select
from mace_accel.ops.conv_tp.spec import cg_nonzeros, make_e3nn_conv_tp, spec_from_e3nn
from mace_accel.options import AccelOptions
from mace_accel.patches.conv_tp import FusedConvTP
from mace_accel.tolerances import EQUIVARIANCE_TOL, PASS_TOL, rel_norm_error

F64 = torch.float64
TOL = PASS_TOL[F64]

# the catalog's small problems (node_feats, edge_attrs, MACE target irreps)
CASES = {p.name: p.irreps for p in select("cpu")}


_TPS: dict = {}


def conv_tp_problem(case: str, built_in: torch.dtype = F64):
    """The e3nn TP of ``case`` built in ``built_in`` (cast to float64 after) and its spec.

    Built in float64, the TP's 3j buffers are exact; built in float32 (what a model made under
    torch's default dtype carries), they are float32-rounded and the spec must follow them.
    """
    key = (case, built_in)
    if key not in _TPS:
        with default_dtype(built_in):
            tp = make_e3nn_conv_tp(*CASES[case])
        tp = tp.to(F64)
        _TPS[key] = (tp, spec_from_e3nn(tp))
    return _TPS[key]


def random_inputs(spec, n_nodes: int = 7, n_edges: int = 23, seed: int = 0,
                  index_dtype: torch.dtype = torch.int64):
    """Node feats, edge attrs, weights, sender, receiver; node 0 never receives (a zero row)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_nodes, spec.dim_in1, generator=g, dtype=F64)
    y = torch.randn(n_edges, spec.dim_in2, generator=g, dtype=F64)
    w = torch.randn(n_edges, spec.weight_numel, generator=g, dtype=F64)
    sender = torch.randint(0, n_nodes, (n_edges,), generator=g).to(index_dtype)
    receiver = torch.randint(1, n_nodes, (n_edges,), generator=g).to(index_dtype)
    return x, y, w, sender, receiver


def e3nn_conv(tp, x, y, w, sender, receiver, n_nodes):
    """What MACE does without fusion: gather, e3nn TP per edge, scatter-sum to receivers."""
    msg = tp(x[sender], y, w)
    return torch.zeros(n_nodes, msg.shape[1], dtype=msg.dtype).index_add(0, receiver, msg)


def dense_cg(path, spec):
    dims = tuple(ir.ir_dim for ir in (spec.irreps_in1[path.i_in1], spec.irreps_in2[path.i_in2],
                                      spec.irreps_out[path.i_out]))
    dense = torch.zeros(dims, dtype=F64)
    for i, j, k, value in path.cg:
        dense[i, j, k] = value
    return dense


# ----- spec ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
def test_spec_mirrors_e3nn_instructions(case):
    tp, spec = conv_tp_problem(case)
    assert spec.irreps_str("in1") == str(tp.irreps_in1).replace(" ", "")
    assert spec.irreps_str("in2") == str(tp.irreps_in2).replace(" ", "")
    assert spec.irreps_str("out") == str(tp.irreps_out).replace(" ", "")
    assert (spec.dim_in1, spec.dim_in2, spec.dim_out) == (
        tp.irreps_in1.dim, tp.irreps_in2.dim, tp.irreps_out.dim)
    assert spec.weight_numel == tp.weight_numel
    assert len(spec.paths) == len(tp.instructions)
    offset = 0
    for path, ins in zip(spec.paths, tp.instructions):
        assert (path.i_in1, path.i_in2, path.i_out) == (ins.i_in1, ins.i_in2, ins.i_out)
        assert path.path_weight == ins.path_weight  # e3nn's final coefficient, bit for bit
        assert path.mode == ins.connection_mode == "uvu"
        assert path.weight_offset == offset
        offset += path.weight_numel
    assert offset == spec.weight_numel
    assert spec.unsupported_reason() is None


def test_spec_is_hashable_and_keyed():
    case = "small-mixed-parity"
    _, spec = conv_tp_problem(case)
    with default_dtype(F64):
        again = spec_from_e3nn(make_e3nn_conv_tp(*CASES[case]))  # a second, independent build
    assert again == spec and hash(again) == hash(spec) and again.key() == spec.key()
    others = {conv_tp_problem(c)[1].key() for c in CASES}
    assert len(others) == len(CASES)


@pytest.mark.parametrize("l1,l2,l3", [(0, 0, 0), (1, 1, 0), (1, 1, 2), (2, 1, 3), (3, 3, 2),
                                      (2, 2, 2), (3, 2, 1)])
def test_cg_nonzeros_are_wigner_3j(l1, l2, l3):
    w3j = o3().wigner_3j(l1, l2, l3, dtype=F64)
    nz = cg_nonzeros(l1, l2, l3)
    assert {(i, j, k) for i, j, k, _ in nz} == {tuple(ix) for ix in
                                               (w3j.abs() > 1e-14).nonzero().tolist()}
    for i, j, k, value in nz:
        assert value == float(w3j[i, j, k])


@pytest.mark.parametrize("case", sorted(CASES))
def test_spec_cg_of_float64_model_is_exact(case):
    tp, spec = conv_tp_problem(case)
    for path in spec.paths:
        ls = (spec.irreps_in1[path.i_in1].l, spec.irreps_in2[path.i_in2].l,
              spec.irreps_out[path.i_out].l)
        assert torch.equal(dense_cg(path, spec), o3().wigner_3j(*ls, dtype=F64)), ls


def test_spec_cg_of_float32_built_model_follows_its_buffers():
    """A float32-built TP keeps float32-rounded 3j buffers: the spec must use those values."""
    tp, spec = conv_tp_problem("small-odd-mul-l3-edges", built_in=torch.float32)
    w3j = {n.rsplit(".", 1)[-1]: b for n, b in tp.named_buffers() if "_w3j_" in n}
    assert w3j, "e3nn no longer stores its 3j symbols as buffers; revisit spec_from_e3nn"
    for path in spec.paths:
        ls = (spec.irreps_in1[path.i_in1].l, spec.irreps_in2[path.i_in2].l,
              spec.irreps_out[path.i_out].l)
        buf = w3j.get("_w3j_%d_%d_%d" % ls)
        if buf is not None:
            assert torch.equal(dense_cg(path, spec), torch.where(buf.abs() > 1e-14, buf, 0.0))
        exact = o3().wigner_3j(*ls, dtype=F64)
        assert rel_norm_error(dense_cg(path, spec), exact) < 1e-6


# ----- unsupported problems -----------------------------------------------------------------
def _tp(irreps_in1, irreps_in2, irreps_out, instructions, **kw):
    kw.setdefault("shared_weights", False)
    kw.setdefault("internal_weights", False)
    return o3().TensorProduct(irreps_in1, irreps_in2, irreps_out, instructions, **kw)


@pytest.mark.parametrize("make_tp,expected", [
    (lambda: _tp("2x0e", "1x0e", "3x0e", [(0, 0, 0, "uvw", True)]), "'uvw'"),
    (lambda: _tp("2x1o", "1x1o", "2x0e", [(0, 0, 0, "uvu", False)]), "without weights"),
    (lambda: _tp("3x0e", "2x0e", "3x0e", [(0, 0, 0, "uvu", True)]), "multiplicity > 1"),
    (lambda: _tp("2x0e+2x1o", "1x0e+1x1o", "2x0e",
                 [(0, 0, 0, "uvu", True), (1, 1, 0, "uvu", True)]), "same output segment"),
    (lambda: _tp("2x0e", "1x0e", "2x0e", [(0, 0, 0, "uvu", True)], shared_weights=True,
                 internal_weights=True), "shared"),
])
def test_unsupported_reason(make_tp, expected):
    reason = spec_from_e3nn(make_tp()).unsupported_reason()
    assert reason is not None and expected in reason


def test_spec_from_non_tensor_product_is_a_clear_error():
    with pytest.raises(UnsupportedModelError, match="expected an e3nn o3.TensorProduct"):
        spec_from_e3nn(torch.nn.Linear(3, 3))


# ----- reference convolution vs e3nn ----------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("built_in", [torch.float64, torch.float32], ids=["f64-built", "f32-built"])
def test_reference_conv_matches_e3nn(case, built_in):
    tp, spec = conv_tp_problem(case, built_in)
    x, y, w, sender, receiver = random_inputs(spec)
    ours = reference.conv_tp(spec, x, y, w, sender, receiver, x.shape[0])
    theirs = e3nn_conv(tp, x, y, w, sender, receiver, x.shape[0])
    assert ours.shape == theirs.shape == (x.shape[0], spec.dim_out)
    assert theirs.norm() > 0 and torch.all(ours[0] == 0)
    assert rel_norm_error(ours, theirs) <= TOL["forward"]
    assert torch.equal(ours, reference.conv_tp_forward(spec, x, y, w, sender, receiver, 7))


# ----- properties -----------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("parity", [False, True], ids=["SO3", "with-parity"])
def test_conv_is_equivariant(case, parity):
    _, spec = conv_tp_problem(case)
    x, y, w, sender, receiver = random_inputs(spec, seed=2)
    torch.manual_seed(7)
    rot = o3().rand_matrix(dtype=F64)
    if parity:
        rot = -rot  # an improper rotation: det = -1
    d1, d2, d_out = (o3().Irreps(spec.irreps_str(k)).D_from_matrix(rot)
                     for k in ("in1", "in2", "out"))
    n = x.shape[0]
    plain = reference.conv_tp(spec, x, y, w, sender, receiver, n)
    rotated_in = reference.conv_tp(spec, x @ d1.T, y @ d2.T, w, sender, receiver, n)
    assert rel_norm_error(rotated_in, plain @ d_out.T) <= EQUIVARIANCE_TOL[F64]
    if parity and any(ir.p == -1 for ir in spec.irreps_out):
        # the check has teeth: ignoring parity (the proper rotation on the output) must fail
        proper = o3().Irreps(spec.irreps_str("out")).D_from_matrix(-rot)
        assert rel_norm_error(rotated_in, plain @ proper.T) > 1e-3


@pytest.mark.parametrize("case", ["small-odd-mul-l3-edges", "small-mixed-parity"])
def test_conv_is_linear_in_each_input(case):
    _, spec = conv_tp_problem(case)
    x, y, w, sender, receiver = random_inputs(spec, seed=4)
    x2, y2, w2, _, _ = random_inputs(spec, seed=5)
    a, b = 0.7, -1.3

    def conv(x_, y_, w_):
        return reference.conv_tp(spec, x_, y_, w_, sender, receiver, x.shape[0])

    for mixed, parts in (((x, y, a * w + b * w2), (conv(x, y, w), conv(x, y, w2))),
                         ((a * x + b * x2, y, w), (conv(x, y, w), conv(x2, y, w))),
                         ((x, a * y + b * y2, w), (conv(x, y, w), conv(x, y2, w)))):
        assert rel_norm_error(conv(*mixed), a * parts[0] + b * parts[1]) <= TOL["forward"]


def test_empty_edge_set():
    tp, spec = conv_tp_problem("small-mixed-parity")
    x, y, w, sender, receiver = random_inputs(spec, n_edges=0)
    assert y.shape == (0, spec.dim_in2) and sender.shape == (0,)
    out = reference.conv_tp(spec, x, y, w, sender, receiver, x.shape[0])
    assert out.shape == (x.shape[0], spec.dim_out) and torch.all(out == 0)
    assert torch.equal(out, e3nn_conv(tp, x, y, w, sender, receiver, x.shape[0]))
    gx, gy, gw = reference.conv_tp_backward(spec, x, y, w, torch.randn_like(out), sender,
                                            receiver)
    assert torch.all(gx == 0) and gx.shape == x.shape
    assert gy.shape == (0, spec.dim_in2) and gw.shape == (0, spec.weight_numel)
    fused = FusedConvTP(tp, spec, AccelOptions(backend="reference"))
    assert torch.equal(fused(x, y, w, torch.stack([sender, receiver])), out)


def test_int32_edge_index_gives_the_same_result():
    tp, spec = conv_tp_problem("small-odd-mul-l3-edges")
    x, y, w, sender, receiver = random_inputs(spec, seed=6)
    s32, r32 = sender.to(torch.int32), receiver.to(torch.int32)
    n = x.shape[0]
    expected = reference.conv_tp(spec, x, y, w, sender, receiver, n)
    assert torch.equal(reference.conv_tp(spec, x, y, w, s32, r32, n), expected)
    g = torch.randn_like(expected)
    for a, b in zip(reference.conv_tp_backward(spec, x, y, w, g, s32, r32),
                    reference.conv_tp_backward(spec, x, y, w, g, sender, receiver)):
        assert torch.equal(a, b)
    fused = FusedConvTP(tp, spec, AccelOptions(backend="reference"))
    out32 = fused(x, y, w, torch.stack([s32, r32]))
    assert torch.equal(out32, fused(x, y, w, torch.stack([sender, receiver])))
    assert rel_norm_error(out32, e3nn_conv(tp, x, y, w, sender, receiver, n)) <= TOL["forward"]
