"""YAML run configs: validation at every level, path resolution, overrides."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from mace_accel.errors import ConfigError, MaceAccelError
from mace_accel.runs.config import (
    GeomOptOptions,
    MDOptions,
    RunConfig,
    SinglePointOptions,
    apply_overrides,
    load_run_config,
    parse_override,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "s.xyz").write_text("1\n\nCu 0 0 0\n")
    return tmp_path


def write(run_dir: Path, data, name: str = "run.yaml") -> Path:
    path = run_dir / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_minimal_run_resolves_paths_and_defaults(run_dir):
    (run_dir / "sub").mkdir()
    path = write(run_dir / "sub", {"task": "md", "struct": "../s.xyz", "md": {"steps": 7}},
                 name="nve.yaml")
    cfg = load_run_config(path)
    assert cfg.struct == (run_dir / "s.xyz").resolve()
    assert cfg.outputs == (run_dir / "sub" / "nve-results").resolve()
    assert cfg.model is None and cfg.model_path.name.endswith(".model")
    assert cfg.device == "auto" and cfg.backend == "auto"  # as the calculator's defaults
    assert cfg.deterministic is True and cfg.frame is None and cfg.min_distance == 0.5
    assert cfg.md.steps == 7 and cfg.md.timestep == 1.0 and isinstance(cfg.md.timestep, float)
    dumped = cfg.to_dict()
    assert "geomopt" not in dumped and dumped["md"]["steps"] == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.md.steps = 3  # type: ignore[misc]


def test_case_insensitive_choices_are_canonicalised(run_dir):
    cfg = load_run_config(write(run_dir, {"task": "geomopt", "struct": "s.xyz", "dtype": "Float64",
                                          "geomopt": {"optimizer": "lbfgs"}}))
    assert cfg.dtype == "float64" and cfg.geomopt.optimizer == "LBFGS"


@pytest.mark.parametrize("raw, section", [
    ({"task": "md", "struct": "s.xyz", "temprature": 300}, None),
    ({"task": "md", "struct": "s.xyz", "md": {"temp": 300}}, MDOptions),
    ({"task": "geomopt", "struct": "s.xyz", "geomopt": {"max_steps": 3}}, GeomOptOptions),
    ({"task": "singlepoint", "struct": "s.xyz", "singlepoint": {"props": ["energy"]}},
     SinglePointOptions),
])
def test_unknown_keys_list_the_valid_keys(run_dir, raw, section):
    with pytest.raises(ConfigError) as err:
        load_run_config(write(run_dir, raw))
    msg = str(err.value)
    bad = next(k for k in (raw if section is None else raw[section.SECTION])
               if k not in ("task", "struct"))
    assert repr(bad) in msg
    for key in (section or RunConfig).keys():
        assert key in msg


# more bad values (negative steps, a timestep not a number, a negative temperature, an unknown
# ensemble or optimizer or property, seeds out of range, bad device, dtype, backend, min_distance)
# are test_bad_input.py's RUN_CASES, through the command line
@pytest.mark.parametrize("raw, key", [
    ({"md": {"steps": 2.5}}, "md.steps"),
    ({"md": {"steps": True}}, "md.steps"),
    ({"md": {"timestep": 0}}, "md.timestep"),
    ({"md": {"timestep": -0.5}}, "md.timestep"),
    ({"md": {"ensemble": "nvt", "friction": 0}}, "md.friction"),
    ({"md": {"ensemble": "npt", "temperature": 0}}, "md.temperature"),
    ({"md": {"ensemble": "npt", "taup": 0}}, "md.taup"),
    ({"md": {"stats_every": 0}}, "md.stats_every"),
    ({"md": {"timestep": float("nan")}}, "md.timestep"),
    ({"verify": "yes"}, "verify"),
    ({"struct": 3}, "struct"),
])
def test_bad_md_values_name_the_key(run_dir, raw, key):
    data = {"task": "md", "struct": "s.xyz", **raw}
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_run_config(write(run_dir, data))


@pytest.mark.parametrize("raw, key", [
    ({"geomopt": {"fmax": 0}}, "geomopt.fmax"),
    ({"geomopt": {"fmax": -0.1}}, "geomopt.fmax"),
    ({"geomopt": {"steps": -5}}, "geomopt.steps"),
    ({"geomopt": {"relax_cell": 1}}, "geomopt.relax_cell"),
])
def test_bad_geomopt_values_name_the_key(run_dir, raw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_run_config(write(run_dir, {"task": "geomopt", "struct": "s.xyz", **raw}))


@pytest.mark.parametrize("props, match", [
    ([], "at least one"), (["energy", "energy"], "twice"),
])
def test_bad_singlepoint_properties(run_dir, props, match):
    with pytest.raises(ConfigError, match=match):
        load_run_config(write(run_dir, {"task": "singlepoint", "struct": "s.xyz",
                                        "singlepoint": {"properties": props}}))


def test_errors_are_mace_accel_errors_and_value_errors():
    assert issubclass(ConfigError, MaceAccelError) and issubclass(ConfigError, ValueError)


def test_overrides_set_nested_keys_before_validation(run_dir):
    path = write(run_dir, {"task": "md", "struct": "s.xyz", "md": {"steps": 1000}})
    cfg = load_run_config(path, {"md.steps": 3, "device": "cpu", "md.ensemble": "nvt"})
    assert (cfg.md.steps, cfg.device, cfg.md.ensemble) == (3, "cpu", "nvt")
    with pytest.raises(ConfigError, match="md.steps"):
        load_run_config(path, {"md.steps": -3})
    with pytest.raises(ConfigError, match="'stepz'"):
        load_run_config(path, {"md.stepz": 3})


def test_apply_overrides_does_not_touch_its_input():
    raw = {"md": {"steps": 1}}
    assert apply_overrides(raw, {"md.steps": 2, "geomopt.fmax": 0.1}) == {
        "md": {"steps": 2}, "geomopt": {"fmax": 0.1}}
    assert raw == {"md": {"steps": 1}}
    with pytest.raises(ConfigError, match="not a section"):
        apply_overrides({"device": "cpu"}, {"device.x": 1})


@pytest.mark.parametrize("text, expected", [
    ("md.steps=5", ("md.steps", 5)), ("device=cpu", ("device", "cpu")),
    ("progress=false", ("progress", False)), ("md.timestep=0.5", ("md.timestep", 0.5)),
    ("singlepoint.properties=[energy, forces]", ("singlepoint.properties", ["energy", "forces"])),
    ("head=", ("head", None)),
])
def test_parse_override(text, expected):
    assert parse_override(text) == expected


def test_parse_override_rejects_malformed():
    """An empty key (no '=' and bad YAML: test_bad_input.py's RUN_CASES)."""
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_override("=5")


def test_python_construction_is_validated_too():
    with pytest.raises(ConfigError, match="md.timestep"):
        MDOptions(timestep=-1.0)
    with pytest.raises(ConfigError, match="geomopt.fmax"):
        GeomOptOptions(fmax=0.0)
    cfg = RunConfig(task="md", struct=Path("x.xyz"), device="cpu", md=MDOptions(steps=5))
    assert cfg.outputs == Path("md-results") and cfg.md.steps == 5


@pytest.mark.parametrize("name", ["singlepoint", "geomopt", "md_nve", "md_langevin", "md_npt"])
def test_example_configs_are_valid(name):
    cfg = load_run_config(CONFIGS / f"{name}.yaml")
    assert cfg.model is None, "examples use the bundled model"
    assert cfg.struct.is_file() and cfg.struct.parent.name == "structures"
    assert cfg.task == name.split("_")[0]


def test_path_overrides_resolve_against_the_given_base(run_dir, tmp_path_factory):
    path = write(run_dir, {"task": "md", "struct": "s.xyz"})
    elsewhere = tmp_path_factory.mktemp("cwd")
    (elsewhere / "other.xyz").write_text("1\n\nNi 0 0 0\n")
    cfg = load_run_config(path, {"struct": "other.xyz", "outputs": "out"}, overrides_base=elsewhere)
    assert cfg.struct == (elsewhere / "other.xyz").resolve()
    assert cfg.outputs == (elsewhere / "out").resolve()
    with pytest.raises(ConfigError, match="no such file"):  # default base: the run file's dir
        load_run_config(path, {"struct": "other.xyz"})


def test_yaml_1_1_numbers_are_read_as_numbers(run_dir):
    """PyYAML reads ``1e3`` (no dot) as a string; a float key takes it as the number 1000."""
    text = ("task: md\nstruct: s.xyz\nmd:\n  temperature: 1e3\n  timestep: 5E-1\n"
            "  steps: 1e3\n  pressure: 1_000.5\n")
    raw = yaml.safe_load(text)
    assert raw["md"]["temperature"] == "1e3"  # what PyYAML gives
    cfg = load_run_config(write(run_dir, text))
    assert (cfg.md.temperature, cfg.md.timestep, cfg.md.steps, cfg.md.pressure) == (
        1000.0, 0.5, 1000, 1000.5)
    assert isinstance(cfg.md.steps, int)
    cfg = load_run_config(write(run_dir, {"task": "md", "struct": "s.xyz"}),
                          dict([parse_override("md.timestep=2e0"),
                                parse_override("md.steps=1e2")]))
    assert cfg.md.timestep == 2.0 and cfg.md.steps == 100


@pytest.mark.parametrize("key, value, match", [
    ("temperature", "nan", "finite number"), ("temperature", ".inf", "finite number"),
    ("temperature", "hot", "finite number"), ("steps", "1.5e0", "integer"),
    ("steps", "1e400", "integer"), ("steps", "ten", "integer"),
])
def test_numeric_strings_that_are_not_valid_numbers(run_dir, key, value, match):
    with pytest.raises(ConfigError, match=f"md.{key} must be .*{match}"):
        load_run_config(write(run_dir, f"task: md\nstruct: s.xyz\nmd:\n  {key}: {value}\n"))


def test_deterministic_frame_and_min_distance_keys(run_dir):
    cfg = load_run_config(write(run_dir, {"task": "md", "struct": "s.xyz", "frame": -1,
                                          "deterministic": False, "min_distance": 0.3}))
    assert cfg.frame == -1 and cfg.deterministic is False and cfg.min_distance == 0.3
    assert cfg.to_dict()["deterministic"] is False
    for raw, key in (({"deterministic": "no"}, "deterministic"), ({"frame": 0.5}, "frame")):
        with pytest.raises(ConfigError, match=key):
            load_run_config(write(run_dir, {"task": "md", "struct": "s.xyz", **raw}))

