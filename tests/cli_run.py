"""The ``askonce`` command run in process, as the tests of its usage errors run it."""

from __future__ import annotations

import subprocess
import sys

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


def run_cli(argv: list[str], *, block: tuple[str, ...] = (), timeout: float = 30,
            stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    """The real ``askonce`` command in a subprocess; the modules in ``block`` unimportable."""
    code = (f"import sys\nfor name in {list(block)!r}:\n    sys.modules[name] = None\n"
            "from askonce.cli import main\nsys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *argv], stdout=stdout,
                          stderr=subprocess.PIPE, text=True, timeout=timeout)


def one_line_error(done: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """Assert the command ended with exit ``code`` and one line on stderr naming ``words``."""
    err = done.stderr
    assert done.returncode == code, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, err
    return err
