"""The files a run writes as it goes, each record whole or not at all.

``run.log`` lines, ``stats.dat`` rows and extxyz frames (``trajectory.extxyz``,
``results.extxyz.partial``) are appended through :class:`~mace_accel.files.RecordWriter`: a record
is rendered in memory and written in one go, and a write that fails part-way (a full disk) is cut
back, so each file stays readable (``ase.io.read(path, ":")``, ``numpy.loadtxt``) after any
failure. :class:`RunFiles` knows them all, for the message that says what a failed run kept.
"""

from __future__ import annotations

import datetime
import io
from pathlib import Path
from typing import Callable, Dict, List, Optional, Union

import numpy as np

from mace_accel.files import RecordWriter

STATS_COLUMNS = ("step", "time_fs", "epot_eV", "ekin_eV", "etot_eV", "temperature_K")
NPT_STATS_COLUMNS = ("volume_A3", "pressure_bar")


def render_frame(atoms) -> str:
    """One extxyz frame of ``atoms`` (with its calculator's results) as text."""
    import ase.io

    buffer = io.StringIO()
    ase.io.write(buffer, atoms, format="extxyz")
    return buffer.getvalue()


class RunLog:
    """Timestamped lines in ``run.log``, each line written whole."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.records = RecordWriter(self.path)
        self.lines = 0

    def write(self, text: str) -> None:
        """``text``'s lines, each with the time in front, as one record."""
        stamp = datetime.datetime.now().isoformat(timespec="seconds")
        self.append("".join(f"{stamp}  {line}\n" for line in str(text).splitlines() or [""]))

    def append(self, lines: str) -> None:
        """Whole lines (``lines`` ends with a newline) as they are, as one record."""
        self.records.write(lines)
        self.lines += lines.count("\n")

    def try_write(self, text: str) -> None:
        """:meth:`write` where a failure must not hide the error being reported (a full disk
        also refuses the line saying so)."""
        try:
            self.write(text)
        except (OSError, ValueError):
            pass

    def stream(self) -> "LogStream":
        """A file-like object for ASE's optimizers' ``logfile``: their lines go into the log."""
        return LogStream(self)

    def describe(self) -> str:
        return f"{self.path.name} ({self.lines} line(s))"

    def close(self) -> None:
        self.records.close()

    def __enter__(self) -> "RunLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LogStream:
    """``write``/``flush`` for code that logs into a file object: whole lines become records."""

    def __init__(self, log: RunLog) -> None:
        self.log = log
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        whole, newline, rest = self._pending.rpartition("\n")
        if newline:
            self.log.append(whole + "\n")
            self._pending = rest
        return len(text)

    def flush(self) -> None:
        """Lines go out as they are completed; a line without its end waits for it."""


class _StepRecords:
    """A file of whole records that knows the step of its last one (for :meth:`describe`)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.records = RecordWriter(self.path)
        self.last_step: Optional[int] = None

    def _describe(self, count: int, what: str, last: str) -> str:
        """``"name (count what(s), <last> step N)"``."""
        text = f"{self.path.name} ({count} {what}(s)"
        if count and self.last_step is not None:
            text += f", {last} step {self.last_step}"
        return text + ")"

    def close(self) -> None:
        self.records.close()


class FrameWriter(_StepRecords):
    """extxyz frames appended one by one, each whole (``trajectory.extxyz``, singlepoint's
    ``results.extxyz.partial``)."""

    def write(self, atoms, step: Optional[int] = None) -> None:
        self.records.write(render_frame(atoms))
        self.last_step = step

    def describe(self) -> str:
        return self._describe(self.records.records, "whole frame", "the last of")


class StatsWriter(_StepRecords):
    """Rows of ``stats.dat`` (whitespace columns under a ``#`` header), each row whole.

    Called as an ASE dynamics observer; ``step()`` gives the current step.
    """

    def __init__(self, path: Path, atoms, npt: bool, step: Callable[[], int],
                 timestep_fs: float) -> None:
        super().__init__(path)
        self.atoms, self.npt, self.step, self.timestep_fs = atoms, npt, step, timestep_fs
        columns = STATS_COLUMNS + (NPT_STATS_COLUMNS if npt else ())
        # "#" + names right-aligned over the 16-character value columns below them
        self.records.write("#" + " ".join([f"{columns[0]:>15}"] + [f"{c:>16}" for c in
                                                                     columns[1:]]) + "\n")

    def __call__(self) -> None:
        from ase import units

        a = self.atoms
        step = self.step()
        epot, ekin = a.get_potential_energy(), a.get_kinetic_energy()
        row = [f"{step:16d}", f"{step * self.timestep_fs:16.6f}", f"{epot:16.8f}",
               f"{ekin:16.8f}", f"{epot + ekin:16.8f}", f"{a.get_temperature():16.6f}"]
        if self.npt:
            pressure = -np.trace(a.get_stress(voigt=False, include_ideal_gas=True)) / 3.0
            row += [f"{a.get_volume():16.6f}", f"{pressure / units.bar:16.6f}"]
        self.records.write(" ".join(row) + "\n")
        self.last_step = step

    def describe(self) -> str:
        return self._describe(self.records.records - 1, "row", "to")  # less the header


Writer = Union[RunLog, FrameWriter, StatsWriter]


class RunFiles:
    """The outputs folder of a running run and the files open in it.

    Args:
        folder: the outputs folder (already claimed).
        log: the run's :class:`RunLog`.
    """

    def __init__(self, folder: Path, log: RunLog) -> None:
        self.folder = Path(folder)
        self.log = log
        self.open: Dict[str, Writer] = {"log": log}
        self.whole: List[Path] = []  # files written atomically (config.yaml, final.extxyz)

    def frames(self, role: str, name: str) -> FrameWriter:
        writer = FrameWriter(self.folder / name)
        self.open[role] = writer
        return writer

    def stats(self, atoms, npt: bool, step: Callable[[], int], timestep_fs: float) -> StatsWriter:
        writer = StatsWriter(self.folder / "stats.dat", atoms, npt, step, timestep_fs)
        self.open["stats"] = writer
        return writer

    def written_whole(self, path: Path) -> None:
        self.whole.append(Path(path))

    def close(self) -> None:
        for role, writer in self.open.items():
            if role != "log":
                writer.close()

    def kept(self) -> str:
        """What the folder holds now, in words: ``kept in DIR: run.log (12 line(s)), ...``."""
        parts = [w.describe() for w in self.open.values()]
        parts += [p.name for p in self.whole if p.exists()]
        return (f"kept in {self.folder}: {', '.join(parts)} (each file ends with its last whole "
                "record)")

    def resume_hint(self) -> Optional[str]:
        """How to go on from the last trajectory frame kept, if there is one."""
        traj = self.open.get("trajectory")
        if not isinstance(traj, FrameWriter) or not traj.records.records:
            return None
        return (f"to go on from its last frame, run again with --set struct={traj.path} "
                "--set frame=-1 --set outputs=NEW_DIR")
