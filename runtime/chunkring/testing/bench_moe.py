"""Does streaming make the MoE layer faster end to end? Batch-ready against streamed, beside the ideal
overlap bound and a plain-torch peer, at every token count and chunk size asked for.

Run it with ``chunkring-launch bench`` (presets ``configs/bench.toml``, ``configs/bench_v3.toml``;
``scripts/bench.sh`` runs the whole matrix): the launcher's ``bench`` job checks the config, opens the
layers, draws the progress bar and prints and writes the figures; what is measured, and how, is here.

For each token count in ``token_counts`` and chunk size in ``chunk_sizes`` (a layer whose streaming ring
has slots of that size), every rank times, as CUDA-graph replays (how serving stacks run a layer: no
Python launch cost in the figure), with CUDA events, the median of ``iterations`` replays after
``warmup``, its hidden states rotated among ``rotate`` buffers so caches do not flatter:

* ``batch``: the whole layer with its own producers (router GEMM, top-k, FP8 quantisation, publish,
  dispatch, experts, combine), batch-ready;
* ``streamed``: the same call streamed;
* ``P``: the producers alone (router GEMM, top-k and quantisation of the whole batch), on the layer's
  producer stream (its SM partition, if it has one);
* ``Q``: the consumer alone: the batch-ready layer on the already routed batch;
* ``bound``: ``max(P, Q) + min(P, Q) / n_chunks``, perfect overlap of the two at this chunking;
* ``gain_possible_ms`` (batch - bound), ``gain_ms`` (batch - streamed), ``streamed_over_batch``, and the
  overlap efficiency ``gain / gain_possible`` (1 = the bound reached, 0 = no gain, negative = streaming
  lost time) - reported only where overlap could save at least 5 % of the batch-ready time; below that
  the ratio divides noise by noise;
* ``peer``: the peer baseline, the same math written the plain-torch way
  (:func:`~chunkring.testing.peer_moe.torch_moe`: bf16 rows sorted by expert, two grouped GEMMs,
  no chunkring), with ``batch_over_peer`` and ``streamed_over_peer`` - on one rank only (several ranks
  share one GPU under MPS, where NCCL's all-to-all, the multi-GPU peer's, cannot run);
* ``streamed_over_bound`` and ``streaming_cost_us_per_chunk`` ((streamed - batch) / chunks);
* per chunk size, ``c<chunk>_auto_streams``: whether ``streaming="auto"`` would stream after
  :func:`chunkring.calibrate` over these token counts (streamed within 3 % of batch-ready at
  every one); and with ``trace``, that shape's timelines as Chrome traces.

Weights are drawn on the GPU (only this rank's experts): the bench checks nothing; the ``run`` and
``stress`` jobs check the same layer against the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from chunkring.moe.auto import DEFAULT_TOLERANCE, StreamingCalibration
from chunkring.moe.weights import expert_weights

__all__ = ["EFFICIENCY_FLOOR", "Timing", "derived_figures", "run"]

#: Overlap efficiency is reported only where the bound is at least this fraction below batch-ready.
EFFICIENCY_FLOOR = 0.05


@dataclass(frozen=True)
class Timing:
    """How each figure is measured: the median of ``iterations`` graph replays after ``warmup``, hidden
    states rotated over ``rotate`` buffers, weights and hidden states drawn from ``seed`` (and the rank)."""

    iterations: int = 20
    warmup: int = 3
    rotate: int = 4
    seed: int = 0


def run(runtime: Any, open_layer: Callable[[int], AbstractContextManager[Any]], *, chunk_sizes: tuple[int, ...],
        token_counts: tuple[int, ...], timing: Timing, trace: tuple[int, int] | None = None,
        trace_out: str = "timeline", on_shape: Callable[[int, str], object] | None = None) -> dict:
    """Every shape's figures on this rank, keyed ``n<tokens>_c<chunk>_<figure>``, and per chunk size
    ``c<chunk>_auto_streams``. A collective: every rank calls it alike.

    ``open_layer(chunk)`` is a context manager yielding the ``MoELayer`` to measure with slots of
    ``chunk`` tokens (closed on exit). The figures that do not depend on the chunk size (batch-ready,
    P, Q, peer) are measured once per token count, with the first chunk size's layer, and reported beside
    every chunk size. ``trace=(tokens, chunk)`` also records that shape's batch-ready and streamed
    timelines, one graph replay each; rank 0 writes every rank's records as Chrome traces
    ``<trace_out>-batch.json`` and ``<trace_out>-streamed.json``.
    ``on_shape(done, text)``, if given, is called after each shape (``done`` shapes so far)."""
    figures, unchunked = {}, {}
    done = 0
    for chunk in chunk_sizes:
        with open_layer(chunk) as layer:
            model = _Model(layer, timing)
            for n in token_counts:
                if n not in unchunked:
                    unchunked[n] = model.measure_unchunked(n)
                shape = model.measure_streamed(n, chunk, unchunked[n])
                figures.update({f"n{n}_c{chunk}_{key}": value for key, value in shape.items()})
                if trace == (n, chunk):
                    model.record_timelines(n, trace_out)
                done += 1
                if on_shape is not None:
                    on_shape(done, f"n={n} chunk={chunk}: streamed/batch {shape['streamed_over_batch']:.2f}")
            layer.check()
        # What chunkring.calibrate would decide for this chunk size over these counts (this rank's figures).
        calibration = StreamingCalibration({n: figures[f"n{n}_c{chunk}_batch_ms"] for n in token_counts},
                                           {n: {chunk: figures[f"n{n}_c{chunk}_streamed_ms"]} for n in token_counts},
                                           DEFAULT_TOLERANCE)
        figures[f"c{chunk}_auto_streams"] = int(calibration.streams)
    return figures


class _Model:
    """This rank's router and experts (drawn on the GPU) and the graphs of one layer."""

    def __init__(self, layer: Any, timing: Timing) -> None:
        import torch

        cfg, device = layer.config, layer.runtime.torch_device
        gen = torch.Generator(device).manual_seed(timing.seed * 7919 + layer.runtime.rank)
        E, H, inter = layer.experts_per_rank, cfg.hidden, cfg.intermediate

        # One expert at a time: no fp32 copy of every expert's weights.
        def draw(*shape: int, fan_in: int) -> torch.Tensor:
            out = torch.empty(shape, dtype=torch.bfloat16, device=device)
            for part in out.view(-1, *shape[-2:]):
                part.copy_(torch.randn(part.shape, generator=gen, device=device) / fan_in**0.5)
            return out

        self.router = draw(cfg.num_experts, H, fan_in=H)
        # bf16 for the peer; the layer's form (FP8 with block scales for the FP8 payload) for the layer.
        self.w13_bf16, self.w2_bf16 = draw(E, 2 * inter, H, fan_in=H), draw(E, H, inter, fan_in=inter)
        weights = expert_weights(layer.config, self.w13_bf16, self.w2_bf16)
        self.w13, self.w2 = weights[0], weights[1]
        self.layer, self.timing, self.gen = layer, timing, gen
        self._cached: _Inputs | None = None

    def _inputs(self, n: int) -> _Inputs:
        if self._cached is None or self._cached.n != n:
            self._cached = _Inputs(self, n)
        return self._cached

    def measure_unchunked(self, n: int) -> dict:
        """batch_ms, P_ms, Q_ms and (one rank) peer_ms at ``n`` tokens."""
        from chunkring.testing.peer_moe import torch_moe

        inputs, layer, cfg = self._inputs(n), self.layer, self.layer.config
        calls = {
            "batch_ms": (inputs.load_hidden, lambda: layer.forward(inputs.hidden, self.router, self.w13, self.w2)),
            "P_ms": (inputs.load_hidden, lambda: _on_stream(layer.producer_stream, inputs.producers)),
            "Q_ms": (inputs.load_routed, lambda: layer.run(*inputs.static, self.w13, self.w2)),
        }
        if layer.runtime.world_size == 1:  # one rank: self.w13 and self.w2 hold every expert
            calls["peer_ms"] = (inputs.load_hidden,
                                lambda: torch_moe(inputs.hidden, self.router, self.w13_bf16, self.w2_bf16, cfg.topk))
        return {name: self._median_ms(load, call) for name, (load, call) in calls.items()}

    def measure_streamed(self, n: int, chunk: int, unchunked: dict) -> dict:
        """streamed_ms at ``n`` tokens in chunks of ``chunk``, beside ``unchunked``'s figures, and what
        follows from them."""
        inputs = self._inputs(n)
        out = dict(unchunked)
        out["streamed_ms"] = self._median_ms(inputs.load_hidden, lambda: self.layer.forward(
            inputs.hidden, self.router, self.w13, self.w2, streaming=True))
        return {**out, **derived_figures(n, chunk, out)}

    def record_timelines(self, n: int, prefix: str) -> None:
        """One graph replay each of the batch-ready and the streamed call with a :class:`chunkring.Timeline`;
        rank 0 writes every rank's records as ``<prefix>-batch.json`` and ``<prefix>-streamed.json``."""
        import torch

        from chunkring import Timeline
        from chunkring.moe.calibration import capture_graph
        from chunkring.moe.timeline import write_chrome_trace

        inputs, layer, runtime = self._inputs(n), self.layer, self.layer.runtime
        timeline = Timeline(runtime.torch_device, capacity=16 * (n + 64) * runtime.world_size + 1024)
        for name, streaming in (("batch", False), ("streamed", True)):
            def call(streaming: bool = streaming) -> None:
                layer.forward(inputs.hidden, self.router, self.w13, self.w2, streaming=streaming, timeline=timeline)

            graph = capture_graph(call, inputs.load_hidden)
            timeline.clear()
            torch.cuda.synchronize()
            runtime.barrier()
            graph.replay()
            gathered = runtime.gather_object(timeline.records(), root=0)
            if runtime.rank == 0:
                write_chrome_trace(f"{prefix}-{name}.json", dict(enumerate(gathered)),
                                   metadata={"call": name, "tokens_per_rank": n,
                                             "chunk": layer.config.stream_slot_tokens,
                                             "config": str(layer.config), "ranks": runtime.world_size})

    def _median_ms(self, load: Callable[[int], object], call: Callable[[], object]) -> float:
        """Median replay time of ``call`` captured in a CUDA graph; ``load(i)`` refreshes its inputs."""
        from chunkring.moe.calibration import replay_median_ms

        return replay_median_ms(call, load, iterations=self.timing.iterations, warmup=self.timing.warmup,
                                barrier=self.layer.runtime.barrier)


def derived_figures(n: int, chunk: int, measured: dict) -> dict:
    """What follows from one shape's measured ``batch_ms``, ``streamed_ms``, ``P_ms``, ``Q_ms`` (and
    ``peer_ms`` where measured) at ``n`` tokens in chunks of ``chunk``: the overlap bound and the ratios."""
    out = {}
    batch, streamed, P, Q = measured["batch_ms"], measured["streamed_ms"], measured["P_ms"], measured["Q_ms"]
    n_chunks = -(-n // chunk)
    out["bound_ms"] = max(P, Q) + min(P, Q) / n_chunks
    out["streamed_over_batch"] = streamed / batch
    out["streamed_over_bound"] = streamed / out["bound_ms"]
    out["gain_possible_ms"] = batch - out["bound_ms"]
    out["gain_ms"] = batch - streamed
    if out["gain_possible_ms"] > EFFICIENCY_FLOOR * batch:  # else the ratio is noise over noise
        out["overlap_efficiency"] = out["gain_ms"] / out["gain_possible_ms"]
    out["chunks_per_call"] = n_chunks
    # What streaming costs per chunk beyond the batch-ready call (negative: it saves time).
    out["streaming_cost_us_per_chunk"] = (streamed - batch) * 1e3 / n_chunks
    if "peer_ms" in measured:
        out["batch_over_peer"] = batch / measured["peer_ms"]
        out["streamed_over_peer"] = streamed / measured["peer_ms"]
    return out


class _Inputs:
    """One token count's inputs: ``rotate`` hidden-state buffers, their routed and quantised forms (the
    consumer-alone call's inputs), and the static tensors the graphs read, refreshed by ``load_*(i)``."""

    def __init__(self, model: _Model, n: int) -> None:
        import torch

        from chunkring.moe.routing import quantize_rows_fp8, route

        cfg, device = model.layer.config, model.layer.runtime.torch_device
        self.n, self.fp8, self.router, self.topk = n, cfg.payload.has_scales, model.router, cfg.topk
        self.rotated = [torch.randn(n, cfg.hidden, generator=model.gen, device=device).to(torch.bfloat16)
                        for _ in range(model.timing.rotate)]
        self.hidden = torch.empty_like(self.rotated[0])
        self.routed = []
        for h in self.rotated:
            idx, w = route(h, model.router, cfg.topk)
            x, x_sf = quantize_rows_fp8(h) if self.fp8 else (h, None)
            self.routed.append((x, x_sf, idx, w))
        self.static = [None if t is None else torch.empty_like(t) for t in self.routed[0]]

    def load_hidden(self, i: int) -> None:
        self.hidden.copy_(self.rotated[i % len(self.rotated)])

    def load_routed(self, i: int) -> None:
        for dst, src in zip(self.static, self.routed[i % len(self.routed)], strict=True):
            if dst is not None and src is not None:
                dst.copy_(src)

    def producers(self) -> None:
        """The producers alone: router GEMM, top-k and (FP8) quantisation of the whole batch."""
        from chunkring.moe.routing import quantize_rows_fp8, route

        route(self.hidden, self.router, self.topk)
        if self.fp8:
            quantize_rows_fp8(self.hidden)


def _on_stream(stream: Any, work: Callable[[], object]) -> None:
    """``work()`` on ``stream`` (the layer's producer stream: its SM partition, if it has one), joined back
    into the current stream, so P is timed on the SMs the layer's producers get."""
    import torch

    caller = torch.cuda.current_stream()
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        work()
    caller.wait_stream(stream)
