"""A one-rank layer's batch-ready call of routed rows on the GPU (docs/PROTOCOL.md, "One rank"): it stages its rows
itself, without the ring, and gives what the ring gives. Run on 1 rank (the local path), or under mpirun on several
(every batch-ready call publishes)."""

import pytest
import torch

from chunkring import MoEConfig, MoELayer
from chunkring.moe import CallMode
from chunkring.ring.layout import CONTROL
from chunkring.ring.spec import PayloadFormat
from tests.gpu.moe_helpers import INTER, H, case_inputs, local_weights, weights

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("payload", ["fp8", "bf16"])
def test_a_one_rank_batch_ready_call_skips_the_ring_and_equals_its_streamed_call(runtime, payload):
    """docs/PROTOCOL.md, "One rank": at one rank a batch-ready call of routed rows stages them itself - its ring's
    producer cursor never moves - and gives the streamed call's rows bit for bit (the same stage, plan and kernels,
    reached through the ring), a device count included; at several ranks it publishes one chunk a call."""
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    cfg = MoEConfig(num_experts=2 * W, hidden=H, intermediate=INTER, topk=2, max_tokens_per_rank=40,
                    payload=PayloadFormat.FP8_E4M3 if payload == "fp8" else PayloadFormat.BF16,
                    stream_slots=2, stream_slot_tokens=8)
    layer = MoELayer(runtime, cfg, timeout_s=60)
    try:
        _, _, _, args = case_inputs(payload, 37, cfg.num_experts, 2, "masked", 11 + rank, device)
        experts = local_weights(layer, *weights(cfg.num_experts, torch.Generator().manual_seed(5)))
        control = layer.rings[CallMode.BATCH_READY].views["control"]
        for count in (None, 20):
            num_tokens = None if count is None else torch.tensor([count], dtype=torch.int32, device=device)
            before = int(control[CONTROL["next_seq"]])
            batch = layer.run(*args, *experts, num_tokens=num_tokens).clone()
            streamed = layer.run(*args, *experts, streaming=True, num_tokens=num_tokens)
            torch.cuda.synchronize()
            layer.check()
            assert int(control[CONTROL["next_seq"]]) - before == (0 if W == 1 else 1)
            assert torch.equal(batch, streamed), f"{count} rows"
            if count is not None:
                assert not bool(batch[count:].any())
    finally:
        layer.close()
