"""The persistent decode consumer (chunkring.moe._engine.persistent, device/kernels/moe_persistent.cu) against today's
decode kernels and DeepGEMM's path, on one GPU, on the same plans: the expert work of a call alone (L1, SwiGLU and the
activation's quantisation, L2), swept over the consumer's variants in one process.

    python -m benchmarks.bench_persistent [--tokens 1,8,32,128,512] [--sweep default|quick|stages]
        [--variant stages=12,token_stages=3 ...] [--reps 15] [--json benchmarks/results/<commit>-persistent.json]

The flash shape (benchmarks.bench_vs_megamoe SHAPES: 32 local experts, hidden 4096, intermediate 2048, top-6), a
batch routed by a random router as bench_decode routes it, planned by the layer's own kernels
(benchmarks.bench_decode.Shape: its ExpertCompute). Per token count and path (``decode``: moe_decode_l1/l2;
``deepgemm``: DeepGEMM's grouped GEMMs and moe_swiglu_fp8; ``persistent`` per variant, :data:`SWEEPS`):

* ``ms``: the median of ``--reps`` CUDA-graph replays, each after the L2 cache is emptied (a read of twice its size)
  and a device delay that lets the host enqueue the replay behind it, the paths interleaved in each round;
* ``tbps`` / ``pct_peak``: the FP8 weights and scales of the experts the batch routes to, over ``ms``, and that rate
  against the card's datasheet bandwidth (the weights read once is the floor of a decode call);
* ``rel_err``: the plan's real rows against an fp64 reference of the recipe (L1 rounded to bf16, SwiGLU, e4m3 per
  1x128, L2), ``vs_decode``: against today's decode kernels' rows; ``verified``: both within 1e-2;
* the default variant's device timeline (one eager launch after an emptied L2): when the first weight stage landed,
  the last L1 and the last L2 unit finished, and the launch's span, in µs from the first block's start.

The record (suite ``persistent``) holds every row; figures per token count: each path's time and TB/s, the best
persistent variant's, and its ratios to the other two paths. A short table prints last.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

import chunkring
from benchmarks.bench_decode import Shape
from benchmarks.bench_vs_megamoe import rel_err, routed_batch
from benchmarks.probe_weight_read import DELAY_CYCLES, L2Flush, peak_tbps
from chunkring.errors import ChunkringRuntimeError
from chunkring.jit import library_for
from chunkring.moe._engine.decode import DecodeGemm
from chunkring.moe._engine.experts import ExpertCompute
from chunkring.moe._engine.persistent import TIMELINE_WORDS, PersistentGemm, PersistentVariant
from chunkring.moe.calibration import capture_graph
from chunkring.moe.gemm import load_deep_gemm
from chunkring.testing import records
from chunkring.testing.reference import plan_reference

#: Named sweeps: each a list of (name, the variant's fields). The default variant first.
SWEEPS: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "default": [("s8t4c64", {}), ("s4t4c64", dict(stages=4)), ("s12t3c64", dict(stages=12, token_stages=3)),
                ("s8t2c64", dict(token_stages=2)), ("s8t4c32", dict(tile_cap=32)), ("s8t4c16", dict(tile_cap=16)),
                ("blocks", dict(claim="strided_blocks")), ("blocked", dict(claim="blocked")),
                ("split", dict(fused=False)), ("w13x16", dict(w13_boxes=16)), ("dynamic", dict(claim="dynamic")),
                ("split_dynamic", dict(claim="dynamic", fused=False))],
    "quick": [("s8t4c64", {}), ("split", dict(fused=False)), ("dynamic", dict(claim="dynamic")),
              ("split_dynamic", dict(claim="dynamic", fused=False))],
    # The layer's variant (dynamic, fused) with more or fewer bytes in flight and narrower passes: where a card's
    # bandwidth asks for more in flight than the H100's did (stages made no difference there).
    "stages": [("s8t4c64", {}), ("dynamic", dict(claim="dynamic")), ("dynamic_s4", dict(claim="dynamic", stages=4)),
               ("dynamic_s12t3", dict(claim="dynamic", stages=12, token_stages=3)),
               ("dynamic_c32", dict(claim="dynamic", tile_cap=32))],
}
TOLERANCE = 1e-2


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``stages=12,token_stages=3`` -> (its name, the fields); values are ints, ``fused`` true/false, ``claim`` a
    name. ``ValueError`` for a field PersistentVariant does not have."""
    fields: dict[str, Any] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or key not in PersistentVariant.__dataclass_fields__:
            raise ValueError(f"variant: expected field=value with a field of "
                             f"{list(PersistentVariant.__dataclass_fields__)}, got {part!r}")
        fields[key] = (value == "true" if key == "fused" else value if key == "claim"
                       else None if value == "none" else int(value))
    return text, fields


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,8,32,128,512")
    parser.add_argument("--sweep", default="default", choices=sorted(SWEEPS))
    parser.add_argument("--variant", action="append", default=[], help="another variant: field=value,...")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
        args.variants = SWEEPS[args.sweep] + [parse_variant(v) for v in args.variant]
    except ValueError as exc:
        parser.error(str(exc))
    if args.reps < 1 or any(t < 1 for t in args.tokens):
        parser.error("--reps and every token count must be >= 1")
    return args


class Timer:
    """CUDA-graph replays after an emptied L2 and a device delay, the calls interleaved in rounds (the median kept)."""

    def __init__(self, device: torch.device) -> None:
        self.empty_l2 = L2Flush(device, int(torch.cuda.get_device_properties(device).L2_cache_size))

    def medians_ms(self, calls: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
        # Each captured after one eager call: DeepGEMM's JIT, the tensor maps.
        graphs = {name: capture_graph(call) for name, call in calls.items()}
        samples: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(reps):
            events = []
            for name, graph in graphs.items():
                self.empty_l2()
                torch.cuda._sleep(DELAY_CYCLES)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                events.append((name, start, end))
            torch.cuda.synchronize()
            for name, start, end in events:
                samples[name].append(start.elapsed_time(end))
        return {name: statistics.median(v) for name, v in samples.items()}


def timeline_us(gemm: PersistentGemm, timer: Timer, plan: Any, w13: Any, w2: Any,
                out: torch.Tensor) -> dict[str, float]:
    """One eager launch of the default variant after an emptied L2: its phases in µs from the first block's start."""
    timeline = torch.zeros((gemm.grid(), TIMELINE_WORDS), dtype=torch.int64, device=out.device)
    timer.empty_l2()
    gemm(plan, w13, w2, out, timeline=timeline)
    torch.cuda.synchronize()
    rec = timeline.cpu()
    start = int(rec[:, 0].min())

    def last(column: int) -> float:
        times = rec[:, column][rec[:, column] > 0]
        return (int(times.max()) - start) / 1e3 if times.numel() else 0.0

    first = rec[:, 1][rec[:, 1] > 0]
    return {"first_stage_us": (int(first.min()) - start) / 1e3 if first.numel() else 0.0,
            "last_l1_us": last(2), "last_l2_us": last(3), "span_us": last(4)}


def measure(s: Shape, gemm: PersistentGemm, timer: Timer, t: int, variants: list[tuple[str, dict[str, Any]]],
            reps: int, peak: float | None) -> list[dict[str, Any]]:
    """One token count's rows: decode, deepgemm, and each persistent variant."""
    device, H = s.runtime.torch_device, s.cfg.hidden
    _, idx, w, xq, xsf = routed_batch(t, s.shape, s.router, s.gen, device)
    x_deq = (xq.double().view(t, H // 128, 128) * xsf.double().unsqueeze(-1)).view(t, H)
    plan = s.computes["deepgemm"].plan(s.stage(t, xq, xsf, idx, w))
    real, ref, _ = plan_reference(plan, x_deq, lambda e: s.w13_ref[e], lambda e: s.w2_ref[e])
    weight_bytes = s.weight_bytes(idx)
    common: dict[str, Any] = {"shape": s.name, "tokens": t, "weight_bytes": weight_bytes,
                              "rows_max": int(plan.counts.max())}
    outs: dict[str, torch.Tensor] = {}
    calls: dict[str, Callable[[], object]] = {}
    for path in ("decode", "deepgemm"):
        def path_call(path: str = path) -> None:
            outs[path] = s.computes[path].experts(plan, s.w13, s.w2)

        calls[path] = path_call
    out = torch.empty((plan.rows.shape[0], H), dtype=torch.bfloat16, device=device)
    checked, refused = {}, []
    for name, fields in variants:
        variant = gemm.with_variant(**fields)

        def variant_call(v: PersistentVariant = variant) -> None:
            gemm(plan, s.w13, s.w2, out, variant=v)

        try:
            variant_call()
        except ChunkringRuntimeError as exc:  # a tensor map the driver refuses: recorded, the others measured
            refused.append({**common, "path": "persistent", "variant": name, "error": str(exc), "verified": False})
            continue
        calls[name] = variant_call
        torch.cuda.synchronize()
        checked[name] = out[real].clone()
    ms = timer.medians_ms(calls, reps)
    rows = []
    for name, time_ms in ms.items():
        got = outs[name][real] if name in outs else checked[name]
        tbps, err = weight_bytes / (time_ms * 1e-3) / 1e12, rel_err(got, ref)
        vs_decode = rel_err(got, outs["decode"][real].double())
        row = {**common, "path": name if name in outs else "persistent", "variant": name, "ms": time_ms,
               "tbps": tbps, "pct_peak": 100 * tbps / peak if peak else None, "rel_err": err, "vs_decode": vs_decode,
               "verified": err <= TOLERANCE and vs_decode <= TOLERANCE}
        if name in checked:
            row["variant_fields"] = asdict(gemm.with_variant(**dict(variants)[name]))
        rows.append(row)
    default = next((r for r in rows if r["variant"] == variants[0][0]), None)  # the sweep's first: the default
    if default is not None:
        default.update(timeline_us(gemm, timer, plan, s.w13, s.w2, out))
    return rows + refused


def figures(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Per token count: each path's ms and TB/s, the best persistent variant's, its ratios, the timeline's µs."""
    found: dict[str, float] = {}
    for t in sorted({r["tokens"] for r in rows}):
        mine = [r for r in rows if r["tokens"] == t]
        by = {r["path"]: r for r in mine if r["path"] != "persistent"}
        persistent = [r for r in mine if r["path"] == "persistent" and r["verified"] and "ms" in r]
        for path, r in by.items():
            found[f"{t}_{path}_ms"], found[f"{t}_{path}_tbps"] = r["ms"], r["tbps"]
        if persistent:
            best = min(persistent, key=lambda r: r["ms"])
            found[f"{t}_persistent_ms"], found[f"{t}_persistent_tbps"] = best["ms"], best["tbps"]
            if best["pct_peak"] is not None:
                found[f"{t}_persistent_pct_peak"] = best["pct_peak"]
            for path, r in by.items():
                found[f"{t}_persistent_over_{path}"] = best["ms"] / r["ms"]
        for key in ("first_stage_us", "last_l1_us", "last_l2_us", "span_us"):
            found.update({f"{t}_default_{key}": r[key] for r in mine if key in r})
    return found


def write_results(path: str, rows: list[dict[str, Any]], *, incomplete: bool = False) -> None:
    """The result file (:mod:`chunkring.testing.records`): suite ``persistent``, every row and the figures; a row
    counts as passed where it was verified."""
    failed = sum(not r["verified"] for r in rows)
    records.write(path, suite="persistent", world_size=1, figures=figures(rows), records=rows, incomplete=incomplete,
                  passed=len(rows) - failed, failed=failed)


def report(rows: list[dict[str, Any]]) -> None:
    print("\ntokens | path       variant    |     ms |  TB/s |  % peak | rel err | vs decode | ok")
    for r in rows:
        if "error" in r:
            print(f"{r['tokens']:6d} | {r['path']:10s} {r['variant']:10s} | refused: {r['error']}")
            continue
        pct = f"{r['pct_peak']:7.1f}" if r["pct_peak"] is not None else "      -"
        print(f"{r['tokens']:6d} | {r['path']:10s} {r['variant']:10s} | {r['ms']:6.3f} | {r['tbps']:5.2f} | {pct} | "
              f"{r['rel_err']:.2e} | {r['vs_decode']:.2e} | {'yes' if r['verified'] else 'NO'}")
    for r in rows:
        if "span_us" in r:
            print(f"{r['tokens']:6d} tokens, default variant: first weight stage {r['first_stage_us']:.1f} us, "
                  f"last L1 unit {r['last_l1_us']:.1f} us, last L2 unit {r['last_l2_us']:.1f} us, "
                  f"span {r['span_us']:.1f} us")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runtime = chunkring.init()
    rows: list[dict[str, Any]] = []
    try:
        shape = Shape("flash", max(args.tokens), runtime, load_deep_gemm(), None, megamoe=False)
        # bench_decode's decode path is the layer's (this kernel, split): the baseline here is the decode kernels.
        E = shape.cfg.num_experts
        shape.computes["decode"] = ExpertCompute(shape.cfg, 1, 0, E, library_for(runtime, "moe_experts"),
                                                 runtime.torch_device,
                                                 decode=DecodeGemm(library_for(runtime, "moe_decode"), shape.cfg, E))
        try:
            gemm = PersistentGemm(library_for(runtime, "moe_persistent"), shape.cfg, shape.cfg.num_experts)
            peak = peak_tbps(torch.cuda.get_device_name(runtime.torch_device))
            timer = Timer(runtime.torch_device)
            for t in args.tokens:
                rows += measure(shape, gemm, timer, t, args.variants, args.reps, peak)
                print(", ".join(f"{r['variant']} {r['ms']:.3f} ms" for r in rows if r["tokens"] == t and "ms" in r),
                      flush=True)
                if args.json:  # what a time limit cuts short survives
                    write_results(args.json, rows, incomplete=True)
                torch.cuda.empty_cache()
        finally:
            shape.close()
    finally:
        runtime.close()
    if args.json:
        write_results(args.json, rows)
    report(rows)
    return 1 if any(not r["verified"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
