"""A bounded barrier that names who did not come: :class:`RollCall`.

Every rank sends every other rank a small "here" message for the barrier's sequence number and waits until
it holds one from each. Unlike ``MPI_Ibarrier``, which can only say "not everyone", the messages say who is
missing when the limit passes. A rank that gives up tells the others ("gave up"), so a rank that comes later
raises too instead of passing a barrier its peers abandoned and then waiting in a collective they never
join. Messages of an abandoned barrier that arrive later are dropped (their sequence number is behind), so
the ranks' later barriers stay in step.

The module holds the protocol only; :class:`chunkring.hostcomm.HostComm` gives it MPI's point-to-point
messages (the only module that imports mpi4py), the unit tests an in-process stand-in.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Protocol

from chunkring.errors import ChunkringHostTimeoutError

__all__ = ["GAVE_UP", "HERE", "Mailbox", "RollCall"]

HERE = "here"
GAVE_UP = "gave_up"
#: Polls without sleeping before the wait starts to sleep between polls: a barrier every rank reaches at
#: once returns in microseconds, one that waits long costs no core.
BUSY_POLLS = 200
POLL_SLEEP_S = 0.0005

Message = tuple[str, int]  # (HERE or GAVE_UP, barrier sequence number)


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
        self._inbox: dict[int, set[Message]] = {r: set() for r in self.others}

    def meet(self, timeout_s: float, what: str = "a barrier") -> None:
        """Return once every rank has reached this barrier. Raise :class:`ChunkringHostTimeoutError` naming
        the absent ranks once ``timeout_s`` passes without them (telling every rank that this one gave up),
        or naming the ranks that gave up on this barrier before this rank came."""
        seq = self._seq
        self._seq += 1
        for r in self.others:
            self.mailbox.post(r, (HERE, seq))
        deadline = self.clock() + timeout_s
        polls = 0
        while True:
            self._collect(seq)
            gave_up = tuple(r for r in self.others if (GAVE_UP, seq) in self._inbox[r])
            absent = tuple(r for r in self.others if (HERE, seq) not in self._inbox[r])
            if not absent and not gave_up:
                self._forget(seq)
                return
            if gave_up or self.clock() > deadline:
                if not gave_up:  # the first to give up tells the others, so none waits on for nothing
                    for r in self.others:
                        self.mailbox.post(r, (GAVE_UP, seq))
                self._forget(seq)
                raise ChunkringHostTimeoutError(self._why(absent, gave_up, timeout_s, what), what=what,
                                                timeout_s=timeout_s, absent_ranks=absent, gave_up_ranks=gave_up)
            polls += 1
            self.sleep(0 if polls < BUSY_POLLS else POLL_SLEEP_S)

    def abandon(self) -> None:
        """Tell every rank that this one will not come to the next barrier (it failed before it), then skip that
        barrier here: the ranks already waiting there, or coming later, raise at once naming this rank instead of
        waiting out their limit; every rank's next barrier after it is again the same."""
        seq = self._seq
        self._seq += 1
        for r in self.others:
            self.mailbox.post(r, (GAVE_UP, seq))

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
        for source, message in self.mailbox.arrived():
            if message[1] >= seq:
                self._inbox[source].add(message)

    def _forget(self, seq: int) -> None:
        for box in self._inbox.values():
            box.difference_update({(HERE, seq), (GAVE_UP, seq)})


def _names(ranks: tuple[int, ...]) -> str:
    return ", ".join(str(r) for r in ranks)
