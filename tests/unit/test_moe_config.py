"""MoEConfig refuses every impossible layer shape with the field named - its own rules and every rule of
the rings its layer allocates - and derives the two ring specs."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkring import ChunkringUsageError, MoEConfig, PayloadFormat, RingSpec

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
    (dict(stream_slots=2), "stream_slot_tokens"),
    (dict(stream_slot_tokens=8), "stream_slots"),
    (dict(stream_slots=0, stream_slot_tokens=8), "stream_slots"),
    (dict(stream_slots=2, stream_slot_tokens=65), "stream_slot_tokens"),
    (dict(intermediate=64), "intermediate"),  # the FP8 payload's activations carry one scale per 1x128
])
def test_bad_config_names_the_field(change, field):
    with pytest.raises(ChunkringUsageError) as info:
        MoEConfig(**{**GOOD, **change})
    assert info.value.field == field


def test_ring_specs():
    cfg = MoEConfig(**GOOD, payload=PayloadFormat.BF16, stream_slots=2, stream_slot_tokens=16)
    assert cfg.streaming and not MoEConfig(**GOOD).streaming
    batch, streamed = cfg.ring_spec(4, streamed=False), cfg.ring_spec(4, streamed=True)
    assert (batch.num_slots, batch.tokens_per_slot) == (1, 64)
    assert (streamed.num_slots, streamed.tokens_per_slot) == (2, 16)
    assert batch.payload is streamed.payload is PayloadFormat.BF16
    with pytest.raises(ChunkringUsageError) as info:  # RingSpec's own checks apply
        cfg.ring_spec(3, streamed=True)
    assert info.value.field == "num_experts"


# Every rule of the rings a layer allocates is a MoEConfig rule: a shape the ring cannot carry fails
# when the config is built, on the host, naming the config's field - not when a GPU builds the layer.
@pytest.mark.parametrize("change, field, needle", [
    (dict(topk=17), "topk", "[1, 16]"),                          # more choices than experts
    (dict(topk=33, num_experts=64), "topk", "[1, 32]"),         # past the ring's top-k limit
    (dict(hidden=100), "hidden", "must be a multiple of 128 (the FP8 scale block"),  # in channels, not bytes
    (dict(hidden=144), "hidden", "must be a multiple of 128 (the FP8 scale block: one fp32 scale per 128 channels), "
                                 "got 144"),
    (dict(hidden=1 << 17), "hidden", "65536"),
    (dict(num_experts=1 << 16), "num_experts", "32768"),
    (dict(max_tokens_per_rank=70_000), "max_tokens_per_rank", "batch-ready ring's tokens_per_slot"),
    (dict(stream_slots=70_000, stream_slot_tokens=8), "stream_slots", "streaming ring's num_slots"),
])
def test_ring_rules_are_config_rules(change, field, needle):
    with pytest.raises(ChunkringUsageError) as info:
        MoEConfig(**{**GOOD, **change})
    assert info.value.field == field and needle in str(info.value), str(info.value)


@pytest.mark.parametrize("hidden", [100, 200, 136])
def test_a_bf16_layer_takes_whole_128_column_blocks(hidden):
    """The ring carries a bf16 row of any multiple of 8 channels (test_ring_spec.py), but the layer's producers move
    rows 128 columns at a time: a bf16 hidden size they cannot carry fails at the config, not in the kernels (the
    fused producer published whole blocks only, and the router left logits unwritten below 16 columns)."""
    with pytest.raises(ChunkringUsageError) as info:
        MoEConfig(**{**GOOD, "hidden": hidden, "payload": PayloadFormat.BF16})
    assert info.value.field == "hidden" and "multiple of 128 (the layer's producers" in str(info.value)
    MoEConfig(**{**GOOD, "hidden": 256, "payload": PayloadFormat.BF16})


def test_ring_specs_and_the_world_size():
    cfg = MoEConfig(**GOOD)
    assert [s.num_slots for s in cfg.ring_specs(2)] == [1]
    streamed = cfg.with_default_ring()
    assert [(s.num_slots, s.tokens_per_slot) for s in streamed.ring_specs(4)] == [(1, 64), (2, 16)]
    for world in (1, 2, 4, 8, 16):
        streamed.check_world_size(world)
    with pytest.raises(ChunkringUsageError) as info:
        streamed.check_world_size(3)
    assert info.value.field == "num_experts" and "over 3 ranks" in str(info.value)
    with pytest.raises(ChunkringUsageError) as info:
        MoEConfig(**{**GOOD, "num_experts": 128}).check_world_size(128)
    assert info.value.field == "world_size"


@settings(max_examples=300, deadline=None)
@given(num_experts=st.integers(1, 1 << 16), hidden=st.integers(1, 1 << 17), topk=st.integers(1, 64),
       tokens=st.integers(1, 1 << 17), slots=st.one_of(st.none(), st.integers(1, 1 << 17)),
       payload=st.sampled_from(list(PayloadFormat)))
def test_a_config_is_valid_exactly_when_its_rings_are(num_experts, hidden, topk, tokens, slots, payload):
    """MoEConfig accepts exactly the shapes whose ring specs RingSpec itself accepts (one rank) and whose rows its
    producers can move (whole 128-column blocks)."""
    front = dict(stream_slots=slots, stream_slot_tokens=max(1, tokens // 8)) if slots else {}
    shared = dict(hidden=hidden, payload=payload, topk=topk, num_experts=num_experts, world_size=1)
    rings = [dict(num_slots=1, tokens_per_slot=tokens)]
    if slots:
        rings.append(dict(num_slots=slots, tokens_per_slot=front["stream_slot_tokens"]))
    try:
        for ring in rings:
            RingSpec(**shared, **ring)
        rings_ok = hidden % 128 == 0
    except ChunkringUsageError:
        rings_ok = False
    try:
        MoEConfig(num_experts=num_experts, hidden=hidden, intermediate=128, topk=topk, max_tokens_per_rank=tokens,
                  payload=payload, **front)
        config_ok = True
    except ChunkringUsageError:
        config_ok = False
    assert config_ok == rings_ok


# What a newcomer met (issue "One house a newcomer can read", item 7): each error names the field the user set,
# its value and what it must be - in the user's units - and a config with several bad values lists them all.
@pytest.mark.parametrize("change, first, lines", [
    (dict(hidden=1040), "hidden",
     ["hidden: must be a multiple of 128 (the FP8 scale block: one fp32 scale per 128 channels), got 1040"]),
    (dict(hidden=1000), "hidden",
     ["hidden: must be a multiple of 128 (the FP8 scale block: one fp32 scale per 128 channels), got 1000"]),
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank", ["max_tokens_per_rank: must be a positive int, got 0"]),
    (dict(stream_slot_tokens=0), "stream_slot_tokens",
     ["stream_slot_tokens: must be a positive int or None, got 0",
      "stream_slots: unset while stream_slot_tokens=0 is set: set both for a streaming ring, or neither"]),
    (dict(stream_slots=2, stream_slot_tokens=65), "stream_slot_tokens",
     ["stream_slot_tokens: must be at most max_tokens_per_rank=64 (a chunk is part of a batch), got 65"]),
    (dict(hidden=1040, topk=100, num_experts=15, intermediate=100), "intermediate",
     ["intermediate: must be a multiple of 128 for the FP8_E4M3 payload (one activation scale per 1x128 block), "
      "got 100",
      "hidden: must be a multiple of 128 (the FP8 scale block: one fp32 scale per 128 channels), got 1040",
      "topk: must be in [1, 15], got 100 (at most num_experts=15)"]),
    (dict(max_tokens_per_rank=70_000, stream_slots=70_000, stream_slot_tokens=8), "max_tokens_per_rank",
     ["max_tokens_per_rank: must be in [1, 65536], got 70000 (the batch-ready ring's tokens_per_slot)",
      "stream_slots: must be in [1, 65536], got 70000 (the streaming ring's num_slots)"]),
])
def test_every_bad_value_is_named_with_its_value(change, first, lines):
    with pytest.raises(ChunkringUsageError) as info:
        MoEConfig(**{**GOOD, **change})
    assert info.value.field == first
    assert str(info.value).splitlines() == lines
    assert [f"{field}: {message}" for field, message in info.value.problems] == lines


def test_a_world_size_check_lists_both_rings():
    cfg = MoEConfig(**{**GOOD, "num_experts": 64, "topk": 2, "stream_slots": 2, "stream_slot_tokens": 8})
    with pytest.raises(ChunkringUsageError) as info:
        cfg.check_world_size(65)
    assert info.value.problems == (
        ("world_size", "must be in [1, 64], got 65 (a consumer's source mask holds 64 ranks)"),)


def test_an_unknown_key_is_a_usage_error_naming_it():
    """MoEConfig(nosuch=1) is a ChunkringUsageError naming every unknown key and the keys there are, not the
    generated __init__'s bare TypeError."""
    with pytest.raises(ChunkringUsageError) as info:
        MoEConfig(**GOOD, nosuch=1, colour="red")
    assert info.value.field == "colour"
    lines = str(info.value).splitlines()
    assert lines[:2] == ["colour: not a key of MoEConfig", "nosuch: not a key of MoEConfig"]
    assert lines[2].startswith("MoEConfig's keys: num_experts, hidden, intermediate, topk, max_tokens_per_rank")


def test_copies_and_replacements_still_build():
    import copy
    import dataclasses
    import pickle

    cfg = MoEConfig(**GOOD).with_default_ring()
    assert copy.deepcopy(cfg) == cfg == pickle.loads(pickle.dumps(cfg))
    assert dataclasses.replace(cfg, topk=2).topk == 2 and MoEConfig(16, 256, 128, 4, 64) == MoEConfig(**GOOD)
