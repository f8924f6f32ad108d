"""The decode path of the FP8 expert work (chunkring.moe._engine.decode, device/kernels/moe_decode.cu) on the GPU:

* on one plan, its expert outputs match the fp32 reference of the recipe within the tolerance the DeepGEMM
  path is held to (tests/gpu/test_moe_experts.py: 1e-2 relative), and match the DeepGEMM path's outputs
  within it, at 1, 8, 32 and 128 tokens, hidden 4096 and 7168 - with experts that have no rows (never
  routed to) and experts with more rows than one pass (DECODE_PASS_ROWS);
* a row's output does not depend on its place in the plan (the plan places rows by atomic cursor), and
  two runs are bitwise equal;
* through the layer (``MoELayer(..., decode=True)``, whose decode path is the persistent consumer as a layer runs
  it, LAYER_VARIANT): streamed equals batch-ready bit for bit and both match the layer's fp32 reference; CUDA-graph
  replays equal eager calls bit for bit; with ``decode="auto"`` each call takes the engine its size does
  (decode_fits), either way matching the reference.

Records: tests/gpu_results/*-decode-1rank.json."""

import functools

import pytest
import torch

from chunkring import MoEConfig, MoELayer
from chunkring.jit import library_for
from chunkring.moe._engine import resources
from chunkring.moe._engine.decode import DECODE_PASS_ROWS, DecodeGemm, decode_fits
from chunkring.moe._engine.experts import ExpertCompute
from chunkring.moe._engine.persistent import PersistentGemm
from tests.gpu.graph_helpers import MAX_TOKENS, SLOTS, Batch, check_replay, strict_capture
from tests.gpu.graph_helpers import TOPK as GRAPH_TOPK
from tests.gpu.graph_helpers import C as GRAPH_C
from tests.gpu.moe_helpers import H as LAYER_H
from tests.gpu.moe_helpers import case_inputs, layer_reference, local_weights, rel_error, tolerance, weights
from tests.gpu.plan_helpers import ACTIVE, E_LOCAL, INTER, TOPK, expert_weights_fp8, reference, staged

pytestmark = pytest.mark.gpu

TOLERANCE = 1e-2  # test_moe_experts.py's bound for the DeepGEMM path against the same reference


def paths(runtime, cfg):
    """(the DeepGEMM path, the decode path) on one kernel library for the plan."""
    device, experts = runtime.torch_device, library_for(runtime, "moe_experts")
    decode = DecodeGemm(library_for(runtime, "moe_decode"), cfg, E_LOCAL)
    return (ExpertCompute(cfg, 1, 0, E_LOCAL, experts, device),
            ExpertCompute(cfg, 1, 0, E_LOCAL, experts, device, decode=decode))


@pytest.mark.parametrize("hidden", [4096, 7168])
@pytest.mark.parametrize("n", [1, 8, 32, 128])
def test_decode_outputs_match_the_reference_and_the_deepgemm_path(runtime, hidden, n):
    device = runtime.torch_device
    cfg = MoEConfig(num_experts=E_LOCAL, hidden=hidden, intermediate=INTER, topk=TOPK, max_tokens_per_rank=n)
    deep, decode = paths(runtime, cfg)
    stage, x_in = staged(n, hidden, device, seed=n + hidden)
    q13, q2 = expert_weights_fp8(hidden, device, seed=hidden)
    plan = deep.plan(stage)
    out_deep = deep.experts(plan, q13, q2)
    out_decode = decode.experts(plan, q13, q2)
    torch.cuda.synchronize()
    counts = plan.counts.tolist()
    assert counts[ACTIVE:] == [0] * (E_LOCAL - ACTIVE), "the idle experts must have no rows"
    if n >= 128:  # a mean of n * TOPK / ACTIVE rows per expert: 85 at 128 tokens
        assert max(counts) > DECODE_PASS_ROWS, "an expert must take more than one pass"
    real, ref, _ = reference(plan, x_in, q13, q2)
    got = out_decode[real].float()
    err_decode, err_deep = rel_error(got, ref), rel_error(out_deep[real].float(), ref)
    between = rel_error(got, out_deep[real].float())
    print(f"hidden {hidden}, {n} tokens: decode {err_decode:.2e}, DeepGEMM {err_deep:.2e}, between {between:.2e}")
    assert err_decode <= TOLERANCE and err_deep <= TOLERANCE and between <= TOLERANCE


def test_a_rows_output_does_not_depend_on_its_place_and_repeats_bitwise(runtime):
    device, hidden, n = runtime.torch_device, 4096, 40
    cfg = MoEConfig(num_experts=E_LOCAL, hidden=hidden, intermediate=INTER, topk=TOPK, max_tokens_per_rank=n)
    _, decode = paths(runtime, cfg)
    stage, _ = staged(n, hidden, device, seed=11)
    q13, q2 = expert_weights_fp8(hidden, device, seed=12)
    by_choice = []
    for _ in range(3):
        plan = decode.plan(stage)
        out = decode.experts(plan, q13, q2).clone()
        real = torch.nonzero(plan.src >= 0).flatten()
        assert torch.equal(decode.experts(plan, q13, q2)[real], out[real]), "a rerun on the same plan differs"
        order = (plan.token[real] * TOPK + plan.k[real]).argsort()
        by_choice.append(out[real[order]])
    assert by_choice[0].shape[0] == n * TOPK
    assert all(torch.equal(other, by_choice[0]) for other in by_choice[1:])


def layer_config(world):
    return MoEConfig(num_experts=2 * world, hidden=LAYER_H, intermediate=128, topk=GRAPH_TOPK,
                     max_tokens_per_rank=MAX_TOKENS, stream_slots=SLOTS, stream_slot_tokens=GRAPH_C)


def check_both_modes(layer, cfg, w13, w2, n, seed, after_call=lambda streaming: None):
    """``layer.run`` of ``n`` tokens batch-ready, then streamed (``after_call(streaming)`` after each): equal bit for
    bit, and matching the layer's fp32 reference."""
    runtime = layer.runtime
    experts = local_weights(layer, w13, w2)
    x_in, idx, w, args = case_inputs("fp8", n, cfg.num_experts, cfg.topk, "uniform", seed + runtime.rank,
                                     runtime.torch_device)
    outs = {}
    for streaming in (False, True):
        outs[streaming] = layer.run(*args, *experts, streaming=streaming).clone()
        torch.cuda.synchronize()
        layer.check()
        after_call(streaming)
    assert torch.equal(outs[True], outs[False])
    err = rel_error(outs[False], layer_reference(layer, x_in, idx, w, w13, w2))
    assert err <= tolerance(layer), f"{n} tokens: relative error {err:.2e}"


@pytest.mark.parametrize("n", [0, 1, 37])
def test_layer_on_the_decode_path_streamed_equals_batch_ready(runtime, n):
    cfg = layer_config(runtime.world_size)
    layer = MoELayer(runtime, cfg, timeout_s=60, decode=True)
    try:
        check_both_modes(layer, cfg, *weights(cfg.num_experts, torch.Generator().manual_seed(21)), n, 100)
    finally:
        layer.close()


def test_auto_runs_each_call_on_the_engine_its_size_takes(runtime, monkeypatch):
    """decode="auto": a call within decode_fits' bound runs its expert GEMMs on the decode path, a larger one on
    DeepGEMM's; each matches the reference, and streamed equals batch-ready at each size. The default bound
    (DECODE_MAX_ROWS) follows the newest measurement and may send every call to DeepGEMM's, so the choice runs
    with a bound of 8 rows per expert: its first value, which puts the crossover inside this layer's capacity."""
    monkeypatch.setattr(resources, "decode_fits", functools.partial(decode_fits, max_rows=8))
    cfg = layer_config(runtime.world_size)
    # Every call launched (no replays), so that each one's engine shows in the decode path's calls.
    layer = MoELayer(runtime, cfg, timeout_s=60, decode="auto", eager_graphs=False)
    assert isinstance(layer.resources.compute.decode, PersistentGemm)
    calls = []
    original = PersistentGemm.__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(PersistentGemm, "__call__", counted)
    try:
        sizes = [n for n in range(1, MAX_TOKENS + 1) if layer.resources.decode_for(n)]
        assert sizes and sizes[-1] < MAX_TOKENS, "the config must put the bound inside the layer's capacity"
        w13, w2 = weights(cfg.num_experts, torch.Generator().manual_seed(31))
        for n in (sizes[-1], sizes[-1] + 1):
            def engine_taken(streaming, n=n):
                assert bool(calls) == (n in sizes), f"{n} tokens, streaming={streaming}: decode path {bool(calls)}"
                calls.clear()

            calls.clear()
            check_both_modes(layer, cfg, w13, w2, n, 200, after_call=engine_taken)
    finally:
        layer.close()


@pytest.mark.parametrize("streaming", [True, False], ids=["streamed", "batch_ready"])
def test_graph_replays_on_the_decode_path_match_eager_calls(runtime, streaming):
    cfg = layer_config(runtime.world_size)
    layer = MoELayer(runtime, cfg, timeout_s=60, decode=True)
    try:
        w13, w2 = weights(cfg.num_experts, torch.Generator().manual_seed(5))
        experts = local_weights(layer, w13, w2)
        batch = Batch(runtime, cfg)
        out = torch.zeros(MAX_TOKENS, LAYER_H, dtype=torch.bfloat16, device=runtime.torch_device)

        def call():
            return layer.run(*batch.args(), *experts, streaming=streaming, out=out, num_tokens=batch.count)

        call()
        torch.cuda.synchronize()
        graph, _ = strict_capture(call)
        for step in range(30):
            check_replay(layer, batch, experts, graph, out, step, streaming=streaming,
                         reference=(w13, w2) if step % 10 == 0 else None)
    finally:
        layer.close()
