"""Expert and router weights of a MoE layer: FP8 block quantisation (DeepSeek's recipe) and random draws.

The FP8 payload runs FP8 expert GEMMs: weights FP8 e4m3 with one fp32 scale per 128x128 block - the
format of DeepSeek-V3-style checkpoints (their ``weight_scale_inv``) and of DeepGEMM - quantised once at
load by :func:`quantize_weight_fp8`. The bf16 payload runs bf16 GEMMs on bf16 weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from chunkring.errors import ChunkringUsageError
from chunkring.moe.config import MoEConfig
from chunkring.ring.spec import E4M3_MAX

__all__ = ["WEIGHT_BLOCK", "ExpertWeights", "Fp8Weight", "Weight", "expert_weights", "init_weights", "payload_weights",
           "quantize_weight_fp8"]

#: Rows and columns of weight that share one fp32 scale.
WEIGHT_BLOCK = 128


@dataclass(frozen=True)
class Fp8Weight:
    """One projection of every local expert: ``data`` float8_e4m3fn [E, N, K] and ``scale`` float32
    [E, ceil(N / 128), ceil(K / 128)], with ``w[e, n, k] ≈ data[e, n, k] * scale[e, n // 128, k // 128]``."""

    data: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != torch.float8_e4m3fn or self.data.dim() != 3:
            raise ChunkringUsageError("expected a float8_e4m3fn tensor [E, N, K]", field="data")
        E, N, K = self.data.shape
        shape = (E, -(-N // WEIGHT_BLOCK), -(-K // WEIGHT_BLOCK))
        if (not isinstance(self.scale, torch.Tensor) or self.scale.dtype != torch.float32
                or tuple(self.scale.shape) != shape):
            raise ChunkringUsageError(f"expected a float32 tensor {list(shape)}", field="scale")
        if self.scale.device != self.data.device:
            raise ChunkringUsageError(f"is on {self.scale.device}, data on {self.data.device}", field="scale")

    def dequantize(self) -> torch.Tensor:
        """float32 [E, N, K]: data * its block's scale."""
        E, N, K = self.data.shape
        scale = self.scale.repeat_interleave(WEIGHT_BLOCK, 1)[:, :N].repeat_interleave(WEIGHT_BLOCK, 2)[:, :, :K]
        return self.data.float() * scale


def quantize_weight_fp8(w: torch.Tensor) -> Fp8Weight:
    """w [E, N, K] (bfloat16 or float32, finite) -> :class:`Fp8Weight`: each 128x128 block's absmax maps to
    448 (e4m3's largest finite value); a zero block gets scale 1. Runs where ``w`` lives, one expert at a
    time (an fp32 copy of one expert, not of every expert, is the largest temporary)."""
    if not isinstance(w, torch.Tensor) or w.dim() != 3 or w.dtype not in (torch.bfloat16, torch.float32):
        raise ChunkringUsageError("expected a bfloat16 or float32 tensor [E, N, K]", field="w")
    E, N, K = w.shape
    nb, kb = -(-N // WEIGHT_BLOCK), -(-K // WEIGHT_BLOCK)
    data = torch.empty((E, N, K), dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty((E, nb, kb), dtype=torch.float32, device=w.device)
    padded = torch.zeros((nb * WEIGHT_BLOCK, kb * WEIGHT_BLOCK), dtype=torch.float32, device=w.device)
    blocks = padded.view(nb, WEIGHT_BLOCK, kb, WEIGHT_BLOCK)
    for e in range(E):
        padded[:N, :K] = w[e]
        s = blocks.abs().amax(dim=(1, 3)) / E4M3_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = (blocks / s[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        data[e] = q.view(nb * WEIGHT_BLOCK, kb * WEIGHT_BLOCK)[:N, :K]
        scale[e] = s
    return Fp8Weight(data, scale)


#: One projection of this rank's experts as a layer's GEMMs take it: an Fp8Weight (FP8 payload) or a bfloat16 tensor.
Weight = torch.Tensor | Fp8Weight
#: This rank's w13 and w2 as a layer's GEMMs take them: two Fp8Weight (FP8 payload) or two bfloat16 tensors.
ExpertWeights = tuple[Fp8Weight, Fp8Weight] | tuple[torch.Tensor, torch.Tensor]


def expert_weights(config: MoEConfig, w13: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
    """One rank's experts in the format the layer of ``config`` runs its GEMMs on, made once, at load.

    Args:
        config: the layer's config.
        w13: bfloat16 [E_local, 2I, H]: each expert's gate rows, then its up rows.
        w2: bfloat16 [E_local, H, I], on ``w13``'s device.

    Returns:
        (w13, w2): for the FP8 payload two :class:`Fp8Weight` (128x128 block scales, :func:`quantize_weight_fp8`);
        for the bf16 payload the tensors as given (contiguous).

    Raises:
        ChunkringUsageError: a tensor of another dtype, shape or device (named).
    """
    if not isinstance(config, MoEConfig):
        raise ChunkringUsageError(f"expected a MoEConfig, got {type(config).__name__}", field="config")
    if not isinstance(w13, torch.Tensor) or w13.dim() != 3:
        raise ChunkringUsageError("expected a bfloat16 tensor [E_local, 2I, H]", field="w13")
    H, inter, E = config.hidden, config.intermediate, w13.shape[0]
    for name, w, shape in (("w13", w13, (E, 2 * inter, H)), ("w2", w2, (E, H, inter))):
        if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or tuple(w.shape) != shape or E < 1:
            got = f"{w.dtype} {list(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
            raise ChunkringUsageError(f"expected bfloat16 {list(shape)} with E_local >= 1, got {got}", field=name)
    if w2.device != w13.device:
        raise ChunkringUsageError(f"is on {w2.device}, w13 on {w13.device}", field="w2")
    return payload_weights(config, w13, w2)


def payload_weights(config: MoEConfig, w13: torch.Tensor, w2: torch.Tensor) -> ExpertWeights:
    """w13 [E_local, 2I, H] and w2 [E_local, H, I] (bfloat16, already checked) in the format ``config``'s
    payload runs its GEMMs on: FP8 -> :func:`quantize_weight_fp8` of each (once, at load), bf16 -> as
    given (contiguous). The one place both :func:`expert_weights` and the checkpoint loader
    (:mod:`chunkring.moe.checkpoint`) turn bf16 experts into the payload's format."""
    if config.payload.has_scales:
        return quantize_weight_fp8(w13), quantize_weight_fp8(w2)
    return w13.contiguous(), w2.contiguous()


def init_weights(config: MoEConfig,
                 generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every expert's weights and the router, bfloat16 on the CPU, drawn from ``generator`` as scaled
    normal samples: router [E, H], w13 [E, 2I, H], w2 [E, H, I]. Ranks that seed alike draw alike, so
    each can keep its own experts and still compute a reference over all of them."""
    E, H, inter = config.num_experts, config.hidden, config.intermediate

    def draw(*shape: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) / fan_in**0.5).to(torch.bfloat16)

    return draw(E, H, fan_in=H), draw(E, 2 * inter, H, fan_in=H), draw(E, H, inter, fan_in=inter)
