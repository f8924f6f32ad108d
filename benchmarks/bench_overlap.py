"""Does streaming pay? ``MoEModule`` batch-ready, streamed and ``streaming="auto"`` on the default config,
beside the overlap bound, at decode to prefill sizes.

    python -m benchmarks.bench_overlap [--shapes flash,v3] [--tokens 1,8,128,1024,2048,4096,8192]
        [--chunks 256,512,1024,2048] [--iterations 10] [--json benchmarks/results/<commit>-overlap.json]
    mpirun -np N python -m benchmarks.bench_overlap ...      (N ranks, e.g. sharing one GPU under MPS)

Shapes are one rank's share (``experts`` local experts per rank, so ``num_experts = experts * ranks``):
``flash`` is DeepGEMM's per-rank shape (32 experts, hidden 4096, intermediate 2048, top-6); ``v3`` DeepSeek-V3's
width and top-k (hidden 7168, intermediate 2048, top-8; 32 experts per rank: over 8 ranks, V3's 256).

Per shape, one layer is built as a serving caller builds it: ``MoEConfig(...).with_default_ring()`` for the largest
token count, ``MoELayer(runtime, config)`` (streamed calls on the default partition; ``--partition none``: on
ordinary streams, each record's ``partition`` says which), and a ``MoEModule`` over it holding this rank's weights.
:func:`chunkring.calibrate` then times the layer at every token count - batch-ready, and streamed in every chunk
size up to the slot (``--chunks``, and the largest that fits) - and sets what ``streaming="auto"`` does. Per token
count two records, ``chunk_kind`` "default" (the slot size: a streamed call with no calibration) and "best" (the
chunk size calibration measured fastest), each with (CUDA-graph replays, every call of a token count interleaved in
rounds, ``burst_for(n)`` replays back to back per sample - :func:`chunkring.moe.calibration.replay_medians_ms` -,
median of ``--iterations`` rounds, ranks started together; the slowest rank's figure where several ranks run; where
both kinds name one chunk size one measurement serves both):

* ``batch_ms``: ``MoEModule.forward(streaming=False)``;
* ``streamed_ms``: the same call streamed in chunks of ``chunk`` tokens (``MoELayer.forward(chunk=)``, the call
  MoEModule's operator makes);
* ``auto_ms``: ``MoEModule.forward(streaming="auto")`` after calibration, ``auto_over_faster`` its ratio to the
  faster of the two modes;
* ``P_ms``, the producers alone (each chunk's router GEMM and fused producer, into a scratch ring a trivial
  consumer drains), and ``Q_ms``, the consumer alone (batch-ready ``MoELayer.run`` on the routed batch);
  ``bound_ms = max(P, Q) + min(P, Q) / chunks``, a perfect pipeline of the two;
* ``bitwise``: the streamed output equals the batch-ready one bit for bit;
* ``entry_check_us``: the host time of the check every call makes at its entry to fail closed
  (``MoELayer.raise_if_failed``: one load of a pinned host word per ring, no device work), mean of
  :data:`ENTRY_CHECK_CALLS` calls, and ``entry_check_over_batch`` its share of ``batch_ms``. A graph replay makes
  no such check (the caller calls ``raise_if_failed`` between replays), so the device times above do not include it.

Rank 0 writes the JSON (``records``, and every number as ``figures``) after each shape, so a run cut short
keeps what it measured, and a timeline of the best streamed case (the lowest streamed / batch-ready of several
chunks) as a Chrome trace and, with matplotlib, a PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

SHAPES = {"flash": dict(experts=32, hidden=4096, intermediate=2048, topk=6),
          "v3": dict(experts=32, hidden=7168, intermediate=2048, topk=8)}

#: Record keys every record carries, in the order the table prints them.
RECORD_KEYS = ("shape", "tokens", "ranks", "chunk", "chunk_kind", "chunks", "batch_ms", "streamed_ms", "auto_ms",
               "P_ms", "Q_ms", "bound_ms", "streamed_over_batch", "auto_over_faster", "bitwise")


def overlap_bound(P: float, Q: float, chunks: int) -> float:
    """The time of a perfect pipeline of producers (P) and consumer (Q) over ``chunks`` chunks: the longer
    side whole, plus one chunk's worth of the shorter (the first chunk's production or the last one's
    consumption, which nothing overlaps)."""
    if chunks < 1 or P < 0 or Q < 0:
        raise ValueError(f"need chunks >= 1 and non-negative times, got P={P}, Q={Q}, chunks={chunks}")
    return max(P, Q) + min(P, Q) / chunks


#: Calls of the entry check timed for ``entry_check_us`` (about 10 ms of host time).
ENTRY_CHECK_CALLS = 10_000


def entry_check_us(check: Callable[[], None], calls: int = ENTRY_CHECK_CALLS) -> float:
    """Mean host µs per call of ``check`` (the layer's ``raise_if_failed``) over ``calls`` calls."""
    if calls < 1:
        raise ValueError(f"need calls >= 1, got {calls}")
    start = time.perf_counter()
    for _ in range(calls):
        check()
    return (time.perf_counter() - start) * 1e6 / calls


def per_chunk_cost_us(streamed_ms: float, bound_ms: float, chunks: int) -> float:
    """Streaming's overhead per chunk in µs: the streamed call's time beyond the overlap bound, per chunk."""
    if chunks < 1:
        raise ValueError(f"need chunks >= 1, got {chunks}")
    return (streamed_ms - bound_ms) * 1e3 / chunks


def shape_record(shape: str, tokens: int, chunk: int, measured: dict) -> dict:
    """One record from the measured ``batch_ms``, ``streamed_ms``, ``auto_ms``, ``P_ms`` and ``Q_ms`` (other keys
    of ``measured`` are kept) and what follows from them."""
    chunks = -(-tokens // chunk)
    bound = overlap_bound(measured["P_ms"], measured["Q_ms"], chunks)
    faster = min(measured["batch_ms"], measured["streamed_ms"])
    return {**measured, "shape": shape, "tokens": tokens, "chunk": chunk, "chunks": chunks, "bound_ms": bound,
            "per_chunk_cost_us": per_chunk_cost_us(measured["streamed_ms"], bound, chunks),
            "streamed_over_batch": measured["streamed_ms"] / measured["batch_ms"],
            "streamed_over_bound": measured["streamed_ms"] / bound,
            "auto_over_faster": measured["auto_ms"] / faster,
            **({"entry_check_over_batch": measured["entry_check_us"] * 1e-3 / measured["batch_ms"]}
               if "entry_check_us" in measured else {})}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="flash,v3", help=f"comma-separated, of {sorted(SHAPES)}")
    parser.add_argument("--tokens", default="1,8,128,1024,2048,4096,8192", help="tokens per rank (comma-separated)")
    parser.add_argument("--chunks", default="256,512,1024,2048",
                        help="chunk sizes calibration tries besides the largest that fits (at most the slot)")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None, help="the result file (rank 0 writes it)")
    parser.add_argument("--partition", default="auto", choices=("auto", "none"),
                        help='the layer\'s partition= (default "auto", the default config\'s)')
    parser.add_argument("--no-timeline", action="store_true", help="skip the timeline trace and PNG")
    args = parser.parse_args(argv)
    try:
        args.shapes = [s for s in args.shapes.split(",") if s]
        args.tokens = sorted({int(t) for t in args.tokens.split(",") if t})
        args.chunks = sorted({int(c) for c in args.chunks.split(",") if c})
    except ValueError:
        parser.error("--tokens and --chunks take comma-separated integers")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown or not args.shapes:
        parser.error(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    if not args.tokens or min(args.tokens + args.chunks, default=1) < 1:
        parser.error("token counts and chunk sizes must be positive")
    if args.iterations < 1 or args.warmup < 0:
        parser.error("--iterations must be >= 1 and --warmup >= 0")
    return args


class Shape:
    """One shape's layer (the default config for ``max_tokens`` tokens per rank), this rank's weights drawn on
    the GPU, and the ``MoEModule`` over them."""

    def __init__(self, name: str, runtime, max_tokens: int, seed: int = 0, slot: int | None = None,
                 partition: str = "auto", eager_graphs: bool = False):
        import torch

        from chunkring import MoEConfig, MoELayer, MoEModule, expert_weights

        self.name, self.runtime, spec = name, runtime, SHAPES[name]
        self.config = MoEConfig(num_experts=spec["experts"] * runtime.world_size, hidden=spec["hidden"],
                                intermediate=spec["intermediate"], topk=spec["topk"],
                                max_tokens_per_rank=max_tokens).with_default_ring()
        if slot is not None:  # a ring of other slots than the default's (the producer probe's chunks)
            self.config = dataclasses.replace(self.config, stream_slot_tokens=slot)
        self.gen = torch.Generator(runtime.torch_device).manual_seed(seed * 7919 + runtime.rank)
        E, H, inter, device = spec["experts"], spec["hidden"], spec["intermediate"], runtime.torch_device
        self.router = (torch.randn(self.config.num_experts, H, generator=self.gen, device=device) / H**0.5).bfloat16()
        w13 = (torch.randn(E, 2 * inter, H, generator=self.gen, device=device) / H**0.5).bfloat16()
        w2 = (torch.randn(E, H, inter, generator=self.gen, device=device) / inter**0.5).bfloat16()
        weights = expert_weights(self.config, w13, w2)
        self.w13, self.w2 = weights[0], weights[1]
        self.layer = MoELayer(runtime, self.config, partition=partition, eager_graphs=eager_graphs)
        self.module = MoEModule(self.layer, weights=(self.router, self.w13, self.w2))

    @property
    def slot(self) -> int:
        slot = self.config.stream_slot_tokens
        assert slot is not None  # with_default_ring set it
        return slot

    def inputs(self, n: int) -> tuple:
        """(hidden bf16 [n, H], the routed FP8 batch MoELayer.run takes) for ``n`` tokens."""
        import torch

        from chunkring.moe.routing import quantize_rows_fp8, route

        hidden = torch.randn(n, self.config.hidden, generator=self.gen, device=self.runtime.torch_device).bfloat16()
        idx, w = route(hidden, self.router, self.config.topk)
        x, x_sf = quantize_rows_fp8(hidden)
        return hidden, (x, x_sf, idx, w)

    def forward(self, hidden, chunk: int):
        """The layer streamed in chunks of ``chunk`` tokens (what MoEModule's operator calls)."""
        return self.layer.forward(hidden, self.router, self.w13, self.w2, streaming=True, chunk=chunk)

    def close(self) -> None:
        self.layer.close()


class ProducersAlone:
    """A streamed call's producer work without its consumer (``P_ms``): per chunk of ``chunk`` tokens the router
    GEMM and the fused producer, on the layer's producer partition, publishing into a scratch ring of the layer's
    streaming spec (or with ``num_slots`` slots) that ``ring_gather`` drains on the consumer partition with the
    largest grid all resident there; with ``drain=False`` not drained (a profiler's single call into a ring of a
    slot per chunk: no publish waits, nothing spins)."""

    def __init__(self, layer, num_slots: int | None = None, drain: bool = True):
        import torch

        from chunkring import Ring
        from chunkring.moe import CallMode
        from chunkring.ring.io import GatherOutputs, gather_grid_limit

        self.layer, self.mode, self.drain = layer, CallMode.STREAMED, drain
        spec = layer.rings[self.mode].spec
        if num_slots is not None:
            spec = dataclasses.replace(spec, num_slots=num_slots)
        self.ring = Ring(layer.runtime, spec, timeout_s=60)
        self.out = GatherOutputs(self.ring, layer.config.max_tokens_per_rank)
        self.arrivals = torch.zeros(1, dtype=torch.int32, device=layer.runtime.torch_device)
        stats = layer.stats()
        self.max_blocks = stats["producer_grid_max"]  # the layer's own streamed-call grid
        consumer_sms = stats["consumer_sms"] or torch.cuda.get_device_properties(layer.runtime.torch_device
                                                                                 ).multi_processor_count
        # Every block of the drain resident at once on the consumer's SMs (a block that cannot start would
        # stall the others), within this rank's share of them where ranks share the GPU.
        share = max(1, consumer_sms // layer.runtime.gpu_ranks)
        self.gather_grid = min(stats["pull_grid"], gather_grid_limit(self.ring, share))

    def __call__(self, hidden, router_weight, chunk: int | None = None) -> None:
        import torch

        from chunkring.moe._engine.producer import enqueue_produce
        from chunkring.moe.routing import router_logits
        from chunkring.ring.io import gather

        layer, n = self.layer, hidden.shape[0]
        T = chunk or self.ring.spec.tokens_per_slot
        producer, consumer = layer.streams(self.mode)
        caller = torch.cuda.current_stream()
        producer.wait_stream(caller)
        consumer.wait_stream(caller)
        # The drain first: a small grid spinning for chunks leaves the producers their SMs (PROTOCOL.md,
        # "Progress" 2), and an eager call never queues a publish that waits behind an absent consumer.
        if self.drain:
            gather(self.ring, self.out, grid=self.gather_grid, stream=consumer)
        kernels = layer.resources.kernels.produce
        with torch.cuda.stream(producer):
            for start in range(0, max(n, 1), T):
                part = hidden[start:start + T]
                logits = router_logits(part, router_weight, kernels=kernels)
                enqueue_produce(self.ring, kernels, logits, part, start, start + T >= n, None, None, self.arrivals,
                                producer, self.max_blocks)
        caller.wait_stream(producer)
        caller.wait_stream(consumer)

    def close(self) -> None:
        self.out.close()  # a collective where the outputs are symmetric (a peer read by RMA)
        self.ring.close()


def measure_shape(shape: Shape, args) -> list[dict]:
    """Calibrate the shape's layer over ``args.tokens``, then two records per token count (see the module)."""
    import torch

    from chunkring import calibrate
    from chunkring.moe.calibration import burst_for, replay_medians_ms

    runtime, layer, module = shape.runtime, shape.layer, shape.module

    def timed(calls: dict, n: int) -> dict:
        """Every call of ``calls`` interleaved (replay_medians_ms), each rank's median; the slowest rank's."""
        mine = replay_medians_ms(calls, iterations=args.iterations, warmup=args.warmup, burst=burst_for(n),
                                 barrier=runtime.barrier)
        everyone = runtime.allgather_object(mine)
        return {key: max(ranks[key] for ranks in everyone) for key in mine}

    calibration = calibrate(layer, shape.router, shape.w13, shape.w2, args.tokens,
                            chunks=[c for c in args.chunks if c <= shape.slot], iterations=args.iterations,
                            warmup=args.warmup)
    _say(runtime, f"{shape.name}: {calibration.describe()}")
    producers = ProducersAlone(layer)
    records = []
    try:
        for n in args.tokens:
            hidden, (x, x_sf, idx, w) = shape.inputs(n)
            kinds = {"default": min(n, shape.slot), "best": calibration.chunk_for(n)}
            calls: dict[object, Callable[[], object]] = {
                "batch": lambda: module(hidden, streaming=False),
                "auto": lambda: module(hidden, streaming="auto"),
                "Q": lambda: layer.run(x, x_sf, idx, w, shape.w13, shape.w2)}
            for chunk in set(kinds.values()):  # one measurement where both kinds name one chunk
                calls[("streamed", chunk)] = partial(shape.forward, hidden, chunk)
                calls[("P", chunk)] = partial(producers, hidden, shape.router, chunk)
            ms = timed(calls, n)
            entry_us = max(runtime.allgather_object(entry_check_us(layer.raise_if_failed)))
            batch_out = module(hidden, streaming=False)
            for kind, chunk in kinds.items():
                streamed_out = shape.forward(hidden, chunk)
                torch.cuda.synchronize()
                layer.check()
                measured = {"ranks": runtime.world_size, "batch_ms": ms["batch"], "auto_ms": ms["auto"],
                            "Q_ms": ms["Q"], "entry_check_us": entry_us, "chunk_kind": kind,
                            "bitwise": all(runtime.allgather_object(bool(torch.equal(batch_out, streamed_out)))),
                            "streamed_ms": ms[("streamed", chunk)], "P_ms": ms[("P", chunk)]}
                record = shape_record(shape.name, n, chunk, measured)
                record["partition"] = "none" if layer.partition is None else "auto"
                records.append(record)
                _say(runtime, " | ".join(_cell(record[k]) for k in RECORD_KEYS) +
                     f" | entry check {record['entry_check_us']:.2f} us")
    finally:
        torch.cuda.synchronize()
        runtime.barrier()
        producers.close()
    return records


def record_timeline(shape: Shape, n: int, chunk: int, prefix: str) -> list[str]:
    """One graph replay of the streamed call at ``n`` tokens in chunks of ``chunk`` with a Timeline; rank 0 writes
    ``<prefix>.json`` (Chrome trace) and ``<prefix>.png`` if it can plot. Returns the files written."""
    import torch

    from chunkring import Timeline
    from chunkring.moe.calibration import capture_graph
    from chunkring.moe.timeline import write_chrome_trace

    runtime, layer = shape.runtime, shape.layer
    hidden, _ = shape.inputs(n)
    timeline = Timeline(runtime.torch_device, capacity=16 * (n + 64) * runtime.world_size + 1024)
    graph = capture_graph(lambda: layer.forward(hidden, shape.router, shape.w13, shape.w2, streaming=True,
                                                chunk=chunk, timeline=timeline))
    timeline.clear()
    torch.cuda.synchronize()
    runtime.barrier()
    graph.replay()
    gathered = runtime.gather_object(timeline.records(), root=0)
    stats = layer.stats()
    if runtime.rank != 0:
        return []
    trace = f"{prefix}.json"
    write_chrome_trace(trace, dict(enumerate(gathered)), metadata={
        "call": "streamed", "shape": shape.name, "tokens_per_rank": n, "chunk": chunk,
        "producer_sms": stats["producer_sms"], "consumer_sms": stats["consumer_sms"], "ranks": runtime.world_size})
    plotter = Path(__file__).resolve().parents[1] / "scripts" / "plot_timeline.py"
    title = (f"{shape.name}, {n} tokens/rank in chunks of {chunk}, {runtime.world_size} rank(s); producers on "
             f"{stats['producer_sms']} SMs, pull on {stats['consumer_sms']}, experts on the whole GPU")
    done = subprocess.run([sys.executable, str(plotter), trace, "-o", f"{prefix}.png", "--title", title],
                          capture_output=True, text=True)
    if done.returncode:  # e.g. no matplotlib: the trace plots anywhere later
        print(f"no PNG ({done.stderr.strip().splitlines()[-1:]}); plot it with: python {plotter} {trace} -o "
              f"{prefix}.png", flush=True)
        return [trace]
    return [trace, f"{prefix}.png"]


def _cell(value) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def _say(runtime, text: str) -> None:
    if runtime.rank == 0:
        print(text, flush=True)


def write_results(path: str, runtime, records: list[dict], files: list[str], incomplete: bool = False) -> None:
    """The result file (rank 0): the summary fields, ``records``, their numbers as ``figures`` keyed
    ``<shape>_n<tokens>_<chunk_kind>_<key>``, and the names of the timeline files beside it."""
    from chunkring.testing import records as record_file

    figures = {f"{r['shape']}_n{r['tokens']}_{r['chunk_kind']}_{k}": v for r in records for k, v in r.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    record_file.write(path, suite="overlap", world_size=runtime.world_size, figures=figures, records=records,
                      files=[Path(f).name for f in files], incomplete=incomplete)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # before any GPU work: a typo costs no bring-up
    import chunkring

    runtime = chunkring.init()
    records: list[dict] = []
    files: list[str] = []
    try:
        _say(runtime, " | ".join(RECORD_KEYS))
        for done, name in enumerate(args.shapes, 1):
            shape = Shape(name, runtime, max(args.tokens), partition=args.partition)
            try:
                mine = measure_shape(shape, args)
                records += mine
                if not args.no_timeline:
                    # The best case that streams at all (several chunks), else the best of one.
                    streamed = [r for r in mine if r["chunks"] > 1] or mine
                    best = min(streamed, key=lambda r: r["streamed_over_batch"])
                    stem = Path(args.json).with_suffix("") if args.json else Path("overlap")
                    files += record_timeline(shape, best["tokens"], best["chunk"],
                                             f"{stem}-timeline-{name}-{best['tokens']}-c{best['chunk']}")
            finally:
                shape.close()
            if args.json and runtime.rank == 0:  # after every shape: a run cut short keeps what it measured,
                # marked incomplete until the last shape is in
                write_results(args.json, runtime, records, files, incomplete=done < len(args.shapes))
    finally:
        runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
