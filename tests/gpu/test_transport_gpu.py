"""The per-peer transport on the GPU: a forced-RMA ring marks every peer RMA in its descriptor, an auto
ring on one node marks every peer DIRECT (NVSHMEM maps them all), and a publish/gather round trip gives
the same bytes over both (ring_gather's fetches: loads or NVSHMEM gets)."""

import pytest
import torch

from chunkring import Ring, RingSpec
from chunkring.ring.io import GatherOutputs, gather, publish_chunk
from chunkring.ring.layout import DESC_FIELDS
from chunkring.ring.spec import PayloadFormat
from chunkring.ring.transport import Transport
from tests.gpu.ring_helpers import H, K, T, source_tensors

pytestmark = pytest.mark.gpu


def spec_for(W):
    return RingSpec(world_size=W, num_slots=2, tokens_per_slot=T, hidden=H, payload=PayloadFormat.FP8_E4M3, topk=K,
                    num_experts=4 * W)


def test_the_descriptor_says_which_peers_are_rma(runtime):
    W = runtime.world_size
    with Ring(runtime, spec_for(W), timeout_s=30, transport="rma") as ring:
        assert ring.transports == (Transport.RMA,) * W
        assert int(ring.desc[DESC_FIELDS.index("rma_peers")].item()) & ((1 << W) - 1) == (1 << W) - 1
        pes = "PE 0" if W == 1 else f"PEs 0-{W - 1}"
        assert ring.describe_transport().endswith(f"RMA to {pes}")
    with Ring(runtime, spec_for(W), timeout_s=30, transport="auto") as ring:  # one node: every peer mapped
        assert ring.transports == (Transport.DIRECT,) * W
        assert int(ring.desc[DESC_FIELDS.index("rma_peers")].item()) == 0


@pytest.mark.parametrize("grid", [1, 3])
def test_gather_over_rma_returns_the_published_bytes(runtime, grid):
    W, device = runtime.world_size, runtime.torch_device
    spec, n, capacity = spec_for(W), 3 * T - 1, 3 * T
    outs = {}
    for transport in ("auto", "rma"):
        with Ring(runtime, spec, timeout_s=30, transport=transport) as ring:
            out = GatherOutputs(ring, capacity)
            out.x.view(torch.uint8).fill_(0x55)
            x, x_sf, idx, w = source_tensors(spec, runtime.rank, 0, n, device)
            producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
            torch.cuda.synchronize()
            with torch.cuda.stream(producer):
                for base in range(0, n, T):
                    rows = slice(base, min(n, base + T))
                    publish_chunk(ring, x=x[rows], x_sf=x_sf[rows], topk_idx=idx[rows], topk_weights=w[rows],
                                  token_base=base, end_of_stream=base + T >= n)
            gather(ring, out, grid=grid, stream=consumer)
            torch.cuda.synchronize()
            ring.check()
            runtime.barrier()
            outs[transport] = out
    for src in range(W):
        rx, rsf, ridx, rw = source_tensors(spec, src, 0, n, device)
        got = outs["rma"]
        assert torch.equal(got.x[src, :n].view(torch.uint8), rx.view(torch.uint8)), src
        assert torch.equal(got.x_sf[src, :n], rsf) and torch.equal(got.topk_idx[src, :n], ridx)
        assert torch.equal(got.topk_weights[src, :n], rw)
        assert torch.equal(got.x[src].view(torch.uint8), outs["auto"].x[src].view(torch.uint8))
    for out in outs.values():
        out.close()  # symmetric for the RMA ring: a collective
