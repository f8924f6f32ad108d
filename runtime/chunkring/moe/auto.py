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

from dataclasses import dataclass

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

    def __post_init__(self) -> None:
        if not self.batch_ms or set(self.batch_ms) != set(self.streamed_ms):
            raise ChunkringUsageError("needs figures for the same, non-empty set of token counts in both modes",
                                      field="streamed_ms")
        if any(not chunks for chunks in self.streamed_ms.values()):
            raise ChunkringUsageError("needs at least one chunk size measured at each count", field="streamed_ms")

    def governing_count(self, n: int) -> int:
        """The calibrated count whose figures decide a call of ``n`` tokens."""
        counts = sorted(self.batch_ms)
        return next((c for c in counts if c >= n), counts[-1])

    def best_chunk(self, count: int) -> int:
        """The chunk size that streamed fastest at calibrated ``count`` (the smaller on a tie)."""
        options = self.streamed_ms[count]
        return min(sorted(options), key=lambda chunk: options[chunk])

    @property
    def streams(self) -> bool:
        """Whether ``streaming="auto"`` calls stream."""
        return all(self.streamed_ms[n][self.best_chunk(n)] <= (1 + self.tolerance) * batch
                   for n, batch in self.batch_ms.items())

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
