"""Stress: many calls of one MoE layer on randomised batches, every output checked against the fp32
reference, with optional delays and chaos.

Each iteration every rank calls ``MoELayer.run`` on its own routed batch: streamed, except every
``batch_every``-th iteration, which is batch-ready, and every ``graph_every``-th, which replays one
CUDA graph of a streamed call captured once at ``max_tokens_per_rank`` rows (the batch copied into the
captured inputs, its token count into the device count the graph reads). Token counts are drawn per rank
and iteration: 10 % of draws an empty rank (0 tokens), 10 % a full one (``max_tokens_per_rank``), 15 % a
multiple of ``stream_slot_tokens``, the rest anything in [1, max] (mostly not a multiple). The rings
persist across calls, so slots wrap; the config must allow more chunks per call than the ring has slots.

With probability ``delay_probability`` an iteration also delays one side of one rank: that rank
enqueues ``torch.cuda._sleep(cycles)`` on its layer's producer or consumer stream before the call (the
call's streams wait for the caller's stream, and work already queued on them runs first).

Chaos (``chaos``, on rank ``chaos_rank`` at iteration ``chaos_iteration``): ``"delay"`` sleeps on the
host for ``chaos_delay_s`` before the call (shorter than the device watchdog, so the job must still
pass); ``"kill"`` SIGKILLs the rank (the launcher must end the job with status 5 and a line naming it).

Everything random is drawn from ``seed`` and the iteration number, so every rank draws the same plan
and a run can be repeated. In ``duration_s`` mode rank 0 decides when to stop and tells the others.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkring.errors import ChunkringUsageError, UsageProblems

from ..config import check_range
from ..progress import progress
from .moe_workload import (
    LayerFields,
    RoutedBatch,
    Weights,
    check_output,
    open_layer,
    reference_output,
    route_batch,
    seeded_hidden,
    seeded_weights,
)

if TYPE_CHECKING:
    import torch

    from chunkring import MoELayer, Runtime

CHAOS = ("none", "delay", "kill")
SIDES = ("producer", "consumer")
#: Shares of the token-count draws (the rest: uniform in [1, max_tokens_per_rank]).
EMPTY_SHARE, FULL_SHARE, MULTIPLE_SHARE = 0.10, 0.10, 0.15


@dataclass(frozen=True)
class CONFIG(LayerFields):
    iterations: int = 200          # iterations to run; 0: run for duration_s instead
    duration_s: float = 0.0        # seconds to run (rank 0's clock) when iterations = 0
    batch_every: int = 4           # every k-th iteration is batch-ready; 0: never
    graph_every: int = 3           # every k-th iteration replays a captured streamed call; 0: never
    delay_probability: float = 0.25
    delay_cycles_max: int = 2_000_000   # GPU clock cycles (2e6 ~ 1 ms on an H200)
    chaos: str = "none"
    chaos_rank: int = 1
    chaos_iteration: int = 10
    chaos_delay_s: float = 5.0

    def check(self, problems: UsageProblems) -> None:
        super().check(problems)
        if (self.iterations > 0) == (self.duration_s > 0):
            problems.add(f"set iterations > 0 or duration_s > 0 (the other 0), got iterations={self.iterations} and "
                         f"duration_s={self.duration_s:g}", field="iterations")
        check_range(problems, self, "iterations", 0, 10_000_000)
        check_range(problems, self, "duration_s", 0, 7 * 86400, "a week")
        check_range(problems, self, "batch_every", 0, 1_000_000)
        if not (self.graph_every == 0 or 2 <= self.graph_every <= 1_000_000):
            problems.add(f"must be 0 or in [2, 1000000] (the first call is eager), got {self.graph_every}",
                         field="graph_every")
        check_range(problems, self, "delay_probability", 0, 1)
        check_range(problems, self, "delay_cycles_max", 1, 2_000_000_000, "2e9 cycles ~ 1 s")
        self._check_chaos(problems)
        ring = ("max_tokens_per_rank", "stream_slot_tokens", "stream_slots")
        if not problems.reported(*ring) and \
                -(-self.max_tokens_per_rank // self.stream_slot_tokens) <= self.stream_slots:
            problems.add(f"a full call of {self.max_tokens_per_rank} tokens in {self.stream_slot_tokens}-token "
                         f"chunks never wraps a ring of {self.stream_slots} slots; stress needs more chunks per "
                         f"call than slots", field="stream_slots")

    def _check_chaos(self, problems: UsageProblems) -> None:
        from chunkring.env import watchdog_timeout_s

        if self.chaos not in CHAOS:
            problems.add(f"must be one of {list(CHAOS)}, got {self.chaos!r}", field="chaos")
        if self.chaos_rank < 0:
            problems.add(f"must be a rank (>= 0), got {self.chaos_rank}", field="chaos_rank")
        if self.chaos_iteration < 0 or (self.iterations and self.chaos_iteration >= self.iterations):
            problems.add(f"must be in [0, iterations={self.iterations}), got {self.chaos_iteration}",
                         field="chaos_iteration")
        watchdog = watchdog_timeout_s()
        if self.chaos == "delay" and not 0 < self.chaos_delay_s < watchdog:
            problems.add(f"must be in (0, {watchdog:g}): shorter than the device watchdog (CHUNKRING_TIMEOUT_S), so "
                         f"the job must still pass; got {self.chaos_delay_s:g}", field="chaos_delay_s")


@dataclass(frozen=True)
class Delay:
    rank: int
    side: str      # "producer" or "consumer"
    cycles: int


@dataclass(frozen=True)
class IterationPlan:
    """What every rank does in one iteration (identical on every rank)."""

    mode: str                 # "streamed", "batch" or "graph" (a replay of a captured streamed call)
    tokens: tuple[int, ...]   # per rank
    delay: Delay | None


def plan_iteration(config: CONFIG, iteration: int, world_size: int) -> IterationPlan:
    """The iteration's plan, drawn from ``config.seed`` and ``iteration`` alone."""
    rng = random.Random(f"chunkring-stress/{config.seed}/{iteration}")
    mode = "streamed"
    if config.batch_every and (iteration + 1) % config.batch_every == 0:
        mode = "batch"
    elif config.graph_every and (iteration + 1) % config.graph_every == 0:
        mode = "graph"
    tokens = tuple(_draw_tokens(rng, config.max_tokens_per_rank, config.stream_slot_tokens)
                   for _ in range(world_size))
    delay = None
    if rng.random() < config.delay_probability:
        delay = Delay(rng.randrange(world_size), rng.choice(SIDES), rng.randint(1, config.delay_cycles_max))
    return IterationPlan(mode, tokens, delay)


def _draw_tokens(rng: random.Random, most: int, per_slot: int) -> int:
    share = rng.random()
    if share < EMPTY_SHARE:
        return 0
    if share < EMPTY_SHARE + FULL_SHARE:
        return most
    if share < EMPTY_SHARE + FULL_SHARE + MULTIPLE_SHARE:
        return per_slot * rng.randint(1, most // per_slot)
    return rng.randint(1, most)


def run(runtime: Runtime, config: CONFIG) -> dict[str, float]:
    """Run the iterations on this rank; returns this rank's figures. Raises on any wrong output."""
    if config.chaos != "none" and config.chaos_rank >= runtime.world_size:
        raise ChunkringUsageError(f"rank {config.chaos_rank} does not exist in a world of {runtime.world_size}",
                                  field="chaos_rank")
    cfg = config.layer_config()
    # Without delays the eager calls replay the layer's own graphs, stressing that path too. A delay acts on the
    # layer's streams, which a replayed call does not use: with delays every eager call launches its kernels there.
    with open_layer(runtime, config, cfg, eager_graphs=config.delay_probability == 0) as layer:
        weights = seeded_weights(layer, config.seed)
        return _iterate(runtime, config, layer, weights)


def _iterate(runtime: Runtime, config: CONFIG, layer: MoELayer, weights: Weights) -> dict[str, float]:
    tally: dict[str, float] = {"iterations": 0, "streamed_calls": 0, "batch_calls": 0, "graph_calls": 0,
                               "empty_calls": 0, "tokens": 0, "delays_injected": 0, "max_abs_error": 0.0,
                               "max_rel_error": 0.0}
    bar = progress("stress", runtime.rank, total=config.iterations or None, duration_s=config.duration_s or None)
    start = time.monotonic()
    iteration = 0
    replay = GraphCall(layer, weights)
    while _keep_going(runtime, config, iteration, start):
        plan = plan_iteration(config, iteration, runtime.world_size)
        rel, abs_err = _one_call(runtime, config, layer, weights, replay, iteration, plan, tally)
        tally["max_rel_error"] = max(tally["max_rel_error"], rel)
        tally["max_abs_error"] = max(tally["max_abs_error"], abs_err)
        iteration += 1
        tally["iterations"] = iteration
        bar.update(iteration, f"max rel err {tally['max_rel_error']:.2e}")
    bar.close(iteration, f"max rel err {tally['max_rel_error']:.2e}")
    tally["wall_s"] = time.monotonic() - start
    return tally


def _keep_going(runtime: Runtime, config: CONFIG, iteration: int, start: float) -> bool:
    """Whether to run ``iteration``; by count on every rank, or by rank 0's clock, which it shares."""
    if config.iterations:
        return iteration < config.iterations
    return runtime.broadcast_object(time.monotonic() - start < config.duration_s, root=0)


def _one_call(runtime: Runtime, config: CONFIG, layer: MoELayer, weights: Weights, replay: GraphCall, iteration: int,
              plan: IterationPlan, tally: dict[str, float]) -> tuple[float, float]:
    """Build this rank's batch and reference, inject what the plan says, call, check."""
    import torch

    from chunkring.moe import CallMode

    rank, cfg = runtime.rank, layer.config
    n = plan.tokens[rank]
    seed = (config.seed * 1_000_003 + iteration) * 4099 + rank  # distinct per (seed, iteration, rank)
    hidden = seeded_hidden(n, cfg.hidden, seed, runtime.torch_device)
    batch = route_batch(hidden, weights.router, cfg.topk, config.payload)
    ref = reference_output(batch, weights)
    if config.chaos != "none" and rank == config.chaos_rank and iteration == config.chaos_iteration:
        _chaos(config)
    if plan.delay is not None and plan.delay.rank == rank:
        producer, consumer = layer.streams(CallMode.BATCH_READY if plan.mode == "batch" else CallMode.STREAMED)
        stream = producer if plan.delay.side == "producer" else consumer
        with torch.cuda.stream(stream):
            torch.cuda._sleep(plan.delay.cycles)
        tally["delays_injected"] += 1
    if plan.mode == "graph":
        out = replay(batch)
    else:
        out = layer.run(batch.x, batch.x_sf, batch.topk_idx, batch.topk_weights, weights.w13, weights.w2,
                        streaming=plan.mode == "streamed")
    torch.cuda.synchronize()
    layer.check()
    mode = plan.mode
    tally[f"{mode}_calls"] += 1
    tally["tokens"] += n
    tally["empty_calls"] += n == 0
    return check_output(out, ref, tolerance=config.tolerance,
                        what=f"rank {rank}: iteration {iteration} ({mode}, {n} tokens)")


class GraphCall:
    """A streamed call captured once (at its first use) with ``max_tokens_per_rank`` rows; a call copies
    the batch into the captured inputs and its length into the device token count, then replays. The
    capture runs nothing, so ranks need not capture together; each replay is one collective call."""

    def __init__(self, layer: MoELayer, weights: Weights) -> None:
        self.layer, self.weights = layer, weights
        self.graph: torch.cuda.CUDAGraph | None = None

    def _capture(self, batch: RoutedBatch) -> torch.cuda.CUDAGraph:
        import torch

        cfg, device = self.layer.config, self.layer.runtime.torch_device
        rows = cfg.max_tokens_per_rank

        def zeros(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=device)

        # The captured call's inputs, max_tokens_per_rank rows each (x_sf None for bf16).
        x, x_sf, topk_idx, topk_weights = _inputs(batch)
        self.inputs = (zeros(x), None if x_sf is None else zeros(x_sf), zeros(topk_idx), zeros(topk_weights))
        self.count = torch.zeros(1, dtype=torch.int32, device=device)
        self.out = torch.empty((rows, cfg.hidden), dtype=torch.bfloat16, device=device)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.layer.run(*self.inputs, self.weights.w13, self.weights.w2, streaming=True, out=self.out,
                           num_tokens=self.count)
        return self.graph

    def __call__(self, batch: RoutedBatch) -> torch.Tensor:
        graph = self.graph if self.graph is not None else self._capture(batch)
        n = batch.x.shape[0]
        for captured, fresh in zip(self.inputs, _inputs(batch), strict=True):
            assert (captured is None) == (fresh is None), "a batch of another payload than the captured call's"
            if captured is not None and fresh is not None:
                captured[:n].copy_(fresh)
        self.count.fill_(n)
        graph.replay()
        return self.out[:n].clone()


def _inputs(batch: RoutedBatch) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """A routed batch as the layer's run() takes it: x, x_sf, topk_idx, topk_weights."""
    return batch.x, batch.x_sf, batch.topk_idx, batch.topk_weights


def _chaos(config: CONFIG) -> None:
    if config.chaos == "delay":
        time.sleep(config.chaos_delay_s)
    elif config.chaos == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
