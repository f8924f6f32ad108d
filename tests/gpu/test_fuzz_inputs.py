"""Malformed slot contents never corrupt memory, never hang, and are masked and reported as documented
(device/include/chunkring/protocol/validate.cuh; docs/PROTOCOL.md "What a consumer trusts").

Each case corrupts one field on one rank (the case number picks both; every rank derives every input
from the case number, so the ranks agree without talking) and runs a call:

* through the MoE layer, the inputs a buggy router / TopK / quantiser would produce: a ``topk_idx``
  outside [-1, E), a NaN or infinite FP8 scale, a device token count outside [0, n];
* through the ring's host API, slot metadata a foreign producer could write: a token count above the
  slot, a token base past the consumer's output (written into the published slot before the consumer
  starts).

Every output sits between guard bands that must keep their sentinel bytes; the output must equal the
reference with the masking rule applied; every rank that reads the bad value must raise
ChunkringInputError naming field, source, row, column and value, and every other rank nothing.
"""

import math

import pytest
import torch

from chunkring import ChunkringInputError, MoEConfig, MoELayer, Ring, RingSpec
from chunkring.ring.io import GatherOutputs, gather, publish_chunk
from chunkring.ring.spec import PayloadFormat
from chunkring.ring.status import InputField
from chunkring.testing.reference import dequantize_fp8_per128, quantize_fp8_per128
from chunkring.testing.variants import mutant_layer
from tests.gpu.moe_helpers import H, layer_reference, local_weights, rel_error, routing, tolerance, weights

pytestmark = pytest.mark.gpu

LAYER_CASES, RING_CASES = 660, 400  # >= 1,000 cases per run, every field at least 200 times
C, MAX_TOKENS, TOPK, GUARD = 8, 28, 2, 3  # 28 tokens: three full chunks and a partial one
SENTINEL = 7.0

BAD_EXPERTS = (-2, -1000, 2**31 - 1, -(2**31))
BAD_SCALES = (float("nan"), float("inf"), float("-inf"))


def check_guards(padded, lo, hi, what):
    assert bool((padded[:lo] == SENTINEL).all()) and bool((padded[hi:] == SENTINEL).all()), \
        f"{what}: guard band written"


def expect_report(check, expected):
    """``expected``: None (no report) or a dict of InputRecord fields the raised record must carry."""
    if expected is None:
        check()
        return
    with pytest.raises(ChunkringInputError) as info:
        check()
    record = info.value.record
    got = {name: (record.shown_value() if name == "value" else getattr(record, name)) for name in expected}
    for name, want in expected.items():
        if isinstance(want, float) and math.isnan(want):
            assert math.isnan(got[name]), (got, expected)
        else:
            assert got[name] == want, (got, expected)


def test_layer_masks_and_reports_corrupted_inputs(runtime, record_testsuite_property):
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    cfg = MoEConfig(num_experts=2 * W, hidden=H, intermediate=128, topk=TOPK, max_tokens_per_rank=MAX_TOKENS,
                    stream_slots=2, stream_slot_tokens=C)
    layer = MoELayer(runtime, cfg, timeout_s=30)
    w13, w2 = weights(cfg.num_experts, torch.Generator().manual_seed(2))
    experts = local_weights(layer, w13, w2)
    fields = (InputField.TOPK_IDX, InputField.X_SF, InputField.VALID_TOKENS)
    counts = dict.fromkeys(fields, 0)
    try:
        for case in range(LAYER_CASES):
            field, culprit = fields[case % 3], (case // 3) % W
            gen = torch.Generator().manual_seed(case * 64 + rank)
            n = MAX_TOKENS - int(torch.randint(0, 5, (1,), generator=gen))
            xq, sf = quantize_fp8_per128(torch.randn(n, H, generator=gen))
            idx, w = routing(n, cfg.num_experts, TOPK, "masked", gen)
            count, clean_idx, clean_sf, valid = torch.tensor([n], dtype=torch.int32), idx.clone(), sf.clone(), n
            pick = torch.Generator().manual_seed(case)  # the same on every rank: what the culprit corrupts
            row = int(torch.randint(0, MAX_TOKENS - 4, (1,), generator=pick))  # below every rank's n
            col = int(torch.randint(0, min(TOPK, H // 128), (1,), generator=pick))  # a choice or a scale column
            value = None
            if rank == culprit:
                counts[field] += 1
                if field == InputField.TOPK_IDX:
                    value = (*BAD_EXPERTS, cfg.num_experts, cfg.num_experts + 5)[case % 6]
                    idx[row, col] = value
                    clean_idx[row, col] = -1  # the masking rule
                elif field == InputField.X_SF:
                    # One choice, so exactly one rank pulls the row and reads its scales.
                    idx[row] = torch.tensor([(case // 3) % cfg.num_experts] + [-1] * (TOPK - 1), dtype=torch.int32)
                    clean_idx[row] = idx[row]
                    value = BAD_SCALES[case % 3]
                    sf[row, col] = value
                    clean_sf[row, col] = 0.0
                else:
                    value = (-5, n + 1, 2**31 - 1)[case % 3]
                    count[0] = value
                    valid = min(max(value, 0), n)
            padded = torch.full((GUARD + n + GUARD, H), SENTINEL, dtype=torch.bfloat16, device=device)
            out = padded[GUARD:GUARD + n]
            streaming = case % 5 != 0
            layer.run(*(t.to(device) for t in (xq, sf, idx, w)), *experts, streaming=streaming, out=out,
                      num_tokens=count.to(device))
            torch.cuda.synchronize()
            check_guards(padded, GUARD, GUARD + n, f"case {case}")
            ref = layer_reference(layer, dequantize_fp8_per128(xq, clean_sf)[:valid].to(device), clean_idx[:valid],
                                  w[:valid], w13, w2)
            assert rel_error(out[:valid], ref) <= tolerance(layer), f"case {case} ({field.name})"
            assert not bool(out[valid:].any()), f"case {case}: rows past the count were written"
            # Who reads the bad value: every rank reads every topk_idx; a scale only where its row is
            # pulled (this test routes the row to expert idx[row, 0] on every rank's copy of the plan);
            # a device token count only its own producer.
            reader = {InputField.TOPK_IDX: True, InputField.X_SF: rank == ((case // 3) % cfg.num_experts) // 2,
                      InputField.VALID_TOKENS: rank == culprit}[field]
            expected = None
            if reader:
                expected = {"field": field, "source": culprit}
                if field != InputField.VALID_TOKENS:
                    expected.update(row=row % C if streaming else row, column=col)  # the row within its chunk
                if value is not None:
                    expected["value"] = value
            expect_report(layer.check, expected)
        for field, number in counts.items():
            record_testsuite_property(f"fuzz_cases_{field.name.lower()}_rank{rank}", number)
    finally:
        layer.close()


def test_gather_masks_and_reports_corrupted_metadata(runtime, record_testsuite_property):
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    T, K, slots, capacity = 8, 4, 2, 8 + GUARD  # rows past a chunk's count are guard rows
    spec = RingSpec(world_size=W, num_slots=slots, tokens_per_slot=T, hidden=H, payload=PayloadFormat.BF16, topk=K,
                    num_experts=4 * W)
    fields = (InputField.NUM_TOKENS, InputField.TOKEN_BASE)
    counts = dict.fromkeys(fields, 0)
    with Ring(runtime, spec, timeout_s=30) as ring:
        for case in range(RING_CASES):
            field, culprit = fields[case % 2], (case // 2) % W
            n = 1 + case % T
            x = torch.full((n, H), float(rank + 1), dtype=torch.bfloat16, device=device)
            idx = torch.full((n, K), rank, dtype=torch.int32, device=device)
            w = torch.ones(n, K, device=device)
            # Published first, corrupted in place, consumed after every rank finished (serialized order).
            publish_chunk(ring, x=x, x_sf=None, topk_idx=idx, topk_weights=w, token_base=0, end_of_stream=True)
            torch.cuda.synchronize()
            slot = case % slots  # one chunk per rank per case
            word, value = ((1, (T + 1, 2**40, 2**62)[case % 3]) if field == InputField.NUM_TOKENS
                           else (0, (capacity - n + 1, capacity + 1, 2**62)[case % 3]))
            if rank == culprit:
                counts[field] += 1
                ring.views["meta"][slot, word] = value
                torch.cuda.synchronize()
            runtime.barrier()
            out = GatherOutputs(ring, capacity)
            for t in (out.x, out.topk_weights):
                t.fill_(SENTINEL)
            gather(ring, out, grid=1 + case % 4)
            torch.cuda.synchronize()
            for src in range(W):
                m = 0 if src == culprit else 1 + case % T
                assert int(out.counts[src]) == m, (case, src)
                assert bool((out.x[src, :m] == src + 1).all()), (case, src)
                check_guards(out.x[src], 0, m, f"case {case} source {src} x")  # rows [m, capacity) are the guard
                check_guards(out.topk_weights[src], 0, m, f"case {case} source {src} weights")
            # Every rank reads every source's metadata, so every rank masks and reports the bad chunk.
            expect_report(ring.check, {"field": field, "source": culprit, "slot": slot, "value": value})
            runtime.barrier()
            out.close()
    for field, number in counts.items():
        record_testsuite_property(f"fuzz_cases_{field.name.lower()}_rank{rank}", number)


def test_negative_control_without_the_checks_a_bad_expert_goes_unreported(runtime):
    """With validate.cuh compiled out (the NO_INPUT_CHECKS mutant), the same corruption raises nothing:
    the reports asserted above come from the checks, not from anything else."""
    from chunkring.testing.stress import NO_INPUT_CHECKS

    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    cfg = MoEConfig(num_experts=2 * W, hidden=H, intermediate=128, topk=TOPK, max_tokens_per_rank=MAX_TOKENS,
                    stream_slots=2, stream_slot_tokens=C)
    layer = mutant_layer(runtime, cfg, NO_INPUT_CHECKS, timeout_s=30)
    try:
        w13, w2 = weights(cfg.num_experts, torch.Generator().manual_seed(2))
        gen = torch.Generator().manual_seed(rank)
        xq, sf = quantize_fp8_per128(torch.randn(MAX_TOKENS, H, generator=gen))
        idx, w = routing(MAX_TOKENS, cfg.num_experts, TOPK, "uniform", gen)
        idx[3, 1] = cfg.num_experts + 5  # out of range on every rank: every consumer reads it
        layer.run(*(t.to(device) for t in (xq, sf, idx, w)), *local_weights(layer, w13, w2), streaming=True)
        torch.cuda.synchronize()
        layer.check()  # nothing reported: the fuzz test above would fail against this build
    finally:
        layer.close()
