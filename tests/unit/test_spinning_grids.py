"""Grids that spin, sized so that every rank's blocks on one GPU are resident at once (docs/PROTOCOL.md,
"Progress" 8): a rank's share of the SMs (Runtime.sm_share, gpu_ranks counted at init), the fused
producer's limit beside a consumer on the same SMs (produce_grid_limit), and the layer's pull and producer
grids with and without a partition (spinning_grids)."""

import socket
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chunkring.bringup import Runtime, _ranks_on_my_gpu
from chunkring.errors import ChunkringUsageError
from chunkring.moe.layer import PULL_GRID, spinning_grids
from chunkring.moe.producer import PRODUCE_ELEMENTS_PER_BLOCK, PRODUCE_MAX_BLOCKS, produce_grid, produce_grid_limit
from chunkring.ranks import RankInfo

H200_SMS = 132


def test_init_counts_the_ranks_on_this_ranks_gpu_by_host_and_uuid():
    here = socket.gethostname()
    # Rank 0 and 2 on GPU-a of this host; the same UUID string reported by another host is not this GPU.
    everyone = [(here, "GPU-a"), (here, "GPU-b"), (here, "GPU-a"), ("elsewhere", "GPU-a")]
    comm = SimpleNamespace(allgather_object=lambda mine: everyone)
    assert _ranks_on_my_gpu(comm, "GPU-a") == 2
    assert _ranks_on_my_gpu(comm, "GPU-b") == 1


def test_a_ranks_share_of_the_sms():
    four = RankInfo(rank=1, world_size=4, local_rank=1, local_world_size=4)
    assert Runtime(ranks=four, ordinal=0, device=None, gpu_ranks=4).sm_share(H200_SMS) == 33
    assert Runtime(ranks=four, ordinal=0, device=None, gpu_ranks=1).sm_share(H200_SMS) == H200_SMS
    assert Runtime(ranks=four, ordinal=0, device=None, gpu_ranks=4).sm_share(3) == 1  # never none
    for bad in (0, 5):
        with pytest.raises(ChunkringUsageError) as info:
            Runtime(ranks=four, ordinal=0, device=None, gpu_ranks=bad)
        assert info.value.field == "gpu_ranks"


def test_the_fused_producer_leaves_a_consumer_beside_it_its_sms():
    # The H200 deadlock: 4 ranks under MPS, a 2-block gather beside 32 producer blocks each (132 < 4 x 34).
    assert produce_grid(64, 2048) == 32
    assert produce_grid(64, 2048, produce_grid_limit(H200_SMS // 4, 2)) == 31
    assert produce_grid(64, 2048, produce_grid_limit(H200_SMS, 2)) == 32  # one rank: unchanged
    assert produce_grid(1024, 7168, produce_grid_limit(H200_SMS, 16)) == H200_SMS - 16
    with pytest.raises(ChunkringUsageError) as info:
        produce_grid_limit(16, 16)
    assert info.value.field == "consumer_blocks"


@given(rows=st.integers(1, 4096), hidden=st.sampled_from([256, 1024, 2048, 4096, 7168]),
       max_blocks=st.integers(1, 4 * PRODUCE_MAX_BLOCKS))
def test_produce_grid_is_within_every_bound(rows, hidden, max_blocks):
    grid = produce_grid(rows, hidden, max_blocks)
    assert 1 <= grid <= min(max_blocks, PRODUCE_MAX_BLOCKS, rows)
    assert grid == min(-(-rows * hidden // PRODUCE_ELEMENTS_PER_BLOCK), rows, max_blocks, PRODUCE_MAX_BLOCKS)


@given(sms=st.integers(16, 264), producer_sms=st.integers(8, 64), gpu_ranks=st.integers(1, 8),
       pull_per_sm=st.integers(1, 8), produce_per_sm=st.integers(1, 8))
def test_every_ranks_spinning_blocks_fit_the_gpu_together(sms, producer_sms, gpu_ranks, pull_per_sm, produce_per_sm):
    share = max(1, sms // gpu_ranks)
    if share >= 2:  # without a partition: one SM per block, every rank's pull and producer together
        pull, producer = spinning_grids(share, pull_per_sm)
        assert 1 <= pull <= PULL_GRID and 1 <= producer <= PRODUCE_MAX_BLOCKS
        assert gpu_ranks * (pull + producer) <= sms
    # On a partition (sms the consumer's): each side's kernel, every rank's grid resident in its SMs at once.
    pull, producer = spinning_grids(share, pull_per_sm, max(1, producer_sms // gpu_ranks), produce_per_sm)
    assert 1 <= pull <= PULL_GRID and 1 <= producer <= PRODUCE_MAX_BLOCKS
    assert gpu_ranks * pull <= sms * pull_per_sm
    assert gpu_ranks * producer <= max(producer_sms, gpu_ranks) * produce_per_sm


def test_the_grids_at_the_measured_shapes():
    # The default streamed call on the H200: 32 + 100 SMs, 2 pull blocks and 3 producer blocks resident per SM.
    assert spinning_grids(100, 2, 32, 3) == (PULL_GRID, 96)  # one rank: the producer's grid what its SMs hold
    assert spinning_grids(100 // 4, 2, 32 // 4, 3) == (PULL_GRID, 24)  # 4 ranks under MPS: a quarter each
    # Without a partition the producer leaves the pull its SMs: 132 - 16 at one rank, 33 - 16 at four.
    assert spinning_grids(H200_SMS, 2) == (PULL_GRID, H200_SMS - PULL_GRID)
    assert spinning_grids(H200_SMS // 4, 2) == (PULL_GRID, H200_SMS // 4 - PULL_GRID)
