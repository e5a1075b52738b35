"""Writing files so that nobody ever sees half of one: the one ``atomic_write`` of the project,
and :class:`RecordWriter` for files that grow record by record while a run goes.

``atomic_write``: the data goes to a uniquely named temporary file beside the target (so two
writers never share one), is flushed and fsynced, gets the mode a plain ``open()`` would give
(0666 minus the umask, not mkstemp's 0600), and is then renamed over the target
(``overwrite=True``) or linked to it only if the target does not exist yet (``overwrite=False``:
an atomic no-clobber create, so of two writers racing for a new path exactly one wins and the
other gets FileExistsError).

``RecordWriter``: each record (a log line, a stats row, a trajectory frame) is one ``write`` to
the end of the file; a write that fails part-way (disk full) is cut back, so the file always ends
with its last whole record and stays readable.

The OS errors of both name the file they were writing (``exc.filename``);
:func:`os_error_reason` says in words what a filesystem error means, and :func:`folder_problem`
why an output could not be created where the user asked, before anything is written.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
import threading
from pathlib import Path
from typing import IO, Iterator, Optional, Tuple, Union

_UMASK_LOCK = threading.Lock()
# errors that mean the filesystem has no room for the data: freeing space (or writing elsewhere)
# fixes them, unlike a failing disk
NO_ROOM_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_REASONS = {
    errno.ENOSPC: "the disk is full (no space left on device)",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EFBIG: "the file grew larger than the filesystem allows",
    errno.EROFS: "the filesystem is read-only (mounted read-only)",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "an input/output error of the disk or filesystem",
}


def os_error_reason(exc: OSError) -> str:
    """What an OS error means, in words that name a filesystem's state where it is one (a full
    disk, a read-only filesystem) rather than only the C library's text."""
    return _REASONS.get(exc.errno, exc.strerror or str(exc) or type(exc).__name__)


def read_only_filesystem(path: Union[str, Path]) -> bool:
    """Whether the existing ``path`` lies on a filesystem mounted read-only."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):  # no statvfs (not POSIX): os.access still answers
        return False


def folder_problem(path: Path) -> Tuple[Path, Optional[str]]:
    """Where creating ``path`` (a file or a folder, with any missing parents) would start, and
    why nothing can be created there.

    Returns:
        ``(existing, problem)``: ``path`` itself or its nearest existing parent, and
        ``"not a folder"``, ``"read-only"`` (on a filesystem mounted read-only, where
        ``os.access`` says "no" too: this names the real reason), ``"no permission"``, or None
        where files can be created.
    """
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return existing, "not a folder"
    if read_only_filesystem(existing):
        return existing, "read-only"
    if not os.access(existing, os.W_OK | os.X_OK):
        return existing, "no permission"
    return existing, None


def current_umask() -> int:
    """The process umask (read from /proc where possible, which does not change it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    with _UMASK_LOCK:  # os.umask can only be read by setting it
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_write(path: Union[str, Path], mode: str = "w", *, overwrite: bool = True,
                 encoding: str = "utf-8") -> Iterator[IO]:
    """Open a temporary file for writing; on success it becomes ``path`` in one step.

    Args:
        path: the target file; its directory must exist.
        mode: ``"w"`` (text) or ``"wb"`` (binary).
        overwrite: replace an existing ``path``; if False and ``path`` exists (also when another
            writer created it meanwhile), raise FileExistsError and leave it untouched.

    If the block raises, the temporary file is removed and ``path`` is left as it was; an OS
    error (a full disk) then names ``path``.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not overwrite and path.exists():
        raise FileExistsError(f"{path} exists")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        kwargs = {} if "b" in mode else {"encoding": encoding}
        with os.fdopen(fd, mode, **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            _create_exclusive(tmp, path)
    except OSError as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if exc.errno is None or exc.filename is not None:
            raise
        # a write through the file object: say which file (the target, not the temporary one)
        raise OSError(exc.errno, exc.strerror, str(path)) from exc
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _create_exclusive(tmp: str, path: Path) -> None:
    """Make ``tmp`` appear at ``path`` only if nothing is there (FileExistsError otherwise)."""
    try:
        os.link(tmp, path)  # atomic: fails if path exists
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links: reserve the name, then replace it
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        os.replace(tmp, path)
        return
    os.unlink(tmp)


def atomic_write_text(path: Union[str, Path], text: str, *, overwrite: bool = True) -> Path:
    with atomic_write(path, "w", overwrite=overwrite) as f:
        f.write(text)
    return Path(path)


def atomic_write_bytes(path: Union[str, Path], data: bytes, *, overwrite: bool = True) -> Path:
    with atomic_write(path, "wb", overwrite=overwrite) as f:
        f.write(data)
    return Path(path)


class RecordWriter:
    """A file written as whole records, for outputs that grow while a run goes.

    Each record is appended with one ``os.write`` (no buffer in between: what :meth:`write`
    returned from is in the file, as after a flush). If a write fails part-way (a full disk
    writes what fits, then fails), the file is cut back to its last whole record before the
    error is raised, so a reader never finds half a record at its end.

    Args:
        path: the file; created with the umask's mode, or emptied if it exists.

    Attributes:
        records: how many whole records the file holds.
        size: its size in bytes.
    """

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)
        self._fd: Optional[int] = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                                          | os.O_APPEND, 0o666)
        self.records = 0
        self.size = 0

    def write(self, record: Union[str, bytes]) -> None:
        """Append ``record`` whole, or raise the OSError (naming the file) with the file as it
        was before."""
        if self._fd is None:
            raise ValueError(f"{self.path} is closed")
        data = record.encode("utf-8") if isinstance(record, str) else bytes(record)
        view, done = memoryview(data), 0
        try:
            while done < len(data):
                done += os.write(self._fd, view[done:])
        except OSError as exc:
            if done:  # O_APPEND: the part written is at the end; cutting it back frees its space
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, self.size)
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None
        self.records += 1
        self.size += len(data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RecordWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
