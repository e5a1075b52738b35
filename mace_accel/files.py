"""Writing files so that nobody ever sees half of one: the one ``atomic_write`` of the project.

The data goes to a uniquely named temporary file beside the target (so two writers never share
one), is flushed and fsynced, gets the mode a plain ``open()`` would give (0666 minus the
umask, not mkstemp's 0600), and is then renamed over the target (``overwrite=True``) or linked
to it only if the target does not exist yet (``overwrite=False``: an atomic no-clobber create, so
of two writers racing for a new path exactly one wins and the other gets FileExistsError).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from pathlib import Path
from typing import IO, Iterator, Union

_UMASK_LOCK = threading.Lock()


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

    If the block raises, the temporary file is removed and ``path`` is left as it was.
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
