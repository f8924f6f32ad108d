"""A failed wait's diagnostic carries the rank's protocol words (Ring.protocol_words, added to the error
as a note by Ring.check): every generation decoded to the chunk it stands for, so the records of all
ranks together show who published, observed and acknowledged what."""

from chunkring.ring.layout import CONTROL
from chunkring.ring.status import AbortRecord, ErrorCode, describe_words


def gen(epoch: int, seq: int, slots: int) -> int:
    return epoch << 48 | (seq // slots + 1)


def test_the_words_of_the_4_rank_failure_read_as_chunks():
    # Rank 0 of a 4-rank ring with 2 slots: its producer is at chunk 10; its consumer took chunks 0-7 of every
    # source and chunk 8 of sources 0-2, and waits for source 3's chunk 8, whose slot-0 word holds chunk 6.
    S, W = 2, 4
    control = [0] * 8
    control[CONTROL["epoch"]], control[CONTROL["next_seq"]] = 1, 10
    route = [[gen(1, 8, S), gen(1, 9, S)] if src < 3 else [gen(1, 6, S), gen(1, 7, S)] for src in range(W)]
    route[0] += [0] * 6  # the row's padding to a cache line is ignored
    acks = [[gen(1, 8, S)] * W + [0] * 4, [gen(1, 7, S)] * 3 + [0] + [0] * 4]  # destination 3 never acked chunk 9
    words = {"control": control, "cursor": [9, 9, 9, 8] + [0] * 4, "route_ready": route, "layout_ready": route,
             "ack": acks}
    text = describe_words(words, num_slots=S, world_size=W)
    assert text.splitlines() == [
        "producer: next chunk 10 (epoch 1); consumer: next chunk per source [9, 9, 9, 8]",
        "route_ready by source, slots 0..1: 0: e1:8 e1:9; 1: e1:8 e1:9; 2: e1:8 e1:9; 3: e1:6 e1:7",
        "layout_ready by source, slots 0..1: 0: e1:8 e1:9; 1: e1:8 e1:9; 2: e1:8 e1:9; 3: e1:6 e1:7",
        "acks by slot, destinations 0..3: 0: e1:8 e1:8 e1:8 e1:8; 1: e1:7 e1:7 e1:7 -",
    ]


def test_signed_words_and_other_epochs_decode():
    # torch reads the int64 regions as signed: a word with the top bit set comes back negative.
    words = {"control": [0x8001, 3], "cursor": [0], "route_ready": [[-(1 << 63) | 1]], "layout_ready": [[0]],
             "ack": [[gen(2, 4, 1)]]}
    lines = describe_words(words, num_slots=1, world_size=1).splitlines()
    assert lines[1].endswith("0: e32768:0") and lines[2].endswith("0: -") and lines[3].endswith("0: e2:4")


def test_words_read_after_an_abort_say_they_may_have_moved_since():
    # The abort ends every spin and frees the SMs its blocks held, so a producer kernel that could not start
    # beside them may publish afterwards: the words then show a chunk the failed wait never saw.
    words = {"control": [1, 2], "cursor": [0], "route_ready": [[gen(1, 0, 1)]], "layout_ready": [[gen(1, 0, 1)]],
             "ack": [[0]]}
    quiet = describe_words(words, num_slots=1, world_size=1, abort=AbortRecord(0))
    assert quiet == describe_words(words, num_slots=1, world_size=1)
    aborted = describe_words(words, num_slots=1, world_size=1, abort=AbortRecord.make(1, 3, ErrorCode.TIMEOUT))
    assert aborted.splitlines()[:-1] == quiet.splitlines()
    assert aborted.splitlines()[-1].startswith("read after the abort (rank 3 recorded TIMEOUT (epoch 1)")
    assert "may have run since" in aborted.splitlines()[-1]
