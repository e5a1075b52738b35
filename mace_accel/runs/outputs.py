"""The output folder of a run: checked before anything is written, then owned by one run.

A run's folder holds the files of exactly one run. :class:`RunFolder` enforces it:

* :meth:`RunFolder.check` (no side effects; ``--dry-run`` and the start of every run call it):
  the path can be a folder we can write to, no other run holds it, and it is empty unless
  ``overwrite`` is given (then it must hold only files a run writes, so nothing else is deleted).
* :meth:`RunFolder.claim` (after every other check has passed): creates the folder, takes its
  lock, checks again (another run may have come and gone meanwhile) and, with ``overwrite``,
  deletes the earlier run's files. The lock is held until :meth:`RunFolder.release`.

The lock is an ``fcntl.flock`` on ``.mace-accel.lock`` inside the folder, which also records
who holds it (pid, host, start time, command) for the error message a second run gets. The
kernel drops the lock when its process dies, so a crashed run never leaves a stale lock; the
file itself stays (unlinking a lock file lets two later runs lock two different files).
Torch-free.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import re
import socket
import sys
from pathlib import Path
from typing import List, Optional, Union

from mace_accel.errors import OutputError
from mace_accel.files import folder_problem, os_error_reason

try:
    import fcntl
except ImportError:  # not POSIX: no locking (documented), every other check still runs
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".mace-accel.lock"
# every file a run writes; only these are deleted by overwrite=True
RUN_FILES = ("run.log", "config.yaml", "results.extxyz", "results.extxyz.partial",
             "trajectory.extxyz", "stats.dat", "final.extxyz")
# mace_accel.files.atomic_write's temporary files of those (left only by a killed process)
_TEMP_RE = re.compile(r"^\.(" + "|".join(re.escape(n) for n in RUN_FILES) + r")\..+\.tmp$")
_OTHER_FOLDER = "choose another folder with `outputs:` in the run file (or --set outputs=DIR)"


def check_output_dir(path: Union[str, Path], what: str = "outputs folder",
                     fix: str = _OTHER_FOLDER) -> Path:
    """Raise :class:`OutputError` unless ``path`` is (or can be created as) a writable folder.

    Args:
        what: the folder's name in messages.
        fix: how the user picks another folder, ending each message.

    Creates nothing. Returns the absolute path.
    """
    path = Path(path).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {str(path)!r} is a file, not a folder; {fix}")
    existing, problem = folder_problem(path)
    if problem == "not a folder":
        raise OutputError(f"cannot create the {what} {str(path)!r}: {str(existing)!r} is a "
                          f"file, not a folder; {fix}")
    if problem == "read-only":
        where = "" if existing == path else f" ({str(existing)!r}, where it would be created)"
        raise OutputError(f"cannot write to the {what} {str(path)!r}: it is on a read-only "
                          f"filesystem{where}; {fix}, on a writable filesystem")
    if problem == "no permission":
        where = "in it" if existing == path else f"in {str(existing)!r} to create it"
        raise OutputError(f"no permission to write to the {what} {str(path)!r} ({where}); "
                          f"fix the permissions or {fix}")
    return path


def _command_line() -> Optional[str]:
    """This process's command line, shortened (``mace-accel run md.yaml --set ...``)."""
    if not sys.argv or not sys.argv[0]:
        return None
    text = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])
    return text if len(text) <= 200 else text[:197] + "..."


def _owner_text(lock: Path) -> str:
    """Who holds ``lock`` in words (from what its holder wrote into it)."""
    try:
        info = json.loads(lock.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "another mace-accel run"
    text = f"another mace-accel run (pid {info.get('pid')} on {info.get('host', '?')}"
    if info.get("started"):
        text += f", started {info['started']}"
    if info.get("command"):
        text += f": {info['command']}"
    return text + ")"


class RunFolder:
    """The output folder of one run; see the module docstring.

    Args:
        path: the folder (created by :meth:`claim` if missing).
        overwrite: replace an earlier run's files instead of refusing the folder.
    """

    def __init__(self, path: Union[str, Path], overwrite: bool = False) -> None:
        self.path = Path(path).expanduser().absolute()
        self.overwrite = bool(overwrite)
        self.lock_path = self.path / LOCK_NAME
        self._fd: Optional[int] = None

    # -- checks (no side effects) --------------------------------------------------------------
    def check(self) -> None:
        """Raise :class:`OutputError` if this run could not own the folder; creates nothing."""
        check_output_dir(self.path)
        if not self.path.is_dir():
            return
        if self.lock_path.exists() and fcntl is not None:
            try:
                fd = os.open(self.lock_path, os.O_RDONLY)
            except OSError:
                fd = None
            if fd is not None:
                try:
                    self._lock_or_raise(fd)
                finally:
                    os.close(fd)  # closing drops the probe's lock
        self._check_contents()

    def _entries(self) -> List[Path]:
        return sorted(p for p in self.path.iterdir() if p.name != LOCK_NAME)

    @staticmethod
    def _is_run_file(p: Path) -> bool:
        named = p.name in RUN_FILES or bool(_TEMP_RE.match(p.name))
        return named and (p.is_symlink() or not p.is_dir())

    def _check_contents(self) -> List[Path]:
        """The earlier run's files to delete (overwrite), or an error; an empty folder is fine."""
        entries = self._entries()
        if not entries:
            return []
        names = ", ".join(p.name for p in entries[:6]) + (", ..." if len(entries) > 6 else "")
        foreign = [p for p in entries if not self._is_run_file(p)]
        if not self.overwrite:
            if not foreign:
                raise OutputError(
                    f"outputs folder {str(self.path)!r} holds the results of an earlier run "
                    f"({names}); rerun with --overwrite to replace them, or {_OTHER_FOLDER}")
            raise OutputError(
                f"outputs folder {str(self.path)!r} is not empty (it holds {names}); a run "
                f"writes into a new or empty folder: {_OTHER_FOLDER}")
        if foreign:
            shown = ", ".join(p.name for p in foreign[:6]) + (", ..." if len(foreign) > 6 else "")
            raise OutputError(
                f"outputs folder {str(self.path)!r} holds files that a mace-accel run does not "
                f"write ({shown}); --overwrite only replaces a run's own files and leaves these "
                f"alone, so {_OTHER_FOLDER} (or move them away)")
        return entries

    def _lock_or_raise(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise OutputError(
                f"outputs folder {str(self.path)!r} is in use by {_owner_text(self.lock_path)}; "
                f"wait for that run to finish, or {_OTHER_FOLDER}") from None

    # -- ownership -----------------------------------------------------------------------------
    def claim(self) -> "RunFolder":
        """Create the folder, take its lock, and (``overwrite``) delete the earlier run's files.

        Raises:
            OutputError: the folder cannot be created or written, another run holds it, or it
                holds files this run may not replace.
        """
        if self._fd is not None:
            return self
        check_output_dir(self.path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise OutputError(f"cannot create the outputs folder {str(self.path)!r}: "
                              f"{os_error_reason(exc)}; {_OTHER_FOLDER}") from None
        try:
            if fcntl is not None:
                self._lock_or_raise(fd)
            stale = self._check_contents()
            for p in stale:
                p.unlink()
            owner = {"pid": os.getpid(), "host": socket.gethostname(),
                     "started": datetime.datetime.now().isoformat(timespec="seconds"),
                     "command": _command_line()}
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, json.dumps(owner).encode() + b"\n")
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the lock file stays; see the module docstring)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def owned(self) -> bool:
        return self._fd is not None

    def __enter__(self) -> "RunFolder":
        return self.claim()

    def __exit__(self, *exc) -> None:
        self.release()
