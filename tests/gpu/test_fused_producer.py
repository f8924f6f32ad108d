"""The MoE layer's fused producer (device/kernels/moe_produce.cu, chunkring.moe._engine.producer.enqueue_produce)
against its torch reference (route, quantize_rows_fp8): every rank publishes chunks it routes and
quantises in one kernel, every rank gathers every source's chunks through the ring, and each row must
equal the reference computed from the same logits - FP8 rows and scales bitwise, the chosen experts
as a valid top-k of the logits (ties, as in a zero row, to the lower expert), their weights within a few
ulps of torch's softmax over them - and, where the top-k is unique, the experts route() chose. One-block
and multi-block grids (the last block to arrive publishes), a one-slot ring that wraps at every chunk,
a device token count that cuts a stream short, a zero row and a row holding NaN."""

import time

import pytest
import torch

from chunkring import ChunkringPeerAbortedError, ChunkringTimeoutError, Ring, RingSpec
from chunkring.jit import library_for
from chunkring.moe._engine.producer import PRODUCE_MAX_BLOCKS, enqueue_produce, produce_grid, produce_grid_limit
from chunkring.moe.routing import quantize_rows_fp8, route, router_logits
from chunkring.ring.io import GatherOutputs, gather
from chunkring.ring.spec import PayloadFormat
from chunkring.ring.status import ErrorCode, Site

pytestmark = pytest.mark.gpu

K, E = 8, 64
GATHER_GRID = 2  # a consumer of several blocks, the last to finish a chunk acknowledging it
SPIN_FIRST_S = 0.5  # long enough for a launched producer to be spinning on the GPU
#: Weight tolerance: the kernel's exp(l - l_max) / sum over the chosen against torch's softmax over the
#: chosen logits - the same exponentials, summed in another order (a few ulps).
WEIGHT_RTOL = 4e-6


def check_routing(logits, idx, weights, ref_idx):
    """idx [n, K] must be a top-k of logits [n, E] in order (equal logits: lower expert first), weights the
    softmax over the chosen logits, and idx route()'s choice wherever the top-k is unique."""
    chosen = logits.gather(1, idx.long())
    assert bool((chosen[:, :-1] >= chosen[:, 1:]).all()), "picks out of order"
    rest = logits.scatter(1, idx.long(), float("-inf"))
    assert bool((chosen[:, -1] >= rest.max(dim=1).values).all()), "an unchosen expert has a larger logit"
    tied = (chosen[:, :-1] == chosen[:, 1:]) & (idx[:, :-1] > idx[:, 1:])
    assert not bool(tied.any()), "equal logits not in expert order"
    torch.testing.assert_close(weights, torch.softmax(chosen, dim=-1), rtol=WEIGHT_RTOL, atol=0)
    # route() ranks softmax probabilities, which tie where distinct logits round to one probability (0 or a
    # subnormal): compare rows whose chosen probabilities are strictly decreasing and above every other.
    p = torch.softmax(logits, dim=-1)
    p_chosen = p.gather(1, idx.long())
    unique = ((p_chosen[:, -1] > p.scatter(1, idx.long(), -1.0).max(dim=1).values)
              & (p_chosen[:, :-1] > p_chosen[:, 1:]).all(dim=1))
    assert torch.equal(idx[unique], ref_idx[unique]), "a unique top-k differs from route()'s"


def source_batch(src, invocation, n, hidden, device):
    """Rank `src`'s hidden rows in `invocation`, its router logits (computed from the rows before one NaN
    was put in: torch.topk orders NaNs unspecified, so routing is compared on finite logits) and the
    reference routing, built alike on every rank."""
    g = torch.Generator(device="cpu").manual_seed(7919 * invocation + src)
    x = (torch.randn(n, hidden, generator=g) * torch.rand(n, 1, generator=g) * 4).to(torch.bfloat16)
    x[2].zero_()  # a zero row: every scale 1
    router = torch.randn(E, hidden, generator=g).to(torch.bfloat16)
    x, router = x.to(device), router.to(device)
    logits = router_logits(x, router)
    ref_idx, _ = route(x, router, K)
    x[3, 5] = float("nan")  # its block's scale is 1 and the NaN stays NaN, as in torch
    return x, logits, ref_idx


@pytest.mark.parametrize("payload", [PayloadFormat.FP8_E4M3, PayloadFormat.BF16])
@pytest.mark.parametrize("hidden,tokens_per_slot", [(256, 8), (2048, 64)])  # 1 block; 32 blocks per chunk
def test_fused_producer_matches_the_torch_reference(runtime, payload, hidden, tokens_per_slot):
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    T = tokens_per_slot
    # No partition here: the producer's spinning blocks share the SMs with the gather's, on every rank of this
    # GPU, so its grid leaves room for them (produce_grid_limit).
    sms = torch.cuda.get_device_properties(runtime.torch_device).multi_processor_count
    max_blocks = produce_grid_limit(sms, runtime.gpu_ranks, GATHER_GRID)
    assert (produce_grid(T, hidden, max_blocks) > 1) == (hidden != 256), "one block, and a grid of several"
    spec = RingSpec(world_size=W, num_slots=1, tokens_per_slot=T, hidden=hidden, payload=payload, topk=K,
                    num_experts=E)
    kernels = library_for(runtime, "moe_produce")
    library_for(runtime, "ring_host_api")  # loaded before a producer spins: a module load would wait for it
    arrivals = torch.zeros(1, dtype=torch.int32, device=device)
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    capacity = 3 * T
    with Ring(runtime, spec, timeout_s=30) as ring:
        for invocation, (n, valid) in enumerate([(3 * T, None), (2 * T + 3, None), (3 * T, 2 * T - 5)]):
            out = GatherOutputs(ring, capacity)
            out.topk_idx.fill_(-7)
            hidden_rows, logits, _ = source_batch(rank, invocation, n, hidden, device)
            valid_t = None if valid is None else torch.tensor([valid], dtype=torch.int32, device=device)
            torch.cuda.synchronize()
            with torch.cuda.stream(producer):
                for base in range(0, n, T):
                    end = min(n, base + T)
                    enqueue_produce(ring, kernels, logits[base:end], hidden_rows[base:end], base, end == n,
                                    valid_t, None if valid is None else n, arrivals, producer, max_blocks)
            gather(ring, out, grid=GATHER_GRID, stream=consumer)
            torch.cuda.synchronize()
            ring.check()
            sent = n if valid is None else valid
            assert out.counts.tolist() == [sent] * W
            assert int(arrivals.item()) == 0, "the last block leaves the arrival count at zero"
            for src in range(W):
                rows, src_logits, ref_idx = source_batch(src, invocation, n, hidden, device)
                rows = rows[:sent]
                check_routing(src_logits[:sent], out.topk_idx[src, :sent], out.topk_weights[src, :sent],
                              ref_idx[:sent])
                if payload is PayloadFormat.FP8_E4M3:
                    ref_x, ref_sf = quantize_rows_fp8(rows)
                    assert torch.equal(out.x[src, :sent].view(torch.uint8), ref_x.view(torch.uint8)), src
                    assert torch.equal(out.x_sf[src, :sent], ref_sf), src
                else:
                    assert torch.equal(out.x[src, :sent].view(torch.uint8), rows.view(torch.uint8)), src
                assert bool((out.topk_idx[src, sent:] == -7).all()), "rows past the count were sent"
            runtime.barrier()
            out.close()


@pytest.mark.parametrize("grid", ["past the share", "within the share"])
def test_producers_spinning_past_their_share_of_a_shared_gpu_starve_the_gathers(runtime, grid):
    """docs/PROTOCOL.md, "Progress" 8, with its broken variant. Every rank's producer spins for acks first
    (three 128 x 4,096 chunks through one slot; the gathers launched only once the second chunk spins), then
    every rank launches its gather. With the full grid (128 blocks a chunk, every rank) every SM holds a
    spinning producer block, beside which a 512-thread gather block does not fit (registers: 20,480 +
    49,152 > 65,536): no gather starts and the watchdog ends the call on every rank. With the grid
    produce_grid_limit gives, the same sequence completes."""
    if runtime.gpu_ranks < 2:
        pytest.skip("needs several ranks on one GPU (under MPS)")
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    T, hidden, n = 128, 4096, 3 * 128
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    assert runtime.gpu_ranks * produce_grid(T, hidden) > sms, "the broken variant must leave no SM without a producer"
    broken = grid == "past the share"
    max_blocks = PRODUCE_MAX_BLOCKS if broken else produce_grid_limit(sms, runtime.gpu_ranks, GATHER_GRID)
    spec = RingSpec(world_size=W, num_slots=1, tokens_per_slot=T, hidden=hidden, payload=PayloadFormat.FP8_E4M3,
                    topk=K, num_experts=E)
    kernels = library_for(runtime, "moe_produce")
    library_for(runtime, "ring_host_api")  # loaded before a producer spins: a module load would wait for it
    arrivals = torch.zeros(1, dtype=torch.int32, device=device)
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    with Ring(runtime, spec, timeout_s=3.0 if broken else 30.0) as ring:
        out = GatherOutputs(ring, n)
        hidden_rows, logits, _ = source_batch(rank, 0, n, hidden, device)
        torch.cuda.synchronize()
        runtime.host_barrier()
        with torch.cuda.stream(producer):
            for base in range(0, n, T):
                enqueue_produce(ring, kernels, logits[base:base + T], hidden_rows[base:base + T], base, base + T == n,
                                None, None, arrivals, producer, max_blocks)
        time.sleep(SPIN_FIRST_S)  # this rank's second chunk now spins for the first one's acks
        runtime.host_barrier()  # and every other rank's (a host barrier: nothing queued behind the spin)
        gather(ring, out, grid=GATHER_GRID, stream=consumer)
        torch.cuda.synchronize()
        if not broken:
            ring.check()
            assert out.counts.tolist() == [n] * W
            out.close()
            return
        with pytest.raises((ChunkringTimeoutError, ChunkringPeerAbortedError)):
            ring.check()
        record = ring.status()
        timed_out = runtime.allgather_object(record.code == ErrorCode.TIMEOUT)
        assert any(timed_out), "no rank's watchdog fired: the gathers found SMs (is a gather block smaller now?)"
        if record.code == ErrorCode.TIMEOUT:  # a producer waiting for the first chunk's acks, none ever written
            assert (record.site, record.slot, record.observed) == (Site.WAIT_REUSABLE, 0, 0), record
        runtime.barrier()
        out.close()
