"""Evidence for streaming: does a streamed call overlap its producers with its consumer, and what does each
chunk cost beyond that overlap? Issue 19 item 5.

    python benchmarks/bench_overlap.py [--shapes flash,v3] [--tokens 2048] [--chunks 256,512,1024]
        [--waves 1,4] [--iterations 10] [--json benchmarks/results/<commit>-overlap.json] [--no-timeline]
    mpirun -np N python benchmarks/bench_overlap.py ...      (N ranks, e.g. sharing one GPU under MPS)

Shapes are one rank's share (``experts`` local experts per rank, so ``num_experts = experts * ranks``):
``flash`` is bench_vs_megamoe.py's (DeepGEMM's per-rank shape: 32 experts, hidden 4096, intermediate 2048,
top-6); ``v3`` the producer-heavy one (hidden 7168, top-8, 32 experts per rank: at 8 ranks the router spans
256 experts, DeepSeek-V3's routing; wider rows to route, quantise and publish per token than flash).
Each layer is built as a serving caller builds it: ``MoELayer(runtime, config)``, so streamed calls run on
the default SM partition (``partition="auto"``) and batch-ready calls on the whole GPU.

Per shape, token count and chunk size, every rank measures (CUDA-graph replays, median of ``--iterations``
after warm-up, ranks started together: :func:`chunkring.moe.calibrate.replay_median_ms`):

* ``batch_ms``: :meth:`MoELayer.forward` batch-ready (router GEMM, fused producer, dispatch, experts, combine);
* ``streamed_ms``: the same call streamed in chunks of ``chunk`` tokens;
* ``P_ms``, the producers alone: exactly the streamed call's producer work - per chunk the router GEMM and
  the fused producer kernel (route, quantise, publish) - on the layer's producer partition, publishing into
  a scratch ring of the same shape that a trivial consumer (``ring_gather`` with the pull's grid, on the
  consumer partition) drains, so no publish waits for a slot and no expert work runs;
* ``Q_ms``, the consumer alone: batch-ready :meth:`MoELayer.run` on the already routed and quantised batch
  (whole GPU; bench_moe.py's Q);
* ``bound_ms`` = ``max(P, Q) + min(P, Q) / chunks`` (:func:`overlap_bound`): a perfect pipeline of the two;
* ``per_chunk_cost_us`` = ``(streamed - bound) / chunks`` in µs (:func:`per_chunk_cost_us`): what streaming
  costs per chunk beyond perfect overlap - each chunk's launches and ring handshake, the consumer's waits
  for chunks, and the consumer's confinement to its partition, spread over the chunks. Ideal streaming
  scores 0; negative would mean the call beat the bound (P or Q measured high).

Every measurement is repeated per ``--waves`` value (``MoEConfig.waves``: 1, the default, computes the
experts after the last chunk; 2-8 compute incremental expert blocks in waves while chunks arrive), each
record carrying its ``waves``. Records come for the default ring (``chunk_kind`` "default":
:meth:`MoEConfig.with_default_ring`, 2 slots of ``max_tokens_per_rank / 16``) and for the best chunk size
(``chunk_kind`` "best": the lowest streamed time over the default and ``--chunks``). With the timeline on,
the default ring's streamed call at the largest token count and the largest ``--waves`` value is recorded
once per shape (:class:`chunkring.Timeline`) and rank 0 writes it as a Chrome trace and, if matplotlib is
installed, a PNG (scripts/plot_timeline.py) next to the JSON: produce spans per chunk on the producer lane,
the pulls and the expert work on the consumer lane.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from chunkring.moe.weights import Fp8Weight

SHAPES = {"flash": dict(experts=32, hidden=4096, intermediate=2048, topk=6),
          "v3": dict(experts=32, hidden=7168, intermediate=2048, topk=8)}

#: Record keys every record carries, in the order the table prints them.
RECORD_KEYS = ("shape", "tokens", "chunk", "chunk_kind", "waves", "chunks", "batch_ms", "streamed_ms", "P_ms", "Q_ms",
               "bound_ms", "per_chunk_cost_us", "streamed_over_batch", "streamed_over_bound")


def overlap_bound(P: float, Q: float, chunks: int) -> float:
    """The time of a perfect pipeline of producers (P) and consumer (Q) over ``chunks`` chunks: the longer
    side whole, plus one chunk's worth of the shorter (the first chunk's production or the last one's
    consumption, which nothing overlaps)."""
    if chunks < 1 or P < 0 or Q < 0:
        raise ValueError(f"need chunks >= 1 and non-negative times, got P={P}, Q={Q}, chunks={chunks}")
    return max(P, Q) + min(P, Q) / chunks


def per_chunk_cost_us(streamed_ms: float, bound_ms: float, chunks: int) -> float:
    """Streaming's overhead per chunk in µs: the streamed call's time beyond the overlap bound, per chunk."""
    if chunks < 1:
        raise ValueError(f"need chunks >= 1, got {chunks}")
    return (streamed_ms - bound_ms) * 1e3 / chunks


def shape_record(shape: str, tokens: int, chunk: int, measured: dict) -> dict:
    """One record from the measured ``batch_ms``, ``streamed_ms``, ``P_ms`` and ``Q_ms`` (other keys of
    ``measured`` are kept) and what follows from them."""
    chunks = -(-tokens // chunk)
    bound = overlap_bound(measured["P_ms"], measured["Q_ms"], chunks)
    return {**measured, "shape": shape, "tokens": tokens, "chunk": chunk, "chunks": chunks, "bound_ms": bound,
            "per_chunk_cost_us": per_chunk_cost_us(measured["streamed_ms"], bound, chunks),
            "streamed_over_batch": measured["streamed_ms"] / measured["batch_ms"],
            "streamed_over_bound": measured["streamed_ms"] / bound}


def pick_records(by_chunk: dict[int, dict], default_chunk: int) -> list[dict]:
    """The default ring's record and the best chunk size's (lowest ``streamed_ms``; the smaller chunk on a
    tie), each marked by ``chunk_kind``; the default one is also the best when no other chunk beat it."""
    best = min(sorted(by_chunk), key=lambda c: by_chunk[c]["streamed_ms"])
    return [{**by_chunk[default_chunk], "chunk_kind": "default"}, {**by_chunk[best], "chunk_kind": "best"}]


def chunk_sizes(default_chunk: int, extra: list[int], tokens: int) -> list[int]:
    """The chunk sizes to measure at ``tokens`` tokens: the default ring's and those of ``extra`` up to the
    batch (a larger chunk would measure the same single chunk again)."""
    return sorted({default_chunk, *(c for c in extra if c <= tokens)})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="flash,v3", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--tokens", default="2048", help="tokens per rank (comma-separated)")
    parser.add_argument("--chunks", default="256,512,1024", help="chunk sizes besides the default ring's")
    parser.add_argument("--waves", default="1", help="MoEConfig.waves values, comma-separated (1: the batch plan; "
                        "2-8: incremental expert blocks computed in waves while chunks arrive)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None, help="the result file (rank 0 writes it)")
    parser.add_argument("--no-timeline", action="store_true", help="skip the timeline trace and PNG")
    args = parser.parse_args(argv)
    try:
        args.shapes = [s for s in args.shapes.split(",") if s]
        args.tokens = [int(t) for t in args.tokens.split(",") if t]
        args.chunks = [int(c) for c in args.chunks.split(",") if c]
        args.waves = [int(w) for w in args.waves.split(",") if w]
    except ValueError:
        parser.error("--tokens, --chunks and --waves take comma-separated integers")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown or not args.shapes:
        parser.error(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    if not args.tokens or min(args.tokens + args.chunks, default=1) < 1:
        parser.error("token counts and chunk sizes must be positive")
    if not args.waves or not all(1 <= w <= 8 for w in args.waves):
        parser.error("--waves takes values in [1, 8]")
    if args.iterations < 1 or args.warmup < 0:
        parser.error("--iterations must be >= 1 and --warmup >= 0")
    return args


class _Shape:
    """One shape's weights (this rank's experts, drawn on the GPU once) and inputs per token count."""

    def __init__(self, name: str, runtime, seed: int = 0):
        import torch

        from chunkring import MoEConfig

        self.name, self.runtime, spec = name, runtime, SHAPES[name]
        self.config = MoEConfig(num_experts=spec["experts"] * runtime.world_size, hidden=spec["hidden"],
                                intermediate=spec["intermediate"], topk=spec["topk"], max_tokens_per_rank=1)
        self.gen = torch.Generator(runtime.torch_device).manual_seed(seed * 7919 + runtime.rank)
        E, H, inter, device = spec["experts"], spec["hidden"], spec["intermediate"], runtime.torch_device
        self.router = (torch.randn(self.config.num_experts, H, generator=self.gen, device=device) / H**0.5).bfloat16()
        self.w13_bf16 = (torch.randn(E, 2 * inter, H, generator=self.gen, device=device) / H**0.5).bfloat16()
        self.w2_bf16 = (torch.randn(E, H, inter, generator=self.gen, device=device) / inter**0.5).bfloat16()
        # the layer's format, from the first layer (MoELayer.expert_weights)
        self._weights: tuple[Fp8Weight | torch.Tensor, Fp8Weight | torch.Tensor] | None = None

    def layer(self, max_tokens: int, chunk: int | None, waves: int = 1):
        """A layer for batches of up to ``max_tokens``, its ring the default (``chunk`` None) or slots of
        ``chunk`` tokens, its streamed calls in ``waves`` waves; the default partition for streamed calls."""
        from chunkring import MoELayer

        cfg = dataclasses.replace(self.config, max_tokens_per_rank=max_tokens, waves=waves).with_default_ring()
        if chunk is not None:
            cfg = dataclasses.replace(cfg, front_tokens_per_slot=chunk)
        layer = MoELayer(self.runtime, cfg)
        if self._weights is None:
            self._weights = layer.expert_weights(self.w13_bf16, self.w2_bf16)
        return layer

    @property
    def weights(self) -> tuple[Fp8Weight | torch.Tensor, Fp8Weight | torch.Tensor]:
        """(w13, w2) of this rank's experts in the layer's format: made by the first :meth:`layer`."""
        assert self._weights is not None, "call layer() first"
        return self._weights

    def inputs(self, n: int) -> tuple:
        """(hidden bf16 [n, H], the routed FP8 batch MoELayer.run takes) for ``n`` tokens."""
        import torch

        from chunkring.moe.producer import quantize_rows_fp8, route

        hidden = torch.randn(n, self.config.hidden, generator=self.gen, device=self.runtime.torch_device).bfloat16()
        idx, w = route(hidden, self.router, self.config.topk)
        x, x_sf = quantize_rows_fp8(hidden)
        return hidden, (x, x_sf, idx, w)


class _ProducersAlone:
    """The streamed call's producer work without its consumer (``P_ms``): a scratch ring of the layer's
    streaming spec (or with ``num_slots`` slots: as many as a call's chunks, no publish waits for an ack),
    drained by ``ring_gather`` with the layer's pull grid on the consumer partition; with ``drain=False`` not
    drained (a profiler's single call into a ring of a slot per chunk: no publish waits, nothing spins)."""

    def __init__(self, layer, num_slots: int | None = None, drain: bool = True):
        import torch

        from chunkring import Ring
        from chunkring.moe.calls import CallMode
        from chunkring.ring.io import GatherOutputs

        self.layer, self.mode, self.drain = layer, CallMode.STREAMED, drain
        spec = layer.rings[self.mode].spec
        if num_slots is not None:
            spec = dataclasses.replace(spec, num_slots=num_slots)
        self.ring = Ring(layer.runtime, spec, timeout_s=60)
        self.out = GatherOutputs(self.ring, layer.config.max_tokens_per_rank)
        self.arrivals = torch.zeros(1, dtype=torch.int32, device=layer.runtime.torch_device)
        self.max_blocks = layer.stats()["producer_grid_max"]  # the layer's own streamed-call grid

    def __call__(self, hidden, router_weight) -> None:
        import torch

        from chunkring.moe.producer import enqueue_produce, router_logits
        from chunkring.ring.io import gather

        layer, n = self.layer, hidden.shape[0]
        T = self.ring.spec.tokens_per_slot
        producer, consumer = layer.streams(self.mode)
        caller = torch.cuda.current_stream()
        producer.wait_stream(caller)
        consumer.wait_stream(caller)
        # The drain first: a small grid spinning for chunks leaves the producers their SMs (PROTOCOL.md,
        # "Progress" 2), and an eager call never queues a publish that waits behind an absent consumer.
        if self.drain:
            gather(self.ring, self.out, grid=layer.stats()["pull_grid"], stream=consumer)
        with torch.cuda.stream(producer):
            for start in range(0, max(n, 1), T):
                chunk = hidden[start:start + T]
                logits = router_logits(chunk, router_weight)
                enqueue_produce(self.ring, layer._produce_kernels, logits, chunk, start, start + T >= n, None, None,
                                self.arrivals, producer, self.max_blocks)
        caller.wait_stream(producer)
        caller.wait_stream(consumer)

    def destroy(self) -> None:
        self.ring.destroy()


def measure(shape: _Shape, n: int, chunks: list[int], args, default_chunk: int, waves: int) -> dict[int, dict]:
    """Every chunk size's measured figures at ``n`` tokens with ``waves`` (batch_ms and Q_ms once, with the
    first layer)."""
    import torch

    from chunkring.moe.calibrate import replay_median_ms

    runtime = shape.runtime
    hidden, routed = shape.inputs(n)
    unchunked: dict = {}
    by_chunk = {}
    for chunk in chunks:
        layer = shape.layer(max(args.tokens), chunk, waves)
        producers = None
        try:
            w13, w2 = shape.weights
            timed = dict(iterations=args.iterations, warmup=args.warmup, barrier=runtime.barrier)
            if not unchunked:
                started = time.monotonic()
                for streaming in (False, True):  # DeepGEMM compiles each grid size at its first call
                    layer.forward(hidden, shape.router, w13, w2, streaming=streaming)
                torch.cuda.synchronize()
                layer.check()
                _say(runtime, f"{shape.name} {n} tokens: warm-up (GEMM JIT) {time.monotonic() - started:.1f} s")
                unchunked["batch_ms"] = replay_median_ms(
                    lambda: layer.forward(hidden, shape.router, w13, w2), **timed)
                unchunked["Q_ms"] = replay_median_ms(lambda: layer.run(*routed, w13, w2), **timed)
            producers = _ProducersAlone(layer)
            measured = dict(unchunked, waves=waves)
            measured["P_ms"] = replay_median_ms(lambda: producers(hidden, shape.router), **timed)
            measured["streamed_ms"] = replay_median_ms(
                lambda: layer.forward(hidden, shape.router, w13, w2, streaming=True), **timed)
            stats = layer.stats()
            measured["producer_sms"], measured["consumer_sms"] = stats["producer_sms"], stats["consumer_sms"]
            layer.check()
            by_chunk[chunk] = shape_record(shape.name, n, chunk, measured)
            _say(runtime, f"{shape.name} {n} tokens, chunk {chunk}{' (default)' if chunk == default_chunk else ''}, "
                          f"{waves} wave(s): "
                          + ", ".join(f"{k} {by_chunk[chunk][k]:.3f}" for k in RECORD_KEYS[6:]))
        finally:
            torch.cuda.synchronize()
            runtime.barrier()
            if producers is not None:
                producers.destroy()
            layer.destroy()
    return by_chunk


def record_timeline(shape: _Shape, n: int, waves: int, prefix: str) -> list[str]:
    """One graph replay of the default ring's streamed call at ``n`` tokens in ``waves`` waves with a
    Timeline; rank 0 writes
    ``<prefix>.json`` (Chrome trace) and ``<prefix>.png`` if it can plot. Returns the files written."""
    import torch

    from chunkring import Timeline
    from chunkring.moe.calibrate import capture_graph
    from chunkring.moe.timeline import write_chrome_trace

    runtime = shape.runtime
    layer = shape.layer(n, None, waves)
    try:
        hidden, _ = shape.inputs(n)
        timeline = Timeline(runtime.torch_device, capacity=16 * (n + 64) * runtime.world_size + 1024)
        w13, w2 = shape.weights
        graph = capture_graph(lambda: layer.forward(hidden, shape.router, w13, w2, streaming=True,
                                                    timeline=timeline))
        timeline.clear()
        torch.cuda.synchronize()
        runtime.barrier()
        graph.replay()
        gathered = runtime.gather_object(timeline.records(), root=0)
        stats = layer.stats()
    finally:
        torch.cuda.synchronize()
        runtime.barrier()
        layer.destroy()
    if runtime.rank != 0:
        return []
    trace = f"{prefix}.json"
    write_chrome_trace(trace, dict(enumerate(gathered)), metadata={
        "call": "streamed", "shape": shape.name, "tokens_per_rank": n, "chunk": stats["chunk_tokens"], "waves": waves,
        "producer_sms": stats["producer_sms"], "consumer_sms": stats["consumer_sms"], "ranks": runtime.world_size})
    plotter = Path(__file__).resolve().parents[1] / "scripts" / "plot_timeline.py"
    title = (f"{shape.name}, {n} tokens/rank, chunks of {stats['chunk_tokens']}, streamed in {waves} wave(s); "
             f"producers on "
             f"{stats['producer_sms']} SMs, consumer on {stats['consumer_sms']}")
    done = subprocess.run([sys.executable, str(plotter), trace, "-o", f"{prefix}.png", "--title", title],
                          capture_output=True, text=True)
    if done.returncode:  # e.g. no matplotlib on the GPU host: the trace plots anywhere later
        print(f"no PNG ({done.stderr.strip().splitlines()[-1:]}); plot it with: python {plotter} {trace} -o "
              f"{prefix}.png", flush=True)
        return [trace]
    return [trace, f"{prefix}.png"]


def _say(runtime, text: str) -> None:
    if runtime.rank == 0:
        print(text, flush=True)


def write_results(path: str, runtime, records: list[dict], files: list[str]) -> None:
    """The result file (rank 0): the summary fields, ``records``, their numbers as ``figures`` keyed
    ``<shape>_n<tokens>_<chunk_kind>_<key>``, and the names of the timeline files beside it."""
    from chunkring.testing import records as result_file  # not `records`: that is the argument

    figures = {f"{r['shape']}_n{r['tokens']}_w{r['waves']}_{r['chunk_kind']}_{k}": v for r in records
               for k, v in r.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    result_file.write(path, suite="overlap", world_size=runtime.world_size, figures=figures, records=records,
                      files=[Path(f).name for f in files])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # before any GPU work: a typo costs no bring-up
    import chunkring

    runtime = chunkring.init()
    records: list[dict] = []
    files: list[str] = []
    try:
        for name in args.shapes:
            shape = _Shape(name, runtime)
            default_chunk = dataclasses.replace(shape.config, max_tokens_per_rank=max(args.tokens)
                                                ).with_default_ring().front_tokens_per_slot
            assert default_chunk is not None  # with_default_ring sets it
            for n in args.tokens:
                for waves in args.waves:
                    by_chunk = measure(shape, n, chunk_sizes(default_chunk, args.chunks, n), args, default_chunk,
                                       waves)
                    records += pick_records(by_chunk, default_chunk)
            if not args.no_timeline:
                stem = Path(args.json).with_suffix("") if args.json else Path("overlap")
                waves = max(args.waves)  # the most overlap asked for: expert blocks under production
                files += record_timeline(shape, max(args.tokens), waves,
                                         f"{stem}-timeline-{name}-{max(args.tokens)}-w{waves}")
            del shape
            if args.json and runtime.rank == 0:  # after every shape: a run cut short keeps what it measured
                write_results(args.json, runtime, records, files)
        if runtime.rank == 0:
            print("\n" + " | ".join(RECORD_KEYS))
            for r in records:
                print(" | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in RECORD_KEYS))
    finally:
        runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
