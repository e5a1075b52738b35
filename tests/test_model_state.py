"""The accelerated model is always the model: after weights change in
place, constants loaded from a state dict, ``revert`` / ``accelerate``, a cast, a new head,
pickling, the next result is the plain model's with the current weights, or one clear error,
through the calculator, batched evaluation and torch-sim; and the state watch a CUDA graph
relies on sees every such change. Each case runs on the CPU's reference backend (float64) and,
marked ``gpu``, on the fused CUDA path with its graphs, radial tables and fused constants in
float64 and float32 (more on the CUDA side: tests/test_gpu_modern_models.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import save_and_load

import mace_accel
from mace_accel import MACEAccelCalculator
from mace_accel.models.architectures import small_test_model
from mace_accel.models.batch import atoms_to_batch, model_info
from mace_accel.state import StateWatch
from mace_accel.surgery import accelerate, revert
from mace_accel.tolerances import MODEL_TOL, rel_norm_error

F64 = torch.float64


class Place:
    """Where and how the accelerated model runs: device, backend, dtype."""

    def __init__(self, device: str, backend: str, dtype: torch.dtype) -> None:
        self.device, self.backend, self.dtype = device, backend, dtype
        self.tol = MODEL_TOL[dtype]
        self.other = torch.float32 if dtype == F64 else F64  # the dtype a cast moves to

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")


@pytest.fixture(params=[
    pytest.param(("cpu", "reference", F64), id="cpu-float64"),
    pytest.param(("cuda", "cuda", F64), id="cuda-float64", marks=pytest.mark.gpu),
    pytest.param(("cuda", "cuda", torch.float32), id="cuda-float32", marks=pytest.mark.gpu),
])
def place(request) -> Place:
    return Place(*request.param)


def _atoms(seed: int = 0):
    from ase import Atoms

    rng = np.random.default_rng(seed)
    positions = rng.uniform(0.0, 4.5, (8, 3))
    numbers = rng.choice([1, 6, 8, 29], 8)
    atoms = Atoms(numbers=numbers, positions=positions, cell=np.eye(3) * 4.6, pbc=True)
    return atoms


def _model():
    model = small_test_model("RealAgnosticResidualInteractionBlock", heads=("a", "b"))
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _plain_forces(model, atoms, head="b"):
    """The plain model's forces with ``model``'s current weights, in float64 on the CPU."""
    plain = copy.deepcopy(model)
    if mace_accel.surgery.is_accelerated(plain):
        revert(plain)
    plain = plain.to("cpu", F64)
    batch = atoms_to_batch(atoms, model_info(plain), head=head)
    return plain(batch, training=False, compute_force=True)["forces"].detach()


def _perturb(model, seed: int) -> dict:
    """The state dict with new weights (the parameters; the buffers are the architecture's
    constants: Clebsch-Gordan coefficients, Bessel frequencies, ... as a fine-tune keeps them)."""
    g = torch.Generator().manual_seed(seed)
    weights = {k for k, _ in model.named_parameters()}
    return {k: (v + 0.1 * v.abs().mean() * torch.randn(v.shape, generator=g, dtype=v.dtype)
                if k in weights else v)
            for k, v in model.state_dict().items()}


def _calculator(model, place: Place):
    return MACEAccelCalculator(model=model, device=place.device,
                               default_dtype=place.dtype_name, backend=place.backend, head="b",
                               min_distance=None)


@pytest.mark.parametrize("reset", [True, False])
def test_load_state_dict_under_a_live_calculator(reset, place):
    base = _model()
    calc = _calculator(copy.deepcopy(base), place)
    atoms = _atoms()
    atoms.calc = calc
    atoms.get_forces()
    new = _perturb(base, 1)
    calc.model.load_state_dict(new)
    if reset:
        calc.reset()
    else:
        atoms.positions[0] += 0.05  # the atoms change: ASE calls the calculator again
    plain = copy.deepcopy(base)
    plain.load_state_dict(new)
    forces = torch.from_numpy(atoms.get_forces())
    assert rel_norm_error(forces, _plain_forces(plain, atoms)) < place.tol


def test_constants_loaded_from_a_state_dict_are_followed(place):
    """Buffers the fused kernels are generated from (the symmetric contraction's U matrices, the
    Bessel frequencies) loaded with other values: the next call is the plain model's with them
    (the spec is read again and gets kernels of its own), not the fused constants'."""
    base = _model()
    calc = _calculator(copy.deepcopy(base), place)
    atoms = _atoms()
    atoms.calc = calc
    before = atoms.get_forces()
    new = {k: (1.1 * v if ("U_matrix" in k or "bessel_weights" in k) else v)
           for k, v in base.state_dict().items()}
    assert sum("U_matrix" in k for k in new) and sum("bessel_weights" in k for k in new)
    calc.model.load_state_dict(new)
    calc.reset()
    plain = copy.deepcopy(base)
    plain.load_state_dict(new)
    forces = torch.from_numpy(atoms.get_forces())
    assert rel_norm_error(forces, _plain_forces(plain, atoms)) < place.tol
    assert not np.allclose(forces.numpy(), before)


def test_optimizer_steps_revert_accelerate_and_cast_under_a_live_calculator(place):
    calc = _calculator(_model(), place)
    atoms = _atoms()
    atoms.calc = calc
    atoms.get_forces()
    params = [p for p in calc.model.parameters() if p.is_floating_point()]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.SGD(params, lr=0.1)
    loss = sum((p ** 2).sum() for p in params)
    loss.backward()
    optimizer.step()  # in place, as a fine-tune does
    for p in params:
        p.requires_grad_(False)
    calc.reset()
    assert rel_norm_error(torch.from_numpy(atoms.get_forces()),
                          _plain_forces(calc.model, atoms)) < place.tol
    revert(calc.model)
    calc.reset()
    assert rel_norm_error(torch.from_numpy(atoms.get_forces()),
                          _plain_forces(calc.model, atoms)) < place.tol
    accelerate(calc.model, backend=place.backend)
    calc.model.to(place.other)  # followed without reset: the next call is in the other dtype
    atoms.positions[1] += 0.05
    forces = torch.from_numpy(atoms.get_forces())
    assert calc.dtype == place.other
    assert rel_norm_error(forces, _plain_forces(calc.model, atoms)) < MODEL_TOL[torch.float32]


def test_a_new_head_is_followed_and_an_unknown_one_refused(place):
    calc = _calculator(_model(), place)
    atoms = _atoms()
    atoms.calc = calc
    fb = atoms.get_forces()
    calc.head = "a"
    calc.reset()
    fa = atoms.get_forces()
    assert rel_norm_error(torch.from_numpy(fa), _plain_forces(calc.model, atoms, "a")) < place.tol
    assert not np.allclose(fa, fb)
    with pytest.raises(mace_accel.errors.InputError, match="unknown head"):
        calc.head = "c"


def test_pickled_and_loaded_model_equals_the_plain_model(place):
    model = _model().to(place.device, place.dtype)
    accelerate(model, backend=place.backend)
    atoms = _atoms()
    loaded = save_and_load(model)
    calc = _calculator(loaded, place)
    atoms.calc = calc
    assert rel_norm_error(torch.from_numpy(atoms.get_forces()),
                          _plain_forces(model, atoms)) < place.tol


def test_the_state_watch_sees_every_change_a_graph_depends_on():
    model = _model()
    accelerate(model, backend="reference")
    watch = StateWatch(model)
    assert not watch.changed()
    with torch.no_grad():
        next(model.parameters()).mul_(1.0)  # in place: a new version
    assert watch.changed()
    watch = StateWatch(model)
    model.load_state_dict(model.state_dict())
    assert watch.changed()
    watch = StateWatch(model)
    revert(model)
    assert watch.changed()
    watch = StateWatch(model)
    model.float()  # a cast makes new storage
    assert watch.changed()
    watch = StateWatch(model)
    assert not watch.changed()


def test_batched_evaluation_follows_new_weights(place):
    from mace_accel.batched import BatchEvaluator

    base = _model()
    evaluator = BatchEvaluator(copy.deepcopy(base), device=place.device,
                               default_dtype=place.dtype_name, backend=place.backend, head="b",
                               min_distance=None)
    frames = [_atoms(0), _atoms(1)]
    before = evaluator.evaluate(frames)
    new = _perturb(base, 2)
    evaluator.model.load_state_dict(new)
    plain = copy.deepcopy(base)
    plain.load_state_dict(new)
    for atoms, got, old in zip(frames, evaluator.evaluate(frames), before):
        forces = torch.from_numpy(np.asarray(got["forces"]))
        assert rel_norm_error(forces, _plain_forces(plain, atoms)) < place.tol
        assert not np.allclose(got["forces"], old["forces"])


def test_torch_sim_model_follows_new_weights(place):
    ts = pytest.importorskip("torch_sim")
    from mace_accel.torchsim import AcceleratedMaceModel

    base = _model()
    model = AcceleratedMaceModel(copy.deepcopy(base), device=place.device,
                                 default_dtype=place.dtype_name, backend=place.backend,
                                 head="b", min_distance=None)
    frames = [_atoms(0), _atoms(1)]
    state = ts.io.atoms_to_state(frames, torch.device(place.device), place.dtype)
    before = model(state)["forces"]
    new = _perturb(base, 3)
    model.model.load_state_dict(new)
    plain = copy.deepcopy(base)
    plain.load_state_dict(new)
    forces = model(state)["forces"]
    want = torch.cat([_plain_forces(plain, atoms) for atoms in frames])
    assert rel_norm_error(forces.cpu(), want) < place.tol
    assert not torch.allclose(forces, before)


def test_a_fused_modules_live_parameters_follow_a_parameter_assigned_anew():
    """The fused modules read their parameters (and their gradient needs) from slots found
    once: a parameter replaced by another tensor is the one they see next call."""
    from mace_accel.options import AccelOptions
    from mace_accel.patches.adopt import FusedModule

    inner = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    other = torch.nn.Linear(4, 2)
    fused = FusedModule(inner, AccelOptions())
    first = fused.live_parameters(other)
    assert [id(p) for p in first] == [id(p) for p in (*inner.parameters(), *other.parameters())]
    new = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
    fused._modules["0"].weight = new
    other.bias = torch.nn.Parameter(torch.ones(2))
    again = fused.live_parameters(other)
    assert again[0] is new and again[-1] is other.bias and len(again) == len(first)
