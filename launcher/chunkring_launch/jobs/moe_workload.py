"""What the MoE jobs (``run``, ``stress``, ``bench``) share: the layer's config fields, the layer on its
SM partition, the seeded weights and batches, and the check of an output against the fp32 reference of
the same math."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from chunkring.errors import ChunkringRuntimeError, UsageProblems

from ..config import CheckedConfig

if TYPE_CHECKING:  # imported where used: checking a config imports no torch
    from collections.abc import Iterator

    import torch

    from chunkring import MoEConfig, MoELayer, PayloadFormat, Runtime
    from chunkring.moe.weights import Fp8Weight


@dataclass(frozen=True)
class LayerFields(CheckedConfig):
    """Config keys of one MoE layer (``chunkring.MoEConfig``), its check tolerance and the seed."""

    num_experts: int = 16
    hidden: int = 1024
    intermediate: int = 512
    topk: int = 4
    max_tokens_per_rank: int = 512
    payload: str = "fp8"
    stream_slots: int = 2
    stream_slot_tokens: int = 128
    tolerance: float = 4e-2  # the FP8 recipe's bound, chunkring.testing.reference.reference_tolerance
    seed: int = 0
    # Streamed calls' SM partition: "auto" (the layer sizes one: chunkring.partition.default_producer_sms),
    # "none", or the producers' SM count N (the consumer gets the rest). Batch-ready calls keep the whole GPU.
    producer_sms: int | str = "auto"
    transport: str = ""  # "auto", "rma" (NVSHMEM gets/puts for every peer) or "": CHUNKRING_TRANSPORT (default auto)

    def check(self, problems: UsageProblems) -> None:
        super().check(problems)
        if self.payload not in ("fp8", "bf16"):
            problems.add(f"must be 'fp8' or 'bf16', got {self.payload!r}", field="payload")
        if self.transport not in ("", "auto", "rma"):
            problems.add(f"must be 'auto', 'rma' or '', got {self.transport!r}", field="transport")
        if not (self.producer_sms in ("auto", "none") or (isinstance(self.producer_sms, int)
                                                          and not isinstance(self.producer_sms, bool)
                                                          and self.producer_sms > 0)):
            problems.add(f'must be "auto", "none" or a positive SM count, got {self.producer_sms!r}',
                         field="producer_sms")
        if not 0 < self.tolerance < 1:
            problems.add(f"must be in (0, 1), got {self.tolerance!r}", field="tolerance")
        with problems.collect():
            # The layer's own checks, before any rank starts GPU work. The payload as given: MoEConfig checks it
            # beside every other field, so a bad payload does not hide the layer's other problems.
            self._layer_config(cast("PayloadFormat", self.payload))

    def layer_config(self) -> MoEConfig:
        from chunkring import PayloadFormat

        return self._layer_config(PayloadFormat.checked(self.payload))

    def _layer_config(self, payload: PayloadFormat) -> MoEConfig:
        from chunkring import MoEConfig

        return MoEConfig(num_experts=self.num_experts, hidden=self.hidden, intermediate=self.intermediate,
                         topk=self.topk, max_tokens_per_rank=self.max_tokens_per_rank, payload=payload,
                         stream_slots=self.stream_slots, stream_slot_tokens=self.stream_slot_tokens,
                         transport=self.transport or None)


@contextlib.contextmanager
def open_layer(runtime: Runtime, fields: LayerFields, config: MoEConfig | None = None, *,
               eager_graphs: bool = False) -> Iterator[MoELayer]:
    """The job's ``MoELayer`` (``config``: a MoEConfig, default ``fields.layer_config()``), its streamed
    calls on the partition ``fields.producer_sms`` names (an ``SmPartition`` of N producer SMs, the layer's
    own with "auto", none with "none"), its eager calls replayed from CUDA graphs if ``eager_graphs``;
    closed (a collective, after every rank's work ended) and the
    partition closed on exit."""
    import torch

    from chunkring import MoELayer, SmPartition

    sms = fields.producer_sms
    partition = SmPartition(runtime, sms) if isinstance(sms, int) else None
    try:
        layer = MoELayer(runtime, config or fields.layer_config(), partition=partition or str(sms),
                         eager_graphs=eager_graphs)
        try:
            yield layer
        finally:
            torch.cuda.synchronize()
            runtime.barrier()
            layer.close()
    finally:
        if partition is not None:
            partition.close()


def transport_figures(layer: MoELayer) -> dict[str, int]:
    """The transport a layer's rings use at this rank, as figures: ``transport_rma`` (1 when forced) and
    ``rma_peers`` (how many PEs this rank reaches by RMA)."""
    from chunkring.ring.transport import Transport

    ring = next(iter(layer.rings.values()))
    return {"transport_rma": int(ring.transport_mode == "rma"),
            "rma_peers": sum(t is Transport.RMA for t in layer.transports)}


@dataclass
class Weights:
    """Every expert's weights as the layer's GEMMs see them (the reference needs all of them) and this
    rank's slice in the form the layer takes (:func:`chunkring.expert_weights`)."""

    router: torch.Tensor       # bfloat16 [E, H]
    w13_all: torch.Tensor      # float32 [E, 2I, H]: dequantised FP8 for the FP8 payload
    w2_all: torch.Tensor       # float32 [E, H, I]
    w13: Fp8Weight | torch.Tensor  # this rank's [E_local, 2I, H]: Fp8Weight (FP8 payload) or bfloat16
    w2: Fp8Weight | torch.Tensor   # this rank's [E_local, H, I]
    fp8_recipe: bool    # the FP8 layer's roundings between its GEMMs (testing.reference.moe_reference)


def seeded_weights(layer: MoELayer, seed: int) -> Weights:
    """The weights ``chunkring.MoEModule`` draws from ``torch.Generator().manual_seed(seed)``, identical
    on every rank."""
    import torch

    from chunkring.moe.weights import expert_weights, init_weights
    from chunkring.testing.reference import layer_weights_reference

    cfg, device = layer.config, layer.runtime.torch_device
    router, w13, w2 = init_weights(cfg, torch.Generator().manual_seed(seed))
    mine = slice(layer.first_expert, layer.first_expert + layer.experts_per_rank)
    w13_local, w2_local = expert_weights(layer.config, w13[mine].contiguous().to(device),
                                         w2[mine].contiguous().to(device))
    w13_all, w2_all = layer_weights_reference(w13, w2, cfg.payload)
    return Weights(router=router.to(device), w13_all=w13_all.to(device), w2_all=w2_all.to(device),
                   w13=w13_local, w2=w2_local, fp8_recipe=cfg.payload.has_scales)


def seeded_hidden(n: int, hidden: int, seed: int, device: torch.device) -> torch.Tensor:
    """bfloat16 [n, hidden] hidden states drawn from a CPU generator seeded with ``seed``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, hidden, generator=gen).to(torch.bfloat16).to(device)


@dataclass
class RoutedBatch:
    """One rank's routed batch as ``MoELayer.run`` takes it, and the fp32 input the payload carries."""

    x: torch.Tensor             # float8_e4m3fn or bfloat16 [n, H]
    x_sf: torch.Tensor | None   # float32 [n, H/128], or None for a bf16 payload
    topk_idx: torch.Tensor      # int32 [n, K]
    topk_weights: torch.Tensor  # float32 [n, K]
    x_ref: torch.Tensor         # float32 [n, H]: what the reference computes on


def route_batch(hidden: torch.Tensor, router: torch.Tensor, topk: int, payload: str) -> RoutedBatch:
    """Route ``hidden`` bfloat16 [n, H] as the layer's producers do, and quantise it for the payload."""
    from chunkring.moe.routing import route
    from chunkring.testing.reference import dequantize_fp8_per128, quantize_fp8_per128

    idx, weights = route(hidden, router, topk)
    if payload == "fp8":
        x, x_sf = quantize_fp8_per128(hidden)
        return RoutedBatch(x, x_sf, idx, weights, dequantize_fp8_per128(x, x_sf))
    return RoutedBatch(hidden, None, idx, weights, hidden.float())


def reference_output(batch: RoutedBatch, weights: Weights) -> torch.Tensor:
    """float32 [n, H]: the layer's math in fp32 over every expert (the FP8 recipe's quantisations included)."""
    from chunkring.testing.reference import moe_reference

    return moe_reference(batch.x_ref, batch.topk_idx, batch.topk_weights, weights.w13_all, weights.w2_all,
                         fp8_recipe=weights.fp8_recipe)


def check_output(out: torch.Tensor, ref: torch.Tensor, *, tolerance: float, what: str) -> tuple[float, float]:
    """(relative error, max abs error) of ``out`` against ``ref``; raises ``ChunkringRuntimeError`` naming
    ``what`` on NaN or when the relative (Frobenius) error exceeds ``tolerance``."""
    import torch

    if ref.numel() == 0:
        return 0.0, 0.0
    diff = out.float() - ref
    if bool(torch.isnan(diff).any()):
        raise ChunkringRuntimeError(f"{what}: output holds NaN")
    rel = float(diff.norm() / ref.norm().clamp(min=1e-30))
    if rel > tolerance:
        raise ChunkringRuntimeError(f"{what}: relative error {rel:.3e} > {tolerance}")
    return rel, float(diff.abs().max())
