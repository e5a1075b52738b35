"""A package whose ``__init__`` runs only when one of its own names is asked for.

``mace/tools/__init__.py`` imports mace's trainer (``mace.tools.train``: torchmetrics, and with
it transformers, torchvision and scikit-learn where they are installed), argument parsers and
fine-tuning helpers. ``mace.modules`` needs none of them: it imports ``mace.tools.scatter``,
``mace.tools.cg`` and a few other submodules, and two names (``to_numpy``, ``TensorDict``). Yet
importing any submodule runs the package's ``__init__`` first: 5.8-10.9 s of a cold start on an
H200 host went to torchmetrics alone (docs/performance.md, "Cold start").

:func:`install_lazy` puts a stand-in for the package in ``sys.modules`` before anything imports
it: the same ``__path__`` (so submodules import as before) and, for every name its
``__init__`` imports from a submodule (read from the source with :mod:`ast`, not run), that
submodule imported when the name is first read. Any other name runs the real ``__init__`` in
the stand-in's namespace once, after which the package is what it would have been. The objects
are mace's own either way.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import types
from typing import Callable, Dict, Optional, Tuple


class LazyPackage(types.ModuleType):
    """The stand-in :func:`install_lazy` makes (see the module docstring)."""

    # name -> (submodule, its attribute the name is; None: the submodule itself)
    _lazy_names: Dict[str, Tuple[str, Optional[str]]]
    _lazy_init: Optional[Callable[[], None]]

    def __getattr__(self, name: str):
        if name.startswith("__") and name != "__all__":  # __all__: for `import *`
            raise AttributeError(name)
        found = self.__dict__["_lazy_names"].get(name)
        if found is not None:
            submodule, attribute = found
            module = importlib.import_module(f"{self.__name__}.{submodule}")
            value = module if attribute is None else getattr(module, attribute)
            object.__setattr__(self, name, value)
            return value
        run_init = self.__dict__["_lazy_init"]
        if run_init is None:
            raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")
        run_init()
        return getattr(self, name)

    def __setattr__(self, name: str, value) -> None:
        # the import system binds each submodule imported to its parent; where the real
        # __init__ binds that name to something else (mace.tools.train: the function, not the
        # module), keep the name for __getattr__ to resolve as the __init__ would
        found = self.__dict__.get("_lazy_names", {}).get(name)
        if found is not None and found[1] is not None and isinstance(value, types.ModuleType) \
                and value.__name__ == f"{self.__name__}.{name}":
            return
        object.__setattr__(self, name, value)


def install_lazy(package: str) -> bool:
    """Stand in for ``package`` (see the module docstring) unless it is imported already or its
    ``__init__`` cannot be read; True where the stand-in was installed."""
    if package in sys.modules:
        return False
    try:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None or spec.submodule_search_locations is None:
            return False
        with open(spec.origin, encoding="utf-8") as fh:
            source = fh.read()
        tree = ast.parse(source, spec.origin)
    except (ImportError, OSError, SyntaxError, ValueError):
        return False
    if package in sys.modules:  # finding it imported its parent, which imported it
        return False
    names: Dict[str, Tuple[str, Optional[str]]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            for alias in node.names:
                if alias.name != "*":  # from .m import a [as b]; from . import m [as b]
                    names[alias.asname or alias.name] = ((node.module, alias.name) if node.module
                                                         else (alias.name, None))
    module = LazyPackage(package)
    module.__spec__, module.__file__ = spec, spec.origin
    module.__path__ = list(spec.submodule_search_locations)
    module.__package__ = package
    module.__loader__ = spec.loader
    module._lazy_names = names

    def run_init() -> None:  # the real __init__, once, in the stand-in's namespace
        module._lazy_init = None
        exec(compile(source, spec.origin, "exec"), module.__dict__)

    module._lazy_init = run_init
    sys.modules[package] = module
    parent, _, child = package.rpartition(".")
    if parent and parent in sys.modules:
        setattr(sys.modules[parent], child, module)
    return True
