"""What several ring tests on the GPU share (no tests here): the shape (T tokens per slot, H, K), what each
source publishes in an invocation - a function of (source, invocation) alone, so every rank builds every
source's reference without communication - a ring of that shape, a rank's whole stream published chunk by
chunk, and the check that a gather received every source's rows exactly."""

import torch

from chunkring import Ring, RingSpec
from chunkring.ring.io import publish_chunk
from chunkring.ring.spec import PayloadFormat

T, H, K = 8, 256, 4


def source_tensors(spec, src, invocation, n, device):
    """What rank `src` sends in `invocation`: a function of (src, invocation) alone, so every rank can
    build every source's reference without communication."""
    g = torch.Generator(device="cpu").manual_seed(1000 * invocation + src)
    fp8 = spec.payload == PayloadFormat.FP8_E4M3
    x = torch.randn(n, H, generator=g).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    x_sf = torch.rand(n, H // 128, generator=g) if spec.payload == PayloadFormat.FP8_E4M3 else None
    idx = torch.randint(-1, spec.num_experts, (n, K), generator=g, dtype=torch.int32)
    w = torch.rand(n, K, generator=g)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return to(x), to(x_sf), to(idx), to(w)


def make_ring(runtime, num_slots, timeout_s=30.0):
    W = runtime.world_size
    spec = RingSpec(world_size=W, num_slots=num_slots, tokens_per_slot=T, hidden=H, payload=PayloadFormat.FP8_E4M3,
                    topk=K, num_experts=4 * W)
    return Ring(runtime, spec, timeout_s=timeout_s)


def publish_all(runtime, ring, n, invocation, stream):
    x, x_sf, idx, w = source_tensors(ring.spec, runtime.rank, invocation, n, runtime.torch_device)
    with torch.cuda.stream(stream):
        for base in range(0, max(n, 1), T):
            rows = slice(base, min(n, base + T))
            publish_chunk(ring, x=x[rows], x_sf=x_sf[rows], topk_idx=idx[rows], topk_weights=w[rows], token_base=base,
                          end_of_stream=base + T >= n)


def check_gathered(runtime, ring, out, counts, invocation):
    torch.cuda.synchronize()
    ring.check()
    assert out.counts.tolist() == counts
    for src, m in enumerate(counts):
        rx, rsf, ridx, rw = source_tensors(ring.spec, src, invocation, m, runtime.torch_device)
        assert torch.equal(out.x[src, :m].view(torch.uint8), rx.view(torch.uint8)), src
        assert torch.equal(out.x_sf[src, :m], rsf) and torch.equal(out.topk_idx[src, :m], ridx), src

