"""What the command-line tools share: one-line errors with exit status 2, checked numeric arguments, and output
files that appear whole or not at all."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable, NoReturn

__all__ = ["CliError", "OneLineParser", "one_line", "number", "check_writable", "write_atomic", "run_cli",
           "missing_torch"]


class CliError(Exception):
    """A user error: reported as one line on stderr, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors become :class:`CliError` (one line, not the usage text)."""

    def error(self, message: str) -> NoReturn:
        raise CliError(message)


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def number(what: str, *, integer: bool = False, low: float | None = None, high: float | None = None,
           unit: str = "") -> Callable[[str], float]:
    """An argparse ``type`` for a finite number in ``[low, high]`` (``low`` exclusive of 0 when it is 0)."""
    kind = "whole number" if integer else "number"

    def parse(text: str) -> float:
        try:
            value: float = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a {kind}{unit}, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{what} must be finite, got {text!r}")
        if low is not None and (value < low or (low == 0 and value <= 0)):
            raise argparse.ArgumentTypeError(f"{what} must be {'positive' if low == 0 else f'at least {low:g}'}, "
                                             f"got {text!r}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{what} must be at most {high:g}, got {text!r}")
        return value

    return parse


def check_writable(path: Path) -> None:
    """Raise :class:`CliError` early if ``path`` cannot be written (before any long work)."""
    if path.is_dir():
        raise CliError(f"cannot write {str(path)!r}: it is a directory")
    parent = path.parent
    if not parent.is_dir():
        raise CliError(f"cannot write {str(path)!r}: directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise CliError(f"cannot write {str(path)!r}: permission denied")


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write through a temporary file renamed into place: readers see the old file or the whole new one."""
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise CliError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None


def missing_torch(exc: BaseException) -> str | None:
    """The one line to print when ``exc`` says this Python has no PyTorch; None for any other error."""
    if not isinstance(exc, ModuleNotFoundError) or (exc.name or "").split(".")[0] != "torch":
        return None
    return (f"PyTorch is not installed for {sys.executable} (needed: {exc.name}); "
            "install it first: pip install torch==2.13.0 (the README's set-up)")


def run_cli(prog: str, run: Callable[[list[str] | None], int], argv: list[str] | None) -> int:
    """Run ``run(argv)``; a :class:`CliError`, or PyTorch missing from this Python, becomes ``prog: error: ...`` on
    stderr and status 2."""
    try:
        return run(argv)
    except CliError as exc:
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        line = missing_torch(exc)
        if line is None:
            raise
        print(f"{prog}: error: {line}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: error: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
