"""The MoE layer's operators (chunkring.moe.op) in compiled models on the GPU: ``torch.compile(fullgraph=True)``
of a two-layer model around :class:`MoEModule` (an FP8 layer, then a bf16 one, with elementwise work
and a residual around them), captured into a CUDA graph under the layer's capture rules
(test_moe_graph.py: one call before the capture, no host synchronisation inside it, the real token
count in a device int32 rewritten before each replay) and replayed with fresh inputs - each replay
bitwise equal to the same model computed with the layer's methods, no operator involved, batch-ready
and streamed, with the ``aot_eager`` and ``inductor`` backends. Also: a rank with zero tokens (a shape
torch.compile specialises) still runs both calls, so its peers' calls complete; ``moe_run`` compiled
and replayed against :meth:`MoELayer.run`; ``torch.library.opcheck`` on the real implementation (no
argument written, the fake implementation's output matching the real one's metadata).

Every rank runs every test (``mpirun ... pytest --with-mpi tests/gpu``, as the other GPU tests); every
rank derives its inputs from (step, rank) seeds. The model's elementwise ops round alike in any fusion
(:class:`TwoLayers`), so Inductor's code matches eager bit for bit.

The CPU half (tests/unit/test_custom_op.py) pins the schema, the effect, the fake implementation and
the tracing of this same model on meta tensors.
"""

import pytest
import torch

from chunkring import MoEConfig, MoELayer, MoEModule, PayloadFormat
from chunkring.moe.op import moe_run
from tests.gpu.graph_helpers import Batch, check_replay, strict_capture
from tests.gpu.graph_helpers import make_layer as make_graph_layer
from tests.gpu.moe_helpers import INTER, H
from tests.helpers.compiled_model import TwoLayers

pytestmark = pytest.mark.gpu

C, SLOTS, MAX_TOKENS, TOPK = 16, 2, 72, 2
REPLAYS = 40
#: The watchdog limit: ranks compile before their first call, each at its own pace; a rank spinning in a
#: call waits for its peers' compilations too.
TIMEOUT_S = 120


def by_methods(model, hidden, streaming, num_tokens):
    """:meth:`TwoLayers.forward` with every MoE call made by :meth:`MoELayer.forward` (no operator)."""
    def call(module, x):
        return module.layer.forward(x, module.router_weight, module.w13, module.w2, streaming=streaming,
                                    num_tokens=num_tokens)

    return hidden + call(model.second, call(model.first, hidden * 2))


def make_model(runtime):
    W = runtime.world_size
    layers = []
    for payload in (PayloadFormat.FP8_E4M3, PayloadFormat.BF16):
        cfg = MoEConfig(num_experts=2 * W, hidden=H, intermediate=INTER, topk=TOPK, max_tokens_per_rank=MAX_TOKENS,
                        payload=payload, stream_slots=SLOTS, stream_slot_tokens=C)
        layers.append(MoELayer(runtime, cfg, timeout_s=TIMEOUT_S))
    model = TwoLayers(*(MoEModule(layer, generator=torch.Generator().manual_seed(i + 1))
                        for i, layer in enumerate(layers)))
    return model, layers


def check(layers):
    torch.cuda.synchronize()
    for layer in layers:
        layer.check()


def backend_or_skip(backend):
    if backend == "inductor":
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            pytest.skip("the inductor backend needs Triton, which this torch install lacks")
    return backend


def compiled_capture(compiled, *args, **kwargs):
    """A compiled call captured into a CUDA graph: no host synchronisation and no recompilation inside it;
    (graph, the captured output)."""
    def call():
        with torch.compiler.set_stance("fail_on_recompile"):
            return compiled(*args, **kwargs)

    return strict_capture(call)


class Hidden:
    """The captured call's inputs, written in place before each replay."""

    def __init__(self, runtime):
        device = runtime.torch_device
        self.x = torch.zeros(MAX_TOKENS, H, dtype=torch.bfloat16, device=device)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)
        self.rank = runtime.rank

    def fill(self, step):
        gen = torch.Generator().manual_seed(1_000_003 * step + self.rank)
        n = 0 if (step + self.rank) % 7 == 0 else int(torch.randint(1, MAX_TOKENS + 1, (1,), generator=gen))
        self.x.copy_(torch.randn(MAX_TOKENS, H, generator=gen).to(torch.bfloat16))
        self.count.fill_(n)
        return n


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("streaming", [True, False], ids=["streamed", "batch_ready"])
def test_compiled_model_captures_and_replays_bitwise_like_eager(runtime, streaming, backend):
    backend = backend_or_skip(backend)
    torch.compiler.reset()
    model, layers = make_model(runtime)
    try:
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        inputs = Hidden(runtime)
        inputs.fill(0)
        # The layer's eager call before a capture (its GEMM kernels loaded), and the compilation.
        first = compiled(inputs.x, streaming=streaming, num_tokens=inputs.count)
        check(layers)
        assert torch.equal(first, by_methods(model, inputs.x, streaming, inputs.count))
        check(layers)

        graph, out = compiled_capture(compiled, inputs.x, streaming=streaming, num_tokens=inputs.count)

        for step in range(1, REPLAYS + 1):
            n = inputs.fill(step)
            graph.replay()
            replayed = out.clone()
            eager = by_methods(model, inputs.x, streaming, inputs.count)
            check(layers)
            assert torch.equal(replayed, eager), f"replay {step} (n={n}) differs from the eager calls"
            if step % 10 == 0:  # and the compiled model outside the graph, interleaved on the same rings
                with torch.compiler.set_stance("fail_on_recompile"):
                    again = compiled(inputs.x, streaming=streaming, num_tokens=inputs.count)
                check(layers)
                assert torch.equal(again, eager), f"compiled call at step {step} differs from the eager calls"
    finally:
        torch.compiler.reset()
        for layer in layers:
            layer.close()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_rank_with_zero_tokens_still_runs_both_calls(runtime, backend, monkeypatch):
    """torch.compile specialises a zero-row batch, and Inductor drops an op with an empty output unless it
    carries an effect: the rank would skip the collective and its peers' calls would time out."""
    backend = backend_or_skip(backend)
    torch.compiler.reset()
    model, layers = make_model(runtime)
    try:
        calls = []
        for i, layer in enumerate(layers):
            method = layer.forward

            def counted(*args, _method=method, _i=i, **kwargs):
                calls.append(_i)
                return _method(*args, **kwargs)

            monkeypatch.setattr(layer, "forward", counted)  # what the operator's implementation calls
        compiled = torch.compile(model, fullgraph=True, backend=backend)
        last = runtime.rank == runtime.world_size - 1
        n = 0 if last else 13
        gen = torch.Generator().manual_seed(77 + runtime.rank)
        hidden = torch.randn(n, H, generator=gen).to(torch.bfloat16).to(runtime.torch_device)
        for streaming in (False, True):
            calls.clear()
            out = compiled(hidden, streaming=streaming)
            check(layers)
            assert calls == [0, 1], f"streaming={streaming}: the layers' calls made: {calls}"
            assert out.shape == (n, H)
            assert torch.equal(out, by_methods(model, hidden, streaming, None))
    finally:
        torch.compiler.reset()
        for layer in layers:
            layer.close()


@pytest.mark.parametrize("streaming", [True, False], ids=["streamed", "batch_ready"])
def test_compiled_moe_run_captures_and_replays_like_run(runtime, streaming):
    torch.compiler.reset()
    layer, experts, _ = make_graph_layer(runtime)
    try:
        batch = Batch(runtime, layer.config)

        def call(x, sf, idx, w, count):
            return moe_run(layer, x, sf, idx, w, *experts, streaming=streaming, num_tokens=count)

        compiled = torch.compile(call, fullgraph=True, backend=backend_or_skip("inductor"))
        batch.fill(0)
        compiled(*batch.args(), batch.count)
        check([layer])
        graph, out = compiled_capture(compiled, *batch.args(), batch.count)
        for step in range(1, 21):
            check_replay(layer, batch, experts, graph, out, step, streaming=streaming)
    finally:
        torch.compiler.reset()
        layer.close()


def test_opcheck_of_the_real_implementation(runtime):
    """torch.library.opcheck runs the operator several times (the same sequence on every rank): its
    fake-tensor check compares the fake implementation's output with the real one's, and it traces the op
    through AOTAutograd with dynamic shapes. Its schema check compares arguments with ``allclose``, which torch
    does not implement for float8, so the schema's promise (no argument written) is checked here, bitwise."""
    model, layers = make_model(runtime)
    try:
        module = model.first
        gen = torch.Generator().manual_seed(5 + runtime.rank)
        hidden = torch.randn(21, H, generator=gen).to(torch.bfloat16).to(runtime.torch_device)
        count = torch.full((1,), 17, dtype=torch.int32, device=runtime.torch_device)
        args = (module.layer.handle, hidden, module.router_weight, module.w13.data, module.w13.scale, module.w2.data,
                module.w2.scale, True, count)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]

        def raw(t: torch.Tensor) -> torch.Tensor:
            return t.contiguous().view(-1).view(torch.uint8).clone()

        before = [raw(t) for t in tensors]
        result = torch.library.opcheck(torch.ops.chunkring.moe_forward.default, args,
                                       test_utils=("test_autograd_registration", "test_faketensor",
                                                   "test_aot_dispatch_dynamic"))
        check(layers)
        assert all(v == "SUCCESS" for v in result.values()), result
        written = [i for i, (t, b) in enumerate(zip(tensors, before, strict=True)) if not torch.equal(raw(t), b)]
        assert not written, f"moe_forward wrote its tensor arguments {written}, which its schema declares read-only"
    finally:
        for layer in layers:
            layer.close()
