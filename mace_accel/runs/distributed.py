"""A YAML ``singlepoint`` run over several GPUs (or CPU processes) with ``torch.distributed``.

Launched by ``torchrun`` (``mace-accel run RUN.yaml --gpus N`` starts it), each process (rank)
takes a share of the frames, balanced by atom count, and evaluates it with a
:class:`~mace_accel.batched.BatchEvaluator` on its own device (``cuda:LOCAL_RANK``, or the CPU
with ``device: cpu``: N processes on one machine, a testing aid). The results are gathered on
rank 0, which alone writes the outputs, in input order, as a one-process run would.

Every phase ends with the ranks agreeing (an ``all_gather_object`` of each rank's status): a
failure on any rank (the run file, a bad frame, a model that does not load, a GPU that is
missing, the outputs folder refused) stops every rank with that rank's error, before anything
is written.

Multi-node runs use torchrun's own rendezvous, e.g. on each of two nodes::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m mace_accel.cli run run.yaml
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, TextIO

from mace_accel.errors import ConfigError, InputError, MaceAccelError

# set by ``mace-accel run --gpus N`` for the processes it starts: where rank 0 leaves the error
# the ranks agreed on, so the launcher prints it as one line instead of torchrun's report
ERROR_FILE_ENV = "MACE_ACCEL_ERROR_FILE"
_FRAME_RE = re.compile(r"^frame (\d+): ")


@dataclasses.dataclass(frozen=True)
class World:
    """This process's place in a torchrun launch (``local_size``: ranks on this node)."""

    rank: int
    size: int
    local_rank: int
    local_size: int


def current_world() -> Optional[World]:
    """The torchrun world this process belongs to (``WORLD_SIZE`` > 1), or None."""
    size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if size <= 1:
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(local_rank + 1)))
    return World(int(os.environ.get("RANK", "0")), size, local_rank, local_size)


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
    """A rank of a distributed run failed; raised on every rank, the message names the rank.

    Attributes:
        exit_code: the command line's exit code for it (2: a user mistake, the rank raised a
            :class:`MaceAccelError`; 1: anything else, such as a full disk).
    """

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# ---------------------------------------------------------------------------------------------
# checks of the launch


def check_shareable(cfg) -> None:
    """Raise :class:`ConfigError` unless the run's task can be shared over processes."""
    if cfg.task != "singlepoint":
        raise ConfigError(f"task {cfg.task} runs in one process; only singlepoint is shared "
                          "over several GPUs (drop --gpus / run it without torchrun)")


def check_launch(cfg, n_processes: int) -> None:
    """What ``mace-accel run --gpus N`` checks before it starts anything: the task can be
    shared and this node has a GPU for each process (unless ``device: cpu``)."""
    check_shareable(cfg)
    _check_gpus(cfg.device, n_processes, f"--gpus {n_processes}")


def _check_gpus(device: str, needed: int, who: str) -> None:
    """Raise :class:`ConfigError` unless ``device`` gives each of ``needed`` processes on this
    node a GPU of its own (``cpu`` needs none)."""
    if device == "cpu":
        return
    if device.startswith("cuda:"):
        raise ConfigError(f"device {device!r} names one GPU; a run over several GPUs gives each "
                          "process its own: set `device: cuda` (or auto)")
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < needed:
        raise ConfigError(f"{who} needs {needed} GPUs on this node, one per process, and torch "
                          f"sees {found}; start at most {found} processes per node, or set "
                          "`device: cpu` to run the processes on the CPU (a testing aid)")


def _rank_config(config, overrides: Optional[Mapping[str, Any]], overrides_base,
                 world: World):
    """The run's config as this rank runs it: its own device (``cuda:LOCAL_RANK`` or cpu)."""
    from mace_accel.runs import tasks

    cfg = tasks._as_config(config, overrides, overrides_base)
    check_shareable(cfg)
    _check_gpus(cfg.device, world.local_size, f"torchrun's {world.local_size} processes here")
    device = "cpu" if cfg.device == "cpu" else f"cuda:{world.local_rank}"
    return dataclasses.replace(cfg, device=device)


# ---------------------------------------------------------------------------------------------
# the process group


class _Group:
    """The process group of one run, and the agreement step between phases.

    The ranks exchange only small host objects (statuses, per-frame numpy results), so the
    group is gloo, on every machine: it is up before a rank knows whether its GPU exists, and
    so can carry that error too (NCCL would need each rank's GPU first)."""

    def __init__(self, world: World) -> None:
        import torch.distributed as dist

        self.world = world
        self.dist = dist
        dist.init_process_group(backend="gloo")

    def agree(self, what: str, step: Callable[[], Any]) -> Any:
        """Run ``step`` on every rank; if it failed on any, raise that rank's error on all
        (:class:`RankFailed`, naming the first rank that failed)."""
        try:
            value, status = step(), None
        except MaceAccelError as exc:
            value, status = None, (str(exc) or type(exc).__name__, 2)
        except OSError as exc:  # not the user's mistake (a full disk, say): exit 1, no traceback
            where = f"{exc.filename!r}: " if exc.filename is not None else ""
            value, status = None, (f"{where}{exc.strerror or exc}", 1)
        except Exception as exc:  # a bug: its traceback on this rank, its text on every rank
            traceback.print_exc()
            value, status = None, (f"{type(exc).__name__}: {exc}", 1)
        statuses: List[Any] = [None] * self.world.size
        self.dist.all_gather_object(statuses, status)
        for rank, failed in enumerate(statuses):
            if failed is not None:
                raise RankFailed(f"rank {rank} of {self.world.size} failed while {what}: "
                                 f"{failed[0]}", exit_code=failed[1])
        return value

    def gather(self, payload: Any) -> Optional[List[Any]]:
        """Every rank's ``payload`` on rank 0 (None elsewhere)."""
        out: Optional[List[Any]] = [None] * self.world.size if self.world.rank == 0 else None
        self.dist.gather_object(payload, out, dst=0)
        return out

    def close(self) -> None:
        """Leave together, then tear down: a rank that tore gloo down while another was still
        in its last collective made that one abort (seen as torchrun's extra failure report)."""
        if not self.dist.is_initialized():
            return
        try:
            self.dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
        except RuntimeError:  # a rank is gone: its error has been reported already
            pass
        self.dist.destroy_process_group()


class _Gathered:
    """The results of every rank, in input order, behind the interface ``run_singlepoint``
    uses of a :class:`~mace_accel.batched.BatchEvaluator`."""

    def __init__(self, evaluator, results: Dict[int, dict], calls: int, n_ranks: int) -> None:
        self._results = results
        self.n_calls, self.budget = calls, evaluator.budget
        self.backend, self.report = evaluator.backend, evaluator.report
        self.n_ranks = n_ranks

    def iter_results(self, frames: Sequence, progress: Optional[Callable[[int], None]] = None
                     ) -> Iterator[dict]:
        for index in range(len(frames)):
            if progress is not None:
                progress(1)
            yield self._results[index]


# ---------------------------------------------------------------------------------------------
# the run


def run_distributed(config, overrides: Optional[Mapping[str, Any]] = None, *,
                    overrides_base=None, overwrite: bool = False,
                    progress_stream: Optional[TextIO] = None):
    """:func:`mace_accel.runs.tasks.run` of a ``singlepoint`` run file over a torchrun world.

    Returns:
        the :class:`~mace_accel.runs.tasks.RunResult` on rank 0; None on the other ranks.

    Raises:
        RankFailed: on every rank, when any rank failed (the message names it): a run file
            or task that cannot be shared, a missing GPU, a bad frame, ...; nothing was written
            unless the failure came while rank 0 wrote.
        ConfigError: not a torchrun launch.
    """
    world = current_world()
    if world is None:
        raise ConfigError("run_distributed needs a torchrun launch (WORLD_SIZE > 1)")
    group = _Group(world)
    try:
        cfg = group.agree("reading the run file",
                          lambda: _rank_config(config, overrides, overrides_base, world))
        return _run(group, cfg, overwrite, progress_stream)
    finally:
        group.close()


def _run(group: _Group, cfg, overwrite: bool, progress_stream: Optional[TextIO]):
    """The phases of :func:`run_distributed`, each agreed on by every rank."""
    from mace_accel.runs import tasks
    from mace_accel.runs.outputs import RunFolder

    world = group.world
    lead = world.rank == 0
    structures = group.agree("reading the structures", lambda: tasks.read_structures(cfg))
    folder = RunFolder(cfg.outputs, overwrite=overwrite)
    # before loading the model: a refused folder fails fast, as in a one-process run
    group.agree("checking the outputs folder", folder.check if lead else lambda: None)
    evaluator = group.agree("loading the model", lambda: tasks.make_calculator(
        cfg, compute_stress=tasks._needs_stress(cfg, structures.frames)))
    mine = share_frames([len(a) for a in structures.frames], world.size)[world.rank]
    own = tasks.Structures(structures.path, [structures.frames[i] for i in mine],
                           [structures.indices[i] for i in mine], structures.total)
    group.agree("checking the frames",
                lambda: tasks.validate_structures(own, evaluator.info, cfg))
    results = group.agree("evaluating", lambda: _evaluate(evaluator, own))
    gathered = group.gather((dict(zip(mine, results)), evaluator.n_calls))

    def write():  # rank 0 alone, and only now: everything is checked and evaluated
        merged: Dict[int, dict] = {}
        for part, _ in gathered:
            merged.update(part)
        source = _Gathered(evaluator, merged, sum(n for _, n in gathered), world.size)
        return tasks._claim_and_write(folder, cfg, structures, source, progress_stream)
    return group.agree("writing the outputs", write if lead else lambda: None)


def _evaluate(evaluator, own) -> List[dict]:
    """``own``'s results; an error naming ``frame i`` of the share names it in the file."""
    try:
        return evaluator.evaluate(own.frames)
    except InputError as exc:
        text = str(exc)
        match = _FRAME_RE.match(text)
        if match is None:
            raise
        raise InputError(f"{own.where(int(match.group(1)))}: {text[match.end():]}") from None


# ---------------------------------------------------------------------------------------------
# the launcher's side (``mace-accel run --gpus N``)


def hand_to_launcher(world: World, error: RankFailed) -> bool:
    """Under ``mace-accel run --gpus N`` (:data:`ERROR_FILE_ENV` set), rank 0 leaves the
    agreed ``error`` for the launcher, which prints it; returns whether the launcher reports it
    (then no rank prints it)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path:
        return False
    if world.rank == 0:
        Path(path).write_text(json.dumps({"message": str(error),
                                          "exit_code": error.exit_code}))
    return True


def launcher_error(path: Path) -> Optional[RankFailed]:
    """The error rank 0 left in ``path`` (see :func:`hand_to_launcher`), or None."""
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    return RankFailed(data["message"], exit_code=int(data["exit_code"]))
