"""mace_accel.lammps.LammpsModel against the ASE calculator, with a stand-in for what LAMMPS
hands one rank: its local atoms, ghost copies of the atoms within the cutoff (periodic
images), the pairs of its local atoms, and the pair style's exchange of per-atom rows between
ghosts and owners. The energy, the forces (each ghost's added to its owner's, as LAMMPS's
reverse communication does) and the virial of the pair forces must be the calculator's."""

from __future__ import annotations

import pickle
from typing import Dict, List, Tuple

import numpy as np
import pytest
import torch

from mace_accel import MACEAccelCalculator
from mace_accel.lammps import LammpsModel, exchange_width

REFERENCE = {"device": "cpu", "backend": "reference", "default_dtype": "float64"}


class RankData:
    """What LAMMPS's ML-IAP coupling gives one rank: ``nlocal`` local atoms (indices
    ``owned`` of the structure) first, then ghosts (images of any atom within the cutoff of a
    local one), the pairs of the local atoms, and the exchanges of the pair style."""

    def __init__(self, atoms, owned: List[int], cutoff: float, species: Dict[int, int]) -> None:
        from ase.neighborlist import neighbor_list

        i, j, shifts = neighbor_list("ijS", atoms, cutoff)
        pos, cell = atoms.get_positions(), np.asarray(atoms.cell)
        local = {a: k for k, a in enumerate(owned)}
        self.owner: List[int] = list(owned)  # structure index of every local and ghost atom
        slots: Dict[Tuple[int, Tuple[int, ...]], int] = {(a, (0, 0, 0)): k
                                                           for a, k in local.items()}
        pair_i, pair_j, rij = [], [], []
        x = [pos[a] for a in owned]  # every local and ghost atom's position
        for a, b, s in zip(i, j, shifts):
            if a not in local:
                continue
            key = (int(b), tuple(int(v) for v in s))
            if key not in slots:  # a ghost: another rank's atom or a periodic image
                slots[key] = len(self.owner)
                self.owner.append(int(b))
                x.append(pos[b] + s @ cell)
            pair_i.append(local[a])
            pair_j.append(slots[key])
            rij.append(pos[b] + s @ cell - pos[a])
        self.nlocal = len(owned)
        self.ntotal = len(self.owner)
        self.npairs = len(pair_i)
        self.pair_i = np.asarray(pair_i, dtype=np.int32)
        self.pair_j = np.asarray(pair_j, dtype=np.int32)
        self.jatoms = self.pair_j
        self.rij = np.asarray(rij, dtype=np.float64).reshape(-1, 3)
        self.x = np.asarray(x, dtype=np.float64).reshape(-1, 3)
        numbers = atoms.get_atomic_numbers()
        self.elems = np.asarray([species[int(numbers[a])] for a in self.owner], dtype=np.int32)
        self.forces = np.zeros((self.ntotal, 3))
        self.f = self.forces  # LAMMPS's force array, which a model may add to directly
        self.vflag = 2  # LAMMPS asks for the virial (0: it does not, this step)
        self.pair_forces_needed = False  # no per-atom virial, no hybrid pair style
        self.eatoms = None
        self.energy = None
        self.exchanges = 0

    def update_pair_forces(self, fij: np.ndarray) -> None:
        np.add.at(self.forces, self.pair_i, fij)
        np.add.at(self.forces, self.pair_j, -fij)
        self.virial = -(self.rij[:, :, None] * fij[:, None, :]).sum(axis=0)

    def fdotr_virial(self) -> np.ndarray:
        """LAMMPS's virial from the forces on the local and ghost atoms where they are (before
        the ghosts' forces go to their owners): the sum of ``x (x) f``."""
        return (self.x[:, :, None] * self.forces[:, None, :]).sum(axis=0)

    # the pair style's exchanges on one rank: every ghost is an image of a local atom
    def forward_exchange(self, copy_from, copy_to, vec_len: int) -> None:
        """Each ghost's row set to its owner's."""
        self.exchanges += 1
        rows = torch.as_tensor(copy_from).reshape(self.ntotal, vec_len)
        out = torch.as_tensor(copy_to).reshape(self.ntotal, vec_len)
        out.copy_(rows[torch.as_tensor(self.owner)])

    def reverse_exchange(self, copy_from, copy_to, vec_len: int) -> None:
        """Each ghost's row added to its owner's, the ghosts' rows zeroed."""
        self.exchanges += 1
        rows = torch.as_tensor(copy_from).reshape(self.ntotal, vec_len)
        out = torch.as_tensor(copy_to).reshape(self.ntotal, vec_len)
        out.copy_(rows)
        out[: self.nlocal].index_add_(0, torch.as_tensor(self.owner[self.nlocal:]),
                                      rows[self.nlocal:])
        out[self.nlocal:] = 0


def _species(model) -> Dict[int, int]:
    return {int(z): k for k, z in enumerate(model.atomic_numbers)}


def calculator_results(model_file, atoms):
    """``(energy, forces, virial [3, 3])`` of the reference calculator (float64), for this
    module's checks and those of tests/test_lammps.py."""
    calc = MACEAccelCalculator(model_file, **REFERENCE)
    atoms = atoms.copy()
    atoms.calc = calc
    return (atoms.get_potential_energy(), atoms.get_forces(),
            -atoms.get_stress(voigt=False) * atoms.get_volume())


def _run_one_rank(lammps_model: LammpsModel, atoms, vflag: int = 2) -> RankData:
    model = lammps_model.model
    data = RankData(atoms, list(range(len(atoms))), float(model.r_max), _species(model))
    data.vflag = vflag
    lammps_model.compute_forces(data)
    return data


def _folded_forces(data: RankData, n_atoms: int) -> np.ndarray:
    """Forces on the structure's atoms: each ghost's force added to its owner's (what
    LAMMPS's reverse communication of forces does)."""
    forces = np.zeros((n_atoms, 3))
    np.add.at(forces, data.owner, data.forces)
    return forces


@pytest.fixture
def lammps_model(model_file):
    from mace_accel.models.checkpoint import load_model

    model = load_model(model_file, dtype=torch.float64)
    made = LammpsModel(model)
    return pickle.loads(pickle.dumps(made))  # as LAMMPS loads the file


@pytest.mark.parametrize("vflag", [2, 0])
def test_one_rank_equals_the_calculator(model_file, lammps_model, cu_atoms, vflag):
    """With the virial asked for, pair forces (LAMMPS sums them and the virial); without,
    each local atom's force added to LAMMPS's force array, the ghosts' left at zero."""
    atoms = cu_atoms.copy()
    atoms.numbers[[1, 4]] = 28  # Cu and Ni
    energy, forces, virial = calculator_results(model_file, atoms)
    data = _run_one_rank(lammps_model, atoms, vflag)
    assert data.ntotal > data.nlocal  # periodic images as ghosts
    assert data.exchanges == 1  # the owners' only: one rank's model sees no ghost atoms
    assert data.energy == pytest.approx(energy, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(data.eatoms.sum(), energy, rtol=1e-12)
    np.testing.assert_allclose(_folded_forces(data, len(atoms)), forces, atol=1e-10)
    if vflag:
        np.testing.assert_allclose(data.virial, virial, atol=1e-9)
    else:
        assert not hasattr(data, "virial")  # no per-pair call
        assert not data.forces[data.nlocal:].any()


def test_the_file_names_the_elements_cutoff_and_exchange(lammps_model):
    assert lammps_model.element_types == ["Ni", "Cu"]
    assert lammps_model.rcutfac == pytest.approx(0.5 * float(lammps_model.model.r_max))
    assert lammps_model.exchange_width == exchange_width(lammps_model.model) == 16  # 4x0e+4x1o
    assert lammps_model.ndescriptors == 1 and lammps_model.nparams == 1


def test_bad_head_and_dtype_are_refused(model_file):
    from mace_accel.models.checkpoint import load_model

    model = load_model(model_file)
    with pytest.raises(ValueError, match="no head 'pbe'"):
        LammpsModel(model, head="pbe")
    with pytest.raises(ValueError, match="float32' or 'float64"):
        LammpsModel(model, dtype="float16")


def test_convert_writes_the_file_lammps_loads(model_file, cu_atoms, tmp_path, capsys):
    from mace_accel import cli

    out = tmp_path / "cuni-mliap.pt"
    assert cli.main(["convert", str(model_file), str(out), "--lammps"]) == 0
    printed = capsys.readouterr().out
    assert f"pair_style mliap unified {out} 0 exchange 16" in printed
    assert "pair_coeff * * Ni Cu" in printed
    made = torch.load(out, weights_only=False)  # what LAMMPS's coupling does
    assert isinstance(made, LammpsModel) and made.dtype == "float64"
    atoms = cu_atoms.copy()
    energy, forces, _ = calculator_results(model_file, atoms)
    data = _run_one_rank(made, atoms)
    assert data.energy == pytest.approx(energy, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(_folded_forces(data, len(atoms)), forces, atol=1e-10)


def test_convert_refuses_an_unknown_head_in_one_line(model_file, tmp_path, capsys):
    from mace_accel import cli

    out = tmp_path / "x.pt"
    assert cli.main(["convert", str(model_file), str(out), "--lammps", "--head", "pbe"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no head 'pbe'" in err and "--head" in err
    assert not out.exists()


def test_each_rank_takes_its_local_rank(monkeypatch):
    from mace_accel.lammps import local_rank

    for name in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert local_rank() == 0
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert local_rank() == 3
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")  # mpirun's own comes first
    assert local_rank() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_host_exchange_equals_the_pair_styles_own(cu_atoms, dtype):
    """Through one host array, in place, and only the rows that matter (the local atoms' rows
    out and the ghosts' rows back on a forward exchange, the other way round on a reverse one),
    the same as the pair style's exchange of the whole arrays; LAMMPS sees a contiguous host
    array."""
    from mace_accel.lammps import _HostArrays, _HostExchange

    data = RankData(cu_atoms, list(range(len(cu_atoms))), 4.5, {29: 0})
    assert data.ntotal > data.nlocal  # ghosts: periodic images
    seen = []

    class Watched:  # the same rank's exchanges, recording the arrays they are handed
        nlocal = data.nlocal

        def forward_exchange(self, copy_from, copy_to, vec_len):
            seen.append((copy_from.device.type, copy_from.is_contiguous(), copy_to.shape,
                         copy_from.data_ptr() == copy_to.data_ptr()))
            data.forward_exchange(copy_from, copy_to, vec_len)

        def reverse_exchange(self, copy_from, copy_to, vec_len):
            seen.append((copy_from.device.type, copy_from.is_contiguous(), copy_to.shape,
                         copy_from.data_ptr() == copy_to.data_ptr()))
            data.reverse_exchange(copy_from, copy_to, vec_len)

    watched = Watched()
    arrays = _HostArrays()
    g = torch.Generator().manual_seed(0)
    for _ in range(2):  # the second time through the kept host arrays
        values = torch.randn(data.ntotal, 7, generator=g, dtype=dtype)
        for forward in (True, False):
            want, got = torch.empty_like(values), torch.full_like(values, float("nan"))
            exchange = data.forward_exchange if forward else data.reverse_exchange
            exchange(values.clone(), want, 7)
            host = _HostExchange(watched, arrays)
            (host.forward_exchange if forward else host.reverse_exchange)(values, got, 7)
            # a forward exchange copies; a reverse one adds the ghosts' rows in another order
            tol = 0.0 if forward else 8 * torch.finfo(dtype).eps
            torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert seen and all(s == ("cpu", True, (data.ntotal, 7), True) for s in seen)
    assert len(arrays._kept) == 1  # one host array for this dtype and width, reused


def test_ghost_owners_on_one_rank(cu_atoms):
    from mace_accel.lammps import ghost_owners

    data = RankData(cu_atoms, list(range(len(cu_atoms))), 4.5, {29: 0})
    assert data.ntotal > data.nlocal
    np.testing.assert_array_equal(ghost_owners(data), data.owner)  # local index = atom index

    class Broken(RankData):  # an exchange that leaves a ghost without its owner's index
        def forward_exchange(self, copy_from, copy_to, vec_len):
            super().forward_exchange(copy_from, copy_to, vec_len)
            copy_to[-1, 0] = self.nlocal

    with pytest.raises(RuntimeError, match="outside this rank's"):
        ghost_owners(Broken(cu_atoms, list(range(len(cu_atoms))), 4.5, {29: 0}))


def test_local_pairs_are_ml_iaps_pairs_in_order(cu_atoms):
    """The pairs found among a rank's local and ghost atoms are ML-IAP's (every pair of a
    local atom within the cutoff, a ghost an atom of its own), sorted by i then j."""
    from mace_accel.lammps import local_pairs

    atoms = cu_atoms.repeat((1, 2, 2))
    atoms.rattle(stdev=0.1, seed=2)
    data = RankData(atoms, list(range(0, len(atoms), 2)), 4.5, {29: 0})  # half of them local
    pair_i, pair_j = local_pairs(torch.from_numpy(data.x), data.nlocal, 4.5)
    found = list(zip(pair_i.tolist(), pair_j.tolist()))
    assert found == sorted(found)
    assert found == sorted(zip(data.pair_i.tolist(), data.pair_j.tolist()))


def test_the_ranks_come_from_lammps_else_the_launcher(monkeypatch):
    from mace_accel.lammps import world_size

    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert world_size(object()) == 1
    monkeypatch.setenv("PMI_SIZE", "4")
    assert world_size(object()) == 4

    class Data:
        nprocs = 2

    assert world_size(Data()) == 2  # LAMMPS's own count first


def test_ghost_atoms_with_exchanges_equal_the_calculator(model_file, lammps_model, cu_atoms,
                                                         monkeypatch):
    """On several ranks the ghosts are nodes of the model and their features come through the
    exchanges between the blocks (here one rank taken for one of several)."""
    import mace_accel.lammps as lammps_module

    monkeypatch.setattr(lammps_module, "world_size", lambda data: 2)
    atoms = cu_atoms.copy()
    atoms.numbers[[1, 4]] = 28
    energy, forces, virial = calculator_results(model_file, atoms)
    data = _run_one_rank(lammps_model, atoms)
    assert data.exchanges > 1  # forward and reverse between the blocks
    assert data.energy == pytest.approx(energy, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(_folded_forces(data, len(atoms)), forces, atol=1e-10)
    # the forces on the ghosts where they are (no step of pair forces): LAMMPS's sum of x f
    np.testing.assert_allclose(data.fdotr_virial(), virial, atol=1e-9)


@pytest.mark.parametrize("vflag", [2, 1])
def test_pairs_found_on_the_device_equal_the_calculator(model_file, lammps_model, cu_atoms,
                                                       monkeypatch, vflag):
    """Several ranks where LAMMPS made no pair arrays (``mliap-positions.patch``): the pairs
    are found among the positions; forces on the local and ghost atoms, and a virial per pair
    (``vflag`` 1) given to LAMMPS directly, else (2) LAMMPS's sum of x f."""
    import mace_accel.lammps as lammps_module

    monkeypatch.setattr(lammps_module, "world_size", lambda data: 2)

    class NoPairs(RankData):  # LAMMPS gave positions and made no pair arrays
        pairs_made, pairs_wanted, given = False, True, None

        def add_virial(self, v):
            self.given = np.asarray(v)

    atoms = cu_atoms.copy()
    atoms.numbers[[1, 4]] = 28
    energy, forces, virial = calculator_results(model_file, atoms)
    model = lammps_model.model
    data = NoPairs(atoms, list(range(len(atoms))), float(model.r_max), _species(model))
    data.vflag = vflag
    lammps_model.compute_forces(data)
    assert data.pairs_wanted is False  # asked for none from now on
    assert data.energy == pytest.approx(energy, rel=1e-12, abs=1e-12)
    np.testing.assert_allclose(_folded_forces(data, len(atoms)), forces, atol=1e-10)
    want = virial[[0, 1, 2, 0, 0, 1], [0, 1, 2, 1, 2, 2]]  # LAMMPS's order
    if vflag == 1:
        np.testing.assert_allclose(data.given, want, atol=1e-9)
    else:
        assert data.given is None
        np.testing.assert_allclose(data.fdotr_virial(), virial, atol=1e-9)


def test_a_rank_without_atoms_makes_the_same_exchanges(lammps_model, cu_atoms, monkeypatch):
    """Each exchange is a call of all ranks together: a rank without local atoms makes the
    same exchanges, of the same widths and in the same order, as one whose model runs."""
    import mace_accel.lammps as lammps_module

    monkeypatch.setattr(lammps_module, "world_size", lambda data: 2)

    class Recorded(RankData):
        def __init__(self, *args):
            super().__init__(*args)
            self.calls = []

        def forward_exchange(self, copy_from, copy_to, vec_len):
            self.calls.append(("forward", vec_len, copy_to.dtype))
            super().forward_exchange(copy_from, copy_to, vec_len)

        def reverse_exchange(self, copy_from, copy_to, vec_len):
            self.calls.append(("reverse", vec_len, copy_to.dtype))
            super().reverse_exchange(copy_from, copy_to, vec_len)

    running = Recorded(cu_atoms, list(range(len(cu_atoms))), 4.5, {29: 0})
    lammps_model.compute_forces(running)

    class Empty:  # no local atoms, a few ghosts
        nlocal, ntotal, npairs = 0, 3, 0

        def __init__(self):
            self.calls = []

        def forward_exchange(self, copy_from, copy_to, vec_len):
            assert copy_to.shape == (3, vec_len)
            self.calls.append(("forward", vec_len, copy_to.dtype))

        def reverse_exchange(self, copy_from, copy_to, vec_len):
            assert copy_to.shape == (3, vec_len)
            self.calls.append(("reverse", vec_len, copy_to.dtype))

    empty = Empty()
    lammps_model.compute_forces(empty)
    assert running.calls and [c[:2] for c in empty.calls] == [c[:2] for c in running.calls]
    assert all(str(c[2]).endswith("float64") for c in running.calls + empty.calls)


def test_row_sums_add_the_rows_of_each_key_in_their_order():
    from mace_accel.lammps_peers import RowSum

    keys = np.asarray([5, 2, 5, 9, 2, 5])
    sources = np.asarray([0, 1, 2, 3, 4, 5])
    values = torch.randn(6, 3, dtype=torch.float64)
    grouped = RowSum(keys, sources, torch.device("cpu"))
    assert grouped.targets.tolist() == [2, 5, 9]
    want = torch.stack([values[1] + values[4], values[0] + values[2] + values[5], values[3]])
    assert torch.equal(grouped.sum(values), want)  # the same order, the same bits
    empty = RowSum(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), torch.device("cpu"))
    assert empty.sum(values).shape == (0, 3)


def test_the_ranks_group_is_made_only_where_the_launcher_says_how(monkeypatch):
    """Without a launcher's rank and size, or with ranks on several hosts and no address, the
    process group is not made and the reason is one line (the exchange then goes through
    LAMMPS)."""
    from mace_accel import lammps_peers

    for name in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                 "PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_RANK", "PMI_SIZE",
                 "MPI_LOCALNRANKS", "SLURM_PROCID", "SLURM_NTASKS",
                 "SLURM_NNODES", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(lammps_peers, "_STATE", {})
    assert lammps_peers.launcher_world() is None
    why = lammps_peers.peer_group(torch.device("cpu"), 2)
    assert why and "launcher" in why and "\n" not in why
    assert lammps_peers.peer_group(torch.device("cpu"), 2) == why  # decided once

    monkeypatch.setattr(lammps_peers, "_STATE", {})
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")  # two hosts
    assert lammps_peers.launcher_world()[:3] == (1, 4, 2)
    assert "MASTER_ADDR" in lammps_peers.peer_group(torch.device("cpu"), 4)
    monkeypatch.setattr(lammps_peers, "_STATE", {})
    assert "LAMMPS 2" in lammps_peers.peer_group(torch.device("cpu"), 2)  # a different count
