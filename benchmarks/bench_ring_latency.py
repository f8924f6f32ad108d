"""Ring protocol latency beside the raw NVSHMEM signal floor, measured in the same run.

    mpirun -np 2 python benchmarks/bench_ring_latency.py [--iters N] [--json PATH]
    mpirun -np N python benchmarks/bench_ring_latency.py --ack-cost [--iters N] [--json PATH]

Prints, on rank 0: raw signal ping-pong one-way latency (selftest_pingpong / 2), ring publish->observe
(ring_publish_pingpong / 2), and the full slot round trip (publish -> consume -> ack by every rank ->
reusable), each with its ratio to the raw floor. Needs at least two ranks (one GPU is fine under MPS).

--ack-cost: the ack's cost against the rank count (run it at 2, 4, 8 ranks). PE 0 produces into a
one-slot ring, every rank consumes and acknowledges each chunk (ring_ack_cost); per chunk it prints the
round trip, PE 0's wait for every rank's ack word (begin_chunk), and each consumer's ack (one remote
swap, a fetching atomic, so a full round trip to the owner) - mean and max over ranks.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

import chunkring
from chunkring import Ring, RingSpec
from chunkring.jit import library_for
from chunkring.ring.spec import PayloadFormat
from chunkring.testing import records, selftest


def launched(runtime, ring, lib, kernel, iters, grid, words=1):
    """Run ``kernel`` once on a freshly reset ``ring``; returns its elapsed_ns words on this rank."""
    elapsed = torch.zeros(words, dtype=torch.int64, device=runtime.torch_device)
    ring.reset()
    lib.launch(kernel, desc=ring.desc, iters=iters, elapsed_ns=elapsed, grid=grid, block=32)
    torch.cuda.synchronize()
    ring.check()
    runtime.barrier()
    return elapsed.tolist()


def timed(runtime, ring, lib, kernel, iters, grid):
    return launched(runtime, ring, lib, kernel, iters, grid)[0] / iters / 1e3  # µs per iteration on PE 0


def ack_cost(runtime, lib, common, iters, json_path) -> None:
    """The ack's cost at this rank count (ring_ack_cost), printed and written by rank 0."""
    with Ring(runtime, RingSpec(num_slots=1, **common), timeout_s=30) as one_slot:
        launched(runtime, one_slot, lib, "ring_ack_cost", min(iters, 100), 2, words=4)  # warm-up
        words = launched(runtime, one_slot, lib, "ring_ack_cost", iters, 2, words=4)
    per_rank = runtime.gather_object(words)
    if per_rank is None:  # not rank 0
        return
    us = [[w / iters / 1e3 for w in rank_words] for rank_words in per_rank]
    acks = [u[2] for u in us]
    figures = {"round_trip_us": us[0][0], "owner_ack_wait_us": us[0][1], "ack_swap_mean_us": sum(acks) / len(acks),
               "ack_swap_max_us": max(acks), "chunk_wait_mean_us": sum(u[3] for u in us) / len(us),
               "ack_swap_us_by_rank": acks}
    print(f"ack cost, {runtime.world_size} ranks on {torch.cuda.get_device_name(runtime.ordinal)}, {iters} chunks "
          f"through one slot, every rank acknowledging each (us per chunk)")
    for name in ("round_trip_us", "owner_ack_wait_us", "ack_swap_mean_us", "ack_swap_max_us", "chunk_wait_mean_us"):
        print(f"{name:<30} {figures[name]:8.3f}")
    if json_path:
        records.write(json_path, suite="bench_ring_ack_cost", world_size=runtime.world_size, figures=figures)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--json", default=None)
    parser.add_argument("--ack-cost", action="store_true", help="measure the ack's cost at this rank count instead")
    args = parser.parse_args()
    runtime = chunkring.init()
    if runtime.world_size < 2:
        print("bench_ring_latency: needs at least two ranks (mpirun -np 2 ...)", file=sys.stderr)
        runtime.close()
        return 2
    common: dict[str, Any] = dict(world_size=runtime.world_size, tokens_per_slot=1, hidden=128,
                                  payload=PayloadFormat.BF16, topk=1, num_experts=runtime.world_size)
    if args.ack_cost:
        ack_cost(runtime, library_for(runtime, "ring_bench"), common, args.iters, args.json)
        runtime.close()
        return 0
    selftest_lib = library_for(runtime, "selftest")
    raw_rtt = selftest.pingpong(runtime, selftest_lib, runtime.alloc(1, torch.int64), args.iters)
    lib = library_for(runtime, "ring_bench")
    with Ring(runtime, RingSpec(num_slots=args.iters, **common), timeout_s=30) as wide:
        publish_rtt = timed(runtime, wide, lib, "ring_publish_pingpong", args.iters, grid=1)
    with Ring(runtime, RingSpec(num_slots=1, **common), timeout_s=30) as one_slot:
        slot_round_trip = timed(runtime, one_slot, lib, "ring_slot_roundtrip", args.iters, grid=2)
    if runtime.rank == 0:
        assert raw_rtt is not None  # pingpong's result on PE 0
        floor = raw_rtt / 2
        rows = [("raw signal one-way (floor)", floor), ("ring publish -> observe", publish_rtt / 2),
                ("ring slot round trip", slot_round_trip)]
        print(f"ring latency, {runtime.world_size} ranks on {torch.cuda.get_device_name(runtime.ordinal)}, "
              f"{args.iters} iters")
        print(f"{'measurement':<30} {'us':>8} {'x floor':>8}")
        for name, value in rows:
            print(f"{name:<30} {value:8.3f} {value / floor:8.2f}")
        if args.json:
            figures = {"raw_signal_one_way_us": floor, "publish_observe_us": publish_rtt / 2,
                       "slot_round_trip_us": slot_round_trip, "publish_observe_over_floor": publish_rtt / 2 / floor,
                       "slot_round_trip_over_floor": slot_round_trip / floor}
            records.write(args.json, suite="bench_ring_latency", world_size=runtime.world_size, figures=figures)
    runtime.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
