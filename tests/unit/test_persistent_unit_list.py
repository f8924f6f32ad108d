"""The persistent consumer's unit list as its host mirror gives it (chunkring.moe._engine.persistent block_units, the
mirror of chunkring/moe/persistent_schedule.cuh's Schedule): every unit to one block, L1 before L2 in each block's
list, the claim orders as the header writes them."""

import pytest

from chunkring.moe._engine.persistent import CLAIMS, block_units


@pytest.mark.parametrize("claim", sorted(CLAIMS))
@pytest.mark.parametrize("phases", [1, 2, 3])
def test_every_unit_goes_to_one_block_and_l1_units_come_first(claim, phases):
    counts, hidden, inter, grid = [3, 0, 70, 1, 0, 9], 512, 384, 5
    blocks = block_units(counts, hidden=hidden, inter=inter, claim=claim, grid=grid, phases=phases)
    assert len(blocks) == grid
    taken = [unit for units in blocks for unit in units]
    active = [e for e, c in enumerate(counts) if c]
    want = {("L1", e, c) for e in active for c in range(inter // 128)} if phases & 1 else set()
    want |= {("L2", e, b) for e in active for b in range(hidden // 128)} if phases & 2 else set()
    assert len(taken) == len(set(taken)) and set(taken) == want
    for units in blocks:
        gemms = [g for g, _, _ in units]
        assert gemms == sorted(gemms), "a block runs every L1 unit of its list before any L2 unit"
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1, "unit counts differ by one at most"


def test_the_claim_orders_are_the_headers():
    counts = [1, 1, 1]
    expert_major = block_units(counts, hidden=256, inter=256, claim="strided_experts", grid=2, phases=1)
    assert expert_major == [[("L1", 0, 0), ("L1", 1, 0), ("L1", 2, 0)], [("L1", 0, 1), ("L1", 1, 1), ("L1", 2, 1)]]
    block_major = block_units(counts, hidden=256, inter=256, claim="strided_blocks", grid=2, phases=1)
    assert block_major == [[("L1", 0, 0), ("L1", 2, 0), ("L1", 1, 1)], [("L1", 1, 0), ("L1", 0, 1), ("L1", 2, 1)]]
    in_turn = block_units(counts, hidden=256, inter=256, claim="dynamic", grid=2, phases=1)
    assert in_turn == expert_major, "the dynamic claim's list is expert-major, dealt as the blocks ask in turn"
    blocked = block_units(counts, hidden=256, inter=256, claim="blocked", grid=2, phases=1)
    assert blocked == [[("L1", 0, 0), ("L1", 0, 1), ("L1", 1, 0)], [("L1", 1, 1), ("L1", 2, 0), ("L1", 2, 1)]]

