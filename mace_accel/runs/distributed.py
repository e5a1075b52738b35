"""A YAML ``singlepoint`` run over several GPUs (or CPU processes) with ``torch.distributed``.

Launched by ``torchrun`` (``mace-accel run RUN.yaml --gpus N`` starts it), each process (rank)
takes a share of the frames, balanced by atom count, and evaluates it with a
:class:`~mace_accel.batched.BatchEvaluator` on its own device (``cuda:LOCAL_RANK``, or the CPU
with ``device: cpu``: N processes talking over gloo, a testing aid). The results are gathered on
rank 0, which alone writes the outputs, in input order, as a one-process run would.

Every phase ends with the ranks agreeing (an ``all_gather_object`` of each rank's status): a
failure on any rank (a bad frame, a model that does not load, a device that is missing, the
outputs folder refused) stops every rank with that rank's error, before anything is written.

Multi-node runs use torchrun's own rendezvous, e.g. on each of two nodes::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m mace_accel.cli run run.yaml
"""

from __future__ import annotations

import dataclasses
import os
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, TextIO

from mace_accel.errors import ConfigError, MaceAccelError

# set by ``mace-accel run --gpus N`` for the processes it starts: where rank 0 leaves the error
# that stopped the run, so the launcher prints it as one line instead of torchrun's report
ERROR_FILE_ENV = "MACE_ACCEL_ERROR_FILE"


@dataclasses.dataclass(frozen=True)
class World:
    """This process's place in a torchrun launch."""

    rank: int
    size: int
    local_rank: int


def current_world() -> Optional[World]:
    """The torchrun world this process belongs to (``WORLD_SIZE`` > 1), or None."""
    size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if size <= 1:
        return None
    return World(int(os.environ.get("RANK", "0")), size, int(os.environ.get("LOCAL_RANK", "0")))


def share_frames(sizes: Sequence[int], n_ranks: int) -> List[List[int]]:
    """Frame indices per rank, balanced by atom count: the largest frame first onto the rank
    with the fewest atoms so far (ties: the lower rank; frames of equal size: input order).
    Deterministic, every frame exactly once, each rank's indices in input order."""
    if n_ranks < 1:
        raise ConfigError(f"cannot share frames over {n_ranks} ranks")
    loads = [0] * n_ranks
    shares: List[List[int]] = [[] for _ in range(n_ranks)]
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(n_ranks), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += sizes[index]
    return [sorted(share) for share in shares]


class RankFailed(MaceAccelError):
    """A rank of a distributed run failed; the message names it and says why."""


class _Group:
    """The process group of one run, and the agreement step between phases."""

    def __init__(self, world: World, device: str) -> None:
        import torch
        import torch.distributed as dist

        self.world = world
        self.dist = dist
        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(world.local_rank)  # object collectives use the current device
        dist.init_process_group(backend="nccl" if cuda else "gloo")

    def agree(self, what: str, step: Callable[[], Any]) -> Any:
        """Run ``step`` on every rank; if it failed on any, raise that rank's error on all."""
        try:
            value, status = step(), None
        except MaceAccelError as exc:
            value, status = None, (type(exc).__name__, str(exc))
        except Exception as exc:  # an unexpected failure still stops every rank, with its text
            traceback.print_exc()
            value, status = None, (type(exc).__name__, f"{type(exc).__name__}: {exc}")
        statuses: List[Any] = [None] * self.world.size
        self.dist.all_gather_object(statuses, status)
        for rank, failed in enumerate(statuses):
            if failed is not None:
                raise RankFailed(f"rank {rank} of {self.world.size} failed while {what}: "
                                 f"{failed[1]}")
        return value

    def gather(self, payload: Any) -> Optional[List[Any]]:
        """Every rank's ``payload`` on rank 0 (None elsewhere)."""
        out: Optional[List[Any]] = [None] * self.world.size if self.world.rank == 0 else None
        self.dist.gather_object(payload, out, dst=0)
        return out

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class _Gathered:
    """The results of every rank, in input order, behind the interface ``run_singlepoint``
    uses of a :class:`~mace_accel.batched.BatchEvaluator`."""

    def __init__(self, evaluator, results: Dict[int, dict], calls: int, n_ranks: int) -> None:
        self._evaluator, self._results = evaluator, results
        self.n_calls, self.budget = calls, evaluator.budget
        self.backend, self.report, self.info = (evaluator.backend, evaluator.report,
                                                evaluator.info)
        self.n_ranks = n_ranks

    def iter_results(self, frames: Sequence, progress: Optional[Callable[[int], None]] = None
                     ) -> Iterator[dict]:
        for index in range(len(frames)):
            if progress is not None:
                progress(1)
            yield self._results[index]


def _rank_device(device: str, world: World) -> str:
    """The device of this rank: ``cuda:LOCAL_RANK`` for cuda/auto (a GPU each), cpu for cpu."""
    import torch

    if device == "cpu":
        return "cpu"
    if device == "auto" and not torch.cuda.is_available():
        raise ConfigError("a run over several processes with `device: auto` needs GPUs and "
                          "none is visible; set `device: cpu` to run the processes on the CPU "
                          "(a testing aid)")
    if device.startswith("cuda:"):
        raise ConfigError(f"device {device!r} names one GPU; a run over several GPUs gives each "
                          "rank its own: set `device: cuda` (or auto)")
    if not torch.cuda.is_available() or torch.cuda.device_count() <= world.local_rank:
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ConfigError(f"rank {world.rank} needs GPU {world.local_rank} but this node has "
                          f"{found}; start at most {found} processes per node, or set "
                          "`device: cpu` to run the ranks on the CPU")
    return f"cuda:{world.local_rank}"


def run_distributed(config, overrides: Optional[Mapping[str, Any]] = None, *,
                    overrides_base=None, overwrite: bool = False,
                    progress_stream: Optional[TextIO] = None):
    """:func:`mace_accel.runs.tasks.run` of a ``singlepoint`` run file over a torchrun world.

    Returns:
        the :class:`~mace_accel.runs.tasks.RunResult` on rank 0; None on the other ranks.

    Raises:
        RankFailed: on every rank, when any rank failed (the message names it).
        ConfigError: a task other than singlepoint.
    """
    from mace_accel.runs import tasks

    world = current_world()
    if world is None:
        raise ConfigError("run_distributed needs a torchrun launch (WORLD_SIZE > 1)")
    group = None
    try:
        cfg = tasks._as_config(config, overrides, overrides_base)
        check_shareable(cfg)
        device = _rank_device(cfg.device, world)
        cfg = dataclasses.replace(cfg, device=device)
        group = _Group(world, device)
        return _run(group, cfg, tasks, overwrite, progress_stream)
    except MaceAccelError as exc:  # the same on every rank, or agreed: rank 0 says it
        _leave_error(world, str(exc))
        raise
    finally:
        if group is not None:
            group.close()


def check_shareable(cfg) -> None:
    """Raise :class:`ConfigError` unless the run's task can be shared over processes."""
    if cfg.task != "singlepoint":
        raise ConfigError(f"task {cfg.task} runs in one process; only singlepoint is shared "
                          "over several GPUs (drop --gpus / run it without torchrun)")


def _run(group: _Group, cfg, tasks, overwrite: bool, progress_stream):
    from mace_accel.runs.outputs import RunFolder

    world = group.world
    structures = group.agree("reading the structures", lambda: tasks.read_structures(cfg))
    folder = RunFolder(cfg.outputs, overwrite=overwrite)
    if world.rank == 0:
        group.agree("checking the outputs folder", folder.check)
    else:
        group.agree("checking the outputs folder", lambda: None)
    sizes = [len(a) for a in structures.frames]
    mine = share_frames(sizes, world.size)[world.rank]
    evaluator = group.agree("loading the model", lambda: tasks.make_calculator(
        cfg, compute_stress=tasks._needs_stress(cfg, structures.frames)))
    own = tasks.Structures(structures.path, [structures.frames[i] for i in mine],
                           [structures.indices[i] for i in mine], structures.total)
    group.agree("checking the frames", lambda: tasks.validate_structures(own, evaluator.info,
                                                                          cfg))
    results = group.agree("evaluating", lambda: evaluator.evaluate(own.frames))
    gathered = group.gather((dict(zip(mine, results)), evaluator.n_calls))
    outcome = None
    if world.rank == 0:
        merged: Dict[int, dict] = {}
        for part, _ in gathered:
            merged.update(part)
        calls = sum(n for _, n in gathered)
        source = _Gathered(evaluator, merged, calls, world.size)

        def write():
            with folder:
                return tasks._run_in(folder.path, cfg, structures, source, progress_stream)
        outcome = group.agree("writing the outputs", write)
    else:
        group.agree("writing the outputs", lambda: None)
    return outcome


def _leave_error(world: World, text: str) -> None:
    """Rank 0 leaves the run's error for the launcher (see :data:`ERROR_FILE_ENV`)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if world.rank == 0 and path:
        Path(path).write_text(text)
