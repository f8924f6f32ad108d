"""Where a streamed chunk's production time goes: the router GEMM and the fused producer kernel, timed per
chunk on the layer's producer partition, for the GEMM's two forms and several block sizes of the kernel.

    python -m benchmarks.probe_producer [--shape flash] [--tokens 2048] [--chunks 128,1024]
        [--elements 32768,4096,2048] [--json benchmarks/results/<commit>-producer-probe.json]

For each chunk size (tokens per chunk) it times, as CUDA-graph replays of a whole call's chunks (median of
10), on the producer partition of a streaming layer built as bench_overlap.py builds it:

* ``gemm_fp32_us``: per chunk, ``chunk.float() @ router.float().T`` (two kernels: the copy and an fp32 GEMM);
* ``gemm_bf16_us``: per chunk, :func:`chunkring.moe.routing.router_logits` (one bf16 tensor-core GEMM, fp32
  out);
* ``produce_us[e]``: per chunk, the router GEMM (bf16) and the fused kernel with ``e`` hidden elements per
  block (``PRODUCE_ELEMENTS_PER_BLOCK``), publishing into a scratch ring that ``ring_gather`` drains on the
  consumer partition (bench_overlap.py's P), so ``produce_us[e] - gemm_bf16_us`` is the kernel's share;
* ``produce_us_all_slots``: the same with the layer's default block size into a ring of as many slots as the
  call has chunks, so no chunk waits for the ack of an earlier one: the kernel's own cost, without the
  ring's back-pressure (the default ring has 2 slots: chunk i waits for the consumer's ack of chunk i - 2).

Each figure is a call's time divided by its chunks, so it includes the gaps between the chunk's kernels.

``--profile-once``: no timing; per chunk size one eager call of the producers into an undrained ring of a slot
per chunk (no publish waits and no consumer spins), for a profiler around this script to read the kernels of
(gpu_suite part ``producer_ncu``: Nsight Compute on ``moe_produce_chunk``).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.bench_overlap import SHAPES, ProducersAlone, Shape


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="flash", choices=sorted(SHAPES))
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunks", default="128,1024")
    parser.add_argument("--elements", default="32768,4096,2048")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile-once", action="store_true", help="one untimed call per chunk size, for a profiler")
    args = parser.parse_args(argv)
    chunks = [int(c) for c in args.chunks.split(",")]
    elements = [int(e) for e in args.elements.split(",")]

    import torch

    import chunkring
    from chunkring.moe._engine import producer
    from chunkring.moe.calibration import replay_median_ms
    from chunkring.moe.routing import router_logits

    runtime = chunkring.init()
    shape = Shape(args.shape, runtime, args.tokens, slot=max(chunks))
    layer = shape.layer
    hidden, _ = shape.inputs(args.tokens)
    router = shape.router
    if args.profile_once:
        for chunk in chunks:
            once = ProducersAlone(layer, num_slots=-(-args.tokens // chunk), drain=False)
            once(hidden, router, chunk)
            torch.cuda.synchronize()
            layer.check()
            once.close()
            print(f"profiled: {args.tokens} tokens in chunks of {chunk}", flush=True)
        shape.close()
        runtime.close()
        return 0
    records = []
    try:
        for chunk in chunks:
            producers = ProducersAlone(layer)
            try:
                pieces = -(-args.tokens // chunk)
                stream, _ = layer.streams(producers.mode)
                timed = dict(iterations=args.iterations, warmup=2)

                def gemms(logits_of) -> None:
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        for start in range(0, args.tokens, chunk):
                            logits_of(hidden[start:start + chunk])
                    torch.cuda.current_stream().wait_stream(stream)

                rec = {"shape": args.shape, "tokens": args.tokens, "chunk": chunk, "chunks": pieces,
                       "producer_sms": layer.stats()["producer_sms"]}
                rec["gemm_fp32_us"] = 1e3 * replay_median_ms(
                    lambda: gemms(lambda c: c.float() @ router.float().T), **timed) / pieces
                rec["gemm_bf16_us"] = 1e3 * replay_median_ms(
                    lambda: gemms(lambda c: router_logits(c, router)), **timed) / pieces
                saved = producer.PRODUCE_ELEMENTS_PER_BLOCK
                try:
                    for e in elements:
                        producer.PRODUCE_ELEMENTS_PER_BLOCK = e
                        rec[f"produce_us_e{e}"] = 1e3 * replay_median_ms(
                            lambda: producers(hidden, router, chunk), **timed) / pieces
                        rec[f"grid_e{e}"] = producer.produce_grid(chunk, shape.config.hidden,
                                                                  layer.stats()["producer_grid_max"])
                finally:
                    producer.PRODUCE_ELEMENTS_PER_BLOCK = saved
                unbounded = ProducersAlone(layer, num_slots=pieces)
                try:
                    rec["produce_us_all_slots"] = 1e3 * replay_median_ms(
                        lambda: unbounded(hidden, router, chunk), **timed) / pieces
                finally:
                    torch.cuda.synchronize()
                    unbounded.close()
                layer.check()
                records.append(rec)
                print(", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()),
                      flush=True)
            finally:
                torch.cuda.synchronize()
                producers.close()
    finally:
        shape.close()
        if args.json:
            from chunkring.testing import records as result_file

            result_file.write(args.json, suite="producer-probe", world_size=runtime.world_size, records=records,
                              passed=len(records), failed=len(chunks) - len(records),
                              figures={f"{k}_chunk{r['chunk']}": v for r in records for k, v in r.items()
                                       if isinstance(v, float)})
        runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
