"""The ghost atoms' features between the ranks of a LAMMPS run, on their devices, through
torch.distributed (NCCL between GPUs, gloo between CPUs) instead of LAMMPS's exchange of host
arrays.

Each call, one LAMMPS forward exchange of two numbers per atom (its index on its rank, and that
rank) tells every ghost where its owner lives (:func:`find_owners`). A ghost that is a periodic
image of one of the rank's own atoms takes that atom's row on the device; the rows of the other
ghosts' owners are asked of their ranks once per call (an all-to-all of the counts, one of the
indices: :class:`PeerPlan`), and every exchange between the blocks is then one all-to-all of
rows (:class:`PeerExchange`): a forward one sends each rank the rows it asked for, a reverse one
sends the ghosts' gradients back to their owners. Every sum over several rows (a ghost's images,
the ranks that asked for one atom) is taken in a fixed order, so the results do not depend on
timing.

Every collective is a call of all ranks together, in the same order on each: a rank without
local atoms makes them too (with nothing to ask and nothing asked of it).

The process group is made once per process (:func:`peer_group`) from the MPI launcher's
environment (Open MPI or Slurm; MPICH with ``MASTER_ADDR`` and ``MASTER_PORT``, which ranks on
several hosts need too). Where it cannot be made, the caller exchanges through LAMMPS and says why once.
"""

from __future__ import annotations

import datetime
import hashlib
import os
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

Tensor = torch.Tensor

# the seconds the ranks wait for each other to make the process group
RENDEZVOUS_SECONDS = 120

_STATE: Dict[str, Optional[str]] = {}  # "why": None once the group is made, else why not


def launcher_world() -> Optional[Tuple[int, int, int, Optional[str]]]:
    """``(rank, size, ranks on this host, job id)`` from the MPI launcher's environment (Open
    MPI, then MPICH's Hydra, then Slurm), else None; an unknown count of ranks on this host is
    0 and an unknown job id None."""
    env = os.environ
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        size = int(env["OMPI_COMM_WORLD_SIZE"])
        return (int(env["OMPI_COMM_WORLD_RANK"]), size,
                int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", size)),
                env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid"))
    if "PMI_SIZE" in env:
        return (int(env.get("PMI_RANK", 0)), int(env["PMI_SIZE"]),
                int(env.get("MPI_LOCALNRANKS", 0)), None)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        size = int(env["SLURM_NTASKS"])
        local = size if env.get("SLURM_NNODES", "1") == "1" else 0
        job = f"{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}"
        return int(env["SLURM_PROCID"]), size, local, job
    return None


def peer_group(device: torch.device, nprocs: int) -> Optional[str]:
    """Make the process group of the run's ``nprocs`` ranks once (NCCL on a GPU, gloo on a
    CPU); None when it is there, else why it cannot be (one line)."""
    import torch.distributed as dist

    if "why" not in _STATE:
        if not dist.is_initialized():
            _STATE["why"] = _init_group(device, nprocs)
        elif dist.get_world_size() != nprocs:
            _STATE["why"] = f"torch.distributed has {dist.get_world_size()} ranks, LAMMPS {nprocs}"
        else:
            _STATE["why"] = None
    return _STATE["why"]


def _init_group(device: torch.device, nprocs: int) -> Optional[str]:
    import torch.distributed as dist

    world = launcher_world()
    if world is None:
        return "no rank and size of an MPI launcher (Open MPI, MPICH, Slurm) in the environment"
    rank, size, local_size, job = world
    if size != nprocs:
        return f"the launcher's environment says {size} ranks, LAMMPS {nprocs}"
    address = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if local_size == size else None)
    if address is None:
        return ("the ranks span several hosts: set MASTER_ADDR and MASTER_PORT (rank 0's host "
                "and a free port) for every rank")
    port = os.environ.get("MASTER_PORT")
    if port is None and job is None:
        return "no job id in the launcher's environment to pick a port: set MASTER_PORT"
    if port is None:  # the same on every rank of the job, different for another job
        port = 20000 + int(hashlib.sha256(job.encode()).hexdigest(), 16) % 40000
    try:
        store = dist.TCPStore(address, int(port), size, rank == 0,
                              timeout=datetime.timedelta(seconds=RENDEZVOUS_SECONDS))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store,
                                rank=rank, world_size=size,
                                device_id=device if device.type == "cuda" else None)
    except Exception as exc:  # noqa: BLE001  (any failure: exchange through LAMMPS instead)
        return f"torch.distributed did not start ({type(exc).__name__}: {exc})".split("\n")[0]
    return None


def find_owners(data: Any) -> Tuple[np.ndarray, np.ndarray]:
    """``(rank, index)``, each ``[ntotal]`` int64: where each atom of ``data`` lives (a local
    atom: here, itself), through one forward exchange of a ``[ntotal, 2]`` float64 host array
    in place."""
    import torch.distributed as dist

    n_local, n_total = int(data.nlocal), int(data.ntotal)
    rows = np.empty((n_total, 2), dtype=np.float64)
    rows[:n_local, 0] = dist.get_rank()
    rows[:n_local, 1] = np.arange(n_local)
    data.forward_exchange(rows, rows, 2)
    ranks, index = rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64)
    if n_total and (ranks.min() < 0 or ranks.max() >= dist.get_world_size() or index.min() < 0):
        raise RuntimeError("LAMMPS's exchange gave a ghost atom an owner that does not exist; "
                           "rebuild LAMMPS with scripts/build_lammps.sh")
    return ranks, index


class RowSum:
    """Sums of rows grouped by a key, in a fixed order: ``sum(values)`` gives ``[targets,
    W]``, the rows of ``sources`` with equal ``keys`` added in the order they come, through a
    padded ``[targets, most rows of one key]`` gather (no atomics: the same bits every time).

    Args:
        keys: ``[n]`` the group of each source row.
        sources: ``[n]`` the row of ``values`` each one takes.
        device: where the index tensors live.
    """

    def __init__(self, keys: np.ndarray, sources: np.ndarray, device: torch.device) -> None:
        order = np.argsort(keys, kind="stable")
        keys, sources = keys[order], sources[order]
        targets, first, counts = np.unique(keys, return_index=True, return_counts=True)
        width = int(counts.max()) if len(counts) else 0
        pad = np.full((len(targets), width), -1, dtype=np.int64)  # -1: the zero row
        slot = np.arange(len(keys)) - np.repeat(first, counts)
        pad[np.repeat(np.arange(len(targets)), counts), slot] = sources
        self.targets = torch.from_numpy(targets).to(device)
        self._pad = torch.from_numpy(pad).to(device)

    def sum(self, values: Tensor) -> Tensor:
        """``[targets, W]`` of ``values [n_rows, W]``."""
        padded = torch.cat([values, values.new_zeros((1, values.shape[1]))])
        return padded[self._pad].sum(dim=1)


class PeerPlan:
    """Who sends which rows to whom for one call: the ghosts that are images of this rank's
    atoms, the other ghosts' owners asked of their ranks, and the rows the other ranks asked of
    this one (two all-to-alls, made by every rank in the same order).

    Args:
        ranks, index: where each atom lives (:func:`find_owners`); ``[ntotal]``.
        n_local: this rank's atoms (the first rows).
        device: where the rows live (the process group's device).
        wanted: whether this rank needs its ghosts' rows (not where it runs no model).
    """

    def __init__(self, ranks: np.ndarray, index: np.ndarray, n_local: int,
                 device: torch.device, wanted: bool = True) -> None:
        import torch.distributed as dist

        me, size = dist.get_rank(), dist.get_world_size()
        ghosts = np.arange(n_local, len(ranks))
        own = ghosts[ranks[n_local:] == me] if wanted else ghosts[:0]
        remote = ghosts[ranks[n_local:] != me] if wanted else ghosts[:0]
        self.n_local = n_local
        self.own_rows = torch.from_numpy(own).to(device)
        self.own_sources = torch.from_numpy(index[own]).to(device)
        self.own_sum = RowSum(index[own], own, device)  # ghosts' gradients to their owners
        # the owners to ask for, each once: sorted by rank, then index
        base = int(index.max(initial=0)) + 1
        unique, slot = np.unique(ranks[remote] * base + index[remote], return_inverse=True)
        asked_ranks, asked_index = np.divmod(unique, base)
        self.remote_rows = torch.from_numpy(remote).to(device)
        self.remote_slot = torch.from_numpy(slot.reshape(-1)).to(device)
        self.remote_sum = RowSum(slot.reshape(-1), remote, device)  # ghosts to their slots
        self.recv_splits: List[int] = np.bincount(asked_ranks, minlength=size).tolist()
        counts = torch.tensor(self.recv_splits, dtype=torch.int64, device=device)
        asked_of_me = torch.empty_like(counts)
        dist.all_to_all_single(asked_of_me, counts)
        self.send_splits: List[int] = asked_of_me.tolist()
        send_index = torch.empty(sum(self.send_splits), dtype=torch.int64, device=device)
        dist.all_to_all_single(send_index, torch.from_numpy(asked_index).to(device),
                               output_split_sizes=self.send_splits,
                               input_split_sizes=self.recv_splits)
        self.send_index = send_index
        # what comes back in a reverse exchange: one row per asked-for atom, summed per atom
        self.back_sum = RowSum(send_index.cpu().numpy(), np.arange(len(send_index)), device)


class PlanKeeper:
    """The last :class:`PeerPlan`, kept while every rank's atoms and ghosts stay where they
    were (LAMMPS moves them only when it rebuilds its neighbour lists): a step then makes no
    plan, only one all-reduce of a flag (whether any rank's owners changed), since making a
    plan is a call of all ranks together and every rank must take the same branch."""

    def __init__(self) -> None:
        self._kept: Optional[Tuple[np.ndarray, np.ndarray, int, bool, PeerPlan]] = None

    def plan(self, ranks: np.ndarray, index: np.ndarray, n_local: int, device: torch.device,
             wanted: bool = True) -> PeerPlan:
        """The plan for owners ``ranks``, ``index`` (:func:`find_owners`): the kept one where
        no rank's owners changed since it was made, else a new one."""
        import torch.distributed as dist

        kept = self._kept
        same = (kept is not None and kept[2] == n_local and kept[3] == wanted
                and np.array_equal(kept[0], ranks) and np.array_equal(kept[1], index))
        changed = torch.tensor([0 if same else 1], dtype=torch.int32, device=device)
        dist.all_reduce(changed, op=dist.ReduceOp.MAX)
        if int(changed.item()) == 0:
            return kept[4]
        plan = PeerPlan(ranks, index, n_local, device, wanted)
        self._kept = (ranks.copy(), index.copy(), n_local, wanted, plan)
        return plan


class PeerExchange:
    """The exchange mace's LAMMPS mode calls between the blocks (``forward_exchange``,
    ``reverse_exchange`` on ``[ntotal, W]`` rows), on the device (:class:`PeerPlan`)."""

    def __init__(self, plan: PeerPlan) -> None:
        self.plan = plan

    def forward_exchange(self, feats: Tensor, out: Tensor, vec_len: int) -> None:
        """``out``: ``feats`` with each ghost's row its owner's."""
        import torch.distributed as dist

        p = self.plan
        out[:p.n_local] = feats[:p.n_local]
        out[p.n_local:] = 0
        out[p.own_rows] = feats[p.own_sources]
        received = feats.new_empty((sum(p.recv_splits), feats.shape[1]))
        dist.all_to_all_single(received, feats[p.send_index].contiguous(),
                               output_split_sizes=p.recv_splits,
                               input_split_sizes=p.send_splits)
        out[p.remote_rows] = received[p.remote_slot]

    def reverse_exchange(self, grads: Tensor, out: Tensor, vec_len: int) -> None:
        """``out``: the local atoms' rows of ``grads`` plus those of their ghosts, wherever
        these are; the ghosts' rows zero."""
        import torch.distributed as dist

        p = self.plan
        out.zero_()
        out[:p.n_local] = grads[:p.n_local]
        out.index_add_(0, p.own_sum.targets, p.own_sum.sum(grads))  # each target once
        sent_back = grads.new_empty((sum(p.send_splits), grads.shape[1]))
        dist.all_to_all_single(sent_back, p.remote_sum.sum(grads).contiguous(),
                               output_split_sizes=p.send_splits,
                               input_split_sizes=p.recv_splits)
        out.index_add_(0, p.back_sum.targets, p.back_sum.sum(sent_back))
