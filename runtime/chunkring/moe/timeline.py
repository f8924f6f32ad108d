"""The MoE layer's timeline: device timestamps of chunk events, and their export as a Chrome trace.

A :class:`Timeline` owns the buffer the layer's kernels append to (device/include/chunkring/moe/
timeline.cuh): ``buffer[0]`` counts the appends tried, record ``i`` is ``buffer[1 + 4 * i : 5 + 4 * i] =
(kind, src, chunk, t_ns)``; appends past ``capacity`` are counted but not stored. ``t_ns`` is the GPU's
``%globaltimer``: one nanosecond clock per GPU, shared by every SM and process on it.

:func:`spans` turns one rank's records into Chrome trace events (pure numpy, no GPU) and
:func:`write_chrome_trace` writes several ranks' into one JSON file for Perfetto (ui.perfetto.dev) or
chrome://tracing; ``scripts/plot_timeline.py`` draws that file as a PNG.
"""

from __future__ import annotations

import enum
import json
import os
from collections import defaultdict, deque

import numpy as np
import numpy.typing as npt
import torch

from chunkring.errors import ChunkringRuntimeError, ChunkringUsageError

__all__ = ["LANES", "Event", "Timeline", "spans", "write_chrome_trace"]


class Event(enum.IntEnum):
    """Mirrors moe/timeline.cuh Event (append-only): what a record marks."""

    PRODUCE_BEGIN = 0  # producer stream, before chunk's router/top-k/quantise work
    PUBLISHED = 1  # producer stream, after chunk's publish kernel (its ready signal sent)
    OBSERVED = 2  # consumer kernel: saw source src's chunk ready (acquire done)
    PULLED = 3  # consumer kernel: the chunk's rows routed to this rank copied out of the slot
    ACKED = 4  # consumer: this rank acknowledged source src's chunk (the slot may be reused)
    EXPERTS_BEGIN = 5  # consumer stream, before the expert computation (chunk -1)
    EXPERTS_DONE = 6  # consumer stream, after the grouped GEMMs
    COMBINE_DONE = 7  # consumer stream, after the combine rows were pushed to their sources
    DRAINED = 8  # producer stream: every destination acknowledged every chunk of this rank (chunk -1)
    OUTPUT_DONE = 9  # producer stream: this rank's output reduced (chunk -1)
    CALL_BEGIN = 10  # producer stream, start of the call (chunk -1)


#: Trace thread id of each lane. Ids start at 1 and pids are ``rank + 1``: Perfetto treats pid/tid 0
#: as the kernel's idle task, and string ids are an import hack that shares one id across processes.
LANES = {"producer": 1, "consumer": 2}

_KNOWN_KINDS = frozenset(int(kind) for kind in Event)
_PRODUCER_KINDS = frozenset({Event.PRODUCE_BEGIN, Event.PUBLISHED, Event.DRAINED, Event.OUTPUT_DONE, Event.CALL_BEGIN})

# Spans paired in order per (src, chunk): (family, lane, begin kind, end kind).
_PAIRED_SPANS = (
    ("produce", "producer", Event.PRODUCE_BEGIN, Event.PUBLISHED),
    ("reduce", "producer", Event.DRAINED, Event.OUTPUT_DONE),
    ("pull", "consumer", Event.OBSERVED, Event.PULLED),
    ("experts", "consumer", Event.EXPERTS_BEGIN, Event.EXPERTS_DONE),
    ("combine", "consumer", Event.EXPERTS_DONE, Event.COMBINE_DONE),
)

# Keys write_chrome_trace adds to otherData; a caller's metadata may not use them.
_RESERVED_METADATA = ("time_origin_ns", "unpaired_events")


def _lane_of(kind: int) -> str:
    return "producer" if kind in _PRODUCER_KINDS else "consumer"


def _kind_name(kind: int) -> str:
    try:
        return Event(kind).name
    except ValueError:  # a newer device side may append kinds this host does not know
        return f"kind {kind}"


class Timeline:
    """A zeroed int64 buffer of ``capacity`` records on ``device``, for the layer's kernels to append to.

    Pass it to a layer call (``timeline=``); read it with :meth:`records` after the call. It is not
    cleared between calls: records of several calls accumulate (``spans`` pairs them in order) until
    :meth:`clear`.
    """

    def __init__(self, device: torch.device | str | int, capacity: int = 4096) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ChunkringUsageError(f"must be a positive int, got {capacity!r}", field="capacity")
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ChunkringUsageError(f"not a torch device: {device!r} ({exc})", field="device") from None
        self._capacity = capacity
        self._buffer = torch.zeros(1 + 4 * capacity, dtype=torch.int64, device=device)

    @property
    def buffer(self) -> torch.Tensor:
        """The int64 tensor ``[1 + 4 * capacity]`` the kernels append to."""
        return self._buffer

    @property
    def capacity(self) -> int:
        """How many records the buffer stores; appends past it are counted, not stored."""
        return self._capacity

    def clear(self, stream: torch.cuda.Stream | None = None) -> None:
        """Forget every record: zero the count on ``stream`` (default: the current stream).

        Stream-ordered, with no host synchronisation, so it can be captured in a CUDA graph. The
        records themselves stay; the count alone says how many are valid.
        """
        if stream is None:
            self._buffer[:1].zero_()
            return
        if self._buffer.device.type != "cuda":
            raise ChunkringUsageError(f"a stream applies to a CUDA timeline, this one is on {self._buffer.device}",
                                      field="stream")
        with torch.cuda.stream(stream):
            self._buffer[:1].zero_()

    def _attempted(self) -> int:
        """Synchronise the device (the kernels append from several streams) and read the count."""
        if self._buffer.device.type == "cuda":
            torch.cuda.synchronize(self._buffer.device)
        attempted = int(self._buffer[0].item())
        if attempted < 0:
            raise ChunkringRuntimeError(f"timeline count is {attempted}: the buffer was overwritten")
        return attempted

    @property
    def dropped(self) -> int:
        """How many appends found the buffer full (synchronises the device)."""
        return max(0, self._attempted() - self._capacity)

    def records(self, *, allow_dropped: bool = False) -> np.ndarray:
        """The stored records, int64 ``[m, 4]`` of (kind, src, chunk, t_ns) in append order.

        Synchronises the device, then copies ``m = min(count, capacity)`` records to the host. Raises
        :class:`ChunkringRuntimeError` if appends were dropped (the timeline would miss the latest
        events) unless ``allow_dropped``.
        """
        attempted = self._attempted()
        dropped = attempted - self._capacity
        if dropped > 0 and not allow_dropped:
            raise ChunkringRuntimeError(
                f"the timeline dropped {dropped} of {attempted} records (capacity {self._capacity}): "
                f"raise the capacity to at least {attempted}, clear it between calls, or pass allow_dropped=True")
        stored = min(attempted, self._capacity)
        # A copy: on a CPU timeline .cpu() would alias the buffer the next call overwrites.
        return self._buffer[1:1 + 4 * stored].cpu().numpy().reshape(stored, 4).copy()


def _checked_records(records: npt.ArrayLike) -> np.ndarray:
    array = np.asarray(records)
    if array.ndim != 2 or array.shape[1] != 4 or not np.issubdtype(array.dtype, np.integer):
        raise ChunkringUsageError(f"expected an integer array [m, 4], got {array.dtype} {array.shape}",
                                  field="records")
    return array.astype(np.int64, copy=False)


def _time_ordered(records: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Records as (kind, src, chunk, t_ns) tuples by time; equal times keep append order, which is
    causal for events of one stream."""
    order = np.argsort(records[:, 3], kind="stable")
    return [(int(kind), int(src), int(chunk), int(t)) for kind, src, chunk, t in records[order]]


class _TraceBuilder:
    """Builds one rank's trace events with timestamps in microseconds from ``origin_ns``."""

    def __init__(self, rank: int, origin_ns: int) -> None:
        self.pid = rank + 1
        self.origin_ns = origin_ns
        self.events: list[dict] = []

    def _us(self, t_ns: int) -> float:
        return (t_ns - self.origin_ns) / 1000.0

    def span(self, name: str, family: str, lane: str, begin_ns: int, end_ns: int, src: int, chunk: int) -> None:
        self.events.append({"ph": "X", "name": name, "cat": family, "pid": self.pid, "tid": LANES[lane],
                            "ts": self._us(begin_ns), "dur": (end_ns - begin_ns) / 1000.0,
                            "args": {"src": src, "chunk": chunk}})

    def instant(self, name: str, family: str, lane: str, t_ns: int, src: int, chunk: int, **args: object) -> None:
        self.events.append({"ph": "i", "s": "t", "name": name, "cat": family, "pid": self.pid, "tid": LANES[lane],
                            "ts": self._us(t_ns), "args": {"src": src, "chunk": chunk, **args}})

    def unpaired(self, kind: int, span_family: str, t_ns: int, src: int, chunk: int) -> None:
        self.instant(f"unpaired {_kind_name(kind)}", "unpaired", _lane_of(kind), t_ns, src, chunk, span=span_family)


def _span_name(family: str, src: int, chunk: int) -> str:
    if family == "produce":
        return f"produce {chunk}"
    if family in ("pull", "wait"):
        return f"{family} src {src} chunk {chunk}"
    return family


def _add_paired(trace: _TraceBuilder, events: list[tuple[int, int, int, int]], family: str, lane: str, begin: Event,
                end: Event) -> None:
    """The k-th ``begin`` of a (src, chunk) with its k-th ``end``; leftovers become ``unpaired`` instants."""
    open_begins: dict[tuple[int, int], deque[int]] = defaultdict(deque)
    for kind, src, chunk, t in events:
        if kind == begin:
            open_begins[(src, chunk)].append(t)
        elif kind == end:
            if open_begins[(src, chunk)]:
                trace.span(_span_name(family, src, chunk), family, lane, open_begins[(src, chunk)].popleft(), t,
                           src, chunk)
            else:
                trace.unpaired(kind, family, t, src, chunk)
    for (src, chunk), times in open_begins.items():
        for t in times:
            trace.unpaired(begin, family, t, src, chunk)


def _add_drains(trace: _TraceBuilder, events: list[tuple[int, int, int, int]]) -> None:
    """``drain``: from the last PUBLISHED before each DRAINED (and after the one before it) to it."""
    last_published = None
    for kind, src, chunk, t in events:
        if kind == Event.PUBLISHED:
            last_published = t
        elif kind == Event.DRAINED:
            if last_published is None:
                trace.unpaired(kind, "drain", t, src, chunk)
            else:
                trace.span("drain", "drain", "producer", last_published, t, src, chunk)
            last_published = None


def _add_waits(trace: _TraceBuilder, events: list[tuple[int, int, int, int]]) -> None:
    """``wait``: from the consumer lane's previous event (or a later CALL_BEGIN) to each OBSERVED; the
    consumer works through chunks one at a time, so these never overlap its other spans."""
    previous = None
    for kind, src, chunk, t in events:
        if kind == Event.OBSERVED and previous is not None:
            trace.span(_span_name("wait", src, chunk), "wait", "consumer", previous, t, src, chunk)
        if kind == Event.CALL_BEGIN or _lane_of(kind) == "consumer":
            previous = t


def _add_instants(trace: _TraceBuilder, events: list[tuple[int, int, int, int]]) -> None:
    for kind, src, chunk, t in events:
        if kind == Event.ACKED:
            trace.instant(f"ack src {src} chunk {chunk}", "ack", "consumer", t, src, chunk)
        elif kind == Event.CALL_BEGIN:
            trace.instant("call begin", "call", "producer", t, src, chunk)
        elif kind not in _KNOWN_KINDS:
            trace.instant(f"unknown {_kind_name(kind)}", "unknown", "consumer", t, src, chunk)


def spans(records: npt.ArrayLike, rank: int, origin_ns: int | None = None) -> list[dict]:
    """One rank's records as Chrome trace events, sorted by time.

    ``records``: int array ``[m, 4]`` from :meth:`Timeline.records`. ``origin_ns``: the time that
    becomes ``ts = 0`` (default: the earliest of these records). Complete events (``"ph": "X"``, ``ts``
    and ``dur`` in microseconds) on lane ``producer``: ``produce c``, ``drain``, ``reduce``; on lane
    ``consumer``: ``wait src s chunk c``, ``pull src s chunk c``, ``experts``, ``combine``. Instant
    events (``"ph": "i"``): ``ack src s chunk c``, ``call begin``, and ``unpaired KIND`` for each begin
    or end that found no partner (``args["span"]`` names the span it would have been part of).
    Records of several calls pair in order. ``pid`` is ``rank + 1``, ``tid`` the lane's id in
    :data:`LANES`, ``cat`` the span's family (the plot's colour), ``args`` its ``src`` and ``chunk``.
    """
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ChunkringUsageError(f"must be a non-negative int, got {rank!r}", field="rank")
    records = _checked_records(records)
    if origin_ns is None:
        origin_ns = int(records[:, 3].min()) if len(records) else 0
    events = _time_ordered(records)
    trace = _TraceBuilder(rank, origin_ns)
    for family, lane, begin, end in _PAIRED_SPANS:
        _add_paired(trace, events, family, lane, begin, end)
    _add_drains(trace, events)
    _add_waits(trace, events)
    _add_instants(trace, events)
    return sorted(trace.events, key=lambda e: (e["ts"], e["tid"], e["name"]))


def _lane_metadata(rank: int) -> list[dict]:
    """Perfetto/chrome://tracing names and orders the tracks from these ("ph": "M", no ts)."""
    pid = rank + 1
    events = [{"ph": "M", "name": "process_name", "pid": pid, "tid": LANES["producer"],
               "args": {"name": f"rank {rank}"}},
              {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": LANES["producer"],
               "args": {"sort_index": rank}}]
    for lane, tid in LANES.items():
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return events


def _earliest_ns(records_by_rank: dict[int, np.ndarray]) -> int:
    starts = [int(r[:, 3].min()) for r in records_by_rank.values() if len(r)]
    return min(starts) if starts else 0


def write_chrome_trace(path: str | os.PathLike[str], records_by_rank: dict[int, npt.ArrayLike],
                       metadata: dict | None = None) -> dict:
    """Write the ranks' records as one Chrome trace JSON file; returns what it wrote.

    ``records_by_rank``: rank -> int array ``[m, 4]`` (:meth:`Timeline.records`, gathered from each
    rank). Each rank is a process named ``rank r`` with lanes ``producer`` and ``consumer``
    (:func:`spans`). Every timestamp is measured from the earliest record of all ranks, so the trace
    starts at 0. ``otherData`` is ``metadata`` plus ``time_origin_ns`` (that earliest ``%globaltimer``
    value) and ``unpaired_events`` (rank -> count of ``unpaired`` instants, for ranks with any).

    ``%globaltimer`` is one clock per GPU: ranks on one GPU share a clock, but ranks on different GPUs
    are aligned only as well as their GPUs' timers are, so read cross-GPU gaps of a few microseconds
    with care.
    """
    if not isinstance(records_by_rank, dict):
        raise ChunkringUsageError(f"expected a dict rank -> records, got {type(records_by_rank).__name__}",
                                  field="records_by_rank")
    metadata = dict(metadata or {})
    for key in _RESERVED_METADATA:
        if key in metadata:
            raise ChunkringUsageError(f"{key!r} is written by write_chrome_trace itself", field="metadata")
    checked = {rank: _checked_records(records) for rank, records in sorted(records_by_rank.items())}
    origin_ns = _earliest_ns(checked)
    trace_events, unpaired = [], {}
    for rank, records in checked.items():
        rank_events = spans(records, rank, origin_ns)
        count = sum(1 for e in rank_events if e["cat"] == "unpaired")
        if count:
            unpaired[str(rank)] = count
        trace_events += _lane_metadata(rank) + rank_events
    trace = {"traceEvents": trace_events, "displayTimeUnit": "ns",
             "otherData": {**metadata, "time_origin_ns": origin_ns, "unpaired_events": unpaired}}
    with open(os.fspath(path), "w") as f:
        json.dump(trace, f, indent=None, separators=(",", ":"))
    return trace
