"""The FP8 decode path (the persistent consumer as a layer runs it: chunkring.moe._engine.persistent, LAYER_VARIANT)
against the DeepGEMM path and DeepGEMM's own SM90 MegaMoE at decode sizes, on one GPU, same inputs.

    python -m benchmarks.bench_decode [--shapes flash,v3] [--tokens 1,2,4,8,16,32,64,128,256,512]
        [--iterations 20] [--json benchmarks/results/<commit>-decode.json]
    python -m benchmarks.bench_decode --profile-once [--shapes flash] [--tokens 1,8,32,128]

Per shape (benchmarks.bench_vs_megamoe SHAPES: ``flash`` 32 local experts, hidden 4096, intermediate 2048, top-6;
``v3`` hidden 7168, top-8) and token count, every time from CUDA-graph replays of all the calls below
interleaved in rounds, ``burst_for(tokens)`` replays back to back per sample (the median per call:
:func:`chunkring.moe.calibration.replay_medians_ms`, the same for every side):

* ``layer_decode_ms`` / ``layer_deepgemm_ms``: :meth:`chunkring.MoELayer.run`, batch-ready, on a layer built
  with ``decode=True`` / ``decode=False`` (plan, expert GEMMs, combine push, reduction: the whole call);
* ``experts_decode_ms`` / ``experts_deepgemm_ms``: the expert work alone on the call's plan
  (:meth:`ExpertCompute.experts`: the decode path's L1 and L2 launches / DeepGEMM L1, ``moe_swiglu_fp8``, DeepGEMM
  L2);
* ``megamoe_ms``: ``deep_gemm.fp8_mega_moe`` with its input staging, as bench_vs_megamoe times it;
* ``weight_bytes``: the FP8 weights and scales of the experts the batch routes to - what a call must read at
  least once - and ``*_tbps``: those bytes over each time above (HBM 4.8 TB/s is the datasheet's ceiling);
* ``rows_max`` (the most rows one expert got: the decode path streams its weights once per pass of up to 64),
  ``layer_*_rel_err`` and ``megamoe_rel_err`` against an fp64 reference on the dequantised operands, and
  ``decode_over_deepgemm`` / ``decode_over_megamoe`` (layer times).

``--profile-once``: no timing; per token count one eager call of each path's expert work, for a profiler
around this script (scripts/gpu_suite.sh part ``decode_ncu``: Nsight Compute on ``moe_persistent_gemm``, its
achieved DRAM bandwidth).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

import chunkring
from benchmarks.bench_vs_megamoe import SHAPES, draw_weights, rel_err, routed_batch
from benchmarks.probe_deepgemm import mega_moe_calls, moe_reference, one_rank_group
from chunkring import MoEConfig, MoELayer
from chunkring.jit import library_for
from chunkring.moe._engine.experts import ExpertCompute
from chunkring.moe._engine.persistent import LAYER_VARIANT, PersistentGemm
from chunkring.moe._engine.stage import Stage
from chunkring.moe.calibration import burst_for, replay_medians_ms
from chunkring.moe.gemm import load_deep_gemm
from chunkring.moe.weights import Fp8Weight, expert_weights
from chunkring.testing import records

PATHS = ("deepgemm", "decode")


class Shape:
    """One shape's layers (one per path), expert work, weights, MegaMoE operands and symmetric buffer."""

    def __init__(self, name: str, max_tokens: int, runtime: Any, dg: Any, group: Any, *, megamoe: bool) -> None:
        self.name, self.shape, self.runtime = name, SHAPES[name], runtime
        device = runtime.torch_device
        E, H, inter, K = (self.shape[k] for k in ("experts", "hidden", "intermediate", "topk"))
        self.cfg = MoEConfig(num_experts=E, hidden=H, intermediate=inter, topk=K, max_tokens_per_rank=max_tokens)
        self.layers = {path: MoELayer(runtime, self.cfg, decode=path == "decode") for path in PATHS}
        experts = library_for(runtime, "moe_experts")
        decode = PersistentGemm(library_for(runtime, "moe_persistent"), self.cfg, E, variant=LAYER_VARIANT)
        self.computes = {"deepgemm": ExpertCompute(self.cfg, 1, 0, E, experts, device),
                         "decode": ExpertCompute(self.cfg, 1, 0, E, experts, device, decode=decode)}
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(0)
        self.router, w13_bf16, w2_bf16 = draw_weights(self.shape, self.gen, device)
        w13, w2 = expert_weights(self.cfg, w13_bf16, w2_bf16)
        assert isinstance(w13, Fp8Weight) and isinstance(w2, Fp8Weight)  # the FP8 payload's weights
        self.w13, self.w2 = w13, w2
        del w13_bf16, w2_bf16
        # The fp64 reference's weights: the FP8 weights both paths read, dequantised once.
        self.w13_ref, self.w2_ref = w13.dequantize().double(), w2.dequantize().double()
        self.dg, self.buffer = dg, None
        if megamoe:
            self.l1, self.l2 = dg.transform_weights_for_mega_moe_sm90((w13.data, w13.scale), (w2.data, w2.scale))
            self.buffer = dg.get_symm_buffer_for_mega_moe(group, E, max_tokens, K, H, inter)

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.destroy()  # DeepGEMM names its free destroy
        for layer in self.layers.values():
            layer.close()

    def stage(self, t: int, xq: torch.Tensor, xsf: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> Stage:
        """What moe_pull leaves for this call at one rank: its rows at their token index, -1 past them."""
        N, H, K, device = self.cfg.max_tokens_per_rank, self.cfg.hidden, self.cfg.topk, self.runtime.torch_device
        stage = Stage(torch.zeros((1, N, H), dtype=torch.float8_e4m3fn, device=device),
                      torch.ones((1, N, H // 128), dtype=torch.float32, device=device),
                      torch.full((1, N, K), -1, dtype=torch.int32, device=device),
                      torch.zeros((1, N, K), dtype=torch.float32, device=device), expert_lo=0,
                      expert_hi=self.cfg.num_experts)
        stage.x[0, :t], stage.sf[0, :t], stage.idx[0, :t], stage.w[0, :t] = xq, xsf, idx, w
        return stage

    def weight_bytes(self, idx: torch.Tensor) -> int:
        touched = int(torch.unique(idx[idx >= 0]).numel())
        return touched * sum(q.data[0].numel() + 4 * q.scale[0].numel() for q in (self.w13, self.w2))


def measure(s: Shape, t: int, iterations: int) -> dict:
    """One token count's row (the module docstring's keys)."""
    H, inter = s.cfg.hidden, s.cfg.intermediate
    hidden, idx, w, xq, xsf = routed_batch(t, s.shape, s.router, s.gen, s.runtime.torch_device)
    x_deq = (xq.double().view(t, H // 128, 128) * xsf.double().unsqueeze(-1)).view(t, H)
    ref = moe_reference(x_deq, lambda e: s.w13_ref[e], lambda e: s.w2_ref[e], idx, w, s.cfg.num_experts, inter)
    row: dict = {"shape": s.name, "tokens": t, "weight_bytes": s.weight_bytes(idx)}
    stage = s.stage(t, xq, xsf, idx, w)
    plan = s.computes["deepgemm"].plan(stage)
    row["rows_max"] = int(plan.counts.max())
    outs: dict[str, torch.Tensor] = {}
    calls: dict[str, Callable[[], object]] = {}
    for path, layer in s.layers.items():
        def call(layer: MoELayer = layer, key: str = f"layer_{path}") -> None:
            outs[key] = layer.run(xq, xsf, idx, w, s.w13, s.w2)  # the graph's output, after its replays

        calls[f"layer_{path}"] = call
    for path, compute in s.computes.items():
        calls[f"experts_{path}"] = partial(compute.experts, plan, s.w13, s.w2)
    if s.buffer is not None:
        y = torch.empty(t, H, dtype=torch.bfloat16, device=s.runtime.torch_device)
        tk = {"xq": xq, "xsf": xsf, "idx": idx, "w": w, "x": hidden}
        _, calls["megamoe"], _ = mega_moe_calls(s.dg, s.buffer, tk, t, y, s.l1, s.l2)
    # Every side the same way, interleaved: graph replays in bursts (replay_medians_ms).
    ms = replay_medians_ms(calls, iterations=iterations, warmup=3, burst=burst_for(t))
    torch.cuda.synchronize()
    row.update({f"{key}_ms": value for key, value in ms.items()})
    for path, layer in s.layers.items():
        layer.check()
        row[f"layer_{path}_rel_err"] = rel_err(outs[f"layer_{path}"], ref)
    if s.buffer is not None:
        row["megamoe_rel_err"] = rel_err(y, ref)
        row["decode_over_megamoe"] = row["layer_decode_ms"] / row["megamoe_ms"]
    for key in [k for k in row if k.endswith("_ms")]:
        row[key.removesuffix("_ms") + "_tbps"] = row["weight_bytes"] / (row[key] * 1e-3) / 1e12
    row["decode_over_deepgemm"] = row["layer_decode_ms"] / row["layer_deepgemm_ms"]
    return row


def profile_once(s: Shape, tokens: list[int]) -> None:
    """One eager call of each path's expert work per token count (no timing), for a profiler."""
    for t in tokens:
        _, idx, w, xq, xsf = routed_batch(t, s.shape, s.router, s.gen, s.runtime.torch_device)
        plan = s.computes["deepgemm"].plan(s.stage(t, xq, xsf, idx, w))
        for compute in s.computes.values():
            compute.experts(plan, s.w13, s.w2)
        torch.cuda.synchronize()
        print(f"profiled: {s.name} {t} tokens, {s.weight_bytes(idx)} weight bytes, most rows per expert "
              f"{int(plan.counts.max())}", flush=True)


def report(rows: list[dict]) -> None:
    print("\nshape  tokens | rows_max | layer decode | deepgemm | MegaMoE | experts decode | deepgemm | "
          "weight MB | decode TB/s (experts) | dec/dg | dec/Mega | err dec / dg")
    for r in rows:
        mega = f"{r['megamoe_ms']:7.3f}" if "megamoe_ms" in r else "      -"
        ratio = f"{r['decode_over_megamoe']:8.2f}" if "decode_over_megamoe" in r else "       -"
        print(f"{r['shape']:5s} {r['tokens']:6d} | {r['rows_max']:8d} | {r['layer_decode_ms']:12.3f} | "
              f"{r['layer_deepgemm_ms']:8.3f} | {mega} | {r['experts_decode_ms']:14.3f} | "
              f"{r['experts_deepgemm_ms']:8.3f} | {r['weight_bytes'] / 1e6:9.1f} | {r['experts_decode_tbps']:21.2f} | "
              f"{r['decode_over_deepgemm']:6.2f} | {ratio} | {r['layer_decode_rel_err']:.3f} / "
              f"{r['layer_deepgemm_rel_err']:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="flash,v3")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,256,512")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--profile-once", action="store_true", help="one untimed call per token count, for ncu")
    parser.add_argument("--no-megamoe", action="store_true", help="leave DeepGEMM's MegaMoE out")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    runtime = chunkring.init()
    dg = load_deep_gemm()
    megamoe = not (args.no_megamoe or args.profile_once)
    group = one_rank_group()[0] if megamoe else None
    rows: list[dict] = []
    try:
        for name in args.shapes.split(","):
            shape = Shape(name, max(tokens), runtime, dg, group, megamoe=megamoe)
            try:
                if args.profile_once:
                    profile_once(shape, tokens)
                    continue
                for t in tokens:
                    rows.append(measure(shape, t, args.iterations))
                    print({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}, flush=True)
                    # what a time limit cuts short survives
                    records.write_table(args.json, suite="decode", rows=rows, incomplete=True)
                    torch.cuda.empty_cache()
            finally:
                shape.close()
    finally:
        runtime.close()
    if args.profile_once:
        return 0
    records.write_table(args.json, suite="decode", rows=rows)
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
