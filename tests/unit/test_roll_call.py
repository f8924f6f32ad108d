"""The bounded barrier behind every host-side wait on other ranks (chunkring.rollcall.RollCall): it returns once
every rank came; past its limit it raises ChunkringHostTimeoutError naming the ranks that did not come; a rank
that comes after its peers gave up raises too, naming them, instead of passing a barrier they abandoned; the
abandoned barrier's late messages never satisfy a later one, so the ranks' next barrier lines up. Ranks are
threads here, over an in-process mailbox; tests/mpi/test_host_comm_mpi.py runs the same over MPI."""

import queue
import threading
import time

import pytest

from chunkring import ChunkringHostTimeoutError, ChunkringOutOfStepError
from chunkring.rollcall import RollCall


class Post:
    """Every rank's in-tray: a queue of (source, message)."""

    def __init__(self, world_size):
        self.trays = [queue.Queue() for _ in range(world_size)]

    def mailbox(self, rank):
        post = self

        class Mailbox:
            def post(self, dest, message):
                post.trays[dest].put((rank, message))

            def arrived(self):
                while True:
                    try:
                        yield post.trays[rank].get_nowait()
                    except queue.Empty:
                        return

        return Mailbox()


def roll_calls(world_size):
    post = Post(world_size)
    return [RollCall(rank, world_size, post.mailbox(rank)) for rank in range(world_size)]


def run_ranks(steps):
    """Run ``steps[r]()`` in one thread per rank; return each rank's result or the exception it raised."""
    results = [None] * len(steps)

    def run(rank):
        try:
            results[rank] = steps[rank]()
        except Exception as exc:  # the test inspects it
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(steps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a roll call did not return within its limit"
    return results


def test_every_rank_present_returns_everywhere():
    calls = roll_calls(4)
    assert run_ranks([lambda c=c: c.meet(5.0) for c in calls]) == [None] * 4


def test_a_rank_that_never_comes_is_named_by_every_other_within_the_limit():
    calls = roll_calls(4)
    started = time.monotonic()
    steps = [lambda c=c: c.meet(0.3, "the reset's first barrier") for c in calls[:3]] + [lambda: "stays away"]
    results = run_ranks(steps)
    took = time.monotonic() - started
    for rank in range(3):
        error = results[rank]
        assert isinstance(error, ChunkringHostTimeoutError), error
        # The first rank whose limit passes tells the others, who raise at once naming it too.
        assert error.absent_ranks == (3,) and 3 not in error.gave_up_ranks
        assert (error.what, error.timeout_s) == ("the reset's first barrier", 0.3)
        assert f"rank {rank}: rank(s) 3 did not reach the reset's first barrier within 0.3 s" in str(error)
    assert took < 5.0


def test_a_late_rank_raises_naming_who_gave_up_and_the_next_barrier_lines_up():
    calls = roll_calls(3)
    results = run_ranks([lambda c=c: c.meet(0.2) for c in calls[:2]] + [lambda: None])
    assert all(isinstance(e, ChunkringHostTimeoutError) and e.absent_ranks == (2,) for e in results[:2])
    with pytest.raises(ChunkringHostTimeoutError) as info:
        calls[2].meet(5.0)  # comes late: its peers' "here" messages are there, and so is their giving up
    assert info.value.gave_up_ranks and set(info.value.gave_up_ranks) <= {0, 1} and info.value.absent_ranks == ()
    assert "stopped waiting" in str(info.value)
    # The abandoned barrier's messages satisfy nothing later: the next one needs every rank again...
    results = run_ranks([lambda c=c: c.meet(0.2) for c in calls[:2]] + [lambda: None])
    assert all(isinstance(e, ChunkringHostTimeoutError) and e.absent_ranks == (2,) for e in results[:2])
    # ...and once rank 2 has caught up with barrier 1 (raising: its peers gave up there), barrier 2 lines up.
    with pytest.raises(ChunkringHostTimeoutError):
        calls[2].meet(5.0)
    assert run_ranks([lambda c=c: c.meet(5.0) for c in calls]) == [None] * 3


def test_a_peer_already_at_the_next_barrier_keeps_its_message_for_then():
    calls = roll_calls(2)
    order = []

    def fast():
        calls[0].meet(5.0)
        order.append("fast passed 0")
        calls[0].meet(5.0)
        order.append("fast passed 1")

    def slow():
        time.sleep(0.1)
        calls[1].meet(5.0)
        time.sleep(0.2)  # meanwhile rank 0's "here" for barrier 1 is already in rank 1's tray
        calls[1].meet(5.0)

    assert run_ranks([fast, slow]) == [None, None]
    assert order == ["fast passed 0", "fast passed 1"]


def test_a_rank_that_abandons_a_barrier_is_named_at_once_and_the_next_one_lines_up():
    calls = roll_calls(3)
    started = time.monotonic()
    results = run_ranks([lambda c=c: c.meet(30.0, "the first call's warm-up") for c in calls[:2]] +
                        [calls[2].abandon])
    assert time.monotonic() - started < 5.0, "the waiting ranks waited out their limit"
    for rank in range(2):
        error = results[rank]
        assert isinstance(error, ChunkringHostTimeoutError), error
        assert error.absent_ranks == (2,) and error.gave_up_ranks == (2,)
        assert f"rank {rank}: rank(s) 2 failed before the first call's warm-up and will not come" in str(error)
    assert run_ranks([lambda c=c: c.meet(5.0) for c in calls]) == [None] * 3


def test_a_single_rank_meets_itself():
    (call,) = roll_calls(1)
    call.meet(0.01)


def test_a_rank_that_counts_everyone_as_another_gives_up_does_not_pass_alone():
    """Rank 1 comes with every "here" already waiting - rank 0's sent before rank 0's limit passed - but rank 0
    gave up meanwhile: the second round tells rank 1 so, and it raises too (one verdict on every rank)."""
    post = Post(2)
    calls = [RollCall(rank, 2, post.mailbox(rank)) for rank in range(2)]
    with pytest.raises(ChunkringHostTimeoutError):
        calls[0].meet(0.05)  # its "here" went out; its limit passed before rank 1's came
    with pytest.raises(ChunkringHostTimeoutError) as info:
        calls[1].meet(5.0)  # finds rank 0's "here" and its "gave up"
    assert info.value.gave_up_ranks == (0,) and info.value.absent_ranks == ()
    assert run_ranks([lambda c=c: c.meet(5.0) for c in calls]) == [None, None]


def test_a_rank_that_saw_everyone_still_raises_when_a_peer_gave_up_before_seeing_it():
    """The two-round race: rank 1 holds rank 0's "here" and says "passed", but its own "here" reaches rank 0 only
    after rank 0's limit - so rank 0 gives up. With one round rank 1 would pass alone; in the second round it
    hears rank 0's "gave up" and raises too."""
    post = Post(2)
    held = []  # rank 1's messages to rank 0, delivered late

    class Late:
        def post(self, dest, message):
            held.append((dest, message))

        def arrived(self):
            return post.mailbox(1).arrived()

    calls = [RollCall(0, 2, post.mailbox(0)), RollCall(1, 2, Late())]
    results = run_ranks([lambda: calls[0].meet(0.3), lambda: calls[1].meet(5.0)])
    assert isinstance(results[0], ChunkringHostTimeoutError) and results[0].absent_ranks == (1,)
    assert isinstance(results[1], ChunkringHostTimeoutError), "rank 1 passed a barrier rank 0 gave up on"
    assert results[1].gave_up_ranks == (0,) and results[1].absent_ranks == ()
    assert [message[0] for _, message in held] == ["here", "passed"]


def test_ranks_at_barriers_of_different_names_raise_on_every_rank_and_the_next_one_lines_up():
    """Rank 2 skipped a collective the others made (it is at the destroy's barrier while they build a ring): every
    rank - the one that differs too - raises ChunkringOutOfStepError naming what each rank is at, at once, instead
    of pairing the two collectives; their sequence numbers stay alike, so the barrier after lines up."""
    calls = roll_calls(3)
    started = time.monotonic()
    results = run_ranks([lambda c=c: c.meet(30.0, "an allgather") for c in calls[:2]] +
                        [lambda: calls[2].meet(30.0, "the ring's close()")])
    assert time.monotonic() - started < 5.0, "the ranks waited out their limit"
    assert all(isinstance(error, ChunkringOutOfStepError) for error in results), results
    assert results[0].elsewhere == results[1].elsewhere == {2: "the ring's close()"}
    assert results[2].elsewhere == {0: "an allgather", 1: "an allgather"}
    assert "rank 0: at 'an allgather', but rank 2 at \"the ring's close()\"" in str(results[0])
    assert run_ranks([lambda c=c: c.meet(5.0, "the rejoin") for c in calls]) == [None] * 3
