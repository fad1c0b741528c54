"""What every ``askonce`` command shares: one way to fail, a parser whose usage errors are one
line, and the check that an output folder can be written before any work starts."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

USAGE, FAILED = 2, 1


def fail(command: str, message: str, code: int) -> NoReturn:
    """End the command with one line on stderr, ``<command>: <message>``, and exit ``code``."""
    print(f"{command}: {message}", file=sys.stderr)
    raise SystemExit(code)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (argparse adds the usage before)."""

    def error(self, message: str) -> NoReturn:
        fail(self.prog, f"{message} (see {self.prog} --help)", USAGE)


def writable_dir(command: str, flag: str, path: str | Path) -> None:
    """Create ``path`` and check a file can be written there, before any work starts."""
    if Path(path).exists() and not Path(path).is_dir():
        fail(command, f"{flag} {path}: not a directory", USAGE)
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        fail(command, f"{flag} {path}: cannot write there ({exc.strerror or exc})", USAGE)
