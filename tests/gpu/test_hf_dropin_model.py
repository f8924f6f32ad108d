"""The drop-in MoE block in a whole transformers model on the GPU: a tiny random Qwen3-MoE and DeepSeek-V3
(chunkring.testing.hf_models) with every sparse MoE block replaced by chunkring's
(:func:`replace_moe_blocks`), bf16 and FP8 payloads, batch-ready and streamed, on 1 rank or under
mpirun on 2 / 4 / 8 (the 8 experts split evenly; each rank loads its share from the model through
load_experts). Every rank builds the same model (same seed) and its own input ids (seeded by rank, so
tokens really cross ranks), and checks its own outputs - no communication for the references.

Two checks per case:

* each chunkring block's output against chunkring's fp32 reference of the same math on the same input
  (:func:`moe_reference` with the block's routing, every expert's weights as the payload's GEMMs see
  them, the FP8 recipe; plus the shared experts), within :func:`reference_tolerance` (1e-2 bf16, 4e-2
  FP8; reference.py says why);
* the model's logits against the original transformers model's. bf16 payload: the original model as is;
  FP8 payload: the original model on what the FP8 payload carries - its experts' weights block-quantised
  to FP8 and dequantised, its experts' input quantised per 1x128 and dequantised (each rounded back to
  bf16, 2^-9, negligible here). Routing: the first MoE layer sees bitwise the same hidden states in both
  models (same modules, same device), so its choices must be identical; a later layer's input differs by
  the rounding, so a token whose scores sit within that of a tie may choose differently there (a flip,
  O(1) for that token). The last MoE layer is the only later one in these models, and its output reaches
  only its own token's logits (no attention after it), so flipped tokens - at most 1/8 of them - are left
  out and the rest compared. Tolerance (relative Frobenius norm over those logits): bf16 2e-2, FP8 6e-2.
  Why: a CPU emulation of the layer's roundings (bf16 GEMM outputs, bf16 or e4m3-per-1x128 activation,
  bf16 combine rows, fp32 reduction) in these models measured 0.5-0.6 % (bf16) and 0.8-2.4 % (FP8; the
  activation's e4m3 rounding, which the original model does not make, dominates, most in DeepSeek-V3 whose
  routed_scaling_factor 2.5 weighs the experts up) over 4 inputs, 0-2 flipped tokens of 48; the GPU's
  accumulation order adds to that what reference_tolerance allows per block, diluted in the logits by the
  residual stream. A wrong expert, a lost row or a swapped gate/up moves the logits by 10 % or more (a
  swapped gate/up: 37 % per block on the CPU).

And the drop-in as a serving loop builds it for eager decode (``decode="auto"``, ``eager_graphs=True``) against the
same drop-in launching every call: equal logits bit for bit while its calls replay.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from chunkring.integrations.transformers import (  # noqa: E402
    ChunkringMoEBlock,
    chunkring_blocks,
    find_moe_blocks,
    replace_moe_blocks,
    route,
)
from chunkring.moe.weights import quantize_weight_fp8  # noqa: E402
from chunkring.testing.hf_models import ARCHITECTURES, tiny_model  # noqa: E402
from chunkring.testing.reference import (  # noqa: E402
    dequantize_fp8_per128,
    layer_weights_reference,
    moe_reference,
    quantize_fp8_per128,
    reference_tolerance,
)

pytestmark = pytest.mark.gpu

TOKENS = (2, 24)  # 48 rows per rank and call
MAX_TOKENS = 64
LOGITS_TOLERANCE = {"bf16": 2e-2, "fp8": 6e-2}
MAX_FLIPPED = 1 / 8


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not bool(torch.isnan(out).any()), "NaN in the output"
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def fp8_reference_model(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose experts compute on what the FP8 payload carries: weights block-quantised
    (128x128) and dequantised, inputs quantised per 1x128 and dequantised (both back in the model's bf16)."""
    ref = copy.deepcopy(model)
    for block in find_moe_blocks(ref):
        experts = block.module.experts
        with torch.no_grad():
            for weight in (experts.gate_up_proj, experts.down_proj):
                weight.copy_(quantize_weight_fp8(weight.float()).dequantize().to(weight.dtype))

        def carried(module, args):
            x = args[0]
            return (dequantize_fp8_per128(*quantize_fp8_per128(x.float())).to(x.dtype), *args[1:])

        experts.register_forward_pre_hook(carried)
    return ref


def record_routing(model: torch.nn.Module, seen: list[torch.Tensor]) -> list:
    """Hooks on every MoE router appending its choices (sorted per token) to ``seen`` in call order."""
    return [module.register_forward_hook(lambda m, args, out: seen.append(out[2].sort(-1).values.cpu()))
            for name, module in model.named_modules() if name.endswith("mlp.gate")]


@pytest.fixture(scope="module", params=[(a, p) for a in ARCHITECTURES for p in ("bf16", "fp8")],
                ids=lambda c: "-".join(c))
def dropin(runtime, request):
    """(arch, payload, chunkring model, reference model, original blocks by name), all on the device."""
    arch, payload = request.param
    device = runtime.torch_device
    original = tiny_model(arch, seed=11)  # on the CPU, bf16, the same on every rank
    model = copy.deepcopy(original)
    replaced = replace_moe_blocks(model, runtime, max_tokens_per_rank=MAX_TOKENS, payload=payload, streaming=True,
                                  timeout_s=60)
    assert list(replaced) == [b.name for b in find_moe_blocks(original)]
    reference = original if payload == "bf16" else fp8_reference_model(original)
    try:
        yield arch, payload, model.to(device), reference.to(device), {n: b.to(device) for n, b in replaced.items()}
    finally:
        for _, block in chunkring_blocks(model):
            block.layer.close()


@pytest.mark.parametrize("streaming", [False, True], ids=["batch_ready", "streamed"])
def test_logits_match_the_original_model(runtime, dropin, streaming):
    arch, payload, model, reference, replaced = dropin
    device, rank = runtime.torch_device, runtime.rank
    blocks = dict(chunkring_blocks(model))
    assert list(blocks) == list(replaced) and all(isinstance(b, ChunkringMoEBlock) for b in blocks.values())
    for block in blocks.values():
        block.streaming = streaming
        assert block.layer.experts_per_rank == 8 // runtime.world_size
    ids = torch.randint(0, 128, TOKENS, generator=torch.Generator().manual_seed(100 + rank)).to(device)

    # Each block's input and output in the chunkring model.
    io: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [b.register_forward_hook(lambda m, args, out, n=n: io.__setitem__(n, (args[0], out)))
             for n, b in blocks.items()]
    routes_chunkring: list[torch.Tensor] = []
    routes_original: list[torch.Tensor] = []
    hooks += record_routing(model, routes_chunkring) + record_routing(reference, routes_original)
    with torch.no_grad():
        logits = model(ids).logits.float()
        want = reference(ids).logits.float()
    for h in hooks:
        h.remove()

    # Per block: the chunkring layer against chunkring's fp32 reference of the same math.
    for name, (x, out) in io.items():
        original = replaced[name]
        rows = x.reshape(-1, x.shape[-1])
        idx, w = route(original, rows)
        w13, w2 = layer_weights_reference(original.experts.gate_up_proj.detach().cpu(),
                                          original.experts.down_proj.detach().cpu(), blocks[name].layer.config.payload)
        x_in = dequantize_fp8_per128(*quantize_fp8_per128(rows.float())) if payload == "fp8" else rows.float()
        ref = moe_reference(x_in, idx, w, w13.to(device), w2.to(device), fp8_recipe=payload == "fp8")
        if getattr(original, "shared_experts", None) is not None:
            with torch.no_grad():
                ref = ref + original.shared_experts(x).reshape(-1, x.shape[-1]).float()
        err = rel(out.reshape(-1, x.shape[-1]), ref)
        assert err < reference_tolerance(blocks[name].layer.config.payload), (name, err)

    # The whole model against the original.
    n_moe = len(blocks)
    assert len(routes_chunkring) == len(routes_original) == n_moe
    assert torch.equal(routes_chunkring[0], routes_original[0]), "the first MoE layer's routing differs"
    flipped = (routes_chunkring[-1] != routes_original[-1]).any(-1).reshape(TOKENS).to(device)
    assert int(flipped.sum()) <= MAX_FLIPPED * flipped.numel(), f"{int(flipped.sum())} tokens routed differently"
    err = rel(logits[~flipped], want[~flipped])
    print(f"rank {rank}: {arch} {payload} {'streamed' if streaming else 'batch-ready'}: logits {err:.2e} "
          f"({int(flipped.sum())} flipped of {flipped.numel()})")
    assert err < LOGITS_TOLERANCE[payload], err


@pytest.mark.parametrize("streaming", [False, True], ids=["batch_ready", "streamed"])
def test_a_replaying_dropin_gives_the_launching_ones_logits_bit_for_bit(runtime, streaming):
    """The drop-in built for eager decode - the decode path where a call is small, eager calls replayed from each
    layer's own graphs (``replace_moe_blocks(decode="auto", eager_graphs=True)``) - against the same drop-in launching
    every call: the same logits bit for bit, step after step, sizes repeating so that later calls replay."""
    device = runtime.torch_device
    original = tiny_model("qwen3_moe", seed=11)
    models: dict[bool, torch.nn.Module] = {}
    try:
        for replaying in (False, True):
            model = copy.deepcopy(original)
            replace_moe_blocks(model, runtime, max_tokens_per_rank=MAX_TOKENS, payload="fp8", streaming=streaming,
                               timeout_s=60, decode="auto", eager_graphs=replaying)
            models[replaying] = model.to(device)
        gen = torch.Generator().manual_seed(200 + runtime.rank)
        with torch.no_grad():
            for shape in ((1, 1), (2, 3), (1, 1), (4, 1), (2, 3), (1, 1)):  # 1, 6, 1, 4, 6, 1 tokens
                ids = torch.randint(0, 128, shape, generator=gen).to(device)
                launched, replayed = (models[replaying](ids).logits for replaying in (False, True))
                assert torch.equal(launched, replayed), shape
        graphs = {replaying: [block.layer.stats()["call_graphs"] for _, block in chunkring_blocks(model)]
                  for replaying, model in models.items()}
        assert all(n == 0 for n in graphs[False]) and all(n > 0 for n in graphs[True]), graphs
        for model in models.values():
            for _, block in chunkring_blocks(model):
                block.layer.check()
    finally:
        for model in models.values():
            for _, block in chunkring_blocks(model):
                block.layer.close()
