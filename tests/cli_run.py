"""The ``askonce`` command run in process, as the tests of its usage errors run it."""

from __future__ import annotations

import pytest

from askonce.cli import main


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's usage errors
        code = int(exit_.code or 0)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err
