"""Progress of a long command as lines on stderr when stderr is not a terminal.

Under nohup, in CI or in a Slurm log no bar is drawn, and a command silent for minutes looks hung.
Off a terminal a long command (``collect``, ``train``, ``evaluate``, ``simulate``) writes a line as
each stage starts and, within a stage, one every :data:`LOG_EVERY_S` seconds or
:data:`LOG_EVERY_SHARE` of its work, the first and the last; on a terminal these lines are not
written (the command draws its bar there). Lines go to stderr: stdout holds results only, the same
either way.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from dwise_predict.cli.options import log

LOG_EVERY_S = 30.0
LOG_EVERY_SHARE = 0.1


class ProgressLines:
    """``label: ...`` lines on stderr off a terminal, each kind throttled as the module says.

    ``clock`` gives seconds (a test passes its own); a caller that measures its own elapsed time
    passes it to :meth:`count` instead.
    """

    def __init__(self, label: str, clock: Callable[[], float] = time.monotonic):
        self.label = label
        self.on = not sys.stderr.isatty()
        self.clock = clock
        self.started = clock()
        self.counted: tuple[float, int] | None = None  # (elapsed_s, done) at the last counted line
        self.ticked = 0.0  # elapsed_s at the last line of any kind

    def elapsed_s(self) -> float:
        return self.clock() - self.started

    def due(self, done: int, total: int, elapsed_s: float) -> bool:
        """Whether a line for ``done`` of ``total`` is due: the first, the last (once), and then
        whenever :data:`LOG_EVERY_S` seconds or :data:`LOG_EVERY_SHARE` of ``total`` have passed
        since the last counted line."""
        if self.counted is None or done >= total:
            return self.counted is None or self.counted[1] < done
        since_s, since_done = elapsed_s - self.counted[0], done - self.counted[1]
        return since_s >= LOG_EVERY_S or since_done >= max(1, round(LOG_EVERY_SHARE * total))

    def count(self, done: int, total: int, text: str, elapsed_s: float | None = None) -> None:
        """``label: text`` for ``done`` of ``total`` units of work, when :meth:`due`."""
        elapsed_s = self.elapsed_s() if elapsed_s is None else elapsed_s
        if self.on and self.due(done, total, elapsed_s):
            self.counted = (elapsed_s, done)
            self._write(text, elapsed_s)

    def stage(self, text: str) -> None:
        """``label: text`` now: a stage begins (a few per command, each worth a line)."""
        if self.on:
            self._write(text, self.elapsed_s())

    def tick(self, text: str) -> None:
        """``label: text`` when :data:`LOG_EVERY_S` seconds have passed since the last line: work whose
        length is not known ahead (epochs until early stopping)."""
        elapsed_s = self.elapsed_s()
        if self.on and elapsed_s - self.ticked >= LOG_EVERY_S:
            self._write(text, elapsed_s)

    def _write(self, text: str, elapsed_s: float) -> None:
        self.ticked = elapsed_s
        log(f"{self.label}: {text}")
