"""The MoE layer's calls as PyTorch operators, so ``torch.compile(fullgraph=True)`` sees one opaque op
per call (no graph break) and a compiled model captures into a CUDA graph like an eager one.

Two operators, one per call of :class:`~chunkring.moe.layer.MoELayer`::

    chunkring::moe_forward(int handle, Tensor hidden, Tensor router_weight, Tensor w13, Tensor? w13_scale,
                           Tensor w2, Tensor? w2_scale, bool streaming, Tensor? num_tokens) -> Tensor
    chunkring::moe_run(int handle, Tensor x, Tensor? x_sf, Tensor topk_idx, Tensor topk_weights, Tensor w13,
                       Tensor? w13_scale, Tensor w2, Tensor? w2_scale, bool streaming, Tensor? num_tokens) -> Tensor

An operator's arguments are tensors and scalars only, so the layer travels as ``handle``, the integer
:attr:`MoELayer.handle` (:mod:`chunkring.moe._engine.handles` maps it back; a handle of no live layer is a
``ChunkringUsageError``), and an :class:`~chunkring.moe.weights.Fp8Weight` as its ``data`` and ``scale``
(``*_scale`` None: bfloat16 weights). ``streaming`` is a plain bool, a constant of the traced graph
(:func:`moe_forward` resolves ``"auto"`` while tracing). Call them through :func:`moe_forward` and
:func:`moe_run`, which take the layer and the weights as the layer's methods do.

What they declare:

* Functional: no argument is written (``mutates_args=()``); the output, bfloat16 [n, H], is a new tensor.
  The layer's own buffers (rings, stage, combine rows) are written, but they are no argument: they are
  the layer's state, like a communicator's.
* An ordered side effect (the effect system of ``torch._higher_order_ops.effects``): each call is a
  collective that advances the rings' sequence numbers, so a compiled graph must run every call, in
  program order. Without it, torch.compile's dead-code elimination drops a call whose output is unused,
  and Inductor drops one whose output has no elements - a rank with zero tokens would then skip a
  collective its peers wait in (measured with torch 2.13 on the CPU; tests/unit/test_custom_op.py).
* A fake (meta) implementation: bfloat16 [n, H] on the input's device, from the inputs' shapes alone -
  no handle look-up, no device work, no tensor value read. The arguments are checked (shapes, dtypes,
  devices, the layer's config: :mod:`chunkring.moe._engine.call`) by the real implementation, on the host,
  when the call runs - the same checks as an eager call, before anything is enqueued.
* No autograd formula: the layer is an inference kernel.

The real implementation is registered for every device type, so a call on a wrong device (a CPU
tensor) reaches the layer's own argument check and gets its ``ChunkringUsageError``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from chunkring.errors import ChunkringUsageError
from chunkring.moe._engine import handles
from chunkring.moe._engine.call import CallMode, resolve_mode
from chunkring.moe.weights import Fp8Weight

if TYPE_CHECKING:
    from chunkring.moe.layer import MoELayer

__all__ = ["MOE_FORWARD_SCHEMA", "MOE_RUN_SCHEMA", "layer_for_handle", "moe_forward", "moe_run"]

MOE_FORWARD_SCHEMA = ("(int handle, Tensor hidden, Tensor router_weight, Tensor w13, Tensor? w13_scale, Tensor w2, "
                      "Tensor? w2_scale, bool streaming, Tensor? num_tokens) -> Tensor")
MOE_RUN_SCHEMA = ("(int handle, Tensor x, Tensor? x_sf, Tensor topk_idx, Tensor topk_weights, Tensor w13, "
                  "Tensor? w13_scale, Tensor w2, Tensor? w2_scale, bool streaming, Tensor? num_tokens) -> Tensor")

# ------------------------------------------------------------------ the layer a handle names


def layer_for_handle(handle: int) -> MoELayer:
    """The live layer ``handle`` names, or a ``ChunkringUsageError``. A closed layer is still found
    here; its own calls refuse it."""
    layer = handles.lookup(handle)
    if layer is None:
        raise ChunkringUsageError(f"no MoELayer has handle {handle} in this process (never created here, or "
                                  "garbage-collected: keep the layer alive while a compiled model calls it)",
                                  field="handle")
    return cast("MoELayer", layer)


# ------------------------------------------------------------------ the operators


def _weight(data: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor | Fp8Weight:
    return data if scale is None else Fp8Weight(data, scale)


@torch.library.custom_op("chunkring::moe_forward", mutates_args=(), schema=MOE_FORWARD_SCHEMA)
def _moe_forward_op(handle: int, hidden: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor,
                    w13_scale: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None, streaming: bool,
                    num_tokens: torch.Tensor | None) -> torch.Tensor:
    return layer_for_handle(handle).forward(hidden, router_weight, _weight(w13, w13_scale), _weight(w2, w2_scale),
                                            streaming=streaming, num_tokens=num_tokens)


@torch.library.custom_op("chunkring::moe_run", mutates_args=(), schema=MOE_RUN_SCHEMA)
def _moe_run_op(handle: int, x: torch.Tensor, x_sf: torch.Tensor | None, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor,
                w2_scale: torch.Tensor | None, streaming: bool, num_tokens: torch.Tensor | None) -> torch.Tensor:
    return layer_for_handle(handle).run(x, x_sf, topk_idx, topk_weights, _weight(w13, w13_scale),
                                        _weight(w2, w2_scale), streaming=streaming, num_tokens=num_tokens)


def _fake_output(name: str, batch: torch.Tensor) -> torch.Tensor:
    """bfloat16 [n, H] where ``batch`` is [n, H]: what the real call returns whenever it accepts the call
    (its checks hold ``H`` to the layer's hidden size and the batch to the layer's device)."""
    if batch.dim() != 2:
        raise ChunkringUsageError("expected a 2-D tensor [n, hidden]", field=name)
    return batch.new_empty((batch.shape[0], batch.shape[1]), dtype=torch.bfloat16)


@_moe_forward_op.register_fake
def _moe_forward_fake(handle: int, hidden: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor,
                      w13_scale: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None, streaming: bool,
                      num_tokens: torch.Tensor | None) -> torch.Tensor:
    return _fake_output("hidden", hidden)


@_moe_run_op.register_fake
def _moe_run_fake(handle: int, x: torch.Tensor, x_sf: torch.Tensor | None, topk_idx: torch.Tensor,
                  topk_weights: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor,
                  w2_scale: torch.Tensor | None, streaming: bool, num_tokens: torch.Tensor | None) -> torch.Tensor:
    return _fake_output("x", x)


def _register_ordered_effect(op: torch._ops.OpOverload) -> None:
    # The effect system is private API; this spelling (an OpOverload and _EffectType.ORDERED, from
    # torch._higher_order_ops.effects) is the one torch 2.4 through 2.13 all accept.
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

    _register_effectful_op(op, _EffectType.ORDERED)


_register_ordered_effect(torch.ops.chunkring.moe_forward.default)
_register_ordered_effect(torch.ops.chunkring.moe_run.default)

# ------------------------------------------------------------------ the public calls


def _split(weight: torch.Tensor | Fp8Weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(weight, Fp8Weight):
        return weight.data, weight.scale
    return weight, None


def moe_forward(layer: MoELayer, hidden: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor | Fp8Weight,
                w2: torch.Tensor | Fp8Weight, *, streaming: bool | str = False,
                num_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """:meth:`MoELayer.forward` through the ``chunkring::moe_forward`` operator, as one op a ``torch.compile``'d
    model traces without a graph break. A collective, like the method.

    Args:
        layer: the layer (it travels to the operator as :attr:`MoELayer.handle`).
        hidden, router_weight, w13, w2, num_tokens: as :meth:`MoELayer.forward` takes them.
        streaming: False, True or ``"auto"``; resolved to a bool here (while tracing, a constant of the graph).

    Returns:
        bfloat16 [n, H], a new tensor. No ``out``, ``timeline`` or ``chunk``: call the method for those
        (streamed calls chunk as the layer's calibration says, else in the slot size).

    Raises:
        ChunkringUsageError: what the method raises, checked when the call runs (the fake implementation reads
            shapes only).
        ChunkringDeviceError: an earlier call failed on the device (:meth:`MoELayer.raise_if_failed`, which the
            method calls at its entry; a graph replay of a captured call does not).
    """
    w13_data, w13_scale = _split(w13)
    w2_data, w2_scale = _split(w2)
    streamed = resolve_mode(layer.config, layer.streaming_calibration, streaming) is CallMode.STREAMED
    return torch.ops.chunkring.moe_forward(layer.handle, hidden, router_weight, w13_data, w13_scale, w2_data, w2_scale,
                                           streamed, num_tokens)


def moe_run(layer: MoELayer, x: torch.Tensor, x_sf: torch.Tensor | None, topk_idx: torch.Tensor,
            topk_weights: torch.Tensor, w13: torch.Tensor | Fp8Weight, w2: torch.Tensor | Fp8Weight, *,
            streaming: bool | str = False, num_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """:meth:`MoELayer.run` (a routed batch) through the ``chunkring::moe_run`` operator, as :func:`moe_forward`
    is :meth:`MoELayer.forward`.

    Args:
        layer: the layer.
        x, x_sf, topk_idx, topk_weights, w13, w2, num_tokens: as :meth:`MoELayer.run` takes them.
        streaming: False, True or ``"auto"``, resolved to a bool here.

    Returns:
        bfloat16 [n, H], a new tensor.

    Raises:
        ChunkringUsageError, ChunkringDeviceError: as :func:`moe_forward`.
    """
    w13_data, w13_scale = _split(w13)
    w2_data, w2_scale = _split(w2)
    streamed = resolve_mode(layer.config, layer.streaming_calibration, streaming) is CallMode.STREAMED
    return torch.ops.chunkring.moe_run(layer.handle, x, x_sf, topk_idx, topk_weights, w13_data, w13_scale, w2_data,
                                       w2_scale, streamed, num_tokens)
