"""Where a batch-ready call of the MoE layer spends its time, on one GPU: the call's device timeline
(each event's offset from the call's start, in a graph replay) and the consumer's steps timed alone as CUDA-graph
replays.

    python benchmarks/bench_consumer_breakdown.py [--shape flash] [--tokens 8,1024,8192] [--json PATH]

Steps timed alone (median of graph replays, :func:`chunkring.moe.calibration.replay_median_ms`): the whole
call (``call_ms``); the expert plan (``plan_ms``: moe_plan_reset, moe_plan_count,
moe_plan_scatter); the experts (``experts_ms``: L1, SwiGLU + FP8 quantisation, L2); the combine push
(``combine_push_ms``: every row into a local buffer, as a rank pushes its peers' rows); the owner's reduction over
k (``reduce_ms``: ``moe_combine_reduce`` over the routed choices' combine rows; ``reduce_own_ms``: the same with
every choice read where the experts left it, as a rank reduces its own choices, which the layer's push skips;
``reduce_torch_ms``: torch's sum of every row, beside them). The timeline adds what only a full call has: the
publish, the pull, the drain.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import chunkring
from benchmarks.bench_vs_megamoe import SHAPES, draw_weights, routed_batch
from chunkring import MoEConfig, MoELayer, Timeline
from chunkring.jit import library_for
from chunkring.moe._engine.experts import ExpertCompute, OwnRows
from chunkring.moe._engine.stage import Stage
from chunkring.moe.calibration import capture_graph, replay_median_ms
from chunkring.moe.timeline import Event
from chunkring.moe.weights import expert_weights
from chunkring.testing import records


def timeline_offsets_us(layer, args, calls: int = 3) -> dict[str, float]:
    """Median over ``calls`` graph replays of the call of each event's offset from CALL_BEGIN, in µs (first of a
    kind): replays, as the steps beside them are timed, so that no offset holds a host launch gap."""
    timeline = Timeline(layer.runtime.torch_device)
    graph = capture_graph(lambda: layer.run(*args, timeline=timeline))
    per_call = []
    for _ in range(calls):
        timeline.clear()
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        records = timeline.records()
        begin = min(int(r[3]) for r in records if int(r[0]) == Event.CALL_BEGIN)
        firsts: dict[str, float] = {}
        for kind, _, _, t in sorted(records.tolist(), key=lambda r: r[3]):
            name = Event(kind).name.lower()
            firsts.setdefault(name, (t - begin) / 1e3)
        per_call.append(firsts)
    return {name: sorted(c[name] for c in per_call)[len(per_call) // 2] for name in per_call[0]}


def breakdown(name: str, tokens: list[int], runtime, iterations: int) -> list[dict]:
    shape, device = SHAPES[name], runtime.torch_device
    E, H, inter, K = shape["experts"], shape["hidden"], shape["intermediate"], shape["topk"]
    N = max(tokens)
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=inter, topk=K, max_tokens_per_rank=N)
    layer = MoELayer(runtime, cfg)
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    router, w13_bf16, w2_bf16 = draw_weights(shape, gen, device)
    w13, w2 = expert_weights(layer.config, w13_bf16, w2_bf16)
    compute = ExpertCompute(cfg, 1, 0, E, library_for(runtime, "moe_experts"), device)
    combine = torch.empty((N * K, H), dtype=torch.bfloat16, device=device)
    local = torch.tensor([combine.data_ptr()], dtype=torch.int64, device=device)
    rows = []
    try:
        for t in tokens:
            _, idx, w, xq, xsf = routed_batch(t, shape, router, gen, device)
            args = (xq, xsf, idx, w, w13, w2)
            row = {"shape": name, "tokens": t}
            row["call_ms"] = replay_median_ms(lambda: layer.run(*args), iterations=iterations, warmup=3)
            stage = Stage(  # what moe_pull leaves: this call's rows at their token index, -1 past them
                torch.zeros((1, N, H), dtype=torch.float8_e4m3fn, device=device),
                torch.ones((1, N, H // 128), dtype=torch.float32, device=device),
                torch.full((1, N, K), -1, dtype=torch.int32, device=device),
                torch.zeros((1, N, K), dtype=torch.float32, device=device), expert_lo=0, expert_hi=E)
            stage.x[0, :t], stage.sf[0, :t], stage.idx[0, :t], stage.w[0, :t] = xq, xsf, idx, w
            row["plan_ms"] = replay_median_ms(lambda: compute.plan(stage), iterations=iterations, warmup=3)
            plan = compute.plan(stage)
            row["experts_ms"] = replay_median_ms(lambda: compute.experts(plan, w13, w2), iterations=iterations,
                                                 warmup=3)
            out = compute.experts(plan, w13, w2)
            row["combine_push_ms"] = replay_median_ms(lambda: compute.combine_push(plan, out, local),
                                                      iterations=iterations, warmup=3)
            result = torch.empty((t, H), dtype=torch.bfloat16, device=device)
            row["reduce_ms"] = replay_median_ms(lambda: compute.reduce(combine, stage.idx[0], stage.w[0], result),
                                                iterations=iterations, warmup=3)
            own = OwnRows(plan.own_row, out)  # one rank: every choice is this rank's own
            row["reduce_own_ms"] = replay_median_ms(
                lambda: compute.reduce(combine, stage.idx[0], stage.w[0], result, own), iterations=iterations,
                warmup=3)
            row["reduce_torch_ms"] = replay_median_ms(  # the torch sum the layer used before moe_combine_reduce
                lambda: torch.sum(combine[:t * K].view(t, K, H), dim=1, out=result), iterations=iterations, warmup=3)
            row["timeline_us"] = timeline_offsets_us(layer, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        layer.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="flash", choices=sorted(SHAPES))
    parser.add_argument("--tokens", default="8,1024,8192")
    parser.add_argument("--iterations", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    runtime = chunkring.init()
    try:
        rows = breakdown(args.shape, [int(t) for t in args.tokens.split(",")], runtime, args.iterations)
    finally:
        runtime.close()
    keys = ("call_ms", "plan_ms", "experts_ms", "combine_push_ms", "reduce_ms", "reduce_own_ms", "reduce_torch_ms")
    records.write_table(args.json, suite="consumer-breakdown", rows=rows)
    print("tokens | " + " | ".join(keys))
    for r in rows:
        print(f"{r['tokens']:6d} | " + " | ".join(f"{r[k]:.3f}" for k in keys))
        print("        timeline µs: " + ", ".join(f"{k} {v:.0f}" for k, v in r["timeline_us"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
