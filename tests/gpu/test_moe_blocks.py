"""Incremental expert blocks on the GPU (docs/PROTOCOL.md, "Incremental expert blocks"): a layer with
``waves > 1`` - the pull writing rows straight into sealed blocks per expert, the expert work in waves that
start while producers still publish - against the fp32 reference (chunkring.testing.reference.
reference_tolerance) and against the batch plan (``waves=1``) on the same inputs; and the negative control
the section names, the kSealOnReserve mutant (a block sealed when its last row is reserved, before its rows
landed), caught by wrong outputs (the pool rows are poisoned with NaN before each call) or by the claimant's
recorded INTERNAL error (its landed count is short).

Every rank derives its inputs from (case, iteration, rank) seeds and checks its own output."""

import math

import pytest
import torch

import chunkring.env
from chunkring import ChunkringRuntimeError, MoEConfig, MoELayer, SmPartition
from chunkring.moe import CallMode
from chunkring.ring.spec import PayloadFormat
from chunkring.testing.reference import dequantize_fp8_per128, quantize_fp8_per128
from chunkring.testing.variants import mutant_layer
from tests.gpu.moe_helpers import case_inputs, layer_reference, local_weights, rel_error, tolerance, weights

pytestmark = [
    pytest.mark.gpu,
    # The pool is not NVSHMEM-registered, so a layer with waves > 1 refuses RMA peers at construction
    # (docs/PROTOCOL.md, "Incremental expert blocks"); the forced-RMA suite has nothing to run here.
    pytest.mark.skipif(chunkring.env.transport_mode() == "rma", reason="waves > 1 runs with DIRECT peers only"),
]

H, INTER = 256, 128

# (payload, topk, experts per rank, waves, C = stream_slot_tokens, tokens, routing)
CASES = [
    ("fp8", 2, 2, 2, 8, "many", "uniform"),
    ("fp8", 8, 2, 4, 8, "uneven", "masked"),
    ("fp8", 1, 3, 3, 8, "many", "one_expert"),   # every row to one expert: full blocks sealed while streaming
    ("fp8", 2, 3, 2, 8, "empty_rank", "idle"),
    ("fp8", 2, 1, 2, 8, "zero", "uniform"),
    ("bf16", 6, 2, 4, 16, "many", "uniform"),
]


def tokens_of(pattern, C, rank, world):
    many = 40 * C + 5  # 41 chunks, the last partial: several full blocks of 128 rows per expert
    return {"zero": 0, "many": many, "uneven": [many, 1, 0, C + 1][rank % 4],
            "empty_rank": 0 if rank == world - 1 else many}[pattern]


def _layers(runtime, case, **kwargs):
    payload, topk, per_rank, waves, C, pattern, _ = case
    per_rank = max(per_rank, math.ceil(topk / runtime.world_size))
    base = dict(num_experts=per_rank * runtime.world_size, hidden=H, intermediate=INTER, topk=topk,
                max_tokens_per_rank=40 * C + 8, stream_slots=2, stream_slot_tokens=C,
                payload=PayloadFormat.FP8_E4M3 if payload == "fp8" else PayloadFormat.BF16)
    return (MoELayer(runtime, MoEConfig(**base), timeout_s=60),
            MoELayer(runtime, MoEConfig(**base, waves=waves), timeout_s=60, **kwargs))


def _inputs(case, it, rank, world, num_experts, device):
    payload, topk, _, _, C, pattern, mode = case
    n = tokens_of(pattern, C, rank, world)
    seed = 10_000 * CASES.index(case) + 100 * it + rank
    return (n, *case_inputs(payload, n, num_experts, topk, mode, seed, device))


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_incremental_blocks_match_the_reference_and_the_batch_plan(runtime, case):
    device, rank, world = runtime.torch_device, runtime.rank, runtime.world_size
    batch, incremental = _layers(runtime, case)
    try:
        num_experts = batch.config.num_experts
        w13, w2 = weights(num_experts, torch.Generator().manual_seed(CASES.index(case)))
        w13_local, w2_local = local_weights(batch, w13, w2)
        for it in range(3):
            n, x_in, idx, w, args = _inputs(case, it, rank, world, num_experts, device)
            ref = layer_reference(incremental, x_in, idx, w, w13, w2)
            outs = {}
            for streaming in (False, True):
                for name, layer in (("batch", batch), ("waves", incremental)):
                    out = torch.full((n, H), float("nan"), dtype=torch.bfloat16, device=device)  # sentinel
                    layer.run(*args, w13_local, w2_local, streaming=streaming, out=out)
                    torch.cuda.synchronize()
                    layer.check()
                    err = rel_error(out, ref)
                    assert err <= tolerance(layer), f"{name} streaming={streaming} iteration {it}: error {err:.2e}"
                    outs[name, streaming] = out
                runtime.barrier()
            # Each row goes through the same GEMM tile math and SwiGLU whichever block holds it, and the
            # combine reduces over k in a fixed order: the waves reproduce the batch plan bit for bit.
            for streaming in (False, True):
                assert torch.equal(outs["waves", streaming], outs["batch", streaming]), f"streaming={streaming}"
    finally:
        incremental.close()
        batch.close()


#: The seal-on-reserve control's sleep before each call's producers (GPU clock cycles, about 10 ms on an H100): several
#: times what the host takes to enqueue the call's 41 publishes and its waves (some 40 launches from Python).
PRODUCER_DELAY_CYCLES = 20_000_000


def _seal_on_reserve_caught(runtime, variant):
    """Streamed calls of a ``waves=4`` layer built as ``variant``, each after poisoning the pool rows with NaN
    (e4m3 and bf16 0xFF bytes): per call, whether the output missed the reference or the call recorded an
    error. Every row names one expert of the last rank, so its blocks fill and seal while producers publish."""
    device, rank, world = runtime.torch_device, runtime.rank, runtime.world_size
    n = 325  # 41 chunks of 8 tokens: two full blocks of 128 rows and a partial one per source
    cfg = dict(num_experts=2 * world, hidden=H, intermediate=INTER, topk=1, max_tokens_per_rank=n + 3,
               stream_slots=2, stream_slot_tokens=8, waves=4)
    layer = mutant_layer(runtime, MoEConfig(**cfg), variant, timeout_s=20)
    caught = []
    try:
        w13, w2 = weights(cfg["num_experts"], torch.Generator().manual_seed(7))
        w13_local, w2_local = local_weights(layer, w13, w2)
        for it in range(5):
            gen = torch.Generator().manual_seed(100 * it + rank)
            xq, sf = quantize_fp8_per128(torch.randn(n, H, generator=gen))
            idx = torch.full((n, 1), cfg["num_experts"] - 1, dtype=torch.int32)  # the last rank's last expert
            w = torch.rand(n, 1, generator=gen) + 0.1
            ref = layer_reference(layer, dequantize_fp8_per128(xq, sf).to(device), idx, w, w13, w2)
            args = [t.to(device) for t in (xq, sf, idx, w)]
            layer.resources.pool.x.fill_(0xFF)  # NaN in e4m3 and in bf16: a row read before it landed shows
            # The call's producers start after a sleep on their stream, so its waves are launched and claiming before
            # the pull reserves a row: the host enqueues the waves after every publish (docs/PROTOCOL.md, "Progress"
            # 10), and without the sleep the rows may all have landed by then, leaving the mutant nothing to misclaim.
            with torch.cuda.stream(layer.streams(CallMode.BATCH_READY)[0]):
                torch.cuda._sleep(PRODUCER_DELAY_CYCLES)
            try:
                out = layer.run(*args, w13_local, w2_local, streaming=True)
                torch.cuda.synchronize()
                layer.check()
                wrong = bool(torch.isnan(out).any()) or rel_error(out, ref) > tolerance(layer)
            except ChunkringRuntimeError as exc:  # the claimant's landed check (INTERNAL), or a peer's abort
                print(f"seal_on_reserve: call {it} recorded {exc}")
                wrong = True
                layer.reset()
            caught.append(wrong)
            runtime.barrier()
    finally:
        layer.close()
    return [any(c) for c in zip(*runtime.allgather_object(caught), strict=True)]  # caught on any rank


def test_negative_control_a_block_sealed_at_its_reservation(runtime):
    """The seal rule (docs/PROTOCOL.md, "The GPU mutant"): the real build passes the same calls the
    kSealOnReserve mutant fails - a wave claims a block whose rows have not all landed."""
    from chunkring.testing.stress import SEAL_ON_RESERVE

    assert not any(_seal_on_reserve_caught(runtime, 0))
    caught = _seal_on_reserve_caught(runtime, SEAL_ON_RESERVE)
    print(f"seal_on_reserve: caught in {sum(caught)} of {len(caught)} calls")
    assert any(caught), "the kSealOnReserve mutant escaped: no wave claimed a block before its rows landed"


def test_waves_on_a_given_partition_and_batch_ready_calls_on_the_batch_plan(runtime):
    """A waves layer on a caller's SmPartition: streamed calls pull on the partition's second consumer stream
    beside the waves, and match the reference and the batch plan bit for bit; its batch-ready calls compute
    the batch plan and never touch the block pool (its words, set to a sentinel, stay as they were)."""
    device, rank, world = runtime.torch_device, runtime.rank, runtime.world_size
    case = CASES[0]  # fp8, top-2, 2 experts per rank, 2 waves, 8-token chunks, 41 chunks per rank
    _, topk, per_rank, waves, C, _, _ = case
    cfg = dict(num_experts=per_rank * world, hidden=H, intermediate=INTER, topk=topk, max_tokens_per_rank=40 * C + 8,
               stream_slots=2, stream_slot_tokens=C)
    with SmPartition(runtime, producer_sms=16) as part:
        batch = MoELayer(runtime, MoEConfig(**cfg), partition=part, timeout_s=60)
        incremental = MoELayer(runtime, MoEConfig(**cfg, waves=waves), partition=part, timeout_s=60)
        try:
            assert incremental.resources.pull_stream is part.consumer_side_stream
            w13, w2 = weights(cfg["num_experts"], torch.Generator().manual_seed(77))
            w13_local, w2_local = local_weights(batch, w13, w2)
            n, x_in, idx, w, args = _inputs(case, 0, rank, world, cfg["num_experts"], device)
            ref = layer_reference(incremental, x_in, idx, w, w13, w2)
            outs = {}
            for name, layer in (("batch", batch), ("waves", incremental)):
                outs[name] = layer.run(*args, w13_local, w2_local, streaming=True)
                torch.cuda.synchronize()
                layer.check()
                assert rel_error(outs[name], ref) <= tolerance(layer), name
            assert torch.equal(outs["waves"], outs["batch"])
            words = incremental.resources.pool.words
            words.fill_(0x5A5A5A5A)
            out = incremental.run(*args, w13_local, w2_local, streaming=False)
            torch.cuda.synchronize()
            incremental.check()
            assert rel_error(out, ref) <= tolerance(incremental)
            assert bool((words == 0x5A5A5A5A).all()), "a batch-ready call used the block pool"
            runtime.barrier()
        finally:
            incremental.close()
            batch.close()
