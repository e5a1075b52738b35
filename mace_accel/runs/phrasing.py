"""Errors of the library, phrased for the user of a run file.

The calculator, surgery and checks say how to fix a problem in Python terms
(``backend='reference'``, ``head=...``, ``lower min_distance``). A YAML run's user sets keys in a
run file or with ``--set``; :func:`for_run_file` rewrites those fixes into the run file's terms
(``backend: reference`` in the run file, or ``--set backend=reference``), and
:func:`run_file_terms` does it to every :class:`~mace_accel.errors.MaceAccelError` raised in its
block.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

from mace_accel.errors import MaceAccelError

# Python keyword -> run-file key, where they differ
_KEYS = {"default_dtype": "dtype"}
_RUN_KEYS = ("backend", "fallback", "device", "head", "graphs", "dtype", "default_dtype",
             "verify", "deterministic", "skin", "min_distance")
# key='value', key=True/False/None, key=... : a fix written as a Python keyword argument
_ARGUMENT = re.compile(r"\b(?P<key>" + "|".join(_RUN_KEYS) + r")="
                       r"(?P<value>'[^']*'|\"[^\"]*\"|True|False|None|\.\.\.)")
_LOWER = re.compile(r"\blower (?P<key>min_distance|skin)\b(?!:)")
_FIX_WORDS = re.compile(r"\b(use|Use|choose|pass|set|or)\b")
_YAML_WORDS = {"True": "true", "False": "false", "None": "null", "...": "VALUE"}


def _yaml_value(key: str, value: str) -> str:
    value = _YAML_WORDS.get(value, value.strip("'\""))
    return "NAME" if key == "head" and value == "VALUE" else value


def for_run_file(text: str) -> str:
    """``text`` with its Python-keyword fixes written as run-file keys, and where to set them
    (the run file, or ``--set key=value``) said once at the end."""
    options = []

    def argument(match: re.Match) -> str:
        key = _KEYS.get(match["key"], match["key"])
        value = _yaml_value(key, match["value"])
        if _FIX_WORDS.search(match.string[max(0, match.start() - 40):match.start()]):
            options.append(f"--set {key}={value}")  # a fix, not the setting that failed
        return f"`{key}: {value}`"

    text = _ARGUMENT.sub(argument, text)
    if options:  # the rest of a Python choice list: "graphs=None (auto) or False"
        text = re.sub(r"\bor (True|False|None)\b",
                      lambda m: f"or {_YAML_WORDS[m[1]]}", text)
        text += f" (in the run file, or {' / '.join(dict.fromkeys(options))} on the command line)"
    return _LOWER.sub(lambda m: f"lower `{m['key']}:` in the run file (or --set {m['key']}=...)",
                      text)


@contextlib.contextmanager
def run_file_terms() -> Iterator[None]:
    """Re-raise a :class:`MaceAccelError` of the block with its fix in run-file terms (same
    class; the message unchanged where it holds no Python-keyword fix)."""
    try:
        yield
    except MaceAccelError as exc:
        text = str(exc)
        phrased = for_run_file(text)
        if phrased == text:
            raise
        try:
            replacement = type(exc)(phrased)
        except Exception:  # an error class with another constructor: keep it as it is
            raise exc from None
        raise replacement from None
