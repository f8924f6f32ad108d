"""Hypothesis properties of the host-side checks (issue 10): for any arguments, a public call either
accepts them - and then hands the device exactly what was asked - or raises ``ChunkringUsageError``
naming one of the arguments that is wrong, before anything is enqueued. Never another exception.

The calls run against CPU stand-ins (the checks compare devices, so CPU tensors on a CPU "device" pass
exactly where CUDA tensors on the layer's GPU would)."""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import chunkring.ring.io as ring_io
from chunkring import ChunkringUsageError, MoEConfig, PayloadFormat, RingSpec
from chunkring.jit import parse_kernels
from chunkring.jit.compiler import KERNEL_DIR
from chunkring.jit.launch import check_argument_names
from chunkring.moe._engine.call import CallMode, Layer, resolve_mode, resolve_run
from chunkring.moe.weights import Fp8Weight

CPU = torch.device("cpu")
H, K, T, E = 256, 4, 8, 8
SPEC = RingSpec(world_size=2, num_slots=2, tokens_per_slot=T, hidden=H, payload=PayloadFormat.FP8_E4M3, topk=K,
                num_experts=E)
RING = SimpleNamespace(spec=SPEC, runtime=SimpleNamespace(torch_device=CPU), desc=None, check_alive=lambda: None)

DTYPES = [torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.int32, torch.int64]
odd_values = st.one_of(st.integers(-3, 70_000), st.booleans(), st.floats(allow_nan=False, width=32), st.none(),
                       st.text(max_size=3))


@st.composite
def tensors(draw, good_shape, good_dtype):
    """A tensor that is right, or wrong in its shape, dtype or layout; or not a tensor at all."""
    kind = draw(st.sampled_from(["good", "good", "shape", "dtype", "layout", "none"]))
    if kind == "none":
        return None
    shape = list(good_shape)
    dtype = good_dtype
    if kind == "shape":
        axis = draw(st.integers(0, len(shape) - 1))
        shape[axis] = draw(st.integers(0, 12).filter(lambda v: v != good_shape[axis]))
    if kind == "dtype":
        dtype = draw(st.sampled_from([d for d in DTYPES if d != good_dtype]))
    if kind == "layout" and len(shape) == 2 and shape[0] > 1 and shape[1] > 1:
        return torch.zeros(shape[::-1], dtype=torch.float32).to(dtype).t()
    return torch.zeros(shape, dtype=torch.float32).to(dtype)


def is_good(t, shape, dtype):
    return isinstance(t, torch.Tensor) and tuple(t.shape) == tuple(shape) and t.dtype == dtype and t.is_contiguous()


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, T + 1), data=st.data())
def test_publish_chunk_accepts_exactly_the_valid_arguments(n, data, monkeypatch_module):
    args = {
        "x": data.draw(tensors((n, H), torch.float8_e4m3fn)),
        "x_sf": data.draw(tensors((n, H // 128), torch.float32)),
        "topk_idx": data.draw(tensors((n, K), torch.int32)),
        "topk_weights": data.draw(tensors((n, K), torch.float32)),
        "token_base": data.draw(st.one_of(st.integers(-2, 100), st.booleans(), st.floats(0, 4))),
        "end_of_stream": data.draw(st.one_of(st.booleans(), st.integers(0, 1))),
    }
    wrong = set()
    x = args["x"]
    rows = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else None
    if rows is None or rows > T or not is_good(x, (rows, H), torch.float8_e4m3fn):
        wrong.add("x")
    for name, cols, dtype in (("x_sf", H // 128, torch.float32), ("topk_idx", K, torch.int32),
                              ("topk_weights", K, torch.float32)):
        if rows is None or not is_good(args[name], (rows, cols), dtype):
            wrong.add(name)
    base = args["token_base"]
    if isinstance(base, bool) or not isinstance(base, int) or base < 0:
        wrong.add("token_base")
    if not isinstance(args["end_of_stream"], bool):
        wrong.add("end_of_stream")
    if rows == 0 and args["end_of_stream"] is False:
        wrong.add("x")
    launches = monkeypatch_module
    launches.clear()
    if wrong:
        with pytest.raises(ChunkringUsageError) as info:
            ring_io.publish_chunk(RING, **args)
        assert info.value.field in wrong, (info.value.field, wrong)
        assert not launches
    else:
        ring_io.publish_chunk(RING, **args)
        (name, kernel_args), = launches
        assert name == "ring_publish_tensors"
        launched = kernel_args["args"]  # a RingPublishArgs, by field
        assert (launched["n_tokens"], launched["token_base"], launched["end_of_stream"]) == \
            (rows, base, int(args["end_of_stream"]))


@pytest.fixture(scope="module")
def monkeypatch_module():
    """publish_chunk's launches, recorded instead of enqueued (there is no GPU here), each with its arguments
    checked by name against the kernel's signature as KernelLibrary.launch checks them."""
    launches = []
    signatures = parse_kernels((KERNEL_DIR / "ring_host_api.cu").read_text(), "ring_host_api.cu")

    class Recorder:
        def launch(self, name, /, *, grid=1, block=128, stream=None, shared_bytes=0, pdl=False, **args):
            check_argument_names(name, signatures[name], args)
            launches.append((name, args))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ring_io, "kernel_library", lambda runtime: Recorder())
        yield launches


FIELDS = ("num_experts", "hidden", "intermediate", "topk", "max_tokens_per_rank", "payload", "stream_slots",
          "stream_slot_tokens")


@settings(max_examples=400, deadline=None)
@given(values=st.fixed_dictionaries({name: odd_values for name in FIELDS}),
       use=st.sets(st.sampled_from(FIELDS)))
def test_moe_config_is_valid_or_names_a_field(values, use):
    kwargs = dict(num_experts=16, hidden=256, intermediate=128, topk=4, max_tokens_per_rank=64)
    kwargs.update({name: values[name] for name in use})
    try:
        cfg = MoEConfig(**kwargs)
    except ChunkringUsageError as exc:
        assert exc.field in FIELDS
        return
    for name in ("num_experts", "hidden", "intermediate", "topk", "max_tokens_per_rank"):
        value = getattr(cfg, name)
        assert type(value) is int and value >= 1, name
    assert isinstance(cfg.payload, PayloadFormat)
    assert cfg.intermediate % (128 if cfg.payload.has_scales else 8) == 0
    assert cfg.hidden % 128 == 0  # either payload: the producers move 128-column blocks
    given_payload = kwargs.get("payload", PayloadFormat.FP8_E4M3)
    assert type(given_payload) in (int, PayloadFormat), f"payload {given_payload!r} accepted"  # not True, not 1.0
    assert (cfg.stream_slots is None) == (cfg.stream_slot_tokens is None)
    if cfg.streaming:
        assert 1 <= cfg.stream_slot_tokens <= cfg.max_tokens_per_rank and cfg.stream_slots >= 1


def fp8_weight(t):
    """``t`` as the FP8 payload's weights if it is a 3-D float8 tensor (its shape right or not), else as is."""
    if isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn and t.dim() == 3:
        E_, N_, K_ = t.shape
        return Fp8Weight(t, torch.ones(E_, -(-N_ // 128), -(-K_ // 128)))
    return t


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 20), data=st.data())
def test_layer_run_accepts_exactly_the_valid_arguments(n, data):
    cfg = MoEConfig(num_experts=E, hidden=H, intermediate=128, topk=K, max_tokens_per_rank=16,
                    stream_slots=2, stream_slot_tokens=8)
    El = cfg.num_experts // 2
    good = {
        "x": ((n, H), torch.float8_e4m3fn), "x_sf": ((n, H // 128), torch.float32),
        "topk_idx": ((n, K), torch.int32), "topk_weights": ((n, K), torch.float32),
        "w13": ((El, 256, H), torch.float8_e4m3fn), "w2": ((El, H, 128), torch.float8_e4m3fn),
        "out": ((n, H), torch.bfloat16), "num_tokens": ((1,), torch.int32),
    }
    args = {name: data.draw(tensors(shape, dtype)) for name, (shape, dtype) in good.items()}
    streaming = data.draw(st.one_of(st.booleans(), st.just(1), st.just("auto"), st.just("always")))
    # The batch size is x's: every per-token argument is judged against it.
    x = args["x"]
    rows = x.shape[0] if isinstance(x, torch.Tensor) and x.dim() == 2 else None
    per_token = {"x": H, "x_sf": H // 128, "topk_idx": K, "topk_weights": K, "out": H}
    wrong = set()
    for name, (shape, dtype) in good.items():
        expected = (rows, per_token[name]) if name in per_token else shape
        if (rows is None and name in per_token) or not is_good(args[name], expected, dtype):
            wrong.add(name)
    wrong -= {name for name in ("out", "num_tokens") if args[name] is None}  # optional
    if rows is None or rows > cfg.max_tokens_per_rank:
        wrong.add("x")
    if not isinstance(streaming, bool) and streaming != "auto":
        wrong.add("streaming")
    w13, w2 = fp8_weight(args.pop("w13")), fp8_weight(args.pop("w2"))
    kwargs = dict(out=args.pop("out"), num_tokens=args.pop("num_tokens"), timeline=None, chunk=None)
    context = Layer(cfg, El, CPU, None, lambda n: False)

    def resolve():  # as MoELayer.run: the mode first, then the rest
        return resolve_run(context, resolve_mode(cfg, None, streaming), *args.values(), w13, w2, **kwargs)

    if wrong:
        with pytest.raises(ChunkringUsageError) as info:
            resolve()
        assert info.value.field in wrong, (info.value.field, wrong)
    else:
        call = resolve()
        # "auto" uncalibrated: batch-ready
        assert (call.mode, call.n) == (CallMode.STREAMED if streaming is True else CallMode.BATCH_READY, rows)
