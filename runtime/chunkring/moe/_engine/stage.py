"""The stage: what one rank's consumer pulls in a call, from either ring, and its device descriptor."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from chunkring.errors import ChunkringUsageError
from chunkring.moe._engine.descriptors import STAGE_FIELDS, descriptor_tensor
from chunkring.ring.io import check_tensor
from chunkring.ring.spec import FP8_SCALE_BLOCK

if TYPE_CHECKING:
    from chunkring.moe.config import MoEConfig

__all__ = ["STAGE_ROW_DTYPES", "Stage"]

#: A stage row's payload: FP8 e4m3 or bf16.
STAGE_ROW_DTYPES = (torch.float8_e4m3fn, torch.bfloat16)


class Stage:
    """Every source's rows at their token index (``N`` rows per source) and the pull's bookkeeping.

    ``x`` [W, N, H] (FP8 or bf16), ``sf`` fp32 [W, N, H/128] (empty for bf16), ``idx`` int32 [W, N, K] (-1:
    planned nowhere), ``w`` fp32 [W, N, K]; ``held`` int64 [W]: per source, the seq of its last chunk, whose
    acknowledgement waits for the combine (-1: none); this rank's experts are ``[expert_lo, expert_hi)``.
    ``desc``: the ``StageDesc`` the kernels take (:mod:`chunkring.moe._engine.descriptors`), built once: the tensors
    are never reallocated.
    """

    def __init__(self, x: torch.Tensor, sf: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, *, expert_lo: int,
                 expert_hi: int, held: torch.Tensor | None = None) -> None:
        if not isinstance(idx, torch.Tensor) or idx.dim() != 3:
            raise ChunkringUsageError("expected an int32 tensor [W, N, K]", field="idx")
        W, N, K = idx.shape
        device = idx.device
        held = held if held is not None else torch.full((W,), -1, dtype=torch.int64, device=device)
        # The kernels read these through raw addresses (the descriptor): every shape, type and layout is checked
        # here, once, since no launch sees the tensors themselves.
        # A row's width and payload type are the caller's choice; anything else is the layout above. A payload
        # type of neither kind is checked against FP8, so the error names the field.
        row_dtype = x.dtype if isinstance(x, torch.Tensor) and x.dtype in STAGE_ROW_DTYPES else STAGE_ROW_DTYPES[0]
        check_tensor("x", x, (W, N, _width(x)), row_dtype, device)
        check_tensor("sf", sf, (W, N, _width(sf)), torch.float32, device)
        check_tensor("idx", idx, (W, N, K), torch.int32, device)
        check_tensor("w", w, (W, N, K), torch.float32, device)
        check_tensor("held", held, (W,), torch.int64, device)
        if isinstance(expert_lo, bool) or not isinstance(expert_lo, int) or isinstance(expert_hi, bool) \
                or not isinstance(expert_hi, int) or not 0 <= expert_lo < expert_hi:
            raise ChunkringUsageError(f"need ints 0 <= expert_lo < expert_hi, got {expert_lo!r}, {expert_hi!r}",
                                      field="expert_lo")
        self.x, self.sf, self.idx, self.w, self.held = x, sf, idx, w, held
        self.expert_lo, self.expert_hi = expert_lo, expert_hi
        self.desc = descriptor_tensor(STAGE_FIELDS, {
            "sources": W, "token_capacity": N, "topk": K, "row_bytes": x.shape[2] * x.element_size(),
            "sf_per_row": sf.shape[2], "expert_lo": expert_lo, "expert_hi": expert_hi,
            "x": x, "sf": sf, "idx": idx, "w": w, "held": self.held}, idx.device)

    @classmethod
    def allocate(cls, config: MoEConfig, world_size: int, device: torch.device, *, expert_lo: int,
                 expert_hi: int, alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None) -> Stage:
        """A zeroed stage for ``config`` at ``world_size`` ranks. ``alloc(shape, dtype)``, if given, makes the
        rows (NVSHMEM's symmetric heap, where a source is read by RMA: a get's local buffer must be
        registered off-node)."""
        W, N, H, K = world_size, config.max_tokens_per_rank, config.hidden, config.topk
        fp8 = config.payload.has_scales

        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return alloc(shape, dtype) if alloc is not None else torch.zeros(shape, dtype=dtype, device=device)

        x = zeros((W, N, H), torch.float8_e4m3fn if fp8 else torch.bfloat16)
        # bf16 rows carry no scales: an empty tensor, which no get reaches (and the symmetric heap holds none).
        sf = (zeros((W, N, H // FP8_SCALE_BLOCK), torch.float32) if fp8
              else torch.zeros((W, N, 0), dtype=torch.float32, device=device))
        # -1 (planned nowhere) is refilled before every pull (moe_call_reset): a row no chunk brought is never computed.
        idx = zeros((W, N, K), torch.int32).fill_(-1)
        return cls(x, sf, idx, zeros((W, N, K), torch.float32), expert_lo=expert_lo, expert_hi=expert_hi)


def _width(tensor: object) -> int:
    """The last dimension of a [W, N, width] tensor; -1 (which no shape has) for anything else, so its check fails."""
    return tensor.shape[2] if isinstance(tensor, torch.Tensor) and tensor.dim() == 3 else -1
