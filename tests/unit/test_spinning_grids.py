"""Grids that spin, sized so that every rank's blocks on one GPU are resident at once (docs/PROTOCOL.md,
"Progress" 8): the ranks on a GPU (Runtime.gpu_ranks, counted at init), the fused
producer's limit beside a consumer on the same SMs (produce_grid_limit), and the layer's pull and producer
grids with and without a partition (spinning_grids)."""

import socket
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chunkring.bringup import ranks_on_my_gpu
from chunkring.errors import ChunkringUsageError
from chunkring.moe._engine.producer import (
    PRODUCE_ELEMENTS_PER_BLOCK,
    PRODUCE_MAX_BLOCKS,
    produce_grid,
    produce_grid_limit,
)
from chunkring.moe._engine.resources import PULL_GRID, spinning_grids
from chunkring.ranks import RankInfo
from chunkring.runtime import Runtime

H200_SMS = 132


def test_init_counts_the_ranks_on_this_ranks_gpu_by_host_and_uuid():
    here = socket.gethostname()
    # Rank 0 and 2 on GPU-a of this host; the same UUID string reported by another host is not this GPU.
    everyone = [(here, "GPU-a"), (here, "GPU-b"), (here, "GPU-a"), ("elsewhere", "GPU-a")]
    comm = SimpleNamespace(allgather_object=lambda mine: everyone)
    assert ranks_on_my_gpu(comm, "GPU-a") == 2
    assert ranks_on_my_gpu(comm, "GPU-b") == 1


def test_a_runtime_refuses_a_gpu_rank_count_outside_its_world():
    four = RankInfo(rank=1, world_size=4, local_rank=1, local_world_size=4)
    assert Runtime(ranks=four, ordinal=0, device=None, gpu_ranks=4).gpu_ranks == 4
    for bad in (0, 5):
        with pytest.raises(ChunkringUsageError) as info:
            Runtime(ranks=four, ordinal=0, device=None, gpu_ranks=bad)
        assert info.value.field == "gpu_ranks"


def test_the_fused_producer_leaves_a_consumer_beside_it_its_sms():
    # The H200 deadlock: 4 ranks under MPS, a 2-block gather beside 32 producer blocks each (132 < 4 x 34).
    assert produce_grid(64, 2048) == 32
    assert produce_grid(64, 2048, produce_grid_limit(H200_SMS, 4, 2)) == 30  # 33 SMs each: 2 + 30, one left
    assert produce_grid(64, 2048, produce_grid_limit(H200_SMS, 1, 2)) == 32  # one rank: as measured
    assert produce_grid_limit(H200_SMS, 1, 16) == PRODUCE_MAX_BLOCKS
    assert produce_grid_limit(32, 4) == 7  # a 32-SM producer partition shared by 4 ranks
    with pytest.raises(ChunkringUsageError) as info:
        produce_grid_limit(64, 4, 15)  # 16 SMs each: 15 for the consumer, 1 left over, none for the producer
    assert info.value.field == "gpu_ranks"


@given(rows=st.integers(1, 4096), hidden=st.sampled_from([256, 1024, 2048, 4096, 7168]),
       max_blocks=st.integers(1, 4 * PRODUCE_MAX_BLOCKS))
def test_produce_grid_is_within_every_bound(rows, hidden, max_blocks):
    grid = produce_grid(rows, hidden, max_blocks)
    assert 1 <= grid <= min(max_blocks, PRODUCE_MAX_BLOCKS, rows)
    assert grid == min(-(-rows * hidden // PRODUCE_ELEMENTS_PER_BLOCK), rows, max_blocks, PRODUCE_MAX_BLOCKS)


@given(consumer_sms=st.integers(24, 264), producer_sms=st.integers(16, 64), gpu_ranks=st.integers(2, 8),
       pull_per_sm=st.integers(1, 8))
def test_ranks_sharing_a_gpu_spin_one_block_per_sm_and_leave_each_share_an_sm(consumer_sms, producer_sms, gpu_ranks,
                                                                              pull_per_sm):
    # Without a partition: every rank's pull and producer on the same SMs, one SM per block, one SM per rank free.
    pull, producer = spinning_grids(consumer_sms, pull_per_sm, None, gpu_ranks)
    assert 1 <= pull <= PULL_GRID and 1 <= producer <= PRODUCE_MAX_BLOCKS
    assert gpu_ranks * (pull + producer + 1) <= consumer_sms
    # On a partition: each side alone, one SM per block, one SM per rank free on each side.
    pull, producer = spinning_grids(consumer_sms, pull_per_sm, producer_sms, gpu_ranks)
    assert 1 <= pull <= PULL_GRID and 1 <= producer <= PRODUCE_MAX_BLOCKS
    assert gpu_ranks * (pull + 1) <= consumer_sms and gpu_ranks * (producer + 1) <= producer_sms


def test_one_rank_per_gpu_keeps_the_measured_grids():
    # The default streamed call on the H200 (32 + 100 SMs, 2 pull blocks resident per SM) and no partition.
    assert spinning_grids(100, 2, 32, 1) == (PULL_GRID, PRODUCE_MAX_BLOCKS)
    assert spinning_grids(H200_SMS, 2, None, 1) == (PULL_GRID, PRODUCE_MAX_BLOCKS)
    assert spinning_grids(4, 2, None, 1) == (8, PRODUCE_MAX_BLOCKS)  # a small consumer: what its SMs hold
    # Four ranks under MPS on the default partition: 25 consumer SMs and 8 producer SMs each.
    assert spinning_grids(100, 2, 32, 4) == (PULL_GRID, 7)
    assert spinning_grids(H200_SMS, 2, None, 4) == (PULL_GRID, 16)  # 33 each: 16 + 16, one left


def test_ranks_sharing_a_gpu_without_mps_are_warned(caplog):
    from chunkring.bringup import warn_if_time_sliced

    with caplog.at_level("WARNING", logger="chunkring"):
        warn_if_time_sliced(4, mps=True)
        assert not caplog.records
        warn_if_time_sliced(4, mps=False)
    assert len(caplog.records) == 1 and "4 ranks share this GPU without MPS" in caplog.records[0].getMessage()
