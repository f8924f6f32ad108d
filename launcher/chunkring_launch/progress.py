"""A progress bar for long jobs: rank 0 reports, the launcher draws (stdlib only).

Open MPI forwards a rank's output line by line, so a bar redrawn with ``\\r`` on a rank would appear only
when its line ends. Instead rank 0 writes one marker line per update (at most every ``min_interval_s``)
and the launcher, which owns the terminal, redraws the bar on its stderr from them. The launcher turns
reporting on (``worker --progress``) only when its stderr is a terminal and ``--no-progress`` was not
given; otherwise :func:`progress` returns a reporter that writes nothing.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

MARKER = "@chunkring-progress "

_enabled = False


def enable(flag: bool) -> None:
    """Turn rank 0's progress reports on or off for this process (the worker's ``--progress``)."""
    global _enabled
    _enabled = bool(flag)


class Progress:
    """One loop's progress: ``total`` iterations, or ``duration_s`` seconds of wall time."""

    def __init__(self, label: str, *, total: int | None = None, duration_s: float | None = None,
                 enabled: bool = True, stream: TextIO | None = None, min_interval_s: float = 0.5) -> None:
        self.label, self.total, self.duration_s = label, total, duration_s
        self.enabled, self.stream, self.min_interval_s = enabled, stream, min_interval_s
        self._start = time.monotonic()
        self._last_report = float("-inf")

    def update(self, done: int, note: str = "", *, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last_report < self.min_interval_s):
            return
        self._last_report = now
        state = {"label": self.label, "done": done, "total": self.total, "duration_s": self.duration_s,
                 "elapsed_s": round(now - self._start, 3), "note": note}
        stream = self.stream or sys.stderr
        stream.write(MARKER + json.dumps(state) + "\n")
        stream.flush()

    def close(self, done: int, note: str = "") -> None:
        """The loop's last report, whatever the interval."""
        self.update(done, note, force=True)


def progress(label: str, rank: int, *, total: int | None = None, duration_s: float | None = None) -> Progress:
    """A reporter for a loop of rank ``rank``; only rank 0 reports, and only when reporting is enabled."""
    return Progress(label, total=total, duration_s=duration_s, enabled=_enabled and rank == 0)


def parse_marker(line: str) -> dict[str, Any] | None:
    """The state in a marker line, or None for any other line."""
    if not line.startswith(MARKER):
        return None
    try:
        state = json.loads(line[len(MARKER):])
    except json.JSONDecodeError:
        return None
    return state if isinstance(state, dict) else None


def render(state: dict[str, Any], width: int = 28) -> str:
    """One line: label, bar, percentage, count, elapsed time, estimated time left, note."""
    done, total, duration = state.get("done", 0), state.get("total"), state.get("duration_s")
    elapsed = float(state.get("elapsed_s", 0.0))
    if total:
        fraction, count = done / total, f"{done}/{total}"
    elif duration:
        fraction, count = elapsed / duration, f"{done} it"
    else:
        fraction, count = 0.0, f"{done} it"
    fraction = min(max(fraction, 0.0), 1.0)
    filled = int(fraction * width)
    left = f"  eta {elapsed / fraction - elapsed:.0f} s" if 0 < fraction < 1 else ""
    note = f"  {state['note']}" if state.get("note") else ""
    return (f"{state.get('label', '')} [{'#' * filled}{'.' * (width - filled)}] {fraction * 100:3.0f}%  {count}  "
            f"{elapsed:.1f} s{left}{note}")


class TerminalBar:
    """The launcher's side: draws the latest state on one terminal line; other output goes above it."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self._state: dict[str, Any] | None = None
        self._drawn = 0  # characters of the bar now on the line (0: none)

    def draw(self, state: dict[str, Any]) -> None:
        self._state = state
        line = render(state)
        self.stream.write("\r" + line.ljust(self._drawn))
        self.stream.flush()
        self._drawn = len(line)

    def write_above(self, text: str) -> None:
        """Write ``text`` (whole lines) and redraw the bar below it."""
        if self._drawn:
            self.stream.write("\r" + " " * self._drawn + "\r")
            self._drawn = 0
        self.stream.write(text)
        if self._state is not None:
            self.draw(self._state)
        else:
            self.stream.flush()

    def finish(self) -> None:
        """End the bar's line, so what follows starts on a fresh one."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = 0
        self._state = None
