"""What a layer's ``streaming="auto"`` calls do: the decision :func:`chunkring.moe.calibration.calibrate`
measures on this machine, as data (no measurement here, so the call checks and the layer can hold it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_TOLERANCE", "StreamingCalibration"]

#: How much slower than batch-ready streamed may be, at every calibrated count, for "auto" to stream.
DEFAULT_TOLERANCE = 0.03


@dataclass(frozen=True)
class StreamingCalibration:
    """What :func:`chunkring.moe.calibration.calibrate` measured: per token count, the slowest rank's
    (batch-ready ms, streamed ms), and the tolerance streamed had to meet everywhere for ``"auto"`` to stream."""

    figures: dict[int, tuple[float, ...]]  # token count -> (batch-ready ms, streamed ms)
    tolerance: float

    @property
    def streams(self) -> bool:
        """Whether ``streaming="auto"`` calls stream."""
        return all(streamed <= (1 + self.tolerance) * batch for batch, streamed in self.figures.values())

    def describe(self) -> str:
        ratios = ", ".join(f"{n} tokens {s / b:.3f}" for n, (b, s) in sorted(self.figures.items()))
        verdict = "stream" if self.streams else "run batch-ready"
        return f'streaming="auto" calls {verdict}: streamed / batch-ready {ratios} (tolerance {self.tolerance:.0%})'
