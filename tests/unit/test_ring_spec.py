"""RingSpec rejects every impossible or unsafe shape with the field named: world sizes past the
consumer's 64-bit source mask (63/64/65), generation fields too narrow for the laps, misaligned rows,
uneven expert splits."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunkring.errors import ChunkringUsageError
from chunkring.ring.spec import MAX_WORLD_SIZE, PayloadFormat, RingSpec

GOOD = dict(world_size=8, num_slots=2, tokens_per_slot=128, hidden=7168, payload=PayloadFormat.FP8_E4M3,
            topk=8, num_experts=256)


def spec(**changes):
    return RingSpec(**{**GOOD, **changes})


def test_good_spec():
    s = spec()
    assert s.experts_per_rank == 32 and s.seq_bits == 48 and s.max_laps == (1 << 48) - 1


@pytest.mark.parametrize("world,ok", [(63, True), (64, True), (65, False)])
def test_source_mask_width(world, ok):
    if ok:
        spec(world_size=world, num_experts=world * 4)
    else:
        with pytest.raises(ChunkringUsageError) as info:
            spec(world_size=world, num_experts=world * 4)
        assert info.value.field == "world_size" and "64" in str(info.value)


@pytest.mark.parametrize("changes,field", [
    ({"world_size": 0}, "world_size"),
    ({"num_slots": 0}, "num_slots"),
    ({"tokens_per_slot": 0}, "tokens_per_slot"),
    ({"hidden": 7169}, "hidden"),
    ({"hidden": 200}, "hidden"),  # FP8 scales cover 128 channels
    ({"num_experts": 250}, "num_experts"),
    ({"topk": 0}, "topk"),
    ({"topk": 33, "num_experts": 256}, "topk"),
    ({"payload": 7}, "payload"),
    ({"num_slots": 2.0}, "num_slots"),
    ({"world_size": True}, "world_size"),
    ({"epoch_bits": 15}, "epoch_bits"),
    ({"epoch_bits": 33}, "epoch_bits"),
    ({"epoch_bits": 32, "laps_per_epoch": 1 << 32}, "laps_per_epoch"),
    ({"laps_per_epoch": 0}, "laps_per_epoch"),
])
def test_rejected(changes, field):
    with pytest.raises(ChunkringUsageError) as info:
        spec(**changes)
    assert info.value.field == field


def test_bf16_needs_no_scale_alignment():
    spec(payload=PayloadFormat.BF16, hidden=200)


@settings(max_examples=300, deadline=None)
@given(st.integers(16, 32), st.integers(1, (1 << 49)))
def test_lap_field_bound(epoch_bits, laps):
    fits = laps <= (1 << (64 - epoch_bits)) - 1
    if fits:
        assert spec(epoch_bits=epoch_bits, laps_per_epoch=laps).max_laps >= laps
    else:
        with pytest.raises(ChunkringUsageError) as info:
            spec(epoch_bits=epoch_bits, laps_per_epoch=laps)
        assert info.value.field == "laps_per_epoch"


@settings(max_examples=300, deadline=None)
@given(st.integers(-2, 70), st.integers(1, 300))
def test_world_and_experts(world, experts):
    valid = 1 <= world <= MAX_WORLD_SIZE and experts % world == 0 if world >= 1 else False
    if valid:
        spec(world_size=world, num_experts=experts, topk=1)
    else:
        with pytest.raises(ChunkringUsageError):
            spec(world_size=world, num_experts=experts, topk=1)
