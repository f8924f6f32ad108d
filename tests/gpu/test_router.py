"""Batch-invariant routing (docs/INTEGRATION.md, "Batch-ready or streamed, per batch"): the router GEMM
(``moe_router_logits``, chunkring.moe.routing.router_logits) gives a token the same logits, bit for bit,
whichever tokens share its launch - alone, in a chunk, in the whole batch - and those logits are the fp32
GEMM's within fp32 rounding. So ``MoELayer.forward`` streamed equals batch-ready bit for bit at every size:
checked at 1, 1,024, 4,096 and 8,192 tokens per rank, where a cuBLAS router GEMM changed its kernel with the
token count and routed a chunk's tokens differently from the whole batch's."""

import pytest
import torch

from chunkring import MoEConfig, MoELayer, MoEModule
from chunkring.moe.routing import quantize_rows_fp8, route, router_logits

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("hidden,experts", [(4096, 32), (7168, 256), (1024, 40), (640, 8)])
def test_a_tokens_logits_do_not_depend_on_what_shares_its_launch(runtime, hidden, experts):
    device = runtime.torch_device
    gen = torch.Generator().manual_seed(hidden + experts)
    x = (torch.randn(1100, hidden, generator=gen) * 2).to(torch.bfloat16).to(device)
    router = (torch.randn(experts, hidden, generator=gen) / hidden**0.5).to(torch.bfloat16).to(device)
    whole = router_logits(x, router)
    for start, end in ((0, 1), (5, 6), (0, 17), (3, 1027), (1024, 1100), (100, 612)):
        assert torch.equal(router_logits(x[start:end].clone(), router), whole[start:end]), (start, end)
    reference = x.double() @ router.double().T
    err = (whole.double() - reference).abs().max() / reference.abs().max()
    assert float(err) < 1e-5, f"relative error {float(err):.2e} against the fp64 GEMM"


def test_an_empty_batch_gives_no_logits(runtime):
    x = torch.empty(0, 256, dtype=torch.bfloat16, device=runtime.torch_device)
    router = torch.ones(8, 256, dtype=torch.bfloat16, device=runtime.torch_device)
    assert router_logits(x, router).shape == (0, 8)


def test_routing_and_row_quantisation_capture_into_a_cuda_graph(runtime):
    """route() and quantize_rows_fp8 copy nothing from the host, so a caller may capture them (serving code that
    routes and quantises its own rows, and chunkring-launch bench, do): a replay on new rows gives the bits an
    eager call gives (a host-to-device copy inside them fails the capture: cudaErrorStreamCaptureUnjoined)."""
    device = runtime.torch_device
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(300, 1024, generator=gen).to(torch.bfloat16).to(device)
    router = (torch.randn(40, 1024, generator=gen) / 32).to(torch.bfloat16).to(device)

    def producers():
        return (*route(x, router, 6), *quantize_rows_fp8(x))

    producers()  # loads the router kernel's module outside the capture
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = producers()
    x.copy_((torch.randn(300, 1024, generator=gen) * 3).to(torch.bfloat16))
    graph.replay()
    eager = producers()
    torch.cuda.synchronize(device)
    for got, want in zip(captured, eager, strict=True):
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got,
                           want.view(torch.uint8) if want.element_size() == 1 else want)


def test_forward_streamed_equals_batch_ready_bit_for_bit_at_every_size(runtime):
    W, rank, device = runtime.world_size, runtime.rank, runtime.torch_device
    cfg = MoEConfig(num_experts=8 * W, hidden=512, intermediate=256, topk=2, max_tokens_per_rank=8192,
                    stream_slots=2, stream_slot_tokens=1024)
    layer = MoELayer(runtime, cfg, timeout_s=120)
    try:
        module = MoEModule(layer, generator=torch.Generator().manual_seed(3))
        for n in (1, 1024, 4096, 8192):
            gen = torch.Generator().manual_seed(n + 31 * rank)
            hidden = (torch.randn(n, cfg.hidden, generator=gen) * 3).to(torch.bfloat16).to(device)
            batch = module(hidden, streaming=False)
            streamed = module(hidden, streaming=True)
            torch.cuda.synchronize()
            layer.check()
            differ = int((batch != streamed).any(dim=1).sum())
            assert differ == 0, f"{n} tokens: {differ} rows differ between streamed and batch-ready"
    finally:
        layer.close()
