"""The MoE layer's calls as PyTorch operators (chunkring.moe.op), on the CPU, with the real registrations:

* ``chunkring::moe_forward`` / ``chunkring::moe_run`` exist with the declared schemas: only tensors and
  scalars, no argument written (functional), one new bfloat16 tensor returned, ``streaming`` a bool;
* they carry an ordered effect, so torch.compile keeps every call in program order - also a call whose
  output is unused (FX dead-code elimination) and one with zero rows (Inductor drops an op whose output
  has no elements): the compiled code below reaches the real implementation in both cases, shown by its
  unknown-handle error; a negative control (the same op without the effect) shows both drops happen;
* the fake implementation gives bfloat16 [n, H] on the input's device from shapes alone: it runs under
  FakeTensorMode (where reading a value raises) and on meta tensors, with a handle no layer has;
* ``torch.compile(fullgraph=True)`` traces :class:`MoEModule`'s real ``forward`` (through
  :func:`moe_forward`: Fp8Weight split into its tensors, ``"auto"`` resolved to a constant bool, the
  layer's handle read) into one graph holding exactly one ``chunkring.moe_forward`` call, and
  AOTAutograd threads its effect token; run on meta tensors, so the fake implementation answers;
* a handle of no live layer (never made, or garbage-collected) is a ``ChunkringUsageError``;
* the GPU test's model (its elementwise ops around two opaque bf16 calls) compiles with Inductor to the
  same bits as eager - the premise of that test's bitwise comparison.

What only tests/gpu/test_custom_op_gpu.py shows: the real implementation on a real layer (the handle
look-up, the layer's argument checks, the call), Inductor's code around it on CUDA, a compiled model
captured into a CUDA graph and replayed, outputs bitwise equal to eager calls, and several ranks (a
rank with zero tokens still joins the collective).

The MoEModule here is built around a MoELayer object that was never constructed (no GPU, no buffers,
not in the registry): it carries only the config, calibration and handle its forward reads while
tracing, and the real implementation never runs on it - meta tensors dispatch to the fake one.
"""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import chunkring  # noqa: F401  (registers the operators)
from chunkring import ChunkringUsageError, MoEConfig, MoEModule, PayloadFormat
from chunkring.moe._engine import handles
from chunkring.moe.auto import StreamingCalibration
from chunkring.moe.op import MOE_FORWARD_SCHEMA, MOE_RUN_SCHEMA, layer_for_handle, moe_forward
from chunkring.moe.weights import Fp8Weight
from tests.helpers.compiled_model import TwoLayers  # the GPU test's model, traced here on meta tensors

H, INTER, E, K = 256, 128, 4, 2
UNKNOWN = 2**62  # no layer ever gets this handle: they count up from 1


# torch notes that force_disable_caches (fresh_dynamo, below) turns off its profile-guided recompiles, once per
# compile after a reset; torch's own TODO makes it a log line, not a warning (torch/_dynamo/pgo.py).
pytestmark = pytest.mark.filterwarnings(
    "ignore:dynamo_pgo force disabled by torch.compiler.config.force_disable_caches:UserWarning")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles afresh: no Dynamo cache, and no compiled artifact from an earlier run (a cached
    AOTAutograd graph does not see an effect registered since)."""
    torch.compiler.reset()
    with torch.compiler.config.patch(force_disable_caches=True):
        yield
    torch.compiler.reset()


def config(payload=PayloadFormat.FP8_E4M3, streaming=True):
    ring = dict(stream_slots=2, stream_slot_tokens=16) if streaming else {}
    return MoEConfig(num_experts=E, hidden=H, intermediate=INTER, topk=K, max_tokens_per_rank=64, payload=payload,
                     **ring)


def forward_args(device, n=5, fp8=True, handle=UNKNOWN, streaming=False):
    """chunkring::moe_forward's arguments (uninitialised tensors of the right shapes)."""
    def t(*shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype, device=device)

    wdt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    return (handle, t(n, H, dtype=torch.bfloat16), t(E, H, dtype=torch.bfloat16), t(E, 2 * INTER, H, dtype=wdt),
            t(E, 2, 2) if fp8 else None, t(E, H, INTER, dtype=wdt), t(E, 2, 1) if fp8 else None, streaming, None)


def run_args(device, n=5, handle=UNKNOWN):
    """chunkring::moe_run's arguments, FP8 payload."""
    def t(*shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype, device=device)

    return (handle, t(n, H, dtype=torch.float8_e4m3fn), t(n, H // 128), t(n, K, dtype=torch.int32), t(n, K),
            t(E, 2 * INTER, H, dtype=torch.float8_e4m3fn), t(E, 2, 2), t(E, H, INTER, dtype=torch.float8_e4m3fn),
            t(E, 2, 1), False, None)


# ------------------------------------------------------------------ registration


@pytest.mark.parametrize("name, schema", [("moe_forward", MOE_FORWARD_SCHEMA), ("moe_run", MOE_RUN_SCHEMA)])
def test_registered_with_the_declared_schema(name, schema):
    op = getattr(torch.ops.chunkring, name).default
    assert str(op._schema) == f"chunkring::{name}{schema}"
    assert not op._schema.is_mutable, "no argument may be declared written"
    assert all(a.alias_info is None for a in (*op._schema.arguments, *op._schema.returns))
    assert [str(r.type) for r in op._schema.returns] == ["Tensor"]
    types = {a.name: str(a.type) for a in op._schema.arguments}
    assert (types["handle"], types["streaming"]) == ("int", "bool")
    assert set(types.values()) <= {"int", "bool", "Tensor", "Optional[Tensor]"}


@pytest.mark.parametrize("name", ["moe_forward", "moe_run"])
def test_ops_carry_an_ordered_effect(name):
    from torch._higher_order_ops.effects import _EffectType, _get_effect

    assert _get_effect(getattr(torch.ops.chunkring, name).default) == _EffectType.ORDERED


# ------------------------------------------------------------------ fake implementation


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("n", [0, 1, 37])
def test_fake_forward_gives_the_output_from_shapes_alone(n, fp8):
    # FakeTensorMode raises on any read of a value (.item(), a host copy); the handle names no layer.
    with FakeTensorMode():
        out = torch.ops.chunkring.moe_forward(*forward_args("cpu", n, fp8))
    assert (tuple(out.shape), out.dtype, out.device) == ((n, H), torch.bfloat16, torch.device("cpu"))
    out = torch.ops.chunkring.moe_forward(*forward_args("meta", n, fp8))
    assert (tuple(out.shape), out.dtype, out.device.type) == ((n, H), torch.bfloat16, "meta")


def test_fake_run_gives_the_output_from_shapes_alone():
    with FakeTensorMode():
        out = torch.ops.chunkring.moe_run(*run_args("cpu", 9))
    assert (tuple(out.shape), out.dtype) == ((9, H), torch.bfloat16)
    out = torch.ops.chunkring.moe_run(*run_args("meta", 0))
    assert (tuple(out.shape), out.dtype, out.device.type) == ((0, H), torch.bfloat16, "meta")


def test_fake_refuses_a_batch_that_is_not_2d():
    args = list(forward_args("meta"))
    args[1] = torch.empty(5, H, 1, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ChunkringUsageError) as info:
        torch.ops.chunkring.moe_forward(*args)
    assert info.value.field == "hidden"


# ------------------------------------------------------------------ handles


def test_unknown_handle_is_a_usage_error():
    for call, args in ((torch.ops.chunkring.moe_forward, forward_args("cpu")),
                       (torch.ops.chunkring.moe_run, run_args("cpu"))):
        with pytest.raises(ChunkringUsageError, match=f"no MoELayer has handle {UNKNOWN}") as info:
            call(*args)
        assert info.value.field == "handle"


def test_the_registry_holds_layers_weakly_and_never_reuses_a_handle():
    class Stand:  # any object: the registry only stores and returns it
        pass

    layer = Stand()
    handle = handles.register(layer)
    assert layer_for_handle(handle) is layer
    other = handles.register(Stand())  # collected at once
    assert other > handle
    del layer
    gc.collect()
    for gone in (handle, other):
        with pytest.raises(ChunkringUsageError, match="garbage-collected"):
            layer_for_handle(gone)


# ------------------------------------------------------------------ torch.compile


def unconstructed_layer(cfg, calibration=None):
    """What tracing reads of a MoELayer (see the module docstring): its config, calibration and handle - a
    handle in no registry."""
    return SimpleNamespace(config=cfg, streaming_calibration=calibration, handle=UNKNOWN)


def meta_module(cfg, calibration=None):
    """MoEModule with meta weights around :func:`unconstructed_layer`."""
    module = object.__new__(MoEModule)
    torch.nn.Module.__init__(module)
    module.layer = unconstructed_layer(cfg, calibration)
    module.register_buffer("router_weight", torch.empty(E, H, dtype=torch.bfloat16, device="meta"))
    if cfg.payload.has_scales:
        module.w13 = Fp8Weight(torch.empty(E, 2 * INTER, H, dtype=torch.float8_e4m3fn, device="meta"),
                               torch.empty(E, 2, 2, device="meta"))
        module.w2 = Fp8Weight(torch.empty(E, H, INTER, dtype=torch.float8_e4m3fn, device="meta"),
                              torch.empty(E, 2, 1, device="meta"))
    else:
        module.w13 = torch.empty(E, 2 * INTER, H, dtype=torch.bfloat16, device="meta")
        module.w2 = torch.empty(E, H, INTER, dtype=torch.bfloat16, device="meta")
    return module


class Recorder:
    """A torch.compile backend: keeps Dynamo's graph and AOTAutograd's forward graph, runs the latter."""

    def __init__(self):
        self.dynamo, self.aot = [], []

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        self.dynamo.append(gm)

        def forward(aot_gm, _inputs):
            self.aot.append(aot_gm)
            return aot_gm.forward

        return aot_autograd(fw_compiler=forward)(gm, example_inputs)


def op_calls(gm, op):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (op, op.default)]


@pytest.mark.parametrize("recalibrated", [0.5, 1.0, 2.5])
def test_a_new_calibration_recompiles_without_a_graph_break(recalibrated):
    """Calibrating again (or a second layer's calibration) gives other figures: the recompile must still trace
    "auto" to a constant mode, without comparing the figures (a recompile may make them symbolic)."""
    module = meta_module(config(PayloadFormat.BF16), StreamingCalibration({8: 1.0}, {8: {8: 2.0}}))
    backend = Recorder()
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    hidden = torch.empty(8, H, dtype=torch.bfloat16, device="meta")
    compiled(hidden, streaming="auto")
    module.layer.streaming_calibration = StreamingCalibration({8: 1.0}, {8: {8: recalibrated}}, tolerance=0.03)
    compiled(hidden, streaming="auto")
    modes = [op_calls(graph, torch.ops.chunkring.moe_forward)[0].args[-2] for graph in backend.dynamo]
    assert modes[0] is False and modes[-1] is (recalibrated <= 1.03)


@pytest.mark.parametrize("payload", [PayloadFormat.FP8_E4M3, PayloadFormat.BF16])
@pytest.mark.parametrize("streaming", [False, True, "auto"])
def test_chunked_moe_compiles_to_one_op_without_a_graph_break(payload, streaming):
    calibration = StreamingCalibration({8: 1.0}, {8: {8: 0.5}}, tolerance=0.03)  # "auto" streams
    module = meta_module(config(payload), calibration)
    backend = Recorder()
    compiled = torch.compile(module, fullgraph=True, backend=backend)
    hidden = torch.empty(17, H, dtype=torch.bfloat16, device="meta")
    count = torch.empty(1, dtype=torch.int32, device="meta")
    out = compiled(hidden, streaming=streaming, num_tokens=count)
    assert (tuple(out.shape), out.dtype, out.device.type) == ((17, H), torch.bfloat16, "meta")
    (graph,) = backend.dynamo
    (call,) = op_calls(graph, torch.ops.chunkring.moe_forward)
    handle, *tensors, mode, num_tokens = call.args
    assert (handle, mode) == (UNKNOWN, streaming is not False)  # constants of the graph
    fp8 = payload.has_scales
    assert [t is None for t in tensors] == [False, False, False, not fp8, False, not fp8]
    assert num_tokens is not None
    (aot,) = backend.aot
    effects = [n for n in aot.graph.nodes if n.target is torch.ops.higher_order.with_effects]
    assert len(effects) == 1 and effects[0].args[1] is torch.ops.chunkring.moe_forward.default


def test_two_layer_model_compiles_to_one_graph_in_program_order():
    model = TwoLayers(meta_module(config()), meta_module(config(PayloadFormat.BF16)))
    explanation = torch._dynamo.explain(model)(torch.empty(8, H, dtype=torch.bfloat16, device="meta"), True)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    torch.compiler.reset()
    backend = Recorder()
    torch.compile(model, fullgraph=True, backend=backend)(torch.empty(8, H, dtype=torch.bfloat16, device="meta"))
    (aot,) = backend.aot
    effects = [n for n in aot.graph.nodes if n.target is torch.ops.higher_order.with_effects]
    assert len(effects) == 2
    # The second call's token is the first's: the calls stay in program order.
    first_token = next(u for u in effects[0].users if u.args[1] == 0)
    assert effects[1].args[0] is first_token


def test_moe_forward_refuses_a_bad_streaming_value_while_tracing():
    module = meta_module(config(streaming=False))
    hidden = torch.empty(3, H, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ChunkringUsageError) as info:
        moe_forward(module.layer, hidden, module.router_weight, module.w13, module.w2, streaming=True)
    assert info.value.field == "streaming"
    with pytest.raises(ChunkringUsageError, match="auto"):
        moe_forward(module.layer, hidden, module.router_weight, module.w13, module.w2, streaming="yes")


# Compiled code must reach the real implementation for every call: each case raises the handle's error
# from inside it. "unused": the output is dropped; "zero rows": the output has no elements.
def unused_output(hidden, *rest):
    torch.ops.chunkring.moe_forward(UNKNOWN, hidden, *rest)
    return hidden * 2


def zero_rows(hidden, *rest):
    return torch.ops.chunkring.moe_forward(UNKNOWN, hidden, *rest) + 1


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("fn, n", [(unused_output, 5), (zero_rows, 0)], ids=["unused", "zero_rows"])
def test_compiled_code_runs_every_call(backend, fn, n):
    _, *args = forward_args("cpu", n)
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    with pytest.raises(ChunkringUsageError, match=f"no MoELayer has handle {UNKNOWN}"):
        compiled(*args)


_control_calls: list[int] = []


@torch.library.custom_op("chunkring_test::no_effect", mutates_args=())
def _no_effect(x: torch.Tensor) -> torch.Tensor:
    _control_calls.append(x.shape[0])
    return x.clone()


@_no_effect.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.mark.parametrize("backend, n, use", [("aot_eager", 5, False), ("inductor", 5, False), ("inductor", 0, True)],
                         ids=["unused-aot_eager", "unused-inductor", "zero_rows-inductor"])
def test_negative_control_an_op_without_the_effect_is_dropped(backend, n, use):
    """Why the operators carry an effect: this torch drops these calls of a plain functional op. Should
    it stop doing so, this control fails - then the effect is no longer needed, though harmless."""
    def fn(x):
        y = torch.ops.chunkring_test.no_effect(x)
        return y + 1 if use else x * 2

    _control_calls.clear()
    torch.compile(fn, fullgraph=True, backend=backend)(torch.ones(n, 4))
    assert _control_calls == [], f"torch {torch.__version__} kept the call: {_control_calls}"


@torch.library.custom_op("chunkring_test::mix", mutates_args=())
def _mix(x: torch.Tensor, k: float) -> torch.Tensor:
    return (torch.sin(x.float() * k) * 3.3).to(torch.bfloat16)


@_mix.register_fake
def _(x, k):
    return torch.empty_like(x)


class Mix(torch.nn.Module):
    """In place of a MoEModule: an opaque op with a bf16 output, as the layer's."""

    def __init__(self, k):
        super().__init__()
        self.k = k

    def forward(self, x, streaming=False, num_tokens=None):
        return torch.ops.chunkring_test.mix(x, self.k)


def test_the_gpu_models_elementwise_work_rounds_as_eager_under_inductor():
    """The GPU test compares its compiled TwoLayers with eager bit for bit; this pins the premise that
    Inductor's fusion of its elementwise ops around two opaque calls rounds as eager does."""
    model = TwoLayers(Mix(1.1), Mix(0.7))
    compiled = torch.compile(model, fullgraph=True, backend="inductor")
    for seed in range(3):
        x = (torch.randn(64, H, generator=torch.Generator().manual_seed(seed)) * 4).to(torch.bfloat16)
        assert torch.equal(compiled(x), model(x)), seed
