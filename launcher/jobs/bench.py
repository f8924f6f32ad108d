"""Bench: does streaming make the MoE layer faster end to end? Batch-ready against streamed, beside the
ideal overlap bound, at every token count and chunk size of the config.

For each token count in ``tokens`` and chunk size in ``chunks`` (a layer whose streaming ring has
``front_num_slots`` slots of that size), every rank times, as CUDA-graph replays (how serving stacks
run a layer: no Python launch cost in the figure), with CUDA events, the median of ``iterations``
replays after ``warmup``, its hidden states rotated among ``rotate`` buffers so caches do not flatter:

* ``batch``: the whole layer with its own producers (router GEMM, top-k, FP8 quantisation, publish,
  dispatch, experts, combine), batch-ready;
* ``streamed``: the same call streamed;
* ``P``: the producers alone (router GEMM, top-k and quantisation of the whole batch), on the layer's
  producer stream (its SM partition, if ``producer_sms`` is set);
* ``Q``: the consumer alone: the batch-ready layer on the already routed batch;
* ``bound``: ``max(P, Q) + min(P, Q) / n_chunks``, perfect overlap of the two at this chunking;
* ``gain_possible_ms`` (batch - bound), ``gain_ms`` (batch - streamed), ``streamed_over_batch``, and the
  overlap efficiency ``gain / gain_possible`` (1 = the bound reached, 0 = no gain, negative = streaming
  lost time) - reported only where overlap could save at least 5 % of the batch-ready time; below that
  the ratio divides noise by noise;
* ``peer``: the peer baseline, the same math written the plain-torch way
  (:func:`~chunkring.launcher.jobs.peer_moe.torch_moe`: bf16 rows sorted by expert, two grouped GEMMs,
  no chunkring), with ``batch_over_peer`` and ``streamed_over_peer`` - on one rank only (several ranks
  share one GPU under MPS, where NCCL's all-to-all, the multi-GPU peer's, cannot run);
* ``streamed_over_bound`` and ``streaming_cost_us_per_chunk`` ((streamed - batch) / chunks);
* per chunk size, ``c<chunk>_auto_streams``: whether ``streaming="auto"`` would stream after
  :meth:`chunkring.MoELayer.calibrate` over these token counts (streamed within 3 % of batch-ready at
  every one); and with ``trace``, that shape's timelines as Chrome traces.

Weights are drawn on the GPU (only this rank's experts): the bench checks nothing; ``run`` and
``stress`` check the same layer against the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from chunkring.errors import ChunkringUsageError

from chunkring.moe.calibrate import DEFAULT_TOLERANCE, StreamingCalibration

from ..progress import progress
from .moe_workload import LayerFields, open_layer

#: Overlap efficiency is reported only where the bound is at least this fraction below batch-ready.
EFFICIENCY_FLOOR = 0.05


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
    chunks: str = "64,256"         # front_tokens_per_slot values to measure (comma-separated)
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

    def __post_init__(self):
        for field, values in (("tokens", self.token_counts), ("chunks", self.chunk_sizes)):
            if max(values) > self.max_tokens_per_rank:
                raise ChunkringUsageError(f"{max(values)} exceeds max_tokens_per_rank={self.max_tokens_per_rank}",
                                          field=field)
        for name, top in (("iterations", 100_000), ("warmup", 1000), ("rotate", 64)):
            if not 1 <= getattr(self, name) <= top:
                raise ChunkringUsageError(f"must be in [1, {top}]", field=name)
        self.trace_shape  # checked before any rank starts GPU work
        super().__post_init__()


def run(runtime, config: CONFIG) -> dict:
    """Every shape's figures on this rank, keyed ``n<tokens>_c<chunk>_<figure>``. The figures that do not
    depend on the chunk size (batch-ready, P, Q, peer) are measured once per token count, with the first
    chunk size's layer, and reported beside every chunk size."""
    figures, unchunked = {}, {}
    bar = progress("bench", runtime.rank, total=len(config.chunk_sizes) * len(config.token_counts))
    done = 0
    for chunk in config.chunk_sizes:
        cfg = replace(config.layer_config(), front_tokens_per_slot=chunk)
        with open_layer(runtime, config, cfg) as layer:
            model = _Model(layer, config)
            for n in config.token_counts:
                if n not in unchunked:
                    unchunked[n] = model.measure_unchunked(n)
                shape = model.measure_streamed(n, chunk, unchunked[n])
                figures.update({f"n{n}_c{chunk}_{key}": value for key, value in shape.items()})
                if config.trace_shape == (n, chunk):
                    model.record_timelines(n, config.trace_out)
                done += 1
                bar.update(done, f"n={n} chunk={chunk}: streamed/batch {shape['streamed_over_batch']:.2f}")
            layer.check()
        # What MoELayer.calibrate would decide for this chunk size over these counts (this rank's figures).
        measured = {n: (figures[f"n{n}_c{chunk}_batch_ms"], figures[f"n{n}_c{chunk}_streamed_ms"])
                    for n in config.token_counts}
        figures[f"c{chunk}_auto_streams"] = int(StreamingCalibration(measured, DEFAULT_TOLERANCE).streams)
    bar.close(done, "")
    return figures


class _Model:
    """This rank's router and experts (drawn on the GPU) and the graphs of one layer."""

    def __init__(self, layer, config: CONFIG):
        import torch

        cfg, device = layer.config, layer.runtime.torch_device
        gen = torch.Generator(device).manual_seed(config.seed * 7919 + layer.runtime.rank)
        E, H, inter = layer.experts_per_rank, cfg.hidden, cfg.intermediate

        def draw(*shape, fan_in):  # one expert at a time: no fp32 copy of every expert's weights
            out = torch.empty(shape, dtype=torch.bfloat16, device=device)
            for part in out.view(-1, *shape[-2:]):
                part.copy_(torch.randn(part.shape, generator=gen, device=device) / fan_in**0.5)
            return out

        self.router = draw(cfg.num_experts, H, fan_in=H)
        self.w13, self.w2 = draw(E, 2 * inter, H, fan_in=H), draw(E, H, inter, fan_in=inter)
        self.layer, self.config, self.gen = layer, config, gen

    def _inputs(self, n: int) -> "_Inputs":
        if getattr(self, "_cached", None) is None or self._cached.n != n:
            self._cached = _Inputs(self, n)
        return self._cached

    def measure_unchunked(self, n: int) -> dict:
        """batch_ms, P_ms, Q_ms and (one rank) peer_ms at ``n`` tokens."""
        from .peer_moe import torch_moe

        inputs, layer, cfg = self._inputs(n), self.layer, self.layer.config
        calls = {
            "batch_ms": (inputs.load_hidden, lambda: layer.forward(inputs.hidden, self.router, self.w13, self.w2)),
            "P_ms": (inputs.load_hidden, lambda: _on_stream(layer.producer_stream, inputs.producers)),
            "Q_ms": (inputs.load_routed, lambda: layer.run(*inputs.static, self.w13, self.w2)),
        }
        if layer.runtime.world_size == 1:  # one rank: self.w13 and self.w2 hold every expert
            calls["peer_ms"] = (inputs.load_hidden,
                                lambda: torch_moe(inputs.hidden, self.router, self.w13, self.w2, cfg.topk))
        return {name: self._median_ms(load, call) for name, (load, call) in calls.items()}

    def measure_streamed(self, n: int, chunk: int, unchunked: dict) -> dict:
        """streamed_ms at ``n`` tokens in chunks of ``chunk``, beside ``unchunked``'s figures, and what
        follows from them."""
        inputs = self._inputs(n)
        out = dict(unchunked)
        out["streamed_ms"] = self._median_ms(inputs.load_hidden, lambda: self.layer.forward(
            inputs.hidden, self.router, self.w13, self.w2, streaming=True))
        P, Q = out["P_ms"], out["Q_ms"]
        n_chunks = -(-n // chunk)
        out["bound_ms"] = max(P, Q) + min(P, Q) / n_chunks
        out["streamed_over_batch"] = out["streamed_ms"] / out["batch_ms"]
        out["streamed_over_bound"] = out["streamed_ms"] / out["bound_ms"]
        out["gain_possible_ms"] = out["batch_ms"] - out["bound_ms"]
        out["gain_ms"] = out["batch_ms"] - out["streamed_ms"]
        if out["gain_possible_ms"] > EFFICIENCY_FLOOR * out["batch_ms"]:  # else the ratio is noise over noise
            out["overlap_efficiency"] = out["gain_ms"] / out["gain_possible_ms"]
        out["chunks_per_call"] = n_chunks
        # What streaming costs per chunk beyond the batch-ready call (negative: it saves time).
        out["streaming_cost_us_per_chunk"] = (out["streamed_ms"] - out["batch_ms"]) * 1e3 / n_chunks
        if "peer_ms" in out:
            out["batch_over_peer"] = out["batch_ms"] / out["peer_ms"]
            out["streamed_over_peer"] = out["streamed_ms"] / out["peer_ms"]
        return out

    def record_timelines(self, n: int, prefix: str) -> None:
        """One graph replay each of the batch-ready and the streamed call with a :class:`chunkring.Timeline`;
        rank 0 writes every rank's records as ``<prefix>-batch.json`` and ``<prefix>-streamed.json``."""
        import torch

        from chunkring import Timeline
        from chunkring.moe.calibrate import capture_graph
        from chunkring.moe.timeline import write_chrome_trace

        from ..worker import gather_to_root  # here, not at the top: the worker imports the jobs

        inputs, layer, runtime = self._inputs(n), self.layer, self.layer.runtime
        timeline = Timeline(runtime.torch_device, capacity=16 * (n + 64) * runtime.world_size + 1024)
        for name, streaming in (("batch", False), ("streamed", True)):
            def call():
                layer.forward(inputs.hidden, self.router, self.w13, self.w2, streaming=streaming, timeline=timeline)

            graph = capture_graph(call, inputs.load_hidden)
            timeline.clear()
            torch.cuda.synchronize()
            runtime.barrier()
            graph.replay()
            records = timeline.records()
            gathered = gather_to_root(runtime, records)
            if runtime.rank == 0:
                write_chrome_trace(f"{prefix}-{name}.json", dict(enumerate(gathered)),
                                   metadata={"call": name, "tokens_per_rank": n,
                                             "chunk": layer.config.front_tokens_per_slot,
                                             "config": str(layer.config), "ranks": runtime.world_size})

    def _median_ms(self, load, call) -> float:
        """Median replay time of ``call`` captured in a CUDA graph; ``load(i)`` refreshes its inputs."""
        from chunkring.moe.calibrate import replay_median_ms

        return replay_median_ms(call, load, iterations=self.config.iterations, warmup=self.config.warmup,
                                barrier=self.layer.runtime.barrier)


class _Inputs:
    """One token count's inputs: ``rotate`` hidden-state buffers, their routed and quantised forms (the
    consumer-alone call's inputs), and the static tensors the graphs read, refreshed by ``load_*(i)``."""

    def __init__(self, model: _Model, n: int):
        import torch

        from chunkring.moe.producer import quantize_rows_fp8, route

        cfg, device = model.layer.config, model.layer.runtime.torch_device
        self.n, self.fp8, self.router, self.topk = n, cfg.payload.has_scales, model.router, cfg.topk
        self.rotated = [torch.randn(n, cfg.hidden, generator=model.gen, device=device).to(torch.bfloat16)
                        for _ in range(model.config.rotate)]
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
        for dst, src in zip(self.static, self.routed[i % len(self.routed)]):
            if dst is not None:
                dst.copy_(src)

    def producers(self) -> None:
        """The producers alone: router GEMM, top-k and (FP8) quantisation of the whole batch."""
        from chunkring.moe.producer import quantize_rows_fp8, route

        route(self.hidden, self.router, self.topk)
        if self.fp8:
            quantize_rows_fp8(self.hidden)


def _on_stream(stream, work) -> None:
    """``work()`` on ``stream`` (the layer's producer stream: its SM partition, if it has one), joined back
    into the current stream, so P is timed on the SMs the layer's producers get."""
    import torch

    caller = torch.cuda.current_stream()
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        work()
    caller.wait_stream(stream)
