"""The stream-ordered host API: torch tensors published chunk by chunk from a producer stream arrive,
gathered by a consumer on another stream, at every rank - exact bytes, right rows, right counts - with
ring wrap inside one invocation, empty ranks, partial last chunks, and several invocations per epoch;
gathered by one block and by several that share each chunk."""

import numpy as np
import pytest
import torch

from chunkring import Ring, RingSpec
from chunkring.ring.io import GatherOutputs, gather, publish_chunk, publish_grid
from chunkring.ring.spec import PayloadFormat
from tests.gpu.ring_helpers import H, K, T, source_tensors

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("payload", [PayloadFormat.FP8_E4M3, PayloadFormat.BF16])
@pytest.mark.parametrize("num_slots", [1, 2])
@pytest.mark.parametrize("grid", [1, 7])
def test_publish_and_gather(runtime, payload, num_slots, grid):
    W = runtime.world_size
    spec = RingSpec(world_size=W, num_slots=num_slots, tokens_per_slot=T, hidden=H, payload=payload, topk=K,
                    num_experts=4 * W)
    rng = np.random.default_rng(5)
    capacity = 5 * T
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    with Ring(runtime, spec, timeout_s=30) as ring:
        for invocation in range(6):
            counts = rng.choice([0, 1, T - 1, T, T + 1, capacity], size=W)  # same on every rank
            if invocation == 0 and W > 1:
                counts[W - 1] = 0  # a whole-empty rank
            out = GatherOutputs(ring, capacity)
            for t in (out.x.view(torch.uint8), out.topk_idx, out.topk_weights, out.x_sf):
                t.fill_(-7 if t.dtype == torch.int32 else 0x55 if t.dtype == torch.uint8 else -7.0)  # sentinels
            torch.cuda.synchronize()
            # Producer work first, consumer on its own stream (docs/PROTOCOL.md, progress).
            n = int(counts[runtime.rank])
            x, x_sf, idx, w = source_tensors(spec, runtime.rank, invocation, n, runtime.torch_device)
            with torch.cuda.stream(producer):
                for base in range(0, max(n, 1), T):
                    rows = slice(base, min(n, base + T))
                    publish_chunk(ring, x=x[rows], x_sf=None if x_sf is None else x_sf[rows], topk_idx=idx[rows],
                                  topk_weights=w[rows], token_base=base, end_of_stream=base + T >= n)
            gather(ring, out, grid=grid, stream=consumer)
            torch.cuda.synchronize()
            ring.check()
            assert out.counts.tolist() == counts.tolist()
            for src in range(W):
                m = int(counts[src])
                rx, rsf, ridx, rw = source_tensors(spec, src, invocation, m, runtime.torch_device)
                assert torch.equal(out.x[src, :m].view(torch.uint8), rx.view(torch.uint8)), src
                assert torch.equal(out.topk_idx[src, :m], ridx) and torch.equal(out.topk_weights[src, :m], rw)
                if rsf is not None:
                    assert torch.equal(out.x_sf[src, :m], rsf)
                assert bool((out.topk_idx[src, m:] == -7).all()), "rows nobody sent were written"
            runtime.barrier()
            out.close()


@pytest.mark.parametrize("payload", [PayloadFormat.FP8_E4M3, PayloadFormat.BF16])
def test_a_chunk_too_large_for_one_block_is_published_by_several(runtime, payload):
    """Chunks over PUBLISH_BYTES_PER_BLOCK go out through the three-kernel publish (open, a grid of copy
    blocks, close): exact bytes at every rank, with a one-slot ring that wraps at every chunk (each open
    waits for the previous chunk's acks) and a device token count that ends each rank's stream inside a
    chunk, so the chunk after it publishes nothing."""
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    hidden, T, chunks = 7168, 256, 3
    spec = RingSpec(world_size=W, num_slots=1, tokens_per_slot=T, hidden=hidden, payload=payload, topk=K,
                    num_experts=4 * W)
    fp8 = payload == PayloadFormat.FP8_E4M3
    assert publish_grid(T * hidden * (1 if fp8 else 2)) > 1, "the shape must take the three-kernel publish"
    batch = chunks * T
    valid = [T + 17 + 5 * src for src in range(W)]  # inside the second chunk; the third publishes nothing

    def batch_of(src):
        g = torch.Generator().manual_seed(77 + src)
        x = torch.randn(batch, hidden, generator=g).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
        x_sf = torch.rand(batch, hidden // 128, generator=g) if fp8 else None
        idx = torch.randint(-1, spec.num_experts, (batch, K), generator=g, dtype=torch.int32)
        return x, x_sf, idx, torch.rand(batch, K, generator=g)

    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    with Ring(runtime, spec, timeout_s=30) as ring:
        out = GatherOutputs(ring, batch)
        out.topk_idx.fill_(-7)
        x, x_sf, idx, w = (None if t is None else t.to(device) for t in batch_of(rank))
        count = torch.tensor([valid[rank]], dtype=torch.int32, device=device)
        torch.cuda.synchronize()
        with torch.cuda.stream(producer):
            for base in range(0, batch, T):
                rows = slice(base, base + T)
                publish_chunk(ring, x=x[rows], x_sf=None if x_sf is None else x_sf[rows], topk_idx=idx[rows],
                              topk_weights=w[rows], token_base=base, end_of_stream=base + T >= batch,
                              valid_tokens=count, batch_rows=batch)
        gather(ring, out, stream=consumer)
        torch.cuda.synchronize()
        ring.check()
        assert out.counts.tolist() == valid
        for src in range(W):
            m = valid[src]
            rx, rsf, ridx, rw = batch_of(src)
            assert torch.equal(out.x[src, :m].view(torch.uint8).cpu(), rx[:m].view(torch.uint8)), src
            assert torch.equal(out.topk_idx[src, :m].cpu(), ridx[:m])
            assert torch.equal(out.topk_weights[src, :m].cpu(), rw[:m])
            if rsf is not None:
                assert torch.equal(out.x_sf[src, :m].cpu(), rsf[:m])
            assert bool((out.topk_idx[src, m:] == -7).all()), "rows past the count were written"
        runtime.barrier()
        out.close()
