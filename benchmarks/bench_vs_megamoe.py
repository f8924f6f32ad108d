"""The MoE layer against DeepGEMM's own SM90 MegaMoE and the plain-torch peer, on one GPU, same inputs.

    python -m benchmarks.bench_vs_megamoe [--shapes flash,v3] [--tokens 1,8,32,128,512,1024,2048,4096,8192]
        [--iterations 20] [--json benchmarks/results/<commit>-vs-megamoe.json]

Per shape (``flash``: DeepGEMM's per-rank shape, 32 local experts, hidden 4096, intermediate 2048,
top-6; ``v3``: hidden 7168, top-8, 32 local experts, intermediate 2048) and token count, on one rank:

* ``chunkring_ms`` / ``chunkring_streamed_ms``: :meth:`chunkring.MoELayer.run` on the routed FP8 batch,
  batch-ready and streamed through the default ring (:meth:`MoEConfig.with_default_ring`), with
  ``decode="auto"`` (``engine``: the expert GEMMs' engine the call's size took, "decode" or "deepgemm"), as
  CUDA-graph replays: every side of a token count timed in the same rounds, interleaved, each sample ``burst_for(t)``
  replays back to back (the median per side, :func:`chunkring.moe.calibration.replay_medians_ms`);
* ``megamoe_ms``: ``deep_gemm.fp8_mega_moe`` on a one-rank process group, its symmetric buffer staged
  with the same FP8 rows, scales and routing (the staging copies timed with the call, as a caller must),
  as CUDA-graph replays timed with the layer's (``megamoe_eager_ms`` beside it: with launch overhead);
* ``torch_bf16_ms``: the plain-torch peer on the same routed batch
  (:func:`chunkring.testing.peer_moe.torch_moe_routed`: sort, two ``torch._grouped_mm``) with the bf16 hidden
  states and bf16 weights, timed with the others - routed as the layer's ``run`` is, so neither side routes;
* ``chunkring_rel_err`` / ``megamoe_rel_err``: ``||out - ref|| / ||ref||`` against an fp64 reference on
  the dequantised operands (the FP8 rows and the FP8 weights both paths read);
* ``weight_bytes``: the FP8 weights (with their scales) of the experts the batch routes to, what a call must
  read at least once, and ``achieved_tbps``: those bytes over ``chunkring_ms`` (the HBM floor's measure);
* the ratios the targets name: ``chunkring_over_megamoe``, ``torch_over_chunkring``,
  ``streamed_over_batch``, ``err_over_megamoe``.

Both engines get identical FP8 weights: :func:`chunkring.moe.quantize_weight_fp8` of one bf16 draw
(128x128 blocks), passed to MegaMoE through ``transform_weights_for_mega_moe_sm90``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from functools import partial

import torch

import chunkring
from benchmarks.probe_deepgemm import mega_moe_calls, moe_reference, one_rank_group, time_eager
from chunkring import MoEConfig, MoELayer
from chunkring.moe.calibration import burst_for, replay_medians_ms
from chunkring.moe.gemm import load_deep_gemm
from chunkring.moe.routing import quantize_rows_fp8, route
from chunkring.moe.weights import Fp8Weight, expert_weights
from chunkring.testing import records
from chunkring.testing.peer_moe import torch_moe_routed

SHAPES = {"flash": dict(experts=32, hidden=4096, intermediate=2048, topk=6),
          "v3": dict(experts=32, hidden=7168, intermediate=2048, topk=8)}


def draw_weights(shape, gen, device):
    """bf16 router [E, H], w13 [E, 2I, H], w2 [E, H, I] (scaled so activations stay O(1))."""
    E, H, inter = shape["experts"], shape["hidden"], shape["intermediate"]
    router = (torch.randn(E, H, generator=gen, device=device) / math.sqrt(H)).bfloat16()
    w13 = (torch.randn(E, 2 * inter, H, generator=gen, device=device) / math.sqrt(H)).bfloat16()
    w2 = (torch.randn(E, H, inter, generator=gen, device=device) / math.sqrt(inter)).bfloat16()
    return router, w13, w2


def routed_batch(t: int, shape, router, gen, device):
    """t random bf16 hidden states routed by ``router`` (top-k softmax) and quantised for the FP8 payload:
    (hidden, topk_idx, topk_weights, x_fp8, x_sf)."""
    hidden = torch.randn(t, shape["hidden"], generator=gen, device=device).bfloat16()
    idx, w = route(hidden, router, shape["topk"])
    return (hidden, idx, w, *quantize_rows_fp8(hidden))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp(min=1e-30))


def bench_shape(name, shape, tokens, args, runtime, dg, group) -> list[dict]:
    device = runtime.torch_device
    E, H, inter, K = shape["experts"], shape["hidden"], shape["intermediate"], shape["topk"]
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=inter, topk=K,
                    max_tokens_per_rank=max(tokens)).with_default_ring()
    layer = MoELayer(runtime, cfg, decode="auto")
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    router, w13_bf16, w2_bf16 = draw_weights(shape, gen, device)
    w13, w2 = expert_weights(layer.config, w13_bf16, w2_bf16)
    assert isinstance(w13, Fp8Weight) and isinstance(w2, Fp8Weight)  # the FP8 payload's weights
    w13_ref, w2_ref = w13.dequantize().double(), w2.dequantize().double()
    l1, l2 = dg.transform_weights_for_mega_moe_sm90((w13.data, w13.scale), (w2.data, w2.scale))
    buffer = dg.get_symm_buffer_for_mega_moe(group, E, max(tokens), K, H, inter)
    rows = []
    try:
        for t in tokens:
            hidden, idx, w, xq, xsf = routed_batch(t, shape, router, gen, device)
            ref = moe_reference((xq.double().view(t, H // 128, 128) * xsf.double().unsqueeze(-1)).view(t, H),
                                lambda e: w13_ref[e], lambda e: w2_ref[e], idx, w, E, inter)
            row = {"shape": name, "tokens": t, "chunk": cfg.stream_slot_tokens,
                   "engine": "decode" if layer.resources.decode_for(t) else "deepgemm"}
            out = {}

            def call(streaming: bool) -> None:
                out[streaming] = layer.run(xq, xsf, idx, w, w13, w2, streaming=streaming)

            y = torch.empty(t, H, dtype=torch.bfloat16, device=device)
            tk = {"xq": xq, "xsf": xsf, "idx": idx, "w": w, "x": hidden}
            _, staged, _ = mega_moe_calls(dg, buffer, tk, t, y, l1, l2)
            row["megamoe_eager_ms"] = time_eager(staged, args.iterations)["median_ms"]
            # Every side the same way, interleaved: graph replays in bursts (replay_medians_ms).
            ms = replay_medians_ms({"chunkring_ms": partial(call, False), "chunkring_streamed_ms": partial(call, True),
                                    "megamoe_ms": staged,
                                    "torch_bf16_ms": partial(torch_moe_routed, hidden, idx, w, w13_bf16, w2_bf16)},
                                   iterations=args.iterations, warmup=3, burst=burst_for(t))
            torch.cuda.synchronize()
            layer.check()
            row.update(ms)
            row["chunkring_rel_err"] = rel_err(out[False], ref)
            row["streamed_equals_batch"] = bool(torch.equal(out[False], out[True]))
            row["megamoe_rel_err"] = rel_err(y, ref)

            touched = int(torch.unique(idx[idx >= 0]).numel())
            per_expert = sum(t.data[0].numel() + 4 * t.scale[0].numel() for t in (w13, w2))
            row["weight_bytes"] = touched * per_expert
            row["achieved_tbps"] = row["weight_bytes"] / (row["chunkring_ms"] * 1e-3) / 1e12
            row["chunkring_over_megamoe"] = row["chunkring_ms"] / row["megamoe_ms"]
            row["torch_over_chunkring"] = row["torch_bf16_ms"] / row["chunkring_ms"]
            row["streamed_over_batch"] = row["chunkring_streamed_ms"] / row["chunkring_ms"]
            row["err_over_megamoe"] = row["chunkring_rel_err"] / row["megamoe_rel_err"]
            rows.append(row)
            print(f"{name:5s} {t:5d} tok | chunkring {row['chunkring_ms']:.3f} ms (streamed "
                  f"{row['chunkring_streamed_ms']:.3f}) | MegaMoE {row['megamoe_ms']:.3f} | torch "
                  f"{row['torch_bf16_ms']:.3f} | x{row['chunkring_over_megamoe']:.2f} of MegaMoE, "
                  f"{row['torch_over_chunkring']:.2f}x faster than torch | err {row['chunkring_rel_err']:.2e} vs "
                  f"{row['megamoe_rel_err']:.2e}", flush=True)
            torch.cuda.empty_cache()
    finally:
        buffer.destroy()  # DeepGEMM names its free destroy
        layer.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="flash,v3")
    parser.add_argument("--tokens", default="1,8,32,128,512,1024,2048,4096,8192")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    runtime = chunkring.init()
    dg = load_deep_gemm()
    group, _ = one_rank_group()
    rows: list[dict] = []
    shapes = args.shapes.split(",")
    try:
        for i, name in enumerate(shapes):
            rows += bench_shape(name, SHAPES[name], tokens, args, runtime, dg, group)
            # Rewritten after each shape, marked incomplete until the last: a run a time limit cuts keeps
            # the shapes it finished.
            records.write_table(args.json, suite="vs-megamoe", rows=rows, incomplete=i < len(shapes) - 1)
    finally:
        runtime.close()
    print("\nshape  tokens | engine   | chunkring ms | streamed | MegaMoE | torch bf16 | /MegaMoE | torch/ | err   "
          "| err/Mega")
    for r in rows:
        print(f"{r['shape']:5s} {r['tokens']:6d} | {r['engine']:8s} | {r['chunkring_ms']:12.3f} | "
              f"{r['chunkring_streamed_ms']:8.3f} | "
              f"{r['megamoe_ms']:7.3f} | {r['torch_bf16_ms']:10.3f} | {r['chunkring_over_megamoe']:8.2f} | "
              f"{r['torch_over_chunkring']:6.2f} | {r['chunkring_rel_err']:.3f} | {r['err_over_megamoe']:.2f}")
    print(f"median streamed/batch {statistics.median(r['streamed_over_batch'] for r in rows):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
