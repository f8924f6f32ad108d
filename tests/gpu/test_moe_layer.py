"""The MoE layer on the GPU, batch-ready and streamed, against the fp32 reference of the same math
(relative error at most chunkring.testing.reference.reference_tolerance: 1e-2 for bf16, 2e-2 for the
FP8 recipe; NaN or an unwritten row never passes) and against each other:
token counts 0, 1, C-1, C, C+1, many chunks with a partial last one, uneven counts and a whole-empty
rank; top-k 1, 2, 6, 8; one and several experts per rank; uniform routing, everything to one expert,
idle experts, masked choices; 1, 2 and 4 slots (ring wrap inside a call); FP8 and bf16 payloads;
fresh data every iteration and NaN-filled outputs. Also: the layer's own producers (router -> TopK ->
FP8) streamed and batch-ready, bitwise determinism, and no host synchronisation in a streamed call.

Every rank derives every input from (case, iteration, rank) seeds, so it computes the reference of its
own tokens without communication; each rank checks its own output."""

import math

import pytest
import torch

from chunkring import MoEConfig, MoELayer, MoEModule, calibrate, load_experts
from chunkring.moe.routing import route
from chunkring.moe.weights import expert_weights, init_weights, quantize_weight_fp8
from chunkring.ring.spec import PayloadFormat
from chunkring.testing.reference import dequantize_fp8_per128, quantize_fp8_per128
from chunkring.testing.variants import mutant_layer
from tests.gpu.moe_helpers import (
    INTER,
    H,
    case_inputs,
    layer_reference,
    local_weights,
    rel_error,
    routing,
    tolerance,
    weights,
)

pytestmark = pytest.mark.gpu

ITERATIONS = 3

# (payload, topk, experts per rank, stream_slots, C = stream_slot_tokens, tokens, routing)
CASES = [
    ("fp8", 2, 1, 2, 8, "C", "uniform"),
    ("fp8", 2, 3, 1, 8, "many", "uniform"),
    ("fp8", 6, 2, 4, 8, "many", "uniform"),
    ("fp8", 8, 2, 2, 8, "uneven", "masked"),
    ("fp8", 1, 1, 1, 8, "C+1", "one_expert"),
    ("fp8", 2, 3, 2, 8, "empty_rank", "idle"),
    ("fp8", 2, 1, 2, 8, "zero", "uniform"),
    ("fp8", 2, 1, 2, 8, "one", "uniform"),
    ("fp8", 2, 1, 4, 8, "C-1", "uniform"),
    ("bf16", 2, 3, 2, 8, "many", "uniform"),
    ("bf16", 8, 2, 4, 8, "uneven", "one_expert"),
    ("bf16", 6, 1, 1, 16, "empty_rank", "masked"),
]


def tokens_of(pattern, C, rank, world):
    many = 3 * C + 5  # four chunks, the last partial
    return {"zero": 0, "one": 1, "C-1": C - 1, "C": C, "C+1": C + 1, "many": many,
            "uneven": [many, 1, 0, C + 1][rank % 4],
            "empty_rank": 0 if rank == world - 1 else many}[pattern]


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_layer_matches_reference(runtime, case):
    payload, topk, per_rank, slots, C, pattern, mode = case
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    per_rank = max(per_rank, math.ceil(topk / W))  # top-k never exceeds the experts
    num_experts = per_rank * W
    cfg = MoEConfig(num_experts=num_experts, hidden=H, intermediate=INTER, topk=topk, max_tokens_per_rank=3 * C + 8,
                    payload=PayloadFormat.FP8_E4M3 if payload == "fp8" else PayloadFormat.BF16,
                    stream_slots=slots, stream_slot_tokens=C)
    layer = MoELayer(runtime, cfg, timeout_s=60)
    try:
        w13, w2 = weights(num_experts, torch.Generator().manual_seed(CASES.index(case)))
        w13_local, w2_local = local_weights(layer, w13, w2)
        for it in range(ITERATIONS):
            n, seed = tokens_of(pattern, C, rank, W), 10_000 * CASES.index(case) + 100 * it + rank
            x_in, idx, w, args = case_inputs(payload, n, num_experts, topk, mode, seed, device)
            ref = layer_reference(layer, x_in, idx, w, w13, w2)
            outs = {}
            for streaming in (False, True):
                out = torch.full((n, H), float("nan"), dtype=torch.bfloat16, device=device)  # sentinel
                layer.run(*args, w13_local, w2_local, streaming=streaming, out=out)
                torch.cuda.synchronize()
                layer.check()
                outs[streaming] = out
                err = rel_error(out, ref)
                assert err <= tolerance(layer), f"streaming={streaming} iteration {it}: relative error {err:.2e}"
            assert rel_error(outs[True], outs[False].float()) <= 1e-2
    finally:
        layer.close()


def test_batch_ready_is_bitwise_deterministic_and_streamed_call_never_syncs(runtime):
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    cfg = MoEConfig(num_experts=2 * W, hidden=H, intermediate=INTER, topk=2, max_tokens_per_rank=40,
                    stream_slots=2, stream_slot_tokens=8)
    layer = MoELayer(runtime, cfg, timeout_s=60)
    try:
        gen = torch.Generator().manual_seed(7 + rank)
        xq, sf = quantize_fp8_per128(torch.randn(37, H, generator=gen))
        idx, w = routing(37, cfg.num_experts, 2, "uniform", gen)
        w13, w2 = weights(cfg.num_experts, torch.Generator().manual_seed(3))
        args = [*(t.to(device) for t in (xq, sf, idx, w)), *local_weights(layer, w13, w2)]
        for streaming in (False, True):
            first = layer.run(*args, streaming=streaming).clone()
            torch.cuda.synchronize()
            for _ in range(3):
                assert torch.equal(layer.run(*args, streaming=streaming), first), f"streaming={streaming}"
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host synchronisation in the call raises
        try:
            out = layer.run(*args, streaming=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        layer.check()
        assert torch.equal(out, layer.run(*args, streaming=True))
    finally:
        layer.close()


@pytest.mark.parametrize("payload", [PayloadFormat.FP8_E4M3, PayloadFormat.BF16])
def test_module_with_its_own_producers(runtime, payload):
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    cfg = MoEConfig(num_experts=4 * W, hidden=H, intermediate=INTER, topk=2, max_tokens_per_rank=64, payload=payload,
                    stream_slots=2, stream_slot_tokens=16)
    layer = MoELayer(runtime, cfg, timeout_s=60)
    try:
        module = MoEModule(layer, generator=torch.Generator().manual_seed(11))
        router, w13, w2 = init_weights(cfg, torch.Generator().manual_seed(11))  # every expert: the reference's
        assert torch.equal(module.router_weight.cpu(), router)
        for n in (0, 1, 16, 61):
            hidden = torch.randn(n, H, generator=torch.Generator().manual_seed(n + 100 * rank)).to(torch.bfloat16)
            hidden = hidden.to(device)
            idx, w = route(hidden, module.router_weight, cfg.topk)
            if payload == PayloadFormat.FP8_E4M3:
                x_in = dequantize_fp8_per128(*quantize_fp8_per128(hidden.float()))
            else:
                x_in = hidden.float()
            ref = layer_reference(layer, x_in, idx, w, w13, w2)
            for streaming in (False, True):
                out = module(hidden, streaming=streaming)
                torch.cuda.synchronize()
                layer.check()
                assert rel_error(out, ref) <= tolerance(layer), (n, streaming)
    finally:
        layer.close()


def test_bad_input_is_refused_before_gpu_work(runtime):
    from chunkring import ChunkringDeviceError, ChunkringUsageError
    from chunkring.moe.weights import Fp8Weight
    from chunkring.ring.status import ErrorCode

    W, device = runtime.world_size, runtime.torch_device
    cfg = MoEConfig(num_experts=2 * W, hidden=H, intermediate=INTER, topk=2, max_tokens_per_rank=16)
    layer = MoELayer(runtime, cfg, timeout_s=60)
    try:
        xq = torch.zeros(4, H, dtype=torch.float8_e4m3fn, device=device)
        sf = torch.ones(4, H // 128, device=device)
        idx = torch.zeros(4, 2, dtype=torch.int32, device=device)
        w = torch.ones(4, 2, device=device)
        w13_bf16 = torch.zeros(2, 2 * INTER, H, dtype=torch.bfloat16, device=device)
        w2_bf16 = torch.zeros(2, H, INTER, dtype=torch.bfloat16, device=device)
        w13, w2 = expert_weights(layer.config, w13_bf16, w2_bf16)
        bad = {
            "x": dict(x=torch.zeros(17, H, dtype=torch.float8_e4m3fn, device=device)),
            "x_sf": dict(x_sf=None),
            "topk_idx": dict(topk_idx=idx.long()),
            "w13": dict(w13=Fp8Weight(w13.data[:1], w13.scale[:1])),  # one expert of two
            "w2": dict(w2=w2_bf16),  # the FP8 payload's GEMMs take FP8 weights
            "streaming": dict(streaming=True),  # no streaming ring in this config
        }
        # A good call first: past the mode's first call, a bad one aborts the ring (before it, it abandons the
        # warm-up barrier instead: tests/unit/test_fail_closed_host.py).
        layer.run(xq, sf, idx, w, w13, w2)
        torch.cuda.synchronize()
        layer.check()
        runtime.barrier()  # every rank checked its good call before any rank's bad call aborts the ring
        for field, change in bad.items():
            kwargs = dict(x=xq, x_sf=sf, topk_idx=idx, topk_weights=w, w13=w13, w2=w2)
            kwargs.update(change)
            streaming = kwargs.pop("streaming", False)
            with pytest.raises(ChunkringUsageError) as info:
                layer.run(**kwargs, streaming=streaming)
            assert info.value.field == field
        # A bad tensor of a rank's own aborts the ring its peers may wait in (HOST_USAGE); a bad mode aborts
        # nothing (every rank fails it alike). Every rank made the same bad calls, so each recorded its own.
        torch.cuda.synchronize()
        with pytest.raises(ChunkringDeviceError) as aborted:
            layer.check()
        assert aborted.value.record.code == ErrorCode.HOST_USAGE
        layer.reset()
        layer.check()
    finally:
        layer.close()


#: About 25 ms at the H200's clock: far longer than any rank's own consumer in _rank_outputs_wrong.
EXPERTS_DELAY_CYCLES = 50_000_000


def _rank_outputs_wrong(runtime, variant: int) -> list:
    """Streamed calls of a layer whose ring kernels are compiled as ``variant`` (0: the real ones): per
    iteration, whether any rank's output missed the reference. Every choice names one of the last rank's
    experts: the other ranks' consumers have nothing to compute, so their drains (which start after their
    own consumers) wait on the last rank's experts through its held acknowledgement alone. The last rank's
    experts start EXPERTS_DELAY_CYCLES after its pull (a GPU sleep on its consumer stream): with the held
    ack that only delays the call, without it every owner reduces before the rows land - whatever the
    other ranks' own consumers cost (on the RMA path each block's nvshmem_quiet, for one)."""
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    hidden, inter, per_rank, n = 1024, 1024, 8, 256
    cfg = MoEConfig(num_experts=per_rank * W, hidden=hidden, intermediate=inter, topk=4, max_tokens_per_rank=n,
                    stream_slots=2, stream_slot_tokens=64)
    layer = mutant_layer(runtime, cfg, variant, timeout_s=60)
    if rank == W - 1:
        experts = layer.resources.compute.experts

        def delayed_experts(*args, **kwargs):
            torch.cuda._sleep(EXPERTS_DELAY_CYCLES)
            return experts(*args, **kwargs)

        layer.resources.compute.experts = delayed_experts
    wrong = []
    try:
        gen = torch.Generator().manual_seed(5)
        w13 = (torch.randn(cfg.num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(torch.bfloat16)
        w2 = (torch.randn(cfg.num_experts, hidden, inter, generator=gen) / inter**0.5).to(torch.bfloat16)
        w13_local, w2_local = local_weights(layer, w13, w2)
        for it in range(3):
            gen = torch.Generator().manual_seed(100 * it + rank)
            xq, sf = quantize_fp8_per128(torch.randn(n, hidden, generator=gen))
            idx, w = routing(n, per_rank, cfg.topk, "uniform", gen)
            idx += (W - 1) * per_rank  # the last rank's experts
            ref = layer_reference(layer, dequantize_fp8_per128(xq, sf).to(device), idx, w, w13, w2)
            out = layer.run(*(t.to(device) for t in (xq, sf, idx, w)), w13_local, w2_local, streaming=True)
            torch.cuda.synchronize()
            layer.check()
            wrong.append(rel_error(out, ref) > tolerance(layer))
            runtime.barrier()
    finally:
        layer.close()
    return [any(per_iteration) for per_iteration in zip(*runtime.allgather_object(wrong), strict=True)]


def test_negative_control_acknowledging_the_last_chunk_at_its_pull_loses_combine_rows(runtime):
    """The held acknowledgement is what tells an owner that a peer's combine rows landed (docs/PROTOCOL.md,
    "The MoE layer on the ring"): with the last chunk acknowledged at its pull (the NO_HELD_ACK mutant), the
    owner's drain returns while the peer's experts still run, and outputs miss the reference; the real
    kernels, same calls, match it. One rank has no peer: its drain is stream-ordered after its own
    consumer, which the mutant does not change."""
    from chunkring.testing.stress import NO_HELD_ACK

    if runtime.world_size < 2:
        pytest.skip("the held acknowledgement orders a peer's combine rows; one rank has no peer")

    assert not any(_rank_outputs_wrong(runtime, 0))
    caught = _rank_outputs_wrong(runtime, NO_HELD_ACK)
    print(f"no_held_ack: outputs wrong in {sum(caught)} of {len(caught)} calls")
    assert any(caught), "the NO_HELD_ACK mutant escaped: the held acknowledgement is not what orders the reduction"


def test_negative_control_combine_push_without_its_release(runtime):
    """The combine rows reach their owner before the held acknowledgement through an explicit edge
    (docs/PROTOCOL.md, "The MoE layer on the ring"): each moe_combine_push block releases its stores at
    system scope before it arrives on the push count, which moe_ack_held acquires before it acks. The
    NO_PUSH_RELEASE mutant arrives without the release, so an owner may reduce rows still in flight. Expected
    on one GPU (every rank on it): an escape, and an xfail saying why; on a multi-GPU node: caught, strictly.
    One rank has no peer: its drain is stream-ordered after its own push."""
    from chunkring.testing.stress import NO_PUSH_RELEASE

    if runtime.world_size < 2:
        pytest.skip("the push's release orders rows for a peer's reduction; one rank has no peer")

    caught = _rank_outputs_wrong(runtime, NO_PUSH_RELEASE)
    print(f"no_push_release: outputs wrong in {sum(caught)} of {len(caught)} calls")
    if not any(caught) and torch.cuda.device_count() == 1:
        pytest.xfail("no_push_release escaped: every rank shares one GPU's L2, and the push kernel completes "
                     "before the ack kernel starts in the consumer stream, so no reordering was there to see")
    assert any(caught), "the NO_PUSH_RELEASE mutant escaped: the push's release is not what orders the rows"


def fp8_reference_of(module, seed, hidden):
    """The fp32 reference of ``module`` (a MoEModule drawn with ``seed``, FP8 payload) on ``hidden``."""
    _, w13, w2 = init_weights(module.layer.config, torch.Generator().manual_seed(seed))  # every expert
    idx, w = route(hidden, module.router_weight, module.layer.config.topk)
    return layer_reference(module.layer, dequantize_fp8_per128(*quantize_fp8_per128(hidden.float())), idx, w, w13, w2)


def test_eager_call_of_more_producer_launches_than_the_launch_queue_holds(runtime):
    """256 chunks of 2 tokens with the layer's own producers: over 3,000 producer launches in one eager call,
    more than the launch queue holds while publishes wait for acks. The consumer is enqueued after the
    chunks that fit the ring, so the host never blocks before it (64 chunks deadlocked when every
    producer launch went first; docs/PROTOCOL.md, "Progress")."""
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    cfg = MoEConfig(num_experts=2 * W, hidden=H, intermediate=INTER, topk=2, max_tokens_per_rank=512,
                    stream_slots=2, stream_slot_tokens=2)
    layer = MoELayer(runtime, cfg, timeout_s=30)
    try:
        module = MoEModule(layer, generator=torch.Generator().manual_seed(13))
        hidden = torch.randn(512, H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16).to(device)
        ref = fp8_reference_of(module, 13, hidden)
        out = module(hidden, streaming=True)
        torch.cuda.synchronize()
        layer.check()
        assert rel_error(out, ref) <= tolerance(layer)
    finally:
        layer.close()


def test_calibrated_auto_calls_take_the_agreed_mode_and_match_the_reference(runtime):
    """calibrate() times both modes as graph replays and agrees on one decision across ranks; "auto" calls
    then take that mode (and stay correct)."""
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    cfg = MoEConfig(num_experts=2 * W, hidden=H, intermediate=INTER, topk=2, max_tokens_per_rank=64,
                    stream_slots=2, stream_slot_tokens=16)
    layer = MoELayer(runtime, cfg, timeout_s=60)
    try:
        module = MoEModule(layer, generator=torch.Generator().manual_seed(17))
        result = calibrate(layer, module.router_weight, module.w13, module.w2, [8, 64], iterations=3, warmup=1)
        assert layer.streaming_calibration is result
        # Each count batch-ready and in every chunk size up to the 16-token slot (chunk_candidates).
        assert set(result.batch_ms) == {8, 64} and result.streamed_ms.keys() == {8, 64}
        assert (set(result.streamed_ms[8]), set(result.streamed_ms[64])) == ({8}, {16})
        assert all(ms > 0 for ms in (*result.batch_ms.values(), result.streamed_ms[8][8], result.streamed_ms[64][16]))
        if W > 1:
            from mpi4py import MPI

            mine = (result.batch_ms, result.streamed_ms)
            assert MPI.COMM_WORLD.allgather(mine) == [mine] * W  # one decision everywhere
        hidden = torch.randn(40, H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16).to(device)
        ref = fp8_reference_of(module, 17, hidden)
        out = layer.forward(hidden, module.router_weight, module.w13, module.w2, streaming="auto")
        torch.cuda.synchronize()
        layer.check()
        assert rel_error(out, ref) <= tolerance(layer)
    finally:
        layer.close()


@pytest.mark.parametrize("checkpoint", ["bf16", "fp8"])
def test_experts_loaded_from_a_checkpoint_run_like_the_weights_they_hold(runtime, checkpoint):
    """load_experts for a live FP8 layer's range and device: a Hugging Face-style state dict of every expert (bf16, or
    FP8 with DeepSeek-V3's 128x128 ``weight_scale_inv``) gives this rank's experts on the GPU, and a call
    with them matches the reference of the weights the checkpoint holds."""
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    cfg = MoEConfig(num_experts=2 * W, hidden=H, intermediate=INTER, topk=2, max_tokens_per_rank=32)
    layer = MoELayer(runtime, cfg, timeout_s=60)
    try:
        w13, w2 = weights(cfg.num_experts, torch.Generator().manual_seed(31))
        prefix, state = "model.layers.1.mlp.", {}
        for e in range(cfg.num_experts):
            for name, weight in (("gate_proj", w13[e, :INTER]), ("up_proj", w13[e, INTER:]), ("down_proj", w2[e])):
                key = f"{prefix}experts.{e}.{name}.weight"
                if checkpoint == "fp8":
                    q = quantize_weight_fp8(weight[None].contiguous())
                    state[key], state[key + "_scale_inv"] = q.data[0], q.scale[0]
                else:
                    state[key] = weight.clone()
        state[f"{prefix}gate.weight"] = torch.zeros(cfg.num_experts, H)  # the router: not the loader's
        w13_local, w2_local = load_experts(state, cfg, first_expert=layer.first_expert, count=layer.experts_per_rank,
                                           prefix=prefix, device=device, rank=rank)
        assert w13_local.data.device == device and w13_local.data.shape[0] == layer.experts_per_rank
        gen = torch.Generator().manual_seed(rank)
        xq, sf = quantize_fp8_per128(torch.randn(32, H, generator=gen))
        idx, w = routing(32, cfg.num_experts, 2, "uniform", gen)
        # The FP8 checkpoint's weights are its blocks dequantised; quantising those again gives them back.
        ref = layer_reference(layer, dequantize_fp8_per128(xq, sf).to(device), idx, w, w13, w2)
        out = layer.run(*(t.to(device) for t in (xq, sf, idx, w)), w13_local, w2_local, streaming=False)
        torch.cuda.synchronize()
        layer.check()
        assert rel_error(out, ref) <= tolerance(layer)
    finally:
        layer.close()
