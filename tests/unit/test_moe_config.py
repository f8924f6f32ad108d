"""MoEConfig refuses every impossible layer shape with the field named, and derives the two ring specs."""

import pytest

from chunkring import ChunkringUsageError, MoEConfig, PayloadFormat

GOOD = dict(num_experts=16, hidden=256, intermediate=128, topk=4, max_tokens_per_rank=64)


@pytest.mark.parametrize("change, field", [
    (dict(num_experts=0), "num_experts"),
    (dict(hidden=True), "hidden"),
    (dict(intermediate=100), "intermediate"),
    (dict(topk=-1), "topk"),
    (dict(max_tokens_per_rank=1.5), "max_tokens_per_rank"),
    (dict(payload="fp4"), "payload"),
    (dict(payload=True), "payload"),   # an IntEnum would take True for BF16
    (dict(payload=1.0), "payload"),
    (dict(front_num_slots=2), "front_tokens_per_slot"),
    (dict(front_tokens_per_slot=8), "front_num_slots"),
    (dict(front_num_slots=0, front_tokens_per_slot=8), "front_num_slots"),
    (dict(front_num_slots=2, front_tokens_per_slot=65), "front_tokens_per_slot"),
    (dict(block_m=0), "block_m"),
])
def test_bad_config_names_the_field(change, field):
    with pytest.raises(ChunkringUsageError) as info:
        MoEConfig(**{**GOOD, **change})
    assert info.value.field == field


def test_ring_specs():
    cfg = MoEConfig(**GOOD, payload=PayloadFormat.BF16, front_num_slots=2, front_tokens_per_slot=16)
    assert cfg.streaming and not MoEConfig(**GOOD).streaming
    batch, streamed = cfg.ring_spec(4, streamed=False), cfg.ring_spec(4, streamed=True)
    assert (batch.num_slots, batch.tokens_per_slot) == (1, 64)
    assert (streamed.num_slots, streamed.tokens_per_slot) == (2, 16)
    assert batch.payload is streamed.payload is PayloadFormat.BF16
    with pytest.raises(ChunkringUsageError) as info:  # RingSpec's own checks apply
        cfg.ring_spec(3, streamed=True)
    assert info.value.field == "num_experts"
