"""The ``askonce`` front end: ``--version``, no command, and argparse's errors as one line."""

from __future__ import annotations

from askonce import __version__
from cli_run import one_line_error, run_cli


def test_version_prints_the_version() -> None:
    done = run_cli(["--version"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"askonce {__version__}"


def test_no_command_prints_the_help_and_is_a_usage_error() -> None:
    done = run_cli([])
    one_line_error(done, 2, "a command is required", "demo", "simulate", "report", "audit")
    assert "usage:" in done.stdout and "--version" in done.stdout


def test_an_unknown_command_is_one_line() -> None:
    one_line_error(run_cli(["deploy"]), 2, "invalid choice", "--help")
