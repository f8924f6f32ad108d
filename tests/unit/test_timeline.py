"""The timeline's host side on the CPU: Event values match the device contract, spans pair records into
the expected Chrome trace events, nothing is dropped silently, and the trace file and plot are written."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from chunkring import ChunkringRuntimeError, ChunkringUsageError, Event, Timeline
from chunkring.moe.timeline import LANES, spans, write_chrome_trace

REPO = Path(__file__).resolve().parents[2]
BASE_NS = 1_000_000_000  # records carry raw %globaltimer values; traces start at 0
E = Event


def one_call(offset_ns: int = 0, rank: int = 0) -> np.ndarray:
    """Rank ``rank`` of two, one call of two chunks: records as (kind, src, chunk, t_ns), times in µs * 1000."""
    rows = [
        (E.CALL_BEGIN, rank, -1, 0), (E.PRODUCE_BEGIN, rank, 0, 1000), (E.PUBLISHED, rank, 0, 3000),
        (E.PRODUCE_BEGIN, rank, 1, 3500), (E.OBSERVED, 0, 0, 4000), (E.PUBLISHED, rank, 1, 5000),
        (E.PULLED, 0, 0, 6000), (E.ACKED, 0, 0, 6500), (E.OBSERVED, 1, 0, 7000), (E.PULLED, 1, 0, 8000),
        (E.ACKED, 1, 0, 8500), (E.OBSERVED, 0, 1, 9000), (E.PULLED, 0, 1, 10000), (E.OBSERVED, 1, 1, 11000),
        (E.PULLED, 1, 1, 12000), (E.EXPERTS_BEGIN, rank, -1, 12500), (E.EXPERTS_DONE, rank, -1, 20000),
        (E.COMBINE_DONE, rank, -1, 21000), (E.ACKED, 0, 1, 21500), (E.ACKED, 1, 1, 21600),
        (E.DRAINED, rank, -1, 22000), (E.OUTPUT_DONE, rank, -1, 23000),
    ]
    return np.array([(int(k), s, c, BASE_NS + offset_ns + t) for k, s, c, t in rows], dtype=np.int64)


# (name, lane, ts µs, dur µs) of one_call's complete events, and (name, ts) of its instants.
EXPECTED_SPANS = [
    ("wait src 0 chunk 0", "consumer", 0.0, 4.0), ("produce 0", "producer", 1.0, 2.0),
    ("produce 1", "producer", 3.5, 1.5), ("pull src 0 chunk 0", "consumer", 4.0, 2.0),
    ("drain", "producer", 5.0, 17.0), ("wait src 1 chunk 0", "consumer", 6.5, 0.5),
    ("pull src 1 chunk 0", "consumer", 7.0, 1.0), ("wait src 0 chunk 1", "consumer", 8.5, 0.5),
    ("pull src 0 chunk 1", "consumer", 9.0, 1.0), ("wait src 1 chunk 1", "consumer", 10.0, 1.0),
    ("pull src 1 chunk 1", "consumer", 11.0, 1.0), ("experts", "consumer", 12.5, 7.5),
    ("combine", "consumer", 20.0, 1.0), ("reduce", "producer", 22.0, 1.0),
]
EXPECTED_INSTANTS = [("call begin", 0.0), ("ack src 0 chunk 0", 6.5), ("ack src 1 chunk 0", 8.5),
                     ("ack src 0 chunk 1", 21.5), ("ack src 1 chunk 1", 21.6)]
LANE_OF_TID = {tid: lane for lane, tid in LANES.items()}


def complete(events):
    return sorted((e["name"], LANE_OF_TID[e["tid"]], e["ts"], e["dur"]) for e in events if e["ph"] == "X")


def instants(events):
    return sorted((e["name"], e["ts"]) for e in events if e["ph"] == "i")


def test_event_values_match_the_device_contract():
    assert {e.name: int(e) for e in Event} == {
        "PRODUCE_BEGIN": 0, "PUBLISHED": 1, "OBSERVED": 2, "PULLED": 3, "ACKED": 4, "EXPERTS_BEGIN": 5,
        "EXPERTS_DONE": 6, "COMBINE_DONE": 7, "DRAINED": 8, "OUTPUT_DONE": 9, "CALL_BEGIN": 10}


def test_spans_of_one_call():
    records = one_call()
    shuffled = records[np.random.default_rng(0).permutation(len(records))]  # append order is not time order
    events = spans(shuffled, rank=0)
    assert complete(events) == sorted(EXPECTED_SPANS)
    assert instants(events) == sorted(EXPECTED_INSTANTS)
    assert all(e["pid"] == 1 for e in events)  # pid = rank + 1: Perfetto reserves pid 0
    pull = next(e for e in events if e["name"] == "pull src 1 chunk 0")
    assert pull["args"] == {"src": 1, "chunk": 0} and pull["cat"] == "pull"
    ack = next(e for e in events if e["ph"] == "i" and e["name"].startswith("ack"))
    assert ack["s"] == "t"
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)


def test_spans_pair_two_calls_in_order():
    records = np.concatenate([one_call(), one_call(offset_ns=100_000)])
    events = spans(records, rank=0)
    second = [(name, lane, ts + 100.0, dur) for name, lane, ts, dur in EXPECTED_SPANS]
    assert complete(events) == sorted(EXPECTED_SPANS + second)
    assert not [e for e in events if e["cat"] == "unpaired"]


def test_unpaired_events_are_reported():
    records = one_call()
    missing = ((records[:, 0] == E.PULLED) & (records[:, 1] == 1) & (records[:, 2] == 1)) | \
              ((records[:, 0] == E.PRODUCE_BEGIN) & (records[:, 2] == 0))
    events = spans(records[~missing], rank=0)
    unpaired = sorted((e["name"], e["ts"], e["args"]["span"], e["args"]["src"], e["args"]["chunk"])
                      for e in events if e["cat"] == "unpaired")
    assert unpaired == [("unpaired OBSERVED", 11.0, "pull", 1, 1), ("unpaired PUBLISHED", 3.0, "produce", 0, 0)]
    names = {e["name"] for e in events if e["ph"] == "X"}
    assert "produce 0" not in names and "pull src 1 chunk 1" not in names and "produce 1" in names


def test_unknown_kind_is_reported():
    records = np.array([[99, 0, -1, BASE_NS]], dtype=np.int64)
    assert [e["name"] for e in spans(records, rank=0)] == ["unknown kind 99"]


@pytest.mark.parametrize("bad", [np.zeros((3,), np.int64), np.zeros((2, 3), np.int64), np.zeros((1, 4), np.float32)])
def test_spans_rejects_malformed_records(bad):
    with pytest.raises(ChunkringUsageError, match="records"):
        spans(bad, rank=0)


@pytest.mark.parametrize("capacity", [0, -1, True, 2.0, "8"])
def test_timeline_capacity_is_validated(capacity):
    with pytest.raises(ChunkringUsageError) as info:
        Timeline("cpu", capacity=capacity)
    assert info.value.field == "capacity"


def test_timeline_reads_records_and_reports_drops():
    timeline = Timeline("cpu", capacity=2)
    assert timeline.buffer.shape == (9,) and timeline.buffer.dtype == torch.int64 and timeline.capacity == 2
    assert timeline.records().shape == (0, 4)
    timeline.buffer[0] = 1
    timeline.buffer[1:5] = torch.tensor([int(E.PUBLISHED), 3, 7, BASE_NS])
    assert timeline.records().tolist() == [[int(E.PUBLISHED), 3, 7, BASE_NS]]
    assert timeline.dropped == 0
    timeline.buffer[0] = 5  # the device tried five appends; two were stored
    with pytest.raises(ChunkringRuntimeError, match="dropped 3 of 5 records.*raise the capacity"):
        timeline.records()
    assert timeline.records(allow_dropped=True).shape == (2, 4)
    assert timeline.dropped == 3


def test_timeline_clear():
    timeline = Timeline("cpu", capacity=4)
    timeline.buffer[0] = 3
    timeline.clear()
    assert timeline.records().shape == (0, 4)
    with pytest.raises(ChunkringUsageError, match="stream"):
        timeline.clear(stream=object())


def write_two_ranks(path, metadata=None):
    # Rank 1's clock starts 2 µs earlier: it sets the common origin.
    return write_chrome_trace(path, {0: one_call(), 1: one_call(offset_ns=-2000, rank=1)}, metadata)


def test_write_chrome_trace(tmp_path):
    path = tmp_path / "trace.json"
    write_two_ranks(path, {"config": "test"})
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ns"
    assert trace["otherData"] == {"config": "test", "time_origin_ns": BASE_NS - 2000, "unpaired_events": {}}
    names = {(e["name"], e["pid"], e.get("tid"), e["args"].get("name")) for e in trace["traceEvents"] if e["ph"] == "M"}
    for rank in (0, 1):
        assert ("process_name", rank + 1, LANES["producer"], f"rank {rank}") in names
        for lane, tid in LANES.items():
            assert ("thread_name", rank + 1, tid, lane) in names
    rank0 = [e for e in trace["traceEvents"] if e["pid"] == 1 and e["ph"] != "M"]
    assert complete(rank0) == sorted((n, lane, ts + 2.0, dur) for n, lane, ts, dur in EXPECTED_SPANS)
    assert min(e["ts"] for e in trace["traceEvents"] if e["ph"] != "M") == 0.0


def test_write_chrome_trace_counts_unpaired_and_guards_its_keys(tmp_path):
    records = one_call()
    trace = write_chrome_trace(tmp_path / "t.json", {3: records[records[:, 0] != E.COMBINE_DONE]})
    assert trace["otherData"]["unpaired_events"] == {"3": 1}
    with pytest.raises(ChunkringUsageError, match="time_origin_ns"):
        write_chrome_trace(tmp_path / "u.json", {0: records}, {"time_origin_ns": 1})


def load_plot_script():
    spec = importlib.util.spec_from_file_location("plot_timeline", REPO / "scripts" / "plot_timeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_plot_timeline_writes_a_png(tmp_path):
    trace, out = tmp_path / "trace.json", tmp_path / "timeline.png"
    records = one_call()
    write_chrome_trace(trace, {0: records[records[:, 0] != E.PULLED], 1: one_call(rank=1)})  # with unpaired ticks
    assert load_plot_script().main([str(trace), "-o", str(out), "--title", "two ranks"]) == 0
    assert out.read_bytes().startswith(b"\x89PNG") and out.stat().st_size > 1000
