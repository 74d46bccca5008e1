"""A CLI that explains itself: `salaserve --help` lists every subcommand with one line each, `bench
--help` its own, every command's --help shows its defaults, and mistyped commands and flags get a
suggestion."""

import os
import subprocess
import sys

import pytest
from server_utils import REPO_ROOT

from salaserve import cli
from salaserve.argparsing import ArgumentParser, HelpFormatter
from salaserve.bench import cli as bench_cli
from salaserve.server.args import build_parser


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    """`salaserve ARGV` as a user runs it (a fresh interpreter, the console entry point's main)."""
    return subprocess.run([sys.executable, "-m", "salaserve.cli", *argv], capture_output=True, text=True,
                          timeout=120, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": REPO_ROOT})


def command_lines(help_text: str) -> dict[str, str]:
    """The `commands:` section of a command list: name -> its one line."""
    section = help_text.split("\ncommands:\n", 1)[1].split("\n\n", 1)[0]
    return dict(line.strip().split(None, 1) for line in section.splitlines())


def test_top_level_help_lists_every_subcommand_with_one_line():
    r = run_cli("--help")
    assert r.returncode == 0, r.stderr
    lines = command_lines(r.stdout)
    assert list(lines) == list(cli.COMMANDS)
    for name, summary in lines.items():
        assert summary == cli.COMMANDS[name].summary and len(summary) > 20
    assert "salaserve COMMAND --help" in r.stdout


def test_no_arguments_prints_the_command_list_and_fails():
    r = run_cli()
    assert r.returncode == 2
    assert list(command_lines(r.stderr)) == list(cli.COMMANDS)


def test_bench_help_lists_its_subcommands_not_a_docstring(capsys):
    assert cli.main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert list(command_lines(out)) == ["run", "e2e", "make-workload", "compare", "plot-micro", "report"]
    assert "main(argv)" not in out and "`bench`" not in out


def test_eval_help_names_make_synthetic(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--help"])
    assert e.value.code == 0
    assert "make-synthetic" in capsys.readouterr().out


@pytest.mark.parametrize("argv, shown", [
    (["serve"], ["--port PORT            port to listen on (default: 30000)", "(default: 64)", "(default: 8192)",
                 "(default: 127.0.0.1)", "(default: 0.88)"]),
    (["generate"], ["(default: 64)", "0: greedy (default: 0.0)"]),
    (["make-checkpoint"], ["(default: tiny)"]),
    (["prepare-model"], ["weight format (default: w4a16-gptq)", "(default: 128)"]),
    (["bench", "run"], ["comma-separated (default: S1,S8,Smax)", "(default: 900.0)", "(default: ours)"]),
    (["bench", "make-workload"], ["workload seed (default: 0)"]),
    (["eval"], ["the server (default: http://127.0.0.1:30000)", "requests in flight (default: 8)"]),
    (["eval", "make-synthetic"], ["comma-separated (default: niah,qa,cwe,fwe)"]),
    (["soar-package"], ["--quant {fp8,w4a16-rtn,w4a16-gptq}"]),
    (["sglang-shim"], ["{install,remove,status}"]),
])
def test_every_command_help_shows_its_defaults(argv, shown, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # argparse wraps at the terminal width
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # unwrapped
    for text in shown:
        assert " ".join(text.split()) in out, text


def test_serve_help_shows_every_default_even_without_help_text():
    formatter = HelpFormatter("salaserve serve", width=1000)
    for action in build_parser()._actions:
        if not HelpFormatter._shows_default(action):
            continue
        line = formatter._format_action(action)
        assert f"default: {action.default}" in line, line


def test_formatter_leaves_out_meaningless_defaults():
    p = ArgumentParser(prog="x")
    p.add_argument("--flag", action="store_true", help="a switch")
    p.add_argument("--maybe", default=None, help="unset by default")
    p.add_argument("--empty", default="", help="empty by default")
    p.add_argument("--zero", type=int, default=0)
    text = p.format_help()
    assert "a switch\n" in text and "unset by default\n" in text and "empty by default\n" in text
    assert "default: False" not in text and "default: None" not in text
    assert "default: 0" in text  # a zero is a value, not "off"


def test_mistyped_command_gets_a_suggestion():
    r = run_cli("servee")
    assert r.returncode == 2
    assert "unknown command 'servee' (did you mean 'serve'?)" in r.stderr


def test_mistyped_flag_of_any_command_gets_a_suggestion(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompt", "x", "--max-new-tokns", "3"])
    assert e.value.code == 2
    assert "--max-new-tokns: did you mean --max-new-tokens?" in capsys.readouterr().err


def test_bench_command_list_matches_its_dispatch():
    assert all(cmd.summary for cmd in bench_cli.COMMANDS.values())
    assert bench_cli.main(["--help"]) == 0
