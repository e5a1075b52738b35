"""``mace-accel bench`` from the main CLI on a CPU: CPU-sized defaults that it announces, an
honest message when interrupted, and output-folder problems as one error line."""

from __future__ import annotations

import argparse

import pytest
import torch

from mace_accel import cli
from mace_accel.bench import cli as bench_cli
from mace_accel.bench.cli import CPU_DEFAULTS, GPU_DEFAULTS, add_bench_parser, config_from_args
from mace_accel.bench.report import JSON_NAME
from mace_accel.models.architectures import small_test_model


@pytest.fixture(autouse=True)
def _restore_default_dtype():
    saved = torch.get_default_dtype()
    yield
    torch.set_default_dtype(saved)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "tiny.model"
    torch.save(small_test_model("RealAgnosticResidualInteractionBlock", elements=(28, 29)), path)
    return path


def _parse(*argv):
    parser = argparse.ArgumentParser(prog="mace-accel")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def test_cpu_gets_cpu_sized_defaults_and_given_options_are_kept():
    config = config_from_args(_parse("--device", "cpu"))
    assert (list(config.dtypes), list(config.sizes), config.warmup, config.repeats) == (
        CPU_DEFAULTS["dtypes"], CPU_DEFAULTS["sizes"], CPU_DEFAULTS["warmup"],
        CPU_DEFAULTS["repeats"])
    assert max(config.sizes) < 200 and GPU_DEFAULTS["sizes"][-1] == 6912
    config = config_from_args(_parse("--device", "cpu", "--sizes", "500", "--repeats", "7"))
    assert list(config.sizes) == [500] and config.repeats == 7 and config.warmup == 1


def test_cpu_run_says_what_it_will_run(model_file, tmp_path, capsys, monkeypatch):
    seen = {}

    def fake_run_bench(config, sources, log, on_update, environment):
        seen["config"] = config
        raise KeyboardInterrupt  # stop before any measurement

    monkeypatch.setattr("mace_accel.bench.runner.run_bench", fake_run_bench)
    out = tmp_path / "bench_out"
    code = cli.main(["bench", "--device", "cpu", "--models", str(model_file), "--out", str(out)])
    stdout, err = capsys.readouterr()
    assert "note: benchmarking on the CPU" in err and "32, 108 atoms" in err
    assert "CPU-sized defaults" in err and "would take hours" in err
    assert "note" not in stdout  # notes go to stderr
    assert list(seen["config"].sizes) == [32, 108]
    # interrupted before any measurement: no claim that files were kept, and no empty folder
    assert code == 130
    assert err.strip().splitlines()[-1] == ("error: interrupted; nothing was written (no "
                                            "measurement had finished)")
    assert not out.exists()


def test_large_cpu_sizes_come_with_a_time_warning():
    args = _parse("--device", "cpu", "--sizes", "6912")
    note = bench_cli.cpu_plan_note(config_from_args(args), args)
    assert "6912 atoms" in note and "--time-limit" in note and "minutes" in note


def test_interrupted_bench_points_to_the_results_so_far(model_file, tmp_path, capsys,
                                                        monkeypatch):
    from mace_accel.bench.runner import BenchResult

    def one_record_then_ctrl_c(config, sources, log, on_update, environment):
        on_update(BenchResult(config.to_dict(), {}))  # writes bench.json
        raise KeyboardInterrupt

    monkeypatch.setattr("mace_accel.bench.runner.run_bench", one_record_then_ctrl_c)
    out = tmp_path / "bench_out"
    code = cli.main(["bench", "--device", "cpu", "--models", str(model_file), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 130
    assert err.strip().splitlines()[-1] == (f"error: interrupted; the results measured so far "
                                            f"are in {out / JSON_NAME}")
    assert (out / JSON_NAME).is_file()


def test_out_that_is_a_file_is_one_error_line(model_file, tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    code = cli.main(["bench", "--device", "cpu", "--models", str(model_file),
                     "--out", str(a_file)])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [
        f"error: --out folder {str(a_file)!r} is a file, not a folder; "
        "choose another folder with --out DIR"]


@pytest.mark.parametrize("value,message", [
    ("0", "error: --train-size must be a positive atom count, got 0"),
    ("-5", "error: --train-size must be a positive atom count, got -5"),
    ("many", "error: argument --train-size: invalid int value: 'many'; see mace-accel bench "
             "--help")])
def test_bad_train_size_is_one_error_line(model_file, tmp_path, capsys, value, message):
    try:
        code = cli.main(["bench", "--device", "cpu", "--models", str(model_file), "--train",
                         "--train-size", value, "--out", str(tmp_path / "o")])
    except SystemExit as exc:  # argparse's own errors exit (one line, through cli._Parser)
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines() == [message]
    assert not (tmp_path / "o").exists()


def test_train_options_reach_the_config():
    config = config_from_args(_parse("--device", "cpu", "--train", "--train-size", "500",
                                     "--train-steps", "4", "--train-warmup", "0"))
    assert (config.train, config.train_size, config.train_steps, config.train_warmup) == (
        True, 500, 4, 0)
    config = config_from_args(_parse("--device", "cpu"))
    assert (config.train, config.train_size, config.train_steps, config.train_warmup) == (
        False, 864, 10, 3)
