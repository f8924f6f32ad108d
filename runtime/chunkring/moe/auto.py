"""What a layer's ``streaming="auto"`` calls do: the decision :func:`chunkring.moe.calibration.calibrate`
measures on this machine, as data (no measurement here, so the call checks and the layer can hold it).

Two choices, made differently because different things must agree:

* the mode - batch-ready or streamed - is one per layer: every rank of a call must publish into and pull from
  the same ring, and the ranks' token counts differ, so no rank can choose by its own count. ``"auto"``
  streams only if, at every calibrated count, some chunking streamed no slower than batch-ready (within
  ``tolerance``);
* the chunk size is per call and per rank: a consumer takes each source's chunks as they come, whatever
  their size, so each rank streams its call in the chunking measured fastest at the calibrated count that
  governs its token count (the smallest calibrated count at or above it; the largest beyond them all).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from chunkring.errors import ChunkringUsageError

__all__ = ["DEFAULT_TOLERANCE", "StreamingCalibration"]

#: How much slower than batch-ready streaming may have measured, at a calibrated count, for "auto" to stream:
#: the measurement's own spread (graph replays of one call repeat within about 1 %), not a price paid.
DEFAULT_TOLERANCE = 0.01


@dataclass(frozen=True)
class StreamingCalibration:
    """What :func:`chunkring.moe.calibration.calibrate` measured, the slowest rank's figure of each option.

    ``batch_ms``: per calibrated token count, a batch-ready call's time. ``streamed_ms``: per calibrated
    count, {chunk size: a streamed call's time in chunks of that many tokens}. ``tolerance``: as
    :data:`DEFAULT_TOLERANCE` says.
    """

    batch_ms: dict[int, float]
    streamed_ms: dict[int, dict[int, float]]
    tolerance: float = DEFAULT_TOLERANCE
    #: Decided once from the figures, so that a call - traced by torch.compile too - reads an int and a bool,
    #: never compares the measured floats (which a recompile may treat as symbolic): per calibrated count, the
    #: chunk size that streamed fastest (the smaller on a tie); whether ``streaming="auto"`` calls stream.
    best_chunks: dict[int, int] = field(init=False, repr=False, compare=False)
    streams: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Figures may come from anywhere (saved, rebuilt, edited): a chunk size the layer would publish in must be
        # a positive int, or a streamed call would publish nothing, or fail inside its schedule.
        if not isinstance(self.batch_ms, dict) or not isinstance(self.streamed_ms, dict):
            raise ChunkringUsageError("batch_ms and streamed_ms must be dicts", field="streamed_ms")
        for count, ms in self.batch_ms.items():
            _check_count(count, "batch_ms")
            _check_ms(ms, "batch_ms")
        for count, chunks in self.streamed_ms.items():
            _check_count(count, "streamed_ms")
            if not isinstance(chunks, dict):
                raise ChunkringUsageError(f"expected {{chunk size: ms}} at {count} tokens, got {chunks!r}",
                                          field="streamed_ms")
            for chunk, ms in chunks.items():
                _check_count(chunk, "streamed_ms")
                _check_ms(ms, "streamed_ms")
        if isinstance(self.tolerance, bool) or not isinstance(self.tolerance, int | float) or \
                not 0 <= self.tolerance < 1:
            raise ChunkringUsageError(f"expected a number in [0, 1), got {self.tolerance!r}", field="tolerance")
        if not self.batch_ms or set(self.batch_ms) != set(self.streamed_ms):
            raise ChunkringUsageError("needs figures for the same, non-empty set of token counts in both modes",
                                      field="streamed_ms")
        if any(not chunks for chunks in self.streamed_ms.values()):
            raise ChunkringUsageError("needs at least one chunk size measured at each count", field="streamed_ms")
        best = {count: min(sorted(chunks), key=chunks.__getitem__) for count, chunks in self.streamed_ms.items()}
        object.__setattr__(self, "best_chunks", best)  # frozen: set once, here
        object.__setattr__(self, "streams", all(self.streamed_ms[n][best[n]] <= (1 + self.tolerance) * batch
                                                for n, batch in self.batch_ms.items()))

    def governing_count(self, n: int) -> int:
        """The calibrated count whose figures decide a call of ``n`` tokens."""
        counts = sorted(self.batch_ms)
        return next((c for c in counts if c >= n), counts[-1])

    def best_chunk(self, count: int) -> int:
        """The chunk size that streamed fastest at calibrated ``count`` (the smaller on a tie)."""
        return self.best_chunks[count]

    def chunk_for(self, n: int) -> int:
        """The chunk size a streamed call of ``n`` tokens publishes in (the caller caps it at its slot)."""
        return self.best_chunk(self.governing_count(n))

    def describe(self) -> str:
        parts = []
        for n in sorted(self.batch_ms):
            chunk = self.best_chunk(n)
            parts.append(f"{n} tokens {self.streamed_ms[n][chunk] / self.batch_ms[n]:.3f} (chunks of {chunk})")
        verdict = "stream" if self.streams else "run batch-ready"
        return (f'streaming="auto" calls {verdict}: best streamed / batch-ready {", ".join(parts)} '
                f"(tolerance {self.tolerance:.0%})")


def _check_count(value: object, field: str) -> None:
    """A token count or chunk size: an int >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ChunkringUsageError(f"token counts and chunk sizes must be ints >= 1, got {value!r}", field=field)


def _check_ms(value: object, field: str) -> None:
    """A measured time: a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ChunkringUsageError(f"times must be finite numbers > 0, got {value!r}", field=field)
