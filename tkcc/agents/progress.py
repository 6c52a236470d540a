"""A campaign's progress on stderr: a redrawn bar on a terminal, whole lines anywhere else.

stdout stays one JSON object under ``--json``; a pipe or a log file gets no carriage-return frames.
"""
from __future__ import annotations

import sys
import time


def progress_writer(desc: str, progress, stream=None):
    """(line writer, bar) for ``progress``: a callable is the writer itself (no bar), False is neither; True
    writes to ``stream`` (stderr): a tqdm bar on a terminal, ``LineProgress`` on anything else."""
    if callable(progress):
        return progress, None
    if not progress:
        return None, None
    stream = stream or sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()):
        bar = LineProgress(desc, stream)
        return bar.write, bar
    from tqdm import tqdm

    bar = tqdm(desc=desc, unit="exp", dynamic_ncols=True, file=stream)
    return (lambda msg: bar.write(msg, file=stream)), bar


class LineProgress:
    """The progress bar's interface (``update``, ``set_postfix_str``, ``write``, ``close``) written as whole
    lines: the count and the latest state at most every ``every_s`` seconds, and once at the end."""

    def __init__(self, desc: str, stream, every_s: float = 15.0, clock=time.monotonic):
        self.desc, self.stream, self.every_s, self.clock = desc, stream, every_s, clock
        self.n, self.postfix, self.last = 0, "", clock()

    def write(self, msg: str) -> None:
        print(msg, file=self.stream, flush=True)

    def update(self, n: int = 1) -> None:
        self.n += n
        self._maybe()

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s
        self._maybe()

    def _maybe(self) -> None:
        if self.clock() - self.last >= self.every_s:
            self._line()

    def _line(self) -> None:
        self.last = self.clock()
        self.write(f"{self.desc}: {self.n} experiments" + (f"; last: {self.postfix}" if self.postfix else ""))

    def close(self) -> None:
        self._line()
