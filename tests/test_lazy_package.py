"""The lazy stand-in for a package's ``__init__`` (mace_accel._lazy_package): submodules import
without it, names it imports from a submodule load only that submodule, anything else (and
``import *``) runs the real ``__init__`` once; and mace's models load without mace's trainer."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from mace_accel._lazy_package import LazyPackage, install_lazy


def _package(tmp_path):
    pkg = tmp_path / "lazy_demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent("""\
        import sys
        sys.modules[__name__].__dict__.setdefault("init_runs", 0)
        init_runs += 1
        from .light import value
        from .heavy import trainer as train
        from .fit import fit
        CONSTANT = 3
        __all__ = ["value", "train", "fit", "CONSTANT"]
        """))
    (pkg / "fit.py").write_text("def fit():\n    return 'fitted'\n")
    (pkg / "light.py").write_text("value = 1\n")
    (pkg / "heavy.py").write_text("import sys\nsys.modules[__name__].loaded = True\n"
                                  "def trainer():\n    return 'trained'\n")
    return pkg


def test_names_load_their_submodule_and_the_rest_runs_init_once(tmp_path, monkeypatch):
    _package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m.startswith("lazy_demo")]:
        monkeypatch.delitem(sys.modules, name)
    assert install_lazy("lazy_demo")
    try:
        import lazy_demo
        import lazy_demo.light

        assert isinstance(lazy_demo, LazyPackage) and not install_lazy("lazy_demo")
        assert lazy_demo.light.value == 1 and "init_runs" not in vars(lazy_demo)
        assert lazy_demo.value == 1 and "lazy_demo.heavy" not in sys.modules
        assert lazy_demo.train() == "trained" and "lazy_demo.heavy" in sys.modules
        # a submodule imported first does not hide the function of its name (as after __init__)
        import lazy_demo.fit

        assert lazy_demo.fit() == "fitted" and "init_runs" not in vars(lazy_demo)
        assert lazy_demo.CONSTANT == 3 and lazy_demo.init_runs == 1
        namespace = {}
        exec("from lazy_demo import *", namespace)
        assert {"value", "train", "fit", "CONSTANT"} <= set(namespace)
        assert lazy_demo.init_runs == 1 and namespace["fit"]() == "fitted"
        try:
            lazy_demo.missing
        except AttributeError as exc:
            assert "missing" in str(exc)
        else:
            raise AssertionError("an unknown name must raise AttributeError")
    finally:
        for name in [m for m in sys.modules if m.startswith("lazy_demo")]:
            del sys.modules[name]


def test_a_package_already_imported_or_unreadable_is_left_alone():
    assert not install_lazy("json")  # imported already (by pytest)
    assert not install_lazy("no_such_package_here")


def test_maces_models_load_and_run_without_its_trainer():
    """A fresh process: mace-accel's import of mace leaves ``mace.tools.train`` (and
    torchmetrics) unimported through loading and running the bundled model; mace's own names
    under ``mace.tools`` still resolve, the trainer too when asked for."""
    code = textwrap.dedent("""\
        import sys
        from ase.build import bulk
        from mace_accel.calculator import MACEAccelCalculator
        atoms = bulk("Cu", "fcc", a=3.6, cubic=True)
        atoms.calc = MACEAccelCalculator(device="cpu")
        atoms.get_potential_energy()
        assert "mace.tools.train" not in sys.modules, "the trainer was imported"
        assert "torchmetrics" not in sys.modules
        import mace.tools
        from mace.tools import to_one_hot, torch_geometric
        assert callable(to_one_hot) and hasattr(torch_geometric, "Batch")
        from mace.tools import train
        assert callable(train) and "mace.tools.train" in sys.modules
        print("ok")
        """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]
