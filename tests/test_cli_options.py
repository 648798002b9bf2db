"""The command line's vocabulary: every option documented, shared options meaning the same in every
command, one parser per idea (block-size lists, dtypes), one-line usage errors, `--version`, and
the light public imports."""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys

import pytest

import blockpilot
from blockpilot.cli import build_parser, main
from blockpilot.commands.common import parse_block_sizes, parse_dtype
from blockpilot.errors import UserError

SHARED = ("--device", "--dtype", "--block-sizes", "--backend")


def subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.option_strings[-1]: a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS}


def run_cli(argv, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---------------------------------------------------------------- help


def test_every_command_is_registered():
    assert set(subcommands()) == {"generate", "demo", "answer", "train-drafter", "label", "train-predictor",
                                  "build", "profile", "serve"}


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_every_option_of_every_command_has_help_text(command, capsys):
    code, out, _ = run_cli([command, "--help"], capsys)
    assert code == 0 and out.startswith(f"usage: blockpilot {command}")
    for flag, action in options(subcommands()[command]).items():
        assert action.help and action.help.strip(), f"{command} {flag} has no help"
        assert flag in out


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_help_shows_every_default_that_is_set(command):
    parser = subcommands()[command]
    formatter = parser._get_formatter()
    for flag, action in options(parser).items():
        if action.default not in (None, False, [], ()) and not isinstance(action, argparse._HelpAction):
            shown = formatter._expand_help(action)
            assert "default" in shown and (str(action.default) in shown or "default" in action.help), (command, flag)


def test_minutes_are_named_as_the_unit_of_every_time_option():
    for command, flag in (("train-drafter", "--time-budget"), ("train-drafter", "--eval-every"),
                          ("train-drafter", "--checkpoint-every"), ("answer", "--time-budget")):
        assert "minutes" in options(subcommands()[command])[flag].help, (command, flag)


def test_profile_help_lists_every_named_prompt_set():
    from blockpilot.assets.prompts import DATASET_NAMES

    help_text = options(subcommands()["profile"])["--dataset"].help
    assert all(name in help_text for name in DATASET_NAMES)


def test_shared_options_mean_the_same_in_every_command():
    seen: dict[str, list[tuple[str, argparse.Action]]] = {flag: [] for flag in SHARED}
    for command, parser in subcommands().items():
        for flag, action in options(parser).items():
            if flag in seen:
                seen[flag].append((command, action))
    assert {c for c, _ in seen["--device"]} >= {"generate", "demo", "profile", "label", "answer", "train-drafter"}
    assert {c for c, _ in seen["--block-sizes"]} == {"build", "label", "profile", "train-predictor"}
    for command, action in seen["--device"]:
        assert action.default == "auto" and action.help == seen["--device"][0][1].help, command
    for command, action in seen["--dtype"]:
        assert action.type("bfloat16") == "bf16" and action.type("fp16") == "fp16", command
        with pytest.raises(argparse.ArgumentTypeError):
            action.type("fp8")
    for command, action in seen["--block-sizes"]:
        assert action.type("6-8,10") == (6, 7, 8, 10), command
    for command, action in seen["--backend"]:
        assert tuple(action.choices) == ("torch", "onnxruntime", "tensorrt"), command


def test_no_command_spells_a_block_size_list_otherwise():
    for command, parser in subcommands().items():
        flags = options(parser)
        assert "--candidates" not in flags, command
        if "--block-size" in flags:  # one value: N or auto (generate, demo), or B_train (train-drafter)
            single = flags["--block-size"]
            assert single.metavar == "N|auto" or (single.type is int and single.nargs is None), command


def test_backend_names_are_the_runtimes():
    from blockpilot.commands.common import BACKENDS
    from blockpilot.runtime.engine_dir import BACKENDS as RUNTIME_BACKENDS

    assert BACKENDS == RUNTIME_BACKENDS


# ---------------------------------------------------------------- parsers


def test_block_size_lists_mix_ranges_and_commas():
    assert parse_block_sizes("6-8,10") == (6, 7, 8, 10)
    assert parse_block_sizes("10, 6-7, 7") == (6, 7, 10)
    assert parse_block_sizes("8") == (8,)
    assert parse_block_sizes("oracle,6-7,auto", ("auto", "sweep", "oracle")) == (6, 7, "oracle", "auto")


@pytest.mark.parametrize("text, needle", [
    ("", "an empty entry"), ("6,,8", "an empty entry"), ("eight", "'eight'"), ("8-6", "'8-6'"),
    ("0", "'0'"), ("-2", "'-2'"), ("6-", "'6-'"), ("auto", "'auto'"),
])
def test_bad_block_size_lists_are_user_errors_that_name_the_part(text, needle):
    with pytest.raises(UserError) as caught:
        parse_block_sizes(text)
    assert needle in str(caught.value) and "6-8,10" in str(caught.value)


def test_dtypes_have_one_set_of_names_with_torch_aliases():
    assert [parse_dtype(n) for n in ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16")] == \
        ["fp32", "fp32", "bf16", "bf16", "fp16", "fp16"]
    with pytest.raises(UserError, match="fp32, bf16, fp16"):
        parse_dtype("half")


# ---------------------------------------------------------------- usage errors


@pytest.mark.parametrize("argv, needle", [
    (["label", "--out", "x"], "one of the arguments --prompts --replay-answers is required"),
    (["generate"], "one of the arguments --prompt --prompts-file is required"),
    (["build", "--out", "x", "--block-sizes", "6-x"], "argument --block-sizes: block sizes '6-x'"),
    (["generate", "--prompt", "hi", "--dtype", "fp8"], "argument --dtype: dtype 'fp8'"),
    (["generate", "--prompt", "hi", "--backend", "vllm"], "argument --backend: invalid choice"),
    (["generate", "--prompt", "hi", "--lookup", "sometimes"], "argument --lookup: invalid choice"),
    (["profile", "--dataset", "humaneval", "--out", "x", "--lookup", "greedy,sometimes"],
     "argument --lookup: lookup values 'greedy,sometimes'"),
])
def test_usage_errors_are_one_line_exit_2_naming_the_flag(argv, needle, capsys):
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err, err
    assert err.startswith(f"blockpilot {argv[0]}: error: ") and f"blockpilot {argv[0]} --help" in err


def test_version_is_the_installed_distributions(capsys):
    code, out, _ = run_cli(["--version"], capsys)
    assert code == 0 and out.strip() == f"blockpilot {blockpilot.__version__}"
    assert blockpilot.__version__ == importlib.metadata.version("blockpilot")


# ---------------------------------------------------------------- public imports


def test_runner_is_importable_from_the_package_and_the_runtime():
    from blockpilot import Runner
    from blockpilot.runtime import Runner as RuntimeRunner
    from blockpilot.runtime.runner import Runner as ModuleRunner

    assert Runner is RuntimeRunner is ModuleRunner
    with pytest.raises(AttributeError, match="no attribute 'Runnr'"):
        blockpilot.Runnr  # noqa: B018


def test_importing_the_package_and_building_the_cli_stays_light():
    code = ("import sys, blockpilot, blockpilot.runtime; from blockpilot.cli import build_parser; build_parser(); "
            "heavy = [m for m in ('torch', 'transformers', 'onnxruntime', 'tensorrt') if m in sys.modules]; "
            "print(heavy); from blockpilot import Runner; print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split("\n")[:2] == ["[]", "True"], result.stdout + result.stderr


@pytest.mark.parametrize("command", sorted(subcommands()))
def test_every_number_option_refuses_nan_and_infinity_in_one_line(command, capsys):
    from blockpilot.commands.common import finite_float

    numbers = {flag: action for flag, action in options(subcommands()[command]).items() if action.type is not None
               and getattr(action.type, "__name__", "") in ("float", "finite_float")}
    assert all(action.type is finite_float for action in numbers.values()), numbers  # no bare float left
    for flag in numbers:
        for value in ("nan", "inf", "-inf"):
            code, out, err = run_cli([command, f"{flag}={value}"], capsys)  # "=": "-inf" is no option
            lines = err.strip().splitlines()
            assert code == 2 and out == "" and len(lines) == 1, (flag, value, err)
            assert f"argument {flag}: '{value}' is not a finite number" in lines[0], lines[0]


@pytest.mark.parametrize("argv", [
    ["build", "--out", "{file}/engine"],
    ["label", "--prompts", "p.jsonl", "--out", "{file}/labels"],
    ["profile", "--dataset", "humaneval", "--out", "{file}/report"],
    ["train-drafter", "--answers", "a.jsonl", "--time-budget", "1", "--out", "{file}/drafter"],
    ["train-drafter", "--answers", "a.jsonl", "--time-budget", "1", "--out", "d", "--work-dir", "{file}/work"],
    ["train-predictor", "--dataset", "labels", "--out", "{file}/sub/predictor.onnx"],
    ["answer", "--prompts", "p.jsonl", "--out", "{file}/answers.jsonl"],
])
def test_an_output_path_through_a_file_is_one_line_before_any_work(argv, tmp_path, capsys):
    notes = tmp_path / "notes"
    notes.write_text("a file, not a folder")
    argv = [a.format(file=notes) for a in argv]
    code, out, err = run_cli(argv, capsys)
    flag = argv[argv.index(next(a for a in argv if a.startswith(str(notes)))) - 1]
    assert code == 2 and out == "" and err.strip().splitlines() == [
        f"blockpilot {argv[0]}: error: {flag} {argv[argv.index(flag) + 1]}: {notes} is a file, not a folder; "
        f"choose another {flag}"], err
