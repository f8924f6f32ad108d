"""Bench: does streaming make the MoE layer faster end to end? Batch-ready against streamed, beside the
ideal overlap bound and a plain-torch peer, at every token count and chunk size of the config.

The launcher's entry point to :mod:`chunkring.testing.bench_moe`, which says what is measured and
how: here the config (the layer's keys, ``tokens``, ``chunks``, the timing and the traced shape, all
checked before any rank starts), the layers it measures (one per chunk size, on the config's SM
partition) and rank 0's progress bar. Figures are keyed ``n<tokens>_c<chunk>_<figure>`` and
``c<chunk>_auto_streams``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from chunkring.errors import ChunkringUsageError, UsageProblems

from ..config import check_range
from ..progress import progress
from .moe_workload import LayerFields, open_layer, transport_figures

if TYPE_CHECKING:  # imported where used: checking a config imports no torch
    from collections.abc import Iterator

    from chunkring import MoELayer, Runtime
    from chunkring.testing.bench_moe import Timing


def _ints(text: str, field: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ChunkringUsageError(f"expected comma-separated integers, got {text!r}", field=field) from None
    if not values or min(values) < 1:
        raise ChunkringUsageError(f"expected positive integers, got {text!r}", field=field)
    return values


@dataclass(frozen=True)
class CONFIG(LayerFields):
    tokens: str = "128,512,2048"   # tokens per rank to measure (comma-separated)
    chunks: str = "64,256"         # stream_slot_tokens values to measure (comma-separated)
    iterations: int = 20
    warmup: int = 3
    rotate: int = 4                # hidden-state buffers cycled through
    trace: str = ""                # "<tokens>:<chunk>": also record that shape's timeline (batch and streamed)
    trace_out: str = "timeline"    # where: <trace_out>-batch.json and <trace_out>-streamed.json (Chrome trace)

    @property
    def token_counts(self) -> tuple[int, ...]:
        return _ints(self.tokens, "tokens")

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        return _ints(self.chunks, "chunks")

    @property
    def trace_shape(self) -> tuple[int, int] | None:
        """(tokens, chunk) of the traced shape, or None."""
        if not self.trace:
            return None
        shape = _ints(self.trace.replace(":", ","), "trace")
        if len(shape) != 2 or shape[0] not in self.token_counts or shape[1] not in self.chunk_sizes:
            raise ChunkringUsageError(f"expected '<tokens>:<chunk>' of a measured shape, got {self.trace!r}",
                                      field="trace")
        return shape

    @property
    def timing(self) -> Timing:
        from chunkring.testing.bench_moe import Timing

        return Timing(iterations=self.iterations, warmup=self.warmup, rotate=self.rotate, seed=self.seed)

    def check(self, problems: UsageProblems) -> None:
        super().check(problems)
        for field in ("tokens", "chunks"):
            with problems.collect():
                most = max(_ints(getattr(self, field), field))
                if most > self.max_tokens_per_rank and not problems.reported("max_tokens_per_rank"):
                    problems.add(f"must be at most max_tokens_per_rank={self.max_tokens_per_rank}, got {most}",
                                 field=field)
        for name, top in (("iterations", 100_000), ("warmup", 1000), ("rotate", 64)):
            check_range(problems, self, name, 1, top)
        if not problems.reported("tokens", "chunks"):
            with problems.collect():
                _ = self.trace_shape  # checked before any rank starts GPU work


def run(runtime: Runtime, config: CONFIG) -> dict[str, Any]:
    """Every shape's figures on this rank (:func:`chunkring.testing.bench_moe.run`)."""
    from chunkring.testing import bench_moe

    total = len(config.chunk_sizes) * len(config.token_counts)
    bar = progress("bench", runtime.rank, total=total)

    used: dict[str, Any] = {}

    @contextlib.contextmanager
    def open_chunked(chunk: int) -> Iterator[MoELayer]:
        with open_layer(runtime, config, replace(config.layer_config(), stream_slot_tokens=chunk)) as layer:
            used.update(transport_figures(layer))  # which data path the times are of
            yield layer

    figures = bench_moe.run(runtime, open_chunked, chunk_sizes=config.chunk_sizes, token_counts=config.token_counts,
                            timing=config.timing, trace=config.trace_shape, trace_out=config.trace_out,
                            on_shape=bar.update)
    bar.close(total, "")
    return {**figures, **used}
