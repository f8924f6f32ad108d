"""What the consumer's input checks cost (protocol/validate.cuh): the MoE pull kernel with the checks
against the same kernel built without them (the NO_INPUT_CHECKS mutant), on the same published chunks.

    python benchmarks/bench_input_checks.py [--tokens 256] [--hidden 4096] [--topk 6] [--experts 256] [--json PATH]
    mpirun -np 4 python benchmarks/bench_input_checks.py ...     (several ranks: every source's chunk)

Every rank publishes one full end-of-stream chunk; the pull holds a source's last chunk unacknowledged
(the layer acknowledges it after its combine), so the same chunks can be pulled again: nothing is
acknowledged until the reset at the end. Times ``--launches`` pulls of every source's chunk per build,
median of ``--repeats`` rounds (CUDA events), with the layer's pull grid. The checks are per value read
(one compare per top-k choice, one ``isfinite`` per scale), so the figure is per chunk pulled.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import chunkring
from chunkring import MoEConfig, MoELayer
from chunkring.jit import library_for
from chunkring.moe import CallMode
from chunkring.moe._engine.resources import PULL_BLOCK
from chunkring.moe.routing import quantize_rows_fp8, route
from chunkring.ring.io import publish_chunk
from chunkring.testing import records
from chunkring.testing.stress import NO_INPUT_CHECKS


def pull_us(layer, library, launches: int, repeats: int) -> float:
    """Median µs per pull (every source's chunk) with ``library``'s moe_pull."""
    res = layer.resources
    arrivals = res.arrivals[CallMode.BATCH_READY] if res.pull_grid > 1 else None  # untouched: last chunks are held
    args = {"desc": res.rings[CallMode.BATCH_READY].desc, "arrivals": arrivals, "stage": res.stage.desc,
            "trace": None, "trace_capacity": 0}
    rounds = []
    for _ in range(repeats + 1):  # the first round warms up
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(launches):
            library.launch("moe_pull", grid=res.pull_grid, block=PULL_BLOCK, **args)
        stop.record()
        stop.synchronize()
        rounds.append(start.elapsed_time(stop) * 1e3 / launches)
    return statistics.median(rounds[1:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256, help="rows per chunk (stream_slot_tokens)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--topk", type=int, default=6)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--launches", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    runtime = chunkring.init()
    device = runtime.torch_device
    cfg = MoEConfig(num_experts=args.experts, hidden=args.hidden, intermediate=128, topk=args.topk,
                    max_tokens_per_rank=args.tokens, stream_slots=2, stream_slot_tokens=args.tokens)
    layer = MoELayer(runtime, cfg, timeout_s=60)
    try:
        gen = torch.Generator(device).manual_seed(runtime.rank)
        hidden = torch.randn(args.tokens, args.hidden, generator=gen, device=device).to(torch.bfloat16)
        router = torch.randn(args.experts, args.hidden, generator=gen, device=device).to(torch.bfloat16)
        idx, w = route(hidden, router, args.topk)
        x, x_sf = quantize_rows_fp8(hidden)
        publish_chunk(layer.rings[CallMode.BATCH_READY], x=x, x_sf=x_sf, topk_idx=idx, topk_weights=w, token_base=0,
                      end_of_stream=True)
        torch.cuda.synchronize()
        runtime.barrier()
        unchecked = library_for(runtime, "moe_stream", defines={"CHUNKRING_MUTANT": NO_INPUT_CHECKS})
        checked_us = pull_us(layer, layer.resources.kernels.stream, args.launches, args.repeats)
        unchecked_us = pull_us(layer, unchecked, args.launches, args.repeats)
        layer.check()
        runtime.barrier()
        layer.reset()  # the chunks were pulled but never acknowledged
    finally:
        layer.close()
    if runtime.rank == 0:
        figures = {"pull_checked_us": checked_us, "pull_unchecked_us": unchecked_us,
                   "checks_us_per_step": checked_us - unchecked_us,
                   "checks_share_of_pull": (checked_us - unchecked_us) / checked_us}
        print(f"input checks, {runtime.world_size} rank(s), chunk {args.tokens} x {args.hidden}, top-{args.topk}: "
              f"pull {checked_us:.2f} us checked, {unchecked_us:.2f} us unchecked, "
              f"checks {checked_us - unchecked_us:+.2f} us per chunk ({figures['checks_share_of_pull']:+.1%})")
        if args.json:
            records.write(args.json, suite="bench_input_checks", world_size=runtime.world_size, figures=figures)
    runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
