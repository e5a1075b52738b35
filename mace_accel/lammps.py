"""The accelerated model inside LAMMPS: an ML-IAP unified model (``pair_style mliap unified``).

LAMMPS owns the atoms, the domain decomposition, the neighbour lists and the MPI traffic; each
rank calls :meth:`LammpsModel.compute_forces` with its local atoms, their ghosts, and the pairs
``i -> j`` of its local atoms ``i`` (``rij = r_j - r_i``).

On a run of one rank (LAMMPS on one GPU) every ghost is a periodic image of a local atom: where
LAMMPS gives the positions and the box (``scripts/lammps/mliap-positions.patch``) the rank calls
the ASE calculator itself on them (:class:`~mace_accel.lammps_local.PositionsCall`) and asks
LAMMPS for no pair arrays; otherwise, and on steps that ask for the per-atom virial, it makes
the calculator's call from LAMMPS's pairs, each pair's sender the ghost's owner
(:class:`~mace_accel.lammps_local.LocalCall`, owners from :func:`ghost_owners`).

On several ranks (all of them: each exchange is a call of all ranks together) the model runs
mace's own forward in its LAMMPS mode (``lammps_mliap=True``) with the fused kernels inside, on
the local and ghost atoms; the node features of the ghost atoms, which the later interaction
blocks read, come from their owners between the blocks, and the backward sends the ghosts'
gradients home; a rank without local atoms still takes its part in those exchanges. They go
between the devices through torch.distributed (:mod:`mace_accel.lammps_peers`: NCCL between
GPUs, gloo between CPUs); where its process group cannot be made, through LAMMPS's own exchange
(said once): on a plain LAMMPS the one ``scripts/lammps/mliap-exchange.patch`` adds
(``scripts/build_lammps.sh`` applies it), which works on host arrays, so on a GPU each exchange
copies the features to the host and back; on a KOKKOS build its own, on the device (that path
follows mace's ML-IAP object and is untested here). The energy of each local atom goes back to
LAMMPS with the force on every local and ghost atom (LAMMPS adds the ghosts' to their owners and
takes the virial from them), or, on steps that ask for a virial per pair or per atom, the force
of each pair.

Write the file LAMMPS loads with ``mace-accel convert MODEL --lammps``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

try:  # the base class LAMMPS's Python coupling defines (absent where LAMMPS is not installed)
    from lammps.mliap.mliap_unified_abc import MLIAPUnified
except ImportError:  # the file is written without LAMMPS; LAMMPS loads it with its own
    class MLIAPUnified:  # type: ignore[no-redef]
        """Stand-in with the attributes LAMMPS reads."""

        def __init__(self) -> None:
            self.interface = None


Tensor = torch.Tensor
log = logging.getLogger(__name__)


def local_rank() -> int:
    """This process's rank among those of its host (Open MPI, MPICH, Slurm or torchrun)."""
    for name in ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"):
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def import_before_lammps() -> None:
    """Import mace (with torch, e3nn, matplotlib) and CuPy (with ml_dtypes) now, before a Python
    script loads LAMMPS's library (``lammps.lammps(...)`` loads ``liblammps.so`` with
    ``RTLD_GLOBAL``): C++ extensions imported after it can fail to load (matplotlib's
    ``ft2font``: ``SystemError ... returned NULL``) or crash (ml_dtypes), as seen with LAMMPS's
    4 Jul 2026 release and torch 2.11. The ``lmp`` executable is not affected. Call it first in
    a Python script that drives LAMMPS with this model."""
    from mace_accel._e3nn_compat import import_mace

    import_mace()
    try:
        import cupy  # noqa: F401  (imports ml_dtypes)
    except ImportError:  # no GPU runtime: nothing more to load first
        pass


def exchanged_widths(model: torch.nn.Module) -> List[int]:
    """The values per atom of the model's exchanges, in the forward's order: the node features
    that enter each interaction block after the first."""
    return [int(block.node_feats_irreps.dim) for block in list(model.interactions)[1:]]


def exchange_width(model: torch.nn.Module) -> int:
    """The most values per atom an exchange carries (what ``pair_style mliap ... exchange N``
    must allow)."""
    return max(exchanged_widths(model), default=1)


def world_size(data: Any) -> int:
    """The ranks of the LAMMPS run: the data's ``nprocs`` (``scripts/lammps/
    mliap-world-size.patch``), else the MPI launcher's count
    (:func:`~mace_accel.lammps_peers.launcher_world`), else 1. Every rank must take the same
    path, since each exchange is a call of all ranks together; an overcount only costs speed
    (a single rank then runs with its ghosts)."""
    from mace_accel.lammps_peers import launcher_world

    nprocs = getattr(data, "nprocs", None)
    if nprocs is not None:
        return int(nprocs)
    world = launcher_world()
    return world[1] if world is not None else 1


def ghost_owners(data: Any) -> np.ndarray:
    """``[ntotal]`` int64 on a run of one rank: the local atom each atom of ``data`` is (itself
    for a local atom, the atom it is a periodic image of for a ghost), through one forward
    exchange of each local atom's index (a ``[ntotal, 1]`` float64 host array, in place).
    LAMMPS renumbers its ghosts when it rebuilds its neighbour lists, which a model does not
    see, so this runs every call."""
    n_local, n_total = int(data.nlocal), int(data.ntotal)
    if n_total == n_local:
        return np.arange(n_local, dtype=np.int64)
    rows = np.empty((n_total, 1), dtype=np.float64)
    rows[:n_local, 0] = np.arange(n_local)
    data.forward_exchange(rows, rows, 1)
    owners = rows[:, 0].astype(np.int64)
    if owners.min() < 0 or owners.max() >= n_local:
        raise RuntimeError("LAMMPS's exchange gave a ghost atom an owner outside this rank's "
                           f"{n_local} atoms on a run of one rank; rebuild LAMMPS with "
                           "scripts/build_lammps.sh")
    return owners


# LAMMPS's vflag bits of a virial summed per pair (VIRIAL_PAIR) or per atom (VIRIAL_ATOM,
# VIRIAL_CENTROID): those steps take the forces per pair
PAIR_VIRIAL = 1 | 4 | 8


def atom_forces(pair_forces: Tensor, pair_i: Tensor, pair_j: Tensor, n_atoms: int) -> Tensor:
    """``[n_atoms, 3]`` float64: each pair's force ``pair_forces [npairs, 3]`` added to its atom
    ``pair_i`` and subtracted from ``pair_j``, as LAMMPS's ``update_pair_forces`` does, in the
    same order on every call (on a GPU a sorted accumulation, not atomics)."""
    forces = pair_forces.new_zeros((n_atoms, 3), dtype=torch.float64)
    index = torch.cat([pair_i, pair_j])
    values = torch.cat([pair_forces, -pair_forces]).to(torch.float64)
    if forces.is_cuda:  # deterministic on a GPU (sorts the indices); index_add_ uses atomics
        return forces.index_put_((index,), values, accumulate=True)
    return forces.index_add_(0, index, values)  # one thread in index order on a CPU


def local_pairs(x: Tensor, n_local: int, cutoff: float) -> Tuple[Tensor, Tensor]:
    """``(pair_i, pair_j)`` ``[npairs]`` int64: the pairs of the first ``n_local`` atoms of
    ``x [ntotal, 3]`` (a rank's local atoms, then its ghosts) with any other atom closer than
    ``cutoff``, as ML-IAP's pair arrays hold them (every ghost an atom of its own, no periodic
    images), sorted by ``i`` then ``j`` (the same order every call, whatever vesin's)."""
    from mace_accel.models.neighbours import neighbour_list

    no_cell = torch.zeros((3, 3), dtype=torch.float64, device=x.device)
    edge_index, _ = neighbour_list(x, no_cell, (False, False, False), cutoff)
    i, j = edge_index[0], edge_index[1]
    local = i < n_local
    i, j = i[local], j[local]
    order = torch.argsort(i * x.shape[0] + j)
    return i[order], j[order]


def data_pairs_made(data: Any) -> bool:
    """Whether LAMMPS made this step's pair arrays (always, unless a model asked for none:
    ``mliap-positions.patch``)."""
    return bool(getattr(data, "pairs_made", True))


def _on_device(array: Any, device: torch.device) -> Tensor:
    """One of LAMMPS's arrays on ``device`` as LAMMPS holds it (dtype kept: casts run on the
    device; a KOKKOS build's arrays are there already)."""
    return torch.as_tensor(array).to(device)


def _is_kokkos(data: Any) -> bool:
    """Whether ``data`` is the KOKKOS build's ML-IAP data (arrays on the device, its own
    exchange and ``update_pair_forces_gpu``). This path is written after mace's own ML-IAP
    object and is not tested here (no KOKKOS build)."""
    return "kokkos" in type(data).__module__.lower()


class _HostArrays:
    """Host arrays a rank keeps between LAMMPS's calls, by name: page-locked where they take
    GPU copies (which then run at the link's speed, without a staging copy), grown with the
    atom and pair counts (a quarter more than asked when they grow)."""

    def __init__(self) -> None:
        self._kept: Dict[Tuple[str, torch.dtype, int], Tensor] = {}

    def get(self, name: str, rows: int, cols: int, dtype: torch.dtype, pin: bool) -> Tensor:
        """``[rows, cols]``, a view of the kept array ``name`` (contents undefined)."""
        key = (name, dtype, cols)
        kept = self._kept.get(key)
        if kept is None or kept.shape[0] < rows:
            kept = torch.empty((rows + rows // 4, cols), dtype=dtype, pin_memory=pin)
            self._kept[key] = kept
        return kept[:rows]


class _HostExchange:
    """LAMMPS's exchange for node features that live on a GPU, through one host array (the
    plain LAMMPS exchange reads and writes host arrays ``[ntotal, vec_len]``, here in place: no
    copy of the whole array inside LAMMPS), moving only the rows that matter: a forward exchange
    sends the local atoms' rows (a ghost's value comes from its owner) and takes back the
    ghosts'; a reverse exchange sends the ghosts' rows (they are added to their owners) and
    takes back the local atoms'. The host array is the model's, kept between calls
    (:class:`_HostArrays`)."""

    def __init__(self, data: Any, arrays: _HostArrays) -> None:
        self.data = data
        self._arrays = arrays

    def forward_exchange(self, feats: Tensor, out: Tensor, vec_len: int) -> None:
        n_local = int(self.data.nlocal)
        rows = self._rows(feats, vec_len)
        rows[:n_local].copy_(feats[:n_local], non_blocking=True)
        _wait_for(feats)
        self.data.forward_exchange(rows, rows, vec_len)
        out[:n_local] = feats[:n_local]
        out[n_local:].copy_(rows[n_local:], non_blocking=True)

    def reverse_exchange(self, grads: Tensor, out: Tensor, vec_len: int) -> None:
        n_local = int(self.data.nlocal)
        rows = self._rows(grads, vec_len)
        rows[n_local:].copy_(grads[n_local:], non_blocking=True)
        _wait_for(grads)  # also the copy of the last exchange out of these rows
        rows[:n_local].zero_()  # LAMMPS adds the ghosts' rows to these
        self.data.reverse_exchange(rows, rows, vec_len)
        out[:n_local] = grads[:n_local] + rows[:n_local].to(grads.device, non_blocking=True)
        out[n_local:] = 0

    def _rows(self, values: Tensor, vec_len: int) -> Tensor:
        """The host array ``[ntotal, vec_len]`` in ``values``' dtype."""
        rows, pin = int(values.shape[0]), values.device.type == "cuda"
        return self._arrays.get("exchange", rows, vec_len, values.dtype, pin)


def _wait_for(values: Tensor) -> None:
    """The copies queued on ``values``' stream are done (before LAMMPS reads the host array;
    it also orders the previous exchange's copy back before its host array is reused)."""
    if values.device.type == "cuda":
        torch.cuda.current_stream(values.device).synchronize()


class LammpsModel(MLIAPUnified):
    """An accelerated MACE model as LAMMPS's ML-IAP unified model.

    Args:
        model: a MACE model (the ``cpu`` copy is kept; each rank moves it to its device).
        head: the head of a multi-head model (default: its last, as mace's).
        dtype: ``"float64"`` or ``"float32"``, the precision the rank computes in.
    """

    def __init__(self, model: torch.nn.Module, head: Optional[str] = None,
                 dtype: str = "float64") -> None:
        super().__init__()
        from mace_accel.models.batch import model_info

        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype must be 'float32' or 'float64', not {dtype!r}")
        info = model_info(model)
        heads: List[str] = list(info.heads)
        head = heads[-1] if head is None else head
        if head not in heads:
            raise ValueError(f"the model has no head {head!r}; its heads: {', '.join(heads)}")
        self.model = model.to("cpu")
        self.dtype = dtype
        self.head = head
        self.head_index = heads.index(head)
        self.element_types = info.symbols
        self.ndescriptors = 1
        self.nparams = 1
        self.rcutfac = 0.5 * info.r_max  # LAMMPS's cutoff: 2 x rcutfac
        self.exchange_width = exchange_width(model)
        self._device: Optional[torch.device] = None
        self._host_arrays = _HostArrays()
        self._said_why = False
        self._local: Optional[Any] = None  # LocalCall, made on the first one-rank call
        self._positions: Optional[Any] = None  # PositionsCall, made with the model (_prepare)
        self._plans: Optional[Any] = None  # lammps_peers.PlanKeeper, on several ranks

    def __getstate__(self) -> Dict[str, Any]:
        state = self.__dict__.copy()
        state["_device"] = None  # each process picks its own
        state["_host_arrays"] = _HostArrays()
        state["_said_why"] = False
        state["_local"] = None
        state["_positions"] = None
        state["_plans"] = None
        state.pop("interface", None)  # LAMMPS's coupling, set again on load
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state.setdefault("_host_arrays", _HostArrays())  # files written before these existed
        state.setdefault("_said_why", False)
        state.setdefault("_local", None)
        state.setdefault("_positions", None)
        state.setdefault("_plans", None)
        self.__dict__.update(state)

    # -- LAMMPS's calls ----------------------------------------------------------------------
    def compute_descriptors(self, data: Any) -> None:
        pass

    def compute_gradients(self, data: Any) -> None:
        pass

    def compute_forces(self, data: Any) -> None:
        """Energies of the local atoms, their forces (or their pairs'), and where LAMMPS asks
        for it the virial, written into ``data``."""
        if self._device is None:
            self._prepare()
        n_local, n_total = int(data.nlocal), int(data.ntotal)
        if n_local == 0:
            data.energy = 0.0  # LAMMPS adds it to the total as it finds it
            if world_size(data) > 1 and not _is_kokkos(data):
                self._join_exchanges(data, n_total)
            return
        one_rank = not _is_kokkos(data) and world_size(data) == 1
        if one_rank and self._local_supported() and self._positions.usable(data):
            self._positions_forces(data, n_local)
            return
        if not one_rank and hasattr(data, "pairs_made"):  # the pairs are found on the device
            data.pairs_wanted = False
        owners = ghost_owners(data) if one_rank else None
        if owners is not None and self._local_supported():
            self._local_forces(data, owners, n_local)
            return
        batch, pair_j = self._batch(data, n_local, n_total, owners)
        out = self.model(batch, training=False, compute_force=False, compute_virials=False,
                         compute_stress=False, compute_displacement=False,
                         compute_edge_forces=True, lammps_mliap=True)
        node_energy = out["node_energy"][:n_local].detach().to(torch.float64)
        pair_forces = out["edge_forces"]
        if pair_forces is None:  # no pairs
            pair_forces = torch.zeros_like(batch["vectors"])
        pair_forces = pair_forces.detach().to(torch.float64).contiguous()
        if _is_kokkos(data):  # its arrays may live on the GPU (as mace's own object does)
            torch.as_tensor(data.eatoms).copy_(node_energy)
            data.energy = float(node_energy.sum())
            data.update_pair_forces_gpu(pair_forces)
            return
        node_energy = node_energy.cpu()
        data.eatoms = node_energy.numpy()
        data.energy = float(node_energy.sum())
        if pair_forces.shape[0] == 0:
            return
        if not data_pairs_made(data):  # the pairs were found here: LAMMPS cannot sum them
            if int(data.vflag) & PAIR_VIRIAL:  # a virial per pair (per atom makes pairs)
                pairs_virial = -(batch["vectors"].detach().to(torch.float64)[:, :, None]
                                 * pair_forces[:, None, :]).sum(dim=0)
                from mace_accel.lammps_local import lammps_order

                data.add_virial(lammps_order(pairs_virial.cpu().numpy()))
        elif int(data.vflag) & PAIR_VIRIAL:  # LAMMPS sums the virial per pair on this step
            host = self._host_arrays.get("pair forces", int(pair_forces.shape[0]), 3,
                                         torch.float64, pin=pair_forces.is_cuda)
            data.update_pair_forces(host.copy_(pair_forces).numpy())
            return
        # the forces on every atom, ghosts included: LAMMPS adds the ghosts' to their owners,
        # and takes the virial from them where it asks for it (the sum of x times f over the
        # local and ghost atoms is the sum over the pairs)
        forces = atom_forces(pair_forces, batch["edge_index"][1], pair_j, n_total)
        host = self._host_arrays.get("atom forces", n_total, 3, torch.float64,
                                     pin=forces.is_cuda)
        np.asarray(data.f)[:n_total] += host.copy_(forces).numpy()

    # -- inside ------------------------------------------------------------------------------
    def _local_supported(self) -> bool:
        """Whether the model's energy depends on the positions through its edge vectors only
        (mace's MACE and ScaleShiftMACE), as :class:`~mace_accel.lammps_local.LocalCall`
        needs for pair forces; other classes take mace's LAMMPS mode."""
        from mace_accel.models.outputs import stress_from_edges_supported

        return stress_from_edges_supported(self.model)

    def _positions_forces(self, data: Any, n_local: int) -> None:
        """One rank, where LAMMPS gives the positions and the box: the ASE calculator's call
        (:class:`~mace_accel.lammps_local.PositionsCall`); each atom's force added to LAMMPS's
        force array, and on a step that asks for it the virial from the stress."""
        node_energy, forces, energy, virial = self._positions(data)
        data.eatoms = node_energy
        data.energy = energy
        np.asarray(data.f)[:n_local] += forces
        if virial is not None:
            data.add_virial(virial)

    def _local_forces(self, data: Any, owners: np.ndarray, n_local: int) -> None:
        """One rank: the calculator's call on the local atoms
        (:class:`~mace_accel.lammps_local.LocalCall`, CUDA graphs on a GPU); each atom's force
        added to LAMMPS's force array, or, on a step that asks for the virial, the pair
        forces handed to LAMMPS (which sums them and the virial)."""
        if self._local is None:
            from mace_accel.lammps_local import LocalCall
            from mace_accel.models.batch import model_info

            self._local = LocalCall(self.model, model_info(self.model).r_max, self.head_index,
                                    len(self.element_types), self._device,
                                    getattr(torch, self.dtype), self._device.type == "cuda")
        # forces per pair where LAMMPS takes a virial (this pair style's, or a hybrid's sum of
        # x f over all forces: mliap-positions.patch says so; a LAMMPS without it cannot)
        per_pair = bool(int(data.vflag)) or bool(getattr(data, "pair_forces_needed", True))
        node_energy, forces, energy = self._local(data, owners, per_pair)
        data.eatoms = node_energy
        data.energy = energy
        if not per_pair:
            np.asarray(data.f)[:n_local] += forces
        elif int(data.npairs) > 0:
            data.update_pair_forces(np.ascontiguousarray(forces))

    def _exchange(self, data: Any, n_local: int, wanted: bool = True) -> Any:
        """The exchange between the blocks on several ranks: between the devices where the
        ranks' process group can be made (:mod:`mace_accel.lammps_peers`), else LAMMPS's (the
        KOKKOS build's where the arrays are; the plain one's through host arrays), said once."""
        from mace_accel import lammps_peers

        if _is_kokkos(data):
            return data
        device = self._device
        why = ("the pair style allows one value per atom (pair_style mliap ... exchange N)"
               if self.exchange_width < 2 else lammps_peers.peer_group(device, world_size(data)))
        if why is None:
            ranks, index = lammps_peers.find_owners(data)
            if self._plans is None:
                self._plans = lammps_peers.PlanKeeper()
            return lammps_peers.PeerExchange(self._plans.plan(ranks, index, n_local, device,
                                                              wanted))
        if not self._said_why:
            log.warning("mace-accel: the ghost atoms' features cross between the ranks through "
                        "LAMMPS's host arrays, not between the devices: %s", why)
            self._said_why = True
        return data if device.type == "cpu" else _HostExchange(data, self._host_arrays)

    def _join_exchanges(self, data: Any, n_total: int) -> None:
        """A rank without local atoms takes its part in the exchanges the other ranks' models
        make (each is a call of all ranks together, which would wait for this one for ever):
        the forward exchange of each block after the first, then their reverse exchanges in
        the backward's order, of zero rows (its ghosts' rows are nobody's)."""
        exchange = self._exchange(data, 0, wanted=False)
        dtype, device = getattr(torch, self.dtype), self._device
        widths = exchanged_widths(self.model)
        for width, forward in ([(w, True) for w in widths]
                               + [(w, False) for w in reversed(widths)]):
            rows = torch.zeros((n_total, width), dtype=dtype, device=device)
            if forward:
                exchange.forward_exchange(rows, rows.clone(), width)
            else:
                exchange.reverse_exchange(rows, rows.clone(), width)

    def _pairs(self, data: Any, n_local: int, n_total: int) -> Tuple[Tensor, Tensor, Tensor]:
        """``(pair_i, pair_j [npairs] int64, rij [npairs, 3] float64)`` on the device, the
        pairs ``i -> j`` of the local atoms ``i`` within the cutoff, sorted by ``i`` then
        ``j`` where they are found here. Where LAMMPS gives the positions
        (``mliap-positions.patch``) the vectors are ``x[j] - x[i]`` on the device (the numbers
        LAMMPS's ``rij`` holds, from ``[ntotal, 3]`` copied instead of ``[npairs, 3]``) and the
        pairs themselves are found there among the local and ghost atoms (vesin) on the steps
        LAMMPS made none; otherwise LAMMPS's arrays."""
        device = self._device
        positions = getattr(data, "x", None)
        if positions is None:
            return (_on_device(data.pair_i, device).long(), _on_device(data.pair_j, device).long(),
                    _on_device(data.rij, device))
        x = _on_device(np.asarray(positions)[:n_total], device)
        if data_pairs_made(data):
            pair_i = _on_device(data.pair_i, device).long()
            pair_j = _on_device(data.pair_j, device).long()
        else:
            pair_i, pair_j = local_pairs(x, n_local, 2.0 * self.rcutfac)
        return pair_i, pair_j, x[pair_j] - x[pair_i]

    def _prepare(self) -> None:
        """Move the model to this rank's device (``cuda:<local rank>``, else the CPU), cast it
        and accelerate it there through the ASE calculator that a one-rank run calls
        (:class:`~mace_accel.lammps_local.PositionsCall`), as every other way of evaluating a
        model does (:func:`~mace_accel.prepared.prepare_model`)."""
        from ase.data import atomic_numbers

        from mace_accel._e3nn_compat import import_mace
        from mace_accel.calculator import MACEAccelCalculator
        from mace_accel.lammps_local import PositionsCall

        import_mace()
        if torch.cuda.is_available():
            device = torch.device("cuda", local_rank() % torch.cuda.device_count())
            # a rank owns its GPU: whatever launches on the current device (vesin, cuBLAS's
            # handles) must find this one, and no rank should open a context on another
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        calculator = MACEAccelCalculator(
            model=self.model, device=device, default_dtype=self.dtype, head=self.head,
            backend="cuda" if device.type == "cuda" else "reference", fallback="error")
        numbers = [atomic_numbers[symbol] for symbol in self.element_types]
        self.model, self._device = calculator.model, device
        self._positions = PositionsCall(calculator, np.asarray(numbers))

    def _batch(self, data: Any, n_local: int, n_total: int,
               owners: Optional[np.ndarray]) -> Tuple[Dict[str, Any], Tensor]:
        """mace's LAMMPS-mode input of this rank's atoms and pairs (sender ``j``, receiver
        ``i``: a pair ``i -> j`` carries ``j``'s message to ``i``): the local atoms only, each
        pair's sender its ghost's owner, where :func:`ghost_owners` finds every owner here;
        else (``owners`` None) the ghosts too, with the exchange that fills in their
        features; and LAMMPS's ``pair_j [npairs]`` on the device."""
        device, dtype = self._device, getattr(torch, self.dtype)
        pair_i, pair_j, vectors = self._pairs(data, n_local, n_total)
        if owners is not None:
            n_nodes, exchange = n_local, None
            senders = _on_device(owners, device)[pair_j]
        else:
            n_nodes, senders = n_total, pair_j
            exchange = self._exchange(data, n_local)
        species = _on_device(torch.as_tensor(data.elems)[:n_nodes], device).long()
        return {
            "vectors": vectors.to(dtype),
            "node_attrs": torch.nn.functional.one_hot(
                species, num_classes=len(self.element_types)).to(dtype),
            "edge_index": torch.stack([senders, pair_i]),
            "batch": torch.zeros(n_local, dtype=torch.int64, device=device),
            "head": torch.tensor([self.head_index], dtype=torch.int64, device=device),
            # read by models with charge and spin embeddings (mace's defaults), else unused
            "total_charge": torch.zeros(1, dtype=dtype, device=device),
            "total_spin": torch.ones(1, dtype=dtype, device=device),
            "lammps_class": exchange,
            "natoms": (n_local, n_nodes - n_local),
        }, pair_j
