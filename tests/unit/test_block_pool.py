"""The host side of incremental expert blocks (docs/PROTOCOL.md, "Incremental expert blocks"): MoEConfig.waves
is checked before any GPU work, and the pool's sizes are the bounds PROTOCOL.md derives, laid out as
device/include/chunkring/moe/blocks.cuh reads them. No GPU needed."""

import math
import re
from pathlib import Path

import pytest
import torch

from chunkring import ChunkringUsageError, MoEConfig
from chunkring.moe._engine.blocks import HEADER_WORDS, BlockPool, pool_shape
from chunkring.moe._engine.descriptors import MOE_LAYOUT_VERSION, POOL_FIELDS
from chunkring.moe.config import MAX_WAVES
from chunkring.moe.gemm import padded_rows_bound

GOOD = dict(num_experts=16, hidden=256, intermediate=128, topk=4, max_tokens_per_rank=64)
BLOCKS_CUH = Path(__file__).resolve().parents[2] / "device/include/chunkring/moe/blocks.cuh"


@pytest.mark.parametrize("waves", [0, -1, MAX_WAVES + 1, True, 2.0, "2", None])
def test_bad_waves_name_the_field(waves):
    with pytest.raises(ChunkringUsageError) as info:
        MoEConfig(**GOOD, waves=waves)
    assert info.value.field == "waves"


def test_waves_default_to_the_batch_plan():
    assert MoEConfig(**GOOD).waves == 1 and not MoEConfig(**GOOD).incremental
    for waves in range(2, MAX_WAVES + 1):
        assert MoEConfig(**GOOD, waves=waves).incremental


@pytest.mark.parametrize("n, k, world, experts, bm", [(64, 4, 4, 4, 128), (1, 1, 1, 1, 128), (3, 1, 1, 2, 2),
                                                       (8192, 8, 8, 32, 128), (100, 6, 2, 200, 128)])
def test_pool_sizes_are_the_protocols_bounds(n, k, world, experts, bm):
    shape = pool_shape(n, k, world, experts, bm)
    R = world * n * k
    assert shape.choices == R
    assert shape.blocks_per_expert == math.ceil(R / bm)  # J: one expert can take every choice
    assert shape.rows == padded_rows_bound(n, k, world, experts, bm)  # P * bm: the batch plan's capacity
    g = min(experts, R)
    assert shape.blocks == g + (R - g) // bm
    assert shape.words == HEADER_WORDS + experts + experts * shape.blocks_per_expert + 4 * shape.blocks


def test_the_pool_is_large_enough_for_the_worst_routing():
    # bug_small_pool (docs/model/blocks.pml): ceil(R / bm) blocks overflow with 3 + 1 rows at bm = 2; every
    # split of R rows over the experts must fit P blocks.
    shape = pool_shape(2, 2, 1, 2, 2)  # R = 4, E = 2, bm = 2
    assert shape.blocks == 3 > math.ceil(4 / 2)
    for first in range(0, 5):
        assert math.ceil(first / 2) + math.ceil((4 - first) / 2) <= shape.blocks


def test_pool_bad_arguments_name_the_field():
    with pytest.raises(ChunkringUsageError) as info:
        pool_shape(64, 0, 1, 1, 128)
    assert info.value.field == "topk"


def test_the_device_layout_matches():
    text = BLOCKS_CUH.read_text()
    assert re.search(rf"\bkHeader = {HEADER_WORDS},", text)
    # the per-block arrays after block_of, in this order: landed, state, expert_of, wave_ids (P each)
    assert "experts * (1 + blocks_per_expert) + id" in text
    assert "landed(id) + 2 * blocks" in text and "landed(0) + 3 * blocks" in text


@pytest.mark.parametrize("fp8", [True, False])
def test_pool_buffers(fp8):
    shape = pool_shape(16, 2, 2, 3, 128)
    pool = BlockPool(shape, 256, fp8, "cpu")
    assert pool.words.shape == (shape.words,) and pool.words.dtype == torch.int32
    assert int(pool.words.abs().sum()) == 0
    assert pool.x.shape == (shape.rows, 256 if fp8 else 512)
    assert pool.sf.shape == (shape.rows, 2 if fp8 else 0)
    assert pool.pos.shape == (shape.choices,)
    for t in (pool.src, pool.token, pool.k, pool.weight):
        assert t.shape == (shape.rows,)
    assert pool.nbytes == sum(t.numel() * t.element_size() for t in
                              (pool.words, pool.pos, pool.x, pool.sf, pool.src, pool.token, pool.k, pool.weight))
    pool.words.fill_(7)
    pool.reset()
    assert int(pool.words.abs().sum()) == 0
    desc = dict(zip(POOL_FIELDS, pool.desc.tolist(), strict=True))
    assert desc["layout_version"] == MOE_LAYOUT_VERSION and desc["desc_bytes"] == 8 * len(POOL_FIELDS)
    assert (desc["experts"], desc["blocks_per_expert"], desc["blocks"], desc["block_m"]) == \
        (shape.experts, shape.blocks_per_expert, shape.blocks, shape.block_m)
    assert (desc["row_bytes"], desc["sf_per_row"]) == (pool.x.shape[1], pool.sf.shape[1])
    for name in ("words", "pos", "x", "sf", "src", "token", "k", "weight"):
        assert desc[name] == getattr(pool, name).data_ptr(), name
