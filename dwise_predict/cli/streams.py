"""The CLI's standard streams: results that survive any locale, and a stdout that cannot take them.

Tables print ρ, r̂, … and — (rich measures their columns before encoding them). Under ``LC_ALL=C``
with ``PYTHONUTF8=0``, or ``PYTHONIOENCODING=ascii`` / ``latin-1``, a character the stream's encoding
lacks is written as one ASCII look-alike of the same width (``?`` where none), so the columns stay
aligned. A stdout that is closed (``>&-``), full (``/dev/full``) or a closed pipe is one line and exit 1,
never a success with the results lost nor a traceback: the command's results went nowhere.
"""

from __future__ import annotations

import codecs
import io
import sys
import unicodedata

from dwise_predict.errors import DwiseError

ASCII_FALLBACK = "dwise-ascii"
# one column each, as the character it stands for (rich aligned the table for one column)
_LOOK_ALIKES = {"ρ": "r", "τ": "t", "λ": "l", "µ": "u", "—": "-", "–": "-", "−": "-", "→": ">", "…": ".",
                "±": "+", "×": "x", "·": ".", "≤": "<", "≥": ">", "≈": "~", "²": "2", "³": "3", "▲": "^", "▼": "v"}


class OutputStreamError(DwiseError):
    """Stdout cannot take the command's results (closed, full, a closed pipe)."""


def _ascii_look_alike(err: UnicodeEncodeError) -> tuple[str, int]:
    """Codec error handler: each character the encoding lacks as its look-alike (combining marks,
    zero columns, dropped)."""
    text = err.object[err.start:err.end]
    return "".join("" if unicodedata.combining(c) else _LOOK_ALIKES.get(c, "?") for c in text), err.end


codecs.register_error(ASCII_FALLBACK, _ascii_look_alike)


class _ResultsFile(io.FileIO):
    """Stdout's file descriptor: the first failed write is one typed error naming the reason; the
    writes after it (the rest of a table, the flush at exit) are dropped, as the failure was said."""

    failed = False

    def write(self, data) -> int:
        if self.failed:
            return len(data)
        try:
            return super().write(data)
        except OSError as err:
            self.failed = True
            raise OutputStreamError(
                f"cannot write the results to stdout ({err.strerror or err}): send them somewhere that "
                "takes them, or to /dev/null to discard them") from err


def closed_stdout_error() -> OutputStreamError | None:
    """The error for a command started with its stdout closed (``>&-``): its results would be lost."""
    if sys.stdout is not None:
        return None
    return OutputStreamError("stdout is closed, so the results would be lost: give the command a stdout "
                             "(> file, or > /dev/null to discard them)")


def open_results_stdout():
    """Put a stdout in place that writes through :class:`_ResultsFile` with the look-alike fallback;
    returns what :func:`restore_stdout` puts back. A stdout without a file descriptor (a test's
    capture) keeps its object and only gains the fallback."""
    original = sys.stdout
    try:
        fd = original.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last two
        if hasattr(original, "reconfigure"):
            original.reconfigure(errors=ASCII_FALLBACK)
        return original
    original.flush()
    sys.stdout = io.TextIOWrapper(io.BufferedWriter(_ResultsFile(fd, "w", closefd=False)),
                                  encoding=original.encoding, errors=ASCII_FALLBACK,
                                  line_buffering=original.line_buffering)
    return original


def restore_stdout(original) -> None:
    """Flush the results (a failure is the typed error) and put the original stdout back."""
    ours, sys.stdout = sys.stdout, original
    if ours is not original:
        try:
            ours.flush()
        finally:
            ours.detach()  # the descriptor stays open: it is the process's, not ours
