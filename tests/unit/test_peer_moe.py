"""The bench's peer baseline (plain-torch MoE, one rank) against the fp32 reference on bf16 activations."""

import torch

from chunkring.moe.routing import route
from chunkring.testing.peer_moe import torch_moe, torch_moe_routed
from chunkring.testing.reference import moe_reference

E, H, INTER, K = 8, 256, 64, 2


def _draw(n, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape, fan_in):
        return (torch.randn(*shape, generator=gen) / fan_in**0.5).to(torch.bfloat16)

    return (draw(n, H, fan_in=1), draw(E, H, fan_in=H), draw(E, 2 * INTER, H, fan_in=H),
            draw(E, H, INTER, fan_in=INTER))


def _check(hidden, router, w13, w2):
    out = torch_moe(hidden, router, w13, w2, K)
    assert out.dtype == torch.bfloat16
    assert out.shape == hidden.shape
    # The reference on the same routing and the same bf16 values, in fp32 throughout: what differs is
    # torch_moe's bf16 rounding of the GEMM outputs and of the SwiGLU activations.
    idx, weights = route(hidden, router, K)
    ref = moe_reference(hidden.float(), idx, weights, w13.float(), w2.float())
    err = (out.float() - ref).abs().max() / ref.abs().max()
    assert err < 2e-2, f"relative error {float(err):.3g}"
    return idx


def test_matches_reference():
    _check(*_draw(37))


def test_experts_without_tokens():
    hidden, router, w13, w2 = _draw(37, seed=1)
    # Channel 0 of every token is +4 and experts 0, 3 and 7 (first, middle, last group) see it at -1000
    # and nothing else: their logits are far below the others, so no token picks them.
    hidden[:, 0] = 4
    dead = [0, 3, 7]
    router[dead] = 0
    router[dead, 0] = -1000
    idx = _check(hidden, router, w13, w2)
    assert not torch.isin(idx, torch.tensor(dead, dtype=idx.dtype)).any()


def test_no_rows():
    hidden, router, w13, w2 = _draw(0)
    out = torch_moe(hidden, router, w13, w2, K)
    assert out.shape == (0, H)
    assert out.dtype == torch.bfloat16


def test_no_host_reads():
    # Meta tensors hold no values: a .item(), .tolist(), torch.bincount or data-dependent shape raises.
    # Running there shows the function can be captured in a CUDA graph as the bench does.
    def meta(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")

    out = torch_moe(meta(37, H), meta(E, H), meta(E, 2 * INTER, H), meta(E, H, INTER), K)
    assert out.shape == (37, H)
    assert out.dtype == torch.bfloat16


def test_the_routed_peer_is_the_peer_after_its_routing():
    """bench_vs_megamoe times torch on the batch the layer's run() takes: the same work as torch_moe, less routing."""
    hidden, router, w13, w2 = _draw(29, seed=3)
    idx, weights = route(hidden, router, K)
    assert torch.equal(torch_moe_routed(hidden, idx, weights, w13, w2), torch_moe(hidden, router, w13, w2, K))
