"""The paths ``tangram`` commands read and write, checked while the arguments are parsed.

A run can take minutes (``tangram bench``) or a sweep of simulations; an output path that
cannot be written should cost nothing, so every one is checked before anything starts,
and argparse turns the complaint into a usage error (exit code 2). ``-`` stands for
standard input or output wherever a file is read or written, as in most Unix tools.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

__all__ = ["PLOT_FORMATS", "STDIO", "input_file", "output_dir", "output_file", "plot_file"]

STDIO = "-"
"""The name that stands for standard input (where read) or standard output (where written)."""

PLOT_FORMATS = ("png", "svg", "pdf")
"""The figure formats matplotlib writes without extra packages, chosen by the extension."""


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def input_file(text: str) -> Path | str:
    """A file to read, or :data:`STDIO`; it must exist and be readable now."""
    if text == STDIO:
        return STDIO
    path = Path(text)
    try:
        with path.open("rb"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {text}: {_reason(exc)}") from None
    return path


def output_file(text: str) -> Path | str:
    """A file to write, or :data:`STDIO`; opening it for writing must work now.

    The probe opens in append mode (an existing file keeps its bytes until the command
    writes it) and removes a file it created, so a run that fails leaves nothing behind.
    """
    if text == STDIO:
        return STDIO
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text}: it is a directory")
    existed = path.exists()
    try:
        with path.open("ab"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text}: {_reason(exc)}") from None
    if not existed:
        path.unlink()
    return path


def plot_file(text: str) -> Path | str:
    """:func:`output_file` whose extension names a format in :data:`PLOT_FORMATS`.

    ``-`` writes a PNG to standard output.
    """
    if text != STDIO and plot_format(text) not in PLOT_FORMATS:
        suffix = Path(text).suffix or "no extension"
        raise argparse.ArgumentTypeError(
            f"cannot tell the figure format of {text} ({suffix}): end it in "
            + ", ".join(f".{name}" for name in PLOT_FORMATS)
        )
    return output_file(text)


def plot_format(path: Path | str) -> str:
    """The format a plot path asks for: its extension, lower case; PNG for standard output."""
    return "png" if path == STDIO else Path(path).suffix.lower().removeprefix(".")


def output_dir(text: str) -> Path:
    """A directory to write files into: existing and writable, or creatable.

    Nothing is created here: the nearest existing ancestor must be a writable directory.
    """
    if text == STDIO:
        raise argparse.ArgumentTypeError("names a directory; `-` (standard output) is not one")
    path = Path(text)
    if path.exists():
        if not path.is_dir():
            raise argparse.ArgumentTypeError(f"cannot write into {text}: not a directory")
        try:
            with tempfile.TemporaryFile(dir=path):
                pass
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"cannot write into {text}: {_reason(exc)}") from None
        return path
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise argparse.ArgumentTypeError(f"cannot create {text}: {ancestor} is not a directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot create {text}: {ancestor} is not writable")
    return path
