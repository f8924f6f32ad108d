"""Bench: does streaming make the MoE layer faster end to end? Batch-ready against streamed, beside the
ideal overlap bound, at every token count and chunk size of the config.

For each token count in ``tokens`` and chunk size in ``chunks`` (a layer whose streaming ring has
``front_num_slots`` slots of that size), every rank times, as CUDA-graph replays (how serving stacks
run a layer: no Python launch cost in the figure), with CUDA events, the median of ``iterations``
replays after ``warmup``, its hidden states rotated among ``rotate`` buffers so caches do not flatter:

* ``batch``: the whole layer with its own producers (router GEMM, top-k, FP8 quantisation, publish,
  dispatch, experts, combine), batch-ready;
* ``streamed``: the same call streamed;
* ``P``: the producers alone (router GEMM, top-k and quantisation of the whole batch);
* ``Q``: the consumer alone: the batch-ready layer on the already routed batch;
* ``bound``: ``max(P, Q) + min(P, Q) / n_chunks``, perfect overlap of the two at this chunking;
* ``gain_possible_ms`` (batch - bound), ``gain_ms`` (batch - streamed), ``streamed_over_batch``, and the
  overlap efficiency ``gain / gain_possible`` (1 = the bound reached, 0 = no gain, negative = streaming
  lost time) - reported only where overlap could save at least 5 % of the batch-ready time; below that
  the ratio divides noise by noise.

Weights are drawn on the GPU (only this rank's experts): the bench checks nothing; ``run`` and
``stress`` check the same layer against the reference.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from chunkring.errors import ChunkringUsageError

from ..progress import progress

#: Overlap efficiency is reported only where the bound is at least this fraction below batch-ready.
EFFICIENCY_FLOOR = 0.05
from .moe_workload import LayerFields, open_layer


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

    @property
    def token_counts(self) -> tuple[int, ...]:
        return _ints(self.tokens, "tokens")

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        return _ints(self.chunks, "chunks")

    def __post_init__(self):
        for field, values in (("tokens", self.token_counts), ("chunks", self.chunk_sizes)):
            if max(values) > self.max_tokens_per_rank:
                raise ChunkringUsageError(f"{max(values)} exceeds max_tokens_per_rank={self.max_tokens_per_rank}",
                                          field=field)
        for name, top in (("iterations", 100_000), ("warmup", 1000), ("rotate", 64)):
            if not 1 <= getattr(self, name) <= top:
                raise ChunkringUsageError(f"must be in [1, {top}]", field=name)
        super().__post_init__()


def run(runtime, config: CONFIG) -> dict:
    """Every shape's figures on this rank, keyed ``n<tokens>_c<chunk>_<figure>``."""
    figures = {}
    bar = progress("bench", runtime.rank, total=len(config.chunk_sizes) * len(config.token_counts))
    done = 0
    for chunk in config.chunk_sizes:
        cfg = replace(config.layer_config(), front_tokens_per_slot=chunk)
        with open_layer(runtime, config, cfg) as layer:
            model = _Model(layer, config)
            for n in config.token_counts:
                shape = model.measure(n, chunk)
                figures.update({f"n{n}_c{chunk}_{key}": value for key, value in shape.items()})
                done += 1
                bar.update(done, f"n={n} chunk={chunk}: streamed/batch {shape['streamed_over_batch']:.2f}")
            layer.check()
    bar.close(done, "")
    return figures


class _Model:
    """This rank's router and experts (drawn on the GPU) and the graphs of one layer."""

    def __init__(self, layer, config: CONFIG):
        import torch

        cfg, device = layer.config, layer.runtime.torch_device
        gen = torch.Generator(device).manual_seed(config.seed * 7919 + layer.runtime.rank)
        E, H, inter = layer.experts_per_rank, cfg.hidden, cfg.intermediate

        def draw(*shape, fan_in):
            return (torch.randn(*shape, generator=gen, device=device) / fan_in**0.5).to(torch.bfloat16)

        self.router = draw(cfg.num_experts, H, fan_in=H)
        self.w13, self.w2 = draw(E, 2 * inter, H, fan_in=H), draw(E, H, inter, fan_in=inter)
        self.layer, self.config, self.gen = layer, config, gen

    def measure(self, n: int, chunk: int) -> dict:
        import torch

        from chunkring.moe_producer import quantize_rows_fp8, route

        cfg, device = self.layer.config, self.layer.runtime.torch_device
        fp8 = cfg.payload.has_scales
        rotated = [torch.randn(n, cfg.hidden, generator=self.gen, device=device).to(torch.bfloat16)
                   for _ in range(self.config.rotate)]
        hidden = torch.empty_like(rotated[0])
        routed = []  # the consumer-alone call's inputs, per rotated buffer
        for h in rotated:
            idx, w = route(h, self.router, cfg.topk)
            x, x_sf = quantize_rows_fp8(h) if fp8 else (h, None)
            routed.append((x, x_sf, idx, w))
        static = [None if t is None else torch.empty_like(t) for t in routed[0]]

        def load_hidden(i):
            hidden.copy_(rotated[i % len(rotated)])

        def load_routed(i):
            for dst, src in zip(static, routed[i % len(routed)]):
                if dst is not None:
                    dst.copy_(src)

        def producers():
            route(hidden, self.router, cfg.topk)
            if fp8:
                quantize_rows_fp8(hidden)

        calls = {
            "batch_ms": (load_hidden, lambda: self.layer.forward(hidden, self.router, self.w13, self.w2)),
            "streamed_ms": (load_hidden, lambda: self.layer.forward(hidden, self.router, self.w13, self.w2,
                                                                     streaming=True)),
            "P_ms": (load_hidden, producers),
            "Q_ms": (load_routed, lambda: self.layer.run(*static, self.w13, self.w2)),
        }
        out = {name: self._median_ms(load, call) for name, (load, call) in calls.items()}
        P, Q = out["P_ms"], out["Q_ms"]
        n_chunks = -(-n // chunk)
        out["bound_ms"] = max(P, Q) + min(P, Q) / n_chunks
        out["streamed_over_batch"] = out["streamed_ms"] / out["batch_ms"]
        out["gain_possible_ms"] = out["batch_ms"] - out["bound_ms"]
        out["gain_ms"] = out["batch_ms"] - out["streamed_ms"]
        if out["gain_possible_ms"] > EFFICIENCY_FLOOR * out["batch_ms"]:  # else the ratio is noise over noise
            out["overlap_efficiency"] = out["gain_ms"] / out["gain_possible_ms"]
        out["chunks_per_call"] = n_chunks
        return out

    def _median_ms(self, load, call) -> float:
        """Median replay time of ``call`` captured in a CUDA graph; ``load(i)`` refreshes its inputs."""
        import statistics

        import torch

        runtime = self.layer.runtime
        load(0)
        call()  # eager warm-up: every kernel loaded, every lazy torch initialisation done
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        times = []
        for i in range(self.config.warmup + self.config.iterations):
            load(i)
            torch.cuda.synchronize()
            runtime.barrier()  # every rank replays together: a call is a collective
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            stop.record()
            stop.synchronize()
            if i >= self.config.warmup:
                times.append(start.elapsed_time(stop))
        return statistics.median(times)
