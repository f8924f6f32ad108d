"""Run a job's processes (``mpirun``, or one worker) and turn how they ended into one exit status and
one clear message.

* Output: the ranks' stdout goes straight to ours; their stderr is relayed line by line (Open MPI
  forwards whole lines), so progress marker lines can be drawn as a bar and the tail read afterwards.
* Signals: the processes run in their own session, so a Ctrl-C at the terminal reaches only the
  launcher, which forwards SIGINT/SIGTERM to mpirun (SIGHUP and SIGQUIT as SIGTERM; Open MPI then sends
  SIGTERM to every rank and kills what is left), waits ``grace_s``, then SIGKILLs every process of that
  session.
* Deadline: mpirun enforces ``--timeout`` itself; ours is a backstop ``grace_s`` later (and the only
  one for a single worker).
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import IO, Any, TextIO

from . import exitcodes
from .jobdir import diagnostic_path, failed_ranks, first_failure, ranks_with_stacks
from .progress import TerminalBar, parse_marker

PREFIX = "chunkring-launch: "
#: Open MPI's words when --timeout ends a job (mpirun then exits with 241 on Open MPI 5).
OMPI_TIMEOUT_TEXT = "time limit for job execution has been reached"
#: "prterun noticed that process rank 1 with PID 3987 on node vm exited on signal 9 (Killed)."
_OMPI_SIGNALLED = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on\s+signal (\d+)")
#: "prterun detected that one or more processes exited with non-zero status ... Process name: [x,1] Exit code: 3"
_OMPI_EXITED = re.compile(r"Process name:\s*\[[^\]]*,(\d+)\]\s+Exit code:\s+(\d+)")


class SignalCatcher:
    """While active, SIGINT, SIGTERM, SIGHUP and SIGQUIT are recorded (the first one wins) instead of ending
    the launcher, so its cleanup runs: a closed terminal (SIGHUP) must not leave mpirun, the ranks or an MPS
    daemon running."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    #: What the job's processes are sent for a signal the launcher received: a rank knows SIGINT and SIGTERM
    #: (SIGTERM dumps its stack); SIGQUIT would dump its core.
    FORWARD_AS = {signal.SIGHUP: signal.SIGTERM, signal.SIGQUIT: signal.SIGTERM}

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> SignalCatcher:
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _record(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum


@dataclass
class Outcome:
    """How the job's processes ended."""

    returncode: int | None
    elapsed_s: float
    signal: int | None = None      # a signal the launcher received and forwarded
    deadline_hit: bool = False     # our backstop deadline ended the job
    killed: bool = False           # SIGKILL was needed after the grace period
    stderr_tail: str = ""

    @property
    def timed_out(self) -> bool:
        return self.deadline_hit or OMPI_TIMEOUT_TEXT in self.stderr_tail


def supervise(cmd: list[str], env: Mapping[str, str], *, deadline_s: float, grace_s: float, catcher: SignalCatcher,
              show_progress: bool = False, out: TextIO | None = None) -> Outcome:
    """Run ``cmd`` to its end (or ours): relay stderr, forward signals, enforce ``deadline_s``."""
    out = out or sys.stderr
    start = time.monotonic()
    if catcher.received is not None:  # interrupted before anything started
        return Outcome(None, 0.0, signal=catcher.received)
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, start_new_session=True)
    assert proc.stderr is not None  # stderr=PIPE
    relay = _Relay(proc.stderr, out, TerminalBar(out) if show_progress else None)
    relay.start()
    outcome = Outcome(None, 0.0)
    stop_by: float | None = None  # when the grace period after a forwarded signal ends
    while outcome.returncode is None:
        try:
            outcome.returncode = proc.wait(timeout=0.1)
            break
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        if catcher.received is not None and outcome.signal is None:
            outcome.signal = catcher.received
            _send(proc, catcher.FORWARD_AS.get(catcher.received, catcher.received))
            stop_by = now + grace_s
        elif stop_by is None and now - start > deadline_s:
            outcome.deadline_hit = True
            _send(proc, signal.SIGTERM)
            stop_by = now + grace_s
        if stop_by is not None and now > stop_by and not outcome.killed:
            outcome.killed = True
            kill_session(proc.pid)
    if outcome.returncode != 0:
        kill_session(proc.pid)  # ranks orphaned by a dying mpirun must not live on
    relay.join(timeout=10)
    relay.finish()
    outcome.elapsed_s = time.monotonic() - start
    outcome.stderr_tail = relay.tail()
    return outcome


def _send(proc: subprocess.Popen[bytes], signum: int) -> None:
    try:
        proc.send_signal(signum)
    except ProcessLookupError:
        pass


def kill_session(session_id: int) -> None:
    """SIGKILL every process of the session ``session_id`` (the one our child leads; Open MPI puts each
    rank in its own process group, but they stay in this session)."""
    for pid in _session_members(session_id):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _session_members(session_id: int) -> list[int]:
    if not os.path.isdir("/proc"):
        return [session_id]
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()  # after "(comm)": state ppid pgrp session
        except (OSError, IndexError):
            continue
        if int(fields[3]) == session_id:
            members.append(int(entry))
    return members


class _Relay(threading.Thread):
    """Copies the child's stderr to ``out`` line by line, drawing progress markers as a bar."""

    def __init__(self, pipe: IO[bytes], out: TextIO, bar: TerminalBar | None, tail_lines: int = 400) -> None:
        super().__init__(daemon=True)
        self.pipe, self.out, self.bar = pipe, out, bar
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)

    def run(self) -> None:
        for raw in self.pipe:
            line = raw.decode("utf-8", errors="replace")
            if not line.endswith("\n"):  # a last, unfinished line: what we print next starts afresh
                line += "\n"
            state = parse_marker(line)
            if state is not None:
                if self.bar is not None:
                    self.bar.draw(state)
                continue
            self._tail.append(line)
            if self.bar is not None:
                self.bar.write_above(line)
            else:
                self.out.write(line)
                self.out.flush()

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.finish()

    def tail(self) -> str:
        return "".join(self._tail)


def conclude(outcome: Outcome, *, job_dir: str, timeout_s: float,
             single_worker: bool = False) -> tuple[int, list[str], bool]:
    """Exit status, the lines to print, and whether ``job_dir`` holds something the lines point at;
    ``single_worker``: the job was one worker process, without mpirun."""
    first, failed = first_failure(job_dir), failed_ranks(job_dir)
    if outcome.signal is not None:
        name = signal.Signals(outcome.signal).name
        how = "; some needed SIGKILL after the grace period" if outcome.killed else ""
        lines = [f"{PREFIX}interrupted by {name}: every rank was ended{how}"]
        return exitcodes.interrupted(outcome.signal), lines, False
    if outcome.returncode == 0:
        return exitcodes.PASSED, [], False
    if outcome.timed_out:
        lines = [(f"{PREFIX}the job ran past --timeout {timeout_s:g} s and every rank was ended: a rank hung, or "
                  "the limit is too short for the job")]
        stacks = ranks_with_stacks(job_dir)
        if stacks:
            lines.append(f"{PREFIX}each rank's Python stack when it was ended: {job_dir}/rank<R>.stack "
                         f"(ranks {_ranks(stacks)})")
        return exitcodes.TIMED_OUT, lines, bool(stacks)
    if first is not None:
        return exitcodes.FAILED, *_failure_lines(outcome, job_dir, first, failed)
    dead = dead_rank(outcome, single_worker=single_worker)
    if dead is not None:
        return exitcodes.RANK_DIED, [f"{PREFIX}rank {dead[0]} {dead[1]}; the job was ended"], False
    return exitcodes.FAILED, [f"{PREFIX}the job exited with status {outcome.returncode} and no rank said why"], False


def _failure_lines(outcome: Outcome, job_dir: str, first: int, failed: list[int]) -> tuple[list[str], bool]:
    lines = []
    diagnostic = diagnostic_path(job_dir, first).read_text()
    if diagnostic.splitlines()[0] not in outcome.stderr_tail:  # lost in the abort: show it from the file
        lines.append(diagnostic.rstrip("\n"))
    others = [r for r in failed if r != first]
    if others:
        lines.append(f"{PREFIX}rank(s) {_ranks(others)} failed too; every diagnostic is in {job_dir}/rank<R>.txt")
    return lines, bool(others)


def dead_rank(outcome: Outcome, *, single_worker: bool = False) -> tuple[int, str] | None:
    """(rank, what happened to it) for a rank that died without a diagnostic, from Open MPI's report or,
    for a single worker, from its own exit status."""
    text = " ".join(outcome.stderr_tail.split())
    match = _OMPI_SIGNALLED.search(text)
    if match:
        rank, node, signum = int(match[1]), match[2], int(match[3])
        return rank, f"(on {node}) was killed by signal {signum} ({_signal_name(signum)}) without reporting an error"
    match = _OMPI_EXITED.search(text)
    if match:
        return int(match[1]), f"exited with status {match[2]} without reporting an error"
    if outcome.returncode is not None and outcome.returncode < 0:
        signum = -outcome.returncode
        return 0, f"was killed by signal {signum} ({_signal_name(signum)}) without reporting an error"
    if single_worker and outcome.returncode:
        # The worker itself exited without a diagnostic: what Open MPI reports as "exited with non-zero
        # status" under mpirun, so the same status 5 with or without it.
        return 0, f"exited with status {outcome.returncode} without reporting an error"
    return None


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "unknown signal"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
