"""The two kinds of failure chunkring reports.

``ChunkringUsageError``: the caller asked for something impossible or unsafe (bad shape, bad config,
wrong stream, a closed object). Raised before any GPU work starts.

``ChunkringRuntimeError``: the machine failed us (CUDA, NVRTC, NVSHMEM, MPI). Its subclass
``ChunkringDeviceError`` carries the record a kernel wrote (a failed check, a bad peer value), and
``ChunkringTimeoutError`` the record of a device watchdog that fired: who waited, where, for whom, on
which slot, what it expected and what it last saw; ``ChunkringInputError`` the first malformed value a
consumer masked (docs/PROTOCOL.md, "What a consumer trusts"); ``ChunkringPeerAbortedError`` that another
rank of the ring failed first (its rank and error code), which is why this rank's kernels stopped;
``ChunkringHostTimeoutError`` that a host-side wait on other ranks (a bounded barrier) outlasted its limit, naming
the ranks that did not come.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

__all__ = ["ChunkringError", "ChunkringUsageError", "ChunkringRuntimeError", "ChunkringDeviceError",
           "ChunkringHostTimeoutError", "ChunkringInputError", "ChunkringPeerAbortedError", "ChunkringTimeoutError",
           "ChunkringWedgedError", "NoGpuError", "UsageProblems"]

#: One problem of a usage error: the field (argument, config key) at fault, or None, and what is wrong with it.
Problem = tuple[str | None, str]


class ChunkringError(Exception):
    """Base class of every error chunkring raises on purpose."""


class ChunkringUsageError(ChunkringError, ValueError):
    """Invalid arguments or misuse; ``field`` names the offending argument when there is one.

    An error about several bad values (a config checked whole: :class:`UsageProblems`) lists each in
    ``problems`` - ``(field, message)`` pairs, one ``field: message`` line each in the error's text - and
    ``field`` is the first one's."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.problems: tuple[Problem, ...] = ((field, message),)

    @classmethod
    def listing(cls, problems: Iterable[Problem]) -> ChunkringUsageError:
        """One error for every problem of ``problems`` (at least one), in order."""
        found = tuple(problems)
        if not found:
            raise ValueError("no problem to report")
        (field, message), *_ = found
        error = cls(message, field=field)
        if len(found) > 1:
            error.args = ("\n".join(f"{f}: {m}" if f else m for f, m in found),)
            error.problems = found
        return error


class UsageProblems:
    """Collects what is wrong with several values, to report them all at once: ``add`` a problem, run a check
    that raises ``ChunkringUsageError`` inside ``collect()``, then ``raise_if_any()``. A field already found
    at fault keeps its first problem (``reported`` lets a check of a value derived from it stand aside)."""

    def __init__(self) -> None:
        self._found: list[Problem] = []

    def add(self, message: str, *, field: str | None = None) -> None:
        if field is None or not self.reported(field):
            self._found.append((field, message))

    def extend(self, problems: Iterable[Problem]) -> None:
        for field, message in problems:
            self.add(message, field=field)

    @contextlib.contextmanager
    def collect(self) -> Iterator[None]:
        """Run a check, keeping the problems of the ``ChunkringUsageError`` it raises instead of raising it."""
        try:
            yield
        except ChunkringUsageError as exc:
            self.extend(exc.problems)

    def reported(self, *fields: str) -> bool:
        """Whether any of ``fields`` has a problem already."""
        return any(field in fields for field, _ in self._found)

    def check_range(self, field: str, value: float, low: float, high: float, why: str = "") -> bool:
        """Whether ``value`` (of ``field``, unless that is at fault already) is in [low, high]; a problem naming
        the value and the range if not."""
        if self.reported(field):
            return False
        if low <= value <= high:
            return True
        self.add(f"must be in [{_number(low)}, {_number(high)}], got {value!r}" + (f" ({why})" if why else ""),
                 field=field)
        return False

    def __bool__(self) -> bool:
        return bool(self._found)

    def raise_if_any(self) -> None:
        """Raise one ``ChunkringUsageError`` listing every problem found, if there is one."""
        if self._found:
            raise ChunkringUsageError.listing(self._found)


class ChunkringRuntimeError(ChunkringError, RuntimeError):
    """A CUDA, NVRTC, NVSHMEM or MPI operation failed, or a device watchdog fired."""


class ChunkringDeviceError(ChunkringRuntimeError):
    """A kernel recorded an error; ``record`` is the decoded record (:mod:`chunkring.ring.status`: a
    ``StatusRecord``, ``InputRecord`` or ``AbortRecord``; this module, below the ring, names no ring type)."""

    def __init__(self, message: str, record: object) -> None:
        super().__init__(message)
        self.record = record


class ChunkringTimeoutError(ChunkringDeviceError):
    """A device spin-wait outlasted the watchdog limit; ``record`` says which wait and on whom."""


class ChunkringInputError(ChunkringDeviceError):
    """A consumer masked malformed slot contents (an out-of-range expert, a NaN scale, an impossible
    count): the call completed by the documented masking rule, but its output is not what the caller
    meant. ``record`` is the :class:`chunkring.ring.status.InputRecord` of the first such value."""


class ChunkringPeerAbortedError(ChunkringDeviceError):
    """Another rank of the ring recorded an error, and its abort word stopped this rank's waits (or would
    stop the next): ``origin_rank`` names that rank, ``code`` its error (a ``chunkring.ring.status.ErrorCode``
    where the value is one), ``epoch`` the ring's epoch then; ``record`` is the
    :class:`chunkring.ring.status.AbortRecord`. This rank did not fail on its own: look at the origin's report.
    The ring needs a :meth:`chunkring.Ring.reset` (a collective) like any failure."""

    def __init__(self, message: str, record: object, *, origin_rank: int, code: int, epoch: int) -> None:
        super().__init__(message, record)
        self.origin_rank = origin_rank
        self.code = code
        self.epoch = epoch


class ChunkringWedgedError(ChunkringRuntimeError):
    """A wait for this rank's device outlasted its limit: a kernel still runs - one that waits on a peer's remote
    operation that never completes. The runtime is left wedged (its close() touches nothing): end the job."""


class NoGpuError(ChunkringRuntimeError):
    """No CUDA device is visible to this process."""


class ChunkringHostTimeoutError(ChunkringRuntimeError):
    """A host-side wait on other ranks (a bounded barrier: a reset, a teardown) outlasted its limit.
    ``absent_ranks`` names the ranks that had not come when this rank stopped waiting; ``gave_up_ranks``
    the ranks that had stopped waiting for this one before it came (their limit passed first); ``what`` names
    the wait and ``timeout_s`` its limit. Nothing of the wait's purpose happened on this rank (no reset, no
    free): every rank must reach it again, or the job must end."""

    def __init__(self, message: str, *, what: str, timeout_s: float, absent_ranks: tuple[int, ...] = (),
                 gave_up_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.what = what
        self.timeout_s = timeout_s
        self.absent_ranks = absent_ranks
        self.gave_up_ranks = gave_up_ranks


class ChunkringOutOfStepError(ChunkringRuntimeError):
    """The ranks met at a bounded barrier of different names: their host collectives fell out of step (one rank
    skipped or added a collective the others made, e.g. one is in a ring's ``close()`` while another builds a
    ring). ``what`` names this rank's barrier, ``elsewhere`` the others' (rank -> name). Nothing of the barrier's
    purpose happened on any rank; every rank raises alike. The job cannot go on: end it."""

    def __init__(self, message: str, *, what: str, elsewhere: dict[int, str]) -> None:
        super().__init__(message)
        self.what = what
        self.elsewhere = elsewhere


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"
