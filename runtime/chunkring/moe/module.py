"""``MoEModule``: an ``nn.Module`` over a :class:`~chunkring.moe.layer.MoELayer` that owns the router and this
rank's experts, and calls the layer through its PyTorch operator."""

from __future__ import annotations

import torch

from chunkring.errors import ChunkringUsageError
from chunkring.moe.layer import MoELayer
from chunkring.moe.op import moe_forward
from chunkring.moe.weights import Weight, expert_weights, init_weights

__all__ = ["MoEModule"]


class MoEModule(torch.nn.Module):
    """The router (bfloat16 [E, H], a registered buffer) and this rank's expert weights, in the format the
    layer's GEMMs take (:func:`chunkring.moe.weights.expert_weights`: FP8 with 128x128 block scales for the
    FP8 payload, bfloat16 otherwise), over ``layer``.

    Args:
        layer: the :class:`MoELayer` this module calls.
        generator: a CPU ``torch.Generator`` the weights are drawn from (:func:`init_weights`); ranks seeded
            alike draw alike, each keeping its own experts.
        weights: (router bf16 [E, H], w13, w2) to hold instead, on the layer's device: w13 and w2 this rank's
            experts as :func:`chunkring.moe.weights.expert_weights` gives them (checked at each call).

    Raises:
        ChunkringUsageError: ``layer`` is not a :class:`MoELayer`, or ``weights`` is given with ``generator``.

    Its streamed calls run on ``layer``'s partition (by default one the layer sized and made); batch-ready
    calls keep the whole GPU.
    """

    router_weight: torch.Tensor  # a registered buffer
    w13: Weight
    w2: Weight

    def __init__(self, layer: MoELayer, *, generator: torch.Generator | None = None,
                 weights: tuple[torch.Tensor, Weight, Weight] | None = None) -> None:
        super().__init__()
        if not isinstance(layer, MoELayer):
            raise ChunkringUsageError(f"expected a MoELayer, got {type(layer).__name__}", field="layer")
        self.layer = layer
        if weights is not None:
            if generator is not None:
                raise ChunkringUsageError("pass weights or a generator to draw them from, not both", field="weights")
            router, self.w13, self.w2 = weights
            self.register_buffer("router_weight", router)
            return
        router, w13, w2 = init_weights(layer.config, generator)
        device = layer.runtime.torch_device
        mine = slice(layer.first_expert, layer.first_expert + layer.experts_per_rank)
        self.register_buffer("router_weight", router.to(device))
        self.w13, self.w2 = expert_weights(layer.config, w13[mine].to(device), w2[mine].to(device))

    def forward(self, hidden: torch.Tensor, streaming: bool | str = False,
                num_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`MoELayer.forward` on ``hidden`` bfloat16 [n, H] with this module's weights, as the
        ``chunkring::moe_forward`` operator (:func:`chunkring.moe.op.moe_forward`), so ``torch.compile`` of a
        model holding this module traces it as one op, without a graph break. A collective.

        Args:
            hidden: bfloat16 [n, H].
            streaming: False, True or ``"auto"``, as in :meth:`MoELayer.run`.
            num_tokens: int32 [1] on the device, as in :meth:`MoELayer.run`.

        Returns:
            bfloat16 [n, H].

        Raises:
            ChunkringUsageError, ChunkringDeviceError: as :meth:`MoELayer.forward` (a device error of an earlier
                call included: the layer fails closed).
        """
        return moe_forward(self.layer, hidden, self.router_weight, self.w13, self.w2, streaming=streaming,
                           num_tokens=num_tokens)
