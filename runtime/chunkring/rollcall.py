"""A bounded barrier that names who did not come: :class:`RollCall`.

Every rank sends every other rank a small "here" message for the barrier's sequence number and waits until
it holds one from each; then each says "passed", and a rank returns once everyone has. Unlike
``MPI_Ibarrier``, which can only say "not everyone", the messages say who is missing when the limit passes. A
rank that gives up tells the others ("gave up") instead of "passed", so every rank - one that comes later too -
raises rather than passing a barrier a peer abandoned and then waiting in a collective it never joins. Messages
of an abandoned barrier that arrive later are dropped (their sequence number is behind), so the ranks' later
barriers stay in step. Each "here" carries the barrier's name: ranks that meet under different names have
fallen out of step (one skipped or added a collective), and every rank raises instead of pairing them.

The module holds the protocol only; :class:`chunkring.hostcomm.HostComm` gives it MPI's point-to-point
messages (the only module that imports mpi4py), the unit tests an in-process stand-in.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from chunkring.errors import ChunkringHostTimeoutError, ChunkringOutOfStepError

__all__ = ["GAVE_UP", "HERE", "PASSED", "Mailbox", "RollCall", "abandoning_on_failure"]

HERE = "here"
PASSED = "passed"
GAVE_UP = "gave_up"
#: Polls without sleeping before the wait starts to sleep between polls: a barrier every rank reaches at
#: once returns in microseconds, one that waits long costs no core.
BUSY_POLLS = 200
POLL_SLEEP_S = 0.0005

#: (HERE, PASSED or GAVE_UP, barrier sequence number, the ranks a GAVE_UP's sender found missing: itself when
#: it abandons, those it timed out waiting for otherwise; empty for the other two, the barrier's name: a HERE's,
#: empty for the other two).
Message = tuple[str, int, tuple[int, ...], str]


class Mailbox(Protocol):
    """What a roll call needs from the transport: send without blocking, and take what has arrived."""

    def post(self, dest: int, message: Message) -> None: ...

    def arrived(self) -> Iterable[tuple[int, Message]]: ...


class RollCall:
    """Bounded barriers over ``world_size`` ranks through ``mailbox``; this rank is ``rank``. Each
    :meth:`meet` is a collective: every rank calls them in the same order."""

    def __init__(self, rank: int, world_size: int, mailbox: Mailbox, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.rank, self.world_size, self.mailbox = rank, world_size, mailbox
        self.others = tuple(r for r in range(world_size) if r != rank)
        self.clock, self.sleep = clock, sleep
        self._seq = 0  # the next barrier's number
        self._inbox: dict[int, set[tuple[str, int]]] = {r: set() for r in self.others}  # (kind, seq) per sender
        self._missing: dict[tuple[int, int], tuple[int, ...]] = {}  # (sender, seq) -> what its GAVE_UP named
        self._names: dict[tuple[int, int], str] = {}  # (sender, seq) -> the barrier its HERE named

    def meet(self, timeout_s: float, what: str = "a barrier") -> None:
        """Return once every rank has reached this barrier - on every rank or on none. Raise
        :class:`ChunkringHostTimeoutError` naming the absent ranks once ``timeout_s`` passes without them (telling
        every rank that this one gave up), or naming the ranks that gave up on this barrier.

        ``what`` is also the barrier's name, the same on every rank for the same collective: when every rank is
        here but some under another name, every rank raises :class:`ChunkringOutOfStepError` (each holds every
        rank's name, so each sees the same mismatch) instead of pairing two different collectives.

        Two rounds make the verdict the same everywhere. Round 1: "here" to everyone, then wait for everyone's
        "here". A rank that has them all says "passed"; one whose limit passes first says "gave up". Round 2:
        return only on everyone's "passed"; any "gave up" fails the barrier. So a rank that comes just as
        another's limit passes learns of it here, instead of passing a barrier that rank gave up on and then
        waiting alone in the collective after it. One case still splits the verdict: a rank silent for a whole
        limit between its "passed" and the others' (descheduled that long, or dead) makes a waiting rank give up
        in round 2 while ranks that already hold every "passed" return. Each round waits ``timeout_s`` at most."""
        seq = self._seq
        self._seq += 1
        self._post_all(HERE, seq, name=what)
        gave_up, absent = self._wait(seq, HERE, self.clock() + timeout_s)
        if not gave_up and not absent:
            self._raise_if_out_of_step(seq, what)
            self._post_all(PASSED, seq)
            # Bounded again: every rank that sent "here" says its verdict within its own limit, unless it died.
            gave_up, absent = self._wait(seq, PASSED, self.clock() + timeout_s)
        if gave_up:  # not this rank's own count: who was missing is what the ranks that gave up found
            absent = tuple(sorted({r for g in gave_up for r in self._missing.get((g, seq), ())} - {self.rank}))
        self._forget(seq)
        if gave_up or absent:
            raise ChunkringHostTimeoutError(self._why(absent, gave_up, timeout_s, what), what=what,
                                            timeout_s=timeout_s, absent_ranks=absent, gave_up_ranks=gave_up)

    def _wait(self, seq: int, kind: str, deadline: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Wait until every other rank sent ``kind`` for barrier ``seq`` (returns ``((), ())``), one gave up
        (returns who gave up, and who has not sent ``kind``), or ``deadline`` passes - then this rank gives up,
        telling everyone, and returns ``((), absent)``."""
        polls = 0
        while True:
            self._collect(seq)
            gave_up = tuple(r for r in self.others if (GAVE_UP, seq) in self._inbox[r])
            absent = tuple(r for r in self.others if (kind, seq) not in self._inbox[r])
            if gave_up or not absent:
                return gave_up, absent
            if self.clock() > deadline:  # the first to give up tells the others, so none waits on for nothing
                self._post_all(GAVE_UP, seq, absent)
                return (), absent
            polls += 1
            self.sleep(0 if polls < BUSY_POLLS else POLL_SLEEP_S)

    def _raise_if_out_of_step(self, seq: int, what: str) -> None:
        """Every rank is at barrier ``seq``: raise if any came under another name than ``what``."""
        elsewhere = {r: self._names[(r, seq)] for r in self.others if self._names.get((r, seq)) != what}
        if elsewhere:
            self._forget(seq)
            there = "; ".join(f"rank {r} at {name!r}" for r, name in sorted(elsewhere.items()))
            raise ChunkringOutOfStepError(
                f"rank {self.rank}: at {what!r}, but {there}: the ranks' host collectives fell out of step (a rank "
                "skipped or added one); nothing was done here, and the job cannot go on", what=what,
                elsewhere=elsewhere)

    def _post_all(self, kind: str, seq: int, missing: tuple[int, ...] = (), *, name: str = "") -> None:
        for r in self.others:
            self.mailbox.post(r, (kind, seq, missing, name))

    def abandon(self) -> None:
        """Tell every rank that this one will not come to the next barrier (it failed before it), then skip that
        barrier here: the ranks already waiting there, or coming later, raise at once naming this rank instead of
        waiting out their limit; every rank's next barrier after it is again the same."""
        seq = self._seq
        self._seq += 1
        self._post_all(GAVE_UP, seq, (self.rank,))

    def _why(self, absent: tuple[int, ...], gave_up: tuple[int, ...], timeout_s: float, what: str) -> str:
        abandoned = tuple(r for r in gave_up if r in absent)  # told us it will not come (abandon)
        if abandoned:
            return (f"rank {self.rank}: rank(s) {_names(abandoned)} failed before {what} and will not come; "
                    "nothing was done here")
        if not absent:
            return (f"rank {self.rank}: rank(s) {_names(gave_up)} stopped waiting at {what} before this rank came "
                    f"(their limit of {timeout_s:g} s passed first); nothing was done here")
        first = f"; rank(s) {_names(gave_up)} stopped waiting first" if gave_up else ""
        return (f"rank {self.rank}: rank(s) {_names(absent)} did not reach {what} within {timeout_s:g} s{first} "
                f"(a rank that raised before it, hangs or died never comes); nothing was done here")

    def _collect(self, seq: int) -> None:
        """File what arrived; drop what belongs to barriers before ``seq`` (abandoned ones: their late
        arrivals). A peer already at a later barrier keeps its message for then."""
        for source, (kind, number, missing, name) in self.mailbox.arrived():
            if number >= seq:
                self._inbox[source].add((kind, number))
                if kind == GAVE_UP:
                    self._missing[(source, number)] = tuple(missing)
                if kind == HERE:
                    self._names[(source, number)] = name

    def _forget(self, seq: int) -> None:
        for box in self._inbox.values():
            box.difference_update({(HERE, seq), (PASSED, seq), (GAVE_UP, seq)})
        self._missing = {key: ranks for key, ranks in self._missing.items() if key[1] > seq}
        self._names = {key: name for key, name in self._names.items() if key[1] > seq}


class Abandons(Protocol):
    """What can abandon its next bounded barrier (:meth:`chunkring.Runtime.abandon_barrier`)."""

    def abandon_barrier(self) -> None: ...


@contextlib.contextmanager
def abandoning_on_failure(party: Abandons) -> Iterator[None]:
    """The steps before a bounded barrier: when one raises, ``party`` abandons the barrier before the error
    propagates, so its peers raise at once naming it and every rank's barriers stay numbered alike (a rank that
    skipped one would meet its peers' next barrier at the wrong number, and fail every one after)."""
    try:
        yield
    except BaseException:
        party.abandon_barrier()
        raise


def _names(ranks: tuple[int, ...]) -> str:
    return ", ".join(str(r) for r in ranks)
