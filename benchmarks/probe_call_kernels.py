"""Every kernel and memset of one MoE layer call, as the GPU ran it inside a CUDA-graph replay: where a
small call's time goes (issue: the consumer at the hardware's limit).

    python -m benchmarks.probe_call_kernels [--shape flash] [--tokens 1,8,128] [--json PATH]

One rank. Per token count, ``MoELayer.run`` batch-ready on pre-routed FP8 input (as ``bench_decode`` times it),
with ``decode`` False and True, captured in a graph and replayed under ``torch.profiler``; the replays are
spaced by idle gaps, and the last one is reported kernel by kernel: its offset from the replay's first kernel,
its duration, its stream. ``span_us`` is the replay from its first kernel's start to its last kernel's end;
``busy_us`` the time some kernel ran (the union of their intervals), so ``span_us - busy_us`` is time with
nothing running: launch gaps between dependent kernels. ``two_roots_second_start_us``: in a graph of two
one-kernel roots on two forked streams, when the second kernel starts after the first (the layer call's consumer
branch starts some 25 us after its producer's publish: the driver's, or the call's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

import chunkring
from benchmarks.bench_vs_megamoe import SHAPES, draw_weights, routed_batch
from chunkring import MoEConfig, MoELayer
from chunkring.moe.calibration import capture_graph
from chunkring.moe.weights import expert_weights
from chunkring.testing import records as result_records

REPLAYS = 5
#: Replays are this far apart (host sleep after a synchronize), so their kernels split into one cluster each.
GAP_S = 0.002
DEVICE_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")


def device_events(trace_path: str) -> list[dict]:
    """The GPU activities of a Chrome trace written by ``torch.profiler``, in start order."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    picked = [e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    return sorted(picked, key=lambda e: float(e["ts"]))


def last_replay(events: list[dict], gap_us: float) -> list[dict]:
    """The events of the last cluster: split where nothing ran for more than ``gap_us``."""
    clusters: list[list[dict]] = []
    end = -float("inf")
    for e in events:
        start = float(e["ts"])
        if start - end > gap_us:
            clusters.append([])
        clusters[-1].append(e)
        end = max(end, start + float(e["dur"]))
    if len(clusters) < REPLAYS:
        raise RuntimeError(f"found {len(clusters)} replays in the trace, expected {REPLAYS}")
    return clusters[-1]


def busy_us(events: list[dict]) -> float:
    """The union of the events' intervals, in µs."""
    total, cur_start, cur_end = 0.0, 0.0, -float("inf")
    for e in events:
        s, t = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if s > cur_end:
            total += max(cur_end - cur_start, 0.0)
            cur_start, cur_end = s, t
        else:
            cur_end = max(cur_end, t)
    return total + max(cur_end - cur_start, 0.0)


def profile_call(layer: MoELayer, args: tuple) -> dict:
    out = profile_graph(capture_graph(lambda: layer.run(*args)))
    layer.check()
    return out


def profile_two_roots() -> dict:
    """A graph of two roots, one one-block kernel each (two streams forked from the capturing stream and joined
    back, as a layer call's producer and consumer): whether the driver starts the second root with the first, or
    later by about the delay a layer call's consumer shows (its first kernel some 25 us after the publish starts)."""
    from benchmarks.probe_graph_launch import plain_graph

    graph, _ = plain_graph(kernels=2, branches=2)
    return profile_graph(graph)


def profile_graph(graph: torch.cuda.CUDAGraph) -> dict:
    """The last of ``REPLAYS`` replays of ``graph``, spaced by idle gaps, under ``torch.profiler``: its span, busy
    time, launches and every kernel's start (from the first's) and duration."""
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(REPLAYS):
                graph.replay()
                torch.cuda.synchronize()
                time.sleep(GAP_S)
        prof.export_chrome_trace(path)
        events = last_replay(device_events(path), gap_us=GAP_S * 1e6 / 2)
    t0 = float(events[0]["ts"])
    span = max(float(e["ts"]) + float(e["dur"]) for e in events) - t0
    kernels = [{"name": e["name"][:80], "kind": e["cat"], "stream": e.get("args", {}).get("stream"),
                "start_us": round(float(e["ts"]) - t0, 2), "dur_us": round(float(e["dur"]), 2)} for e in events]
    return {"span_us": span, "busy_us": busy_us(events), "launches": len(events), "kernels": kernels}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="flash", choices=sorted(SHAPES))
    parser.add_argument("--tokens", default="1,8,128")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",") if t]
    shape = SHAPES[args.shape]
    runtime = chunkring.init()
    records: list[dict] = []
    try:
        device = runtime.torch_device
        E, H, inter, K = (shape[k] for k in ("experts", "hidden", "intermediate", "topk"))
        cfg = MoEConfig(num_experts=E, hidden=H, intermediate=inter, topk=K, max_tokens_per_rank=max(tokens))
        gen = torch.Generator(device=device)
        gen.manual_seed(0)
        router, w13_bf16, w2_bf16 = draw_weights(shape, gen, device)
        w13, w2 = expert_weights(cfg, w13_bf16, w2_bf16)
        del w13_bf16, w2_bf16
        for decode in (False, True):
            layer = MoELayer(runtime, cfg, decode=decode)
            try:
                for t in tokens:
                    _, idx, w, xq, xsf = routed_batch(t, shape, router, gen, device)
                    rec = {"shape": args.shape, "tokens": t, "decode": decode,
                           **profile_call(layer, (xq, xsf, idx, w, w13, w2))}
                    records.append(rec)
                    print(f"\n{args.shape} {t} tokens, decode={decode}: span {rec['span_us']:.1f} us, busy "
                          f"{rec['busy_us']:.1f} us, {rec['launches']} kernels/memsets", flush=True)
                    for k in rec["kernels"]:
                        print(f"  {k['start_us']:8.1f} +{k['dur_us']:7.1f}  s{k['stream']}  {k['name']}")
            finally:
                layer.close()
        roots = profile_two_roots()
        starts = sorted(k["start_us"] for k in roots["kernels"])
        print(f"\ntwo-root graph: kernels start at {starts} us", flush=True)
        if args.json:
            figures = {f"{r['shape']}_{r['tokens']}_{'decode' if r['decode'] else 'deepgemm'}_{key}": r[key]
                       for r in records for key in ("span_us", "busy_us", "launches")}
            figures["two_roots_second_start_us"] = starts[1] if len(starts) > 1 else -1.0
            result_records.write(args.json, suite="call-kernels-1rank", world_size=1, figures=figures,
                                 records=[*records, {"two_roots": roots}], passed=len(records))
    finally:
        runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
