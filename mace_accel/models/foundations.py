"""The MACE foundation models' files: ``mace_mp_file`` / ``mace_off_file``.

:func:`mace_accel.mace_mp` and :func:`mace_accel.mace_off` put them behind a calculator.

Model names, URLs and the download cache are mace's own (``mace.calculators.foundations_models``):
a model mace already downloaded is reused, and new mace releases bring their new names. A local
file path is accepted too (the way to go on a machine without network).
"""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path
from types import ModuleType
from typing import Callable, Dict, Union

from mace_accel.errors import CheckpointError, InputError

_DOWNLOAD_TIMEOUT = 120  # seconds per read


def mace_mp_file(model: Union[str, Path, None] = "medium") -> Path:
    """The local file of a MACE-MP foundation model (89 elements), downloaded if needed.

    Args:
        model: a MACE-MP name of mace's table (``"small"``, ``"medium"``, ``"large"``,
            ``"medium-mpa-0"``, ``"medium-omat-0"``, ...), an ``https://`` URL, or a local path;
            None means mace's own default (``"medium-mpa-0"``).
    """
    return _model_file(model, "medium-mpa-0", "MACE-MP", "mace_mp_urls", _fetch_mace_mp)


def mace_off_file(model: Union[str, Path, None] = "medium") -> Path:
    """The local file of a MACE-OFF23 organic force field (ASL licence), downloaded if needed.

    Args:
        model: ``"small"``, ``"medium"``, ``"large"`` (mace's table), an ``https://`` URL, or a
            local path.
    """
    return _model_file(model, "medium", "MACE-OFF", "mace_off_urls", _fetch_mace_off)


def _foundations_module() -> ModuleType:
    from mace_accel._e3nn_compat import import_mace

    import_mace()
    from mace.calculators import foundations_models

    return foundations_models


def _model_file(model: Union[str, Path, None], default: str, family: str, urls: str,
                fetch: Callable[[ModuleType, str, str], Path]) -> Path:
    """The local file of a foundation ``model``: a path as given, or a name / URL fetched.

    Args:
        model: a name of mace's table, an ``https://`` URL, a local path, or None (``default``).
        default: mace's own default name of the family.
        family: ``"MACE-MP"`` or ``"MACE-OFF"``, for messages.
        urls: the name of mace's ``{name: url}`` table in ``foundations_models``.
        fetch: ``fetch(foundations_models, name, url)`` downloads (or finds in mace's cache) the
            file and returns its path, raising :class:`CheckpointError` if it cannot.
    """
    fm = _foundations_module()
    model = default if model is None else model  # None: mace's own default
    path = _local_path(model)
    if path is not None:
        return path
    name = str(model)
    table: Dict[str, str] = getattr(fm, urls)
    _check_name(name, table, family)
    return fetch(fm, name, table.get(name, name))


def _fetch_mace_mp(fm: ModuleType, name: str, url: str) -> Path:
    """mace's own MACE-MP download (and cache)."""
    try:
        return Path(fm.download_mace_mp_checkpoint(name))
    except Exception as exc:  # network, HTTP or disk failure
        raise _download_error("MACE-MP", name, url, exc) from exc


def _fetch_mace_off(fm: ModuleType, name: str, url: str) -> Path:
    """A MACE-OFF file in mace's cache, downloaded there first if it is not yet."""
    # the cache file name mace's mace_off uses, so a model it downloaded is reused
    path = Path(fm.get_cache_dir()) / os.path.basename(url).split("?")[0]
    if not path.is_file():
        try:
            _download(url, path)
        except Exception as exc:
            raise _download_error("MACE-OFF", name, url, exc) from exc
    return path


def _local_path(model: Union[str, Path]):
    """``model`` as a Path if it names a local file, None if it is a model name or URL."""
    if isinstance(model, Path) or (isinstance(model, str) and (
            os.path.exists(model) or model.endswith((".model", ".pt")) or os.sep in model)
            and not model.startswith(("https:", "http:"))):
        path = Path(model)
        if not path.is_file():
            raise CheckpointError(f"model file {str(path)!r} does not exist; pass the path of a "
                                  "MACE .model file or one of the model names")
        return path
    if not isinstance(model, str):
        raise InputError(f"model must be a name, a URL or a path, got {type(model).__name__}")
    return None


def _check_name(name: str, urls: Dict[str, str], family: str) -> None:
    if name in urls or name.startswith("https:"):
        return
    raise InputError(f"unknown {family} model {name!r}; choose one of {sorted(urls)}, an https:// "
                     "URL, or pass the path of a local .model file")


def _download_error(family: str, name: str, url: str, exc: Exception) -> CheckpointError:
    return CheckpointError(
        f"could not download the {family} model {name!r} from {url} ({type(exc).__name__}: "
        f"{exc}). Without network access, download the file elsewhere and pass its local path, "
        f"e.g. model='/path/to/{os.path.basename(url)}'")


def _download(url: str, path: Path) -> None:
    """Stream ``url`` to ``path`` atomically (a failed download leaves no file behind)."""
    from mace_accel.files import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    with urllib.request.urlopen(url, timeout=_DOWNLOAD_TIMEOUT) as response:
        if "text/html" in str(response.headers.get("Content-Type", "")):
            raise OSError("the server answered with an HTML page, not a model file")
        with atomic_write(path, "wb") as f:
            while True:
                block = response.read(1 << 20)
                if not block:
                    break
                f.write(block)
