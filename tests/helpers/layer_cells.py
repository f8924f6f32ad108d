"""What the fault-matrix and lifetime tests on the GPU share (no tests here): one small MoE layer's config and
fixed inputs (bf16 payload: no DeepGEMM; every rank draws its own batch from one seed, so each can compare its
output with the first one bit for bit), an error described as plain data (to allgather: every rank then asserts
on the same facts, so a failing cell fails on every rank alike and the ranks' collectives stay in step), and
:func:`rejoin`, the bounded barrier after a fault that lines up a rank which missed waits its peers gave up."""

import time

import torch

from chunkring import ChunkringHostTimeoutError, MoEConfig, MoELayer, PayloadFormat
from tests.gpu.moe_helpers import INTER, H, local_weights, routing, weights

#: Tokens per rank: five chunks of 8 through a two-slot ring (the ring wraps inside a call).
TOKENS, CHUNK, SLOTS, TOPK = 37, 8, 2, 2


def layer_config(world_size: int) -> MoEConfig:
    return MoEConfig(num_experts=2 * world_size, hidden=H, intermediate=INTER, topk=TOPK, max_tokens_per_rank=40,
                     payload=PayloadFormat.BF16, stream_slots=SLOTS, stream_slot_tokens=CHUNK)


class Inputs:
    """This rank's fixed batch (``args``: x, x_sf, topk_idx, topk_weights) and every expert's weights (CPU)."""

    def __init__(self, runtime, seed: int = 11) -> None:
        gen = torch.Generator().manual_seed(seed + runtime.rank)
        device = runtime.torch_device
        x = torch.randn(TOKENS, H, generator=gen).to(torch.bfloat16)
        idx, w = routing(TOKENS, 2 * runtime.world_size, TOPK, "uniform", gen)
        self.args = (x.to(device), None, idx.to(device), w.to(device))
        self.w13, self.w2 = weights(2 * runtime.world_size, torch.Generator().manual_seed(seed))

    def experts(self, layer: MoELayer):
        return local_weights(layer, self.w13, self.w2)


def describe(error: BaseException | None, raised_at: float) -> dict | None:
    """An error as picklable facts: its type, whom it names (the abort's origin, the record's peer, the ranks
    that did not come) and when it was raised (host clock, shared by the ranks of one node)."""
    if error is None:
        return None
    record = getattr(error, "record", None)
    return {"kind": type(error).__name__, "message": str(error)[:400], "at": raised_at,
            "origin_rank": getattr(error, "origin_rank", None), "peer": getattr(record, "peer", None),
            "absent": tuple(getattr(error, "absent_ranks", ())), "gave_up": tuple(getattr(error, "gave_up_ranks", ()))}


def attempt(step) -> dict | None:
    """Run ``step()``; the error it raised, described, or None."""
    try:
        step()
    except Exception as exc:  # the cell records what every rank saw and asserts on all of it at the end
        return describe(exc, time.time())
    return None


def rejoin(runtime, timeout_s: float = 60.0, most: int = 8) -> None:
    """Meet every rank after a fault. A rank that skipped waits its peers gave up on (it raised before them, or
    hung) is behind in the numbering of bounded barriers: each of its barriers that only finds peers who gave up
    (``gave_up_ranks``, nobody absent) consumes one such wait, so it tries again until it lines up."""
    for _ in range(most):
        try:
            runtime.host_barrier(timeout_s=timeout_s, what="the rejoin after a fault")
            return
        except ChunkringHostTimeoutError as exc:
            if exc.absent_ranks or not exc.gave_up_ranks:
                raise
    raise AssertionError(f"rank {runtime.rank} did not line up with its peers in {most} barriers")
