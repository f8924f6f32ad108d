"""publish_chunk and gather check every argument before anything is enqueued (no GPU needed)."""

from types import SimpleNamespace

import pytest
import torch

from chunkring.errors import ChunkringUsageError
from chunkring.ring.io import GatherOutputs, gather, publish_chunk
from chunkring.ring.spec import PayloadFormat, RingSpec

SPEC = RingSpec(world_size=2, num_slots=2, tokens_per_slot=8, hidden=256, payload=PayloadFormat.FP8_E4M3, topk=4,
                num_experts=8)
# A stand-in ring whose device is the CPU, so the checks run without a GPU.
RING = SimpleNamespace(spec=SPEC, runtime=SimpleNamespace(torch_device=torch.device("cpu")), check_alive=lambda: None)


def good(n=3):
    return dict(x=torch.zeros(n, 256, dtype=torch.float8_e4m3fn), x_sf=torch.zeros(n, 2),
                topk_idx=torch.zeros(n, 4, dtype=torch.int32), topk_weights=torch.zeros(n, 4), token_base=0,
                end_of_stream=True)


@pytest.mark.parametrize("change,field", [
    ({"x": torch.zeros(9, 256, dtype=torch.float8_e4m3fn)}, "x"),
    ({"x": torch.zeros(3, 256, dtype=torch.bfloat16)}, "x"),
    ({"x": torch.zeros(3, 128, dtype=torch.float8_e4m3fn)}, "x"),
    ({"x": torch.zeros(256, dtype=torch.float8_e4m3fn)}, "x"),
    ({"x_sf": None}, "x_sf"),
    ({"x_sf": torch.zeros(3, 2, dtype=torch.float64)}, "x_sf"),
    ({"topk_idx": torch.zeros(3, 4, dtype=torch.int64)}, "topk_idx"),
    ({"topk_idx": torch.zeros(3, 5, dtype=torch.int32)}, "topk_idx"),
    ({"topk_weights": torch.zeros(4, 3).t()}, "topk_weights"),
    ({"token_base": -1}, "token_base"),
    ({"token_base": 1.0}, "token_base"),
    ({"end_of_stream": 1}, "end_of_stream"),
    ({"valid_tokens": torch.zeros(1, dtype=torch.int32)}, "batch_rows"),
    ({"batch_rows": 8}, "valid_tokens"),
    ({"valid_tokens": torch.zeros(1, dtype=torch.int64), "batch_rows": 8}, "valid_tokens"),
    ({"valid_tokens": torch.zeros(2, dtype=torch.int32), "batch_rows": 8}, "valid_tokens"),
    ({"valid_tokens": torch.zeros(1, dtype=torch.int32), "batch_rows": 2}, "batch_rows"),
    ({"valid_tokens": torch.zeros(1, dtype=torch.int32), "batch_rows": True}, "batch_rows"),
])
def test_publish_rejects(change, field):
    with pytest.raises(ChunkringUsageError) as info:
        publish_chunk(RING, **{**good(), **change})
    assert info.value.field == field


def test_empty_chunk_must_end_the_stream():
    with pytest.raises(ChunkringUsageError, match="empty chunk"):
        publish_chunk(RING, **{**good(0), "end_of_stream": False})


def test_gather_rejects_bad_outputs():
    with pytest.raises(ChunkringUsageError) as info:
        gather(RING, object())
    assert info.value.field == "out"
    with pytest.raises(ChunkringUsageError) as info:
        GatherOutputs(RING, -1)
    assert info.value.field == "capacity"
    for grid in (0, 65536, 2.0, True):
        with pytest.raises(ChunkringUsageError) as info:
            gather(RING, GatherOutputs(RING, 4), grid=grid)
        assert info.value.field == "grid"


def test_publish_grid_keeps_small_chunks_on_one_block_and_caps_large_ones():
    """One block (the one-kernel publish) up to PUBLISH_BYTES_PER_BLOCK, one more per that many bytes
    after it, never more than PUBLISH_MAX_BLOCKS: the three-kernel publish only where a copy is large."""
    from chunkring.ring.io import PUBLISH_BYTES_PER_BLOCK as B
    from chunkring.ring.io import PUBLISH_MAX_BLOCKS, publish_grid

    assert [publish_grid(n) for n in (0, 1, B)] == [1, 1, 1]
    assert [publish_grid(n) for n in (B + 1, 2 * B, 2 * B + 1)] == [2, 2, 3]
    assert publish_grid(8192 * 4096) == PUBLISH_MAX_BLOCKS  # the 34 MB FP8 batch of DeepGEMM's shape
    assert publish_grid(256 * 7168) == 4  # one 256-token chunk of hidden 7,168: the GPU test's split shape
